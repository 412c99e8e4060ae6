"""What a protected loop is told (issue 38 item 3): `thermowatch.watch(model, optimizer, **settings)`
builds a `WatchConfig` from its keyword arguments and checks it at once, before anything is made
from it; `Watch(model, optimizer, WatchConfig(...))` takes one directly. Plain settings only: the
live objects the loop drives or calls (the scheduler, an `lr_schedule` function, a `data_index`
map, an in-process `supervisor_config`) stay Watch's own keyword arguments.

    cfg = thermowatch.WatchConfig(run="gpt2-small", steps=600_000, global_batch=512,
                                  checkpoint_dir="ckpt", precise_skip=True)
    tw = thermowatch.Watch(model, optimizer, cfg, scheduler=sched)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from thermowatch.monitors.names import check_run_id
from thermowatch.monitors.settings import check_number
from thermowatch.monitors.thermometers import ThermometerConfig
from thermowatch.precise_skip import PreciseSkip


@dataclass(frozen=True)
class WatchConfig:
    """docs/any-trainer.md explains each; the defaults are the docs' too."""

    run: str  # the run's name: the supervisor's key, and checkpoints/<run> by default
    steps: int  # the steps the loop trains, 1-based
    global_batch: int  # samples per step over every rank: the skip ledger's unit
    server: str | Sequence[str] | None = None  # the daemon(s); None: THERMOWATCH_SERVER, a login, or embedded
    token: str | None = None
    checkpoint_dir: str | os.PathLike | None = None  # None: checkpoints/<run>
    checkpoint_every: int = 50
    keep_checkpoints: int = 5
    thermometers: ThermometerConfig | bool = True  # False: loss (and grad_norm) only
    config: Mapping[str, Any] | None = None  # stored with the run (the peer envelope compares `model`)
    poll_interval_s: float = 1.0  # how often rank 0 asks the daemon for commands
    precise_skip: PreciseSkip | bool = False  # True: PreciseSkip()'s defaults
    close_timeout_s: float = 10.0  # close() waits at most this for the daemon
    dataset_size: int | None = None  # `data[ids % dataset_size]`: a skip stands for its data in every pass

    def __post_init__(self) -> None:
        check_run_id(self.run)  # before anything is made from it (checkpoints/<run>), on every rank (issue 34)
        for name in ("steps", "global_batch", "checkpoint_every", "keep_checkpoints"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.dataset_size is not None:
            check_number("dataset_size", self.dataset_size, lo=1, integer=True)
        check_number("poll_interval_s", self.poll_interval_s, lo=0.0)
        check_number("close_timeout_s", self.close_timeout_s, lo=0.0)
        if not isinstance(self.thermometers, (bool, ThermometerConfig)):
            raise ValueError(f"thermometers must be True, False or a ThermometerConfig, got {self.thermometers!r}")
        if not isinstance(self.precise_skip, (bool, PreciseSkip)):
            raise ValueError(f"precise_skip must be True, False or a PreciseSkip, got {self.precise_skip!r}")

    @property
    def precise(self) -> PreciseSkip | None:
        """The precise skip to search with, or None (off)."""
        return PreciseSkip() if self.precise_skip is True else self.precise_skip or None

    @property
    def dir(self) -> Path:
        return Path(self.checkpoint_dir or Path("checkpoints") / self.run)
