"""The training run's configuration: nested dataclasses, each validated in __post_init__.

A YAML/JSON file lists only what differs from the defaults (STYLE.md 5):

    run_id: tiny-z3
    zero_stage: 3
    model: {n_layer: 2, d_model: 64}
    optim: {lr: 3.0e-3}

`TrainConfig.from_dict` merges such a dict onto the defaults and names any unknown key.
The defaults are the embedded mode's: a tiny byte-level GPT, 2 CPU ranks over gloo.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from thermowatch.monitors.config_tree import ConfigTreeError, check_tree, schema
from thermowatch.monitors.names import check_run_id
from thermowatch.trainer.data import DataConfig
from thermowatch.trainer.lr import SCHEDULES, LRSchedule
from thermowatch.trainer.model import GPTConfig

PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_SPREAD", "STRICT_PACK")
REDUCTIONS = ("collective", "driver")


class ConfigError(ValueError):
    """A configuration value that cannot be used. The message names the key and the fix."""


def _positive_int(owner: str, name: str, val: Any, minimum: int = 1) -> None:
    if isinstance(val, bool) or not isinstance(val, int) or val < minimum:
        raise ConfigError(f"{owner}.{name} must be an integer >= {minimum}, got {val!r}")


@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak LR; tiny models take a high one (nanoGPT shakespeare-char: 1e-3)
    warmup_steps: int = 10  # linear warmup; GPT-3 warmed up over ~0.1-1% of training
    schedule: str = "cosine"  # "cosine" | "linear" | "constant" after warmup
    min_lr_ratio: float = 0.1  # cosine floor = 10% of peak (GPT-3, Chinchilla)
    weight_decay: float = 0.1  # GPT-3 / YaLM
    betas: tuple[float, float] = (0.9, 0.95)  # beta2 = 0.95 damps spikes (GPT-3, OPT, PaLM)
    eps: float = 1e-8
    grad_clip: float = 1.0  # global-norm clipping; the thermometer reports the norm *before* it

    def __post_init__(self) -> None:
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"optim.lr must be a positive finite float, got {self.lr!r}")
        _positive_int("optim", "warmup_steps", self.warmup_steps, minimum=0)
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"optim.schedule={self.schedule!r} is not one of {SCHEDULES}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay must be >= 0, got {self.weight_decay!r}")
        self.betas = tuple(float(b) for b in self.betas)  # YAML gives lists
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"optim.betas must be two floats in [0, 1), got {self.betas!r}")
        if not self.grad_clip >= 0:
            raise ConfigError(f"optim.grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip!r}")
        if not self.eps > 0:  # AdamW divides by sqrt(v) + eps: -1 once passed here (issue 34)
            raise ConfigError(f"optim.eps must be > 0, got {self.eps!r}")


@dataclass
class CheckpointConfig:
    dir: str = "checkpoints"  # root; each run writes <dir>/<run_id>/step_<n>; must be shared by all nodes
    every: int = 50  # steps between saves; 0 = never (tests, benchmarks)
    keep_last: int = 3  # retention: the newest K ...
    keep_every: int = 500  # ... plus every M-th step, so a healthy target stays behind an onset
    # ... plus every checkpoint of the last N steps, older ones thinning with age: what a rollback
    # asks for is kept whatever keep_last is (monitors/retention.py, issue 35). 0 = off.
    keep_behind: int = 110

    def __post_init__(self) -> None:
        _positive_int("checkpoint", "every", self.every, minimum=0)
        _positive_int("checkpoint", "keep_last", self.keep_last)
        _positive_int("checkpoint", "keep_every", self.keep_every, minimum=0)
        _positive_int("checkpoint", "keep_behind", self.keep_behind, minimum=0)


@dataclass
class FaultConfig:
    """Fault drills (issue 39): real faults put into the run on purpose, so the supervisor's
    replay triage (precise_skip.triage) and its response can be seen and tested on any machine
    (tests/faults/test_replay_triage.py). All off by default; never for a run that should train well.
    Each is real training: the same model, data and engine, with one thing broken."""

    # hardware: at this step, on the run's first attempt only (once: a replay does not repeat
    # it, as a transient fault would not), one activation element of rank `flip_rank`'s forward
    # gets its exponent bits set, as a flipped bit reads (NaN); 0 = off
    flip_step: int = 0
    flip_rank: int = 0
    # data: samples with ids in [lo, hi) are uniformly random tokens, the same on every pass (a
    # corrupt shard); [0, 0] = off
    poison: tuple[int, int] = (0, 0)
    # optimizer: from this step on, on every pass, the LR is `lr_factor` x the schedule's (a wrong
    # config: a rollback re-trains into it again); 0 = off
    lr_step: int = 0
    lr_factor: float = 30.0

    def __post_init__(self) -> None:
        _positive_int("faults", "flip_step", self.flip_step, minimum=0)
        _positive_int("faults", "flip_rank", self.flip_rank, minimum=0)
        _positive_int("faults", "lr_step", self.lr_step, minimum=0)
        self.poison = tuple(self.poison)  # YAML gives a list
        if len(self.poison) != 2 or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in self.poison) \
                or self.poison[1] < self.poison[0]:
            raise ConfigError(f"faults.poison must be [lo, hi) sample ids, 0 <= lo <= hi, got {self.poison!r}")
        if not (self.lr_factor > 0 and math.isfinite(self.lr_factor)):
            raise ConfigError(f"faults.lr_factor must be a positive finite float, got {self.lr_factor!r}")


@dataclass
class TrainConfig:
    run_id: str = "run"  # the supervisor's key for this run; reuse it to resume
    seed: int = 0  # model init; data order has its own seed (data.seed)
    world_size: int = 2  # ranks = Ray actors; the embedded default is 2 CPU ranks over gloo
    zero_stage: int = 2  # ZeRO 1 (optimizer), 2 (+grads), 3 (+params)
    steps: int = 100  # total optimizer steps (also the LR schedule's length)
    use_gpu: bool = False  # one GPU per actor and NCCL; False = CPU + gloo
    cpus_per_rank: float = 1.0  # Ray CPU reservation (and torch threads) per rank
    placement: str = "PACK"  # PACK locally; SPREAD / STRICT_SPREAD to put ranks on different nodes
    max_restarts: int = 3  # gang restarts after a worker dies before the run gives up
    flush_every_steps: int = 10  # steps per batch to the supervisor (the sink's: HttpSink, Batched) ...
    flush_every_s: float = 1.0  # ... or sooner, when this much time has passed
    close_timeout_s: float = 10.0  # at the end, wait at most this for the supervisor; the rest stays spooled
    poll_every_s: float = 0.25  # command polling interval while paused
    # A step that neither finishes nor fails in this time means a hung rank (a collective
    # waiting on a stalled node): the gang is killed and restarted like after a death.
    step_timeout_s: float = 600.0
    # How long a new gang waits for Ray to place its ranks (capacity lost with a node may come
    # back, an autoscaler may add a node); then the bring-up counts as one failed restart
    # (max_restarts). While it waits no records arrive: the supervisor's stall detector alerts.
    placement_timeout_s: float = 600.0
    # Hand each step's thermometers out a step late, so the step never waits for their host
    # copy (DESIGN.md, "Nothing blocks training"). None: late on a GPU, where the copy is
    # asynchronous; on time on CPU, where the values are on the host when the step ends and
    # reading them late would only delay records and commands by a step.
    read_late: bool | None = None
    # How the ranks' thermometer vectors become one record. "collective": the ranks all-reduce
    # on the device (max/min with the extreme's rank, sum/mean; monitors.collective) and the
    # driver receives one vector per step whatever the world size. "driver": every rank sends
    # its vector and the controller reduces them (monitors.reduce; the path before issue 13,
    # kept as the reference the collective one is tested against, bit for bit).
    reduction: str = "collective"
    # A tiny model: trains on 2 CPU cores in seconds (a config's `model:` keys merge onto it).
    model: GPTConfig = field(default_factory=lambda: GPTConfig(n_layer=2, n_head=4, d_model=64, seq_len=64))
    # trainer.data.DataConfig: stdlib bytes, 8 samples of 64 tokens per step (tiny-model scale).
    data: DataConfig = field(default_factory=lambda: DataConfig(seq_len=64, global_batch=8))
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    thermometers: dict[str, Any] = field(default_factory=dict,  # monitors ThermometerConfig fields
                                         metadata=schema("thermowatch.monitors.thermometers.config:ThermometerConfig"))
    # A user's own DeepSpeed JSON, merged over the one engine.py builds (dicts merge key by key).
    deepspeed_config_override: dict[str, Any] = field(default_factory=dict)
    # Precise skip (issue 24 item 5, issue 39): before a data rollback resumes, probes re-trained
    # from its checkpoint find which suspect samples did it, and skip only those; with
    # `triage: true` two replays first name the cause (data, hardware, optimizer). null = off;
    # {} = on with thermowatch.precise_skip.PreciseSkip's defaults. Needs a fixed batch (no ramp).
    precise_skip: dict[str, Any] | None = field(default=None, metadata=schema("thermowatch.precise_skip:PreciseSkip"))
    faults: FaultConfig = field(default_factory=FaultConfig)  # fault drills; off

    def __post_init__(self) -> None:
        try:  # the daemon's own rule (monitors.names): checkpoints go to <checkpoint.dir>/<run_id>
            check_run_id(self.run_id)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _positive_int("", "world_size", self.world_size)
        _positive_int("", "seed", self.seed, minimum=0)  # numpy refuses a negative seed, at the first step
        if self.zero_stage not in (1, 2, 3):
            raise ConfigError(f"zero_stage must be 1, 2 or 3, got {self.zero_stage!r}")
        _positive_int("", "steps", self.steps)
        _positive_int("", "max_restarts", self.max_restarts, minimum=0)
        _positive_int("", "flush_every_steps", self.flush_every_steps)
        if self.placement not in PLACEMENT_STRATEGIES:
            raise ConfigError(f"placement={self.placement!r} is not one of {PLACEMENT_STRATEGIES}")
        if not (self.step_timeout_s > 0 and self.poll_every_s > 0 and self.flush_every_s >= 0):
            raise ConfigError("step_timeout_s and poll_every_s must be > 0 and flush_every_s >= 0")
        if not 0 <= self.close_timeout_s < math.inf:
            raise ConfigError(f"close_timeout_s must be a finite number of seconds >= 0, got {self.close_timeout_s!r}")
        if not self.placement_timeout_s > 0:
            raise ConfigError(f"placement_timeout_s must be > 0 seconds, got {self.placement_timeout_s!r}")
        if self.read_late not in (None, True, False):
            raise ConfigError(f"read_late must be true, false or null (auto), got {self.read_late!r}")
        if self.reduction not in REDUCTIONS:
            raise ConfigError(f"reduction={self.reduction!r} is not one of {REDUCTIONS}")
        if not self.cpus_per_rank > 0:
            raise ConfigError(f"cpus_per_rank must be > 0, got {self.cpus_per_rank!r}")
        for sub, cls in (("data", DataConfig), ("optim", OptimConfig), ("checkpoint", CheckpointConfig),
                         ("model", GPTConfig), ("faults", FaultConfig)):
            val = getattr(self, sub)
            if isinstance(val, Mapping):
                setattr(self, sub, _build(cls, val, sub))
        if self.data.global_batch % self.world_size:
            raise ConfigError(
                f"data.global_batch={self.data.global_batch} is not divisible by world_size="
                f"{self.world_size}; use a multiple of {self.world_size}"
            )
        if self.data.start_batch and self.data.batch_multiple % self.world_size:
            raise ConfigError(
                f"data.batch_multiple={self.data.batch_multiple} must be divisible by world_size="
                f"{self.world_size} so every ramped batch splits evenly across ranks"
            )
        if self.data.seq_len > self.model.seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds model.seq_len={self.model.seq_len}; "
                "raise model.seq_len or lower data.seq_len"
            )
        if self.optim.warmup_steps > self.steps:
            raise ConfigError(f"optim.warmup_steps={self.optim.warmup_steps} exceeds steps={self.steps}")
        self.thermometer_config()
        self.precise()
        if self.precise_skip is not None and self.data.ramp_tokens:
            raise ConfigError("precise_skip needs a fixed batch: a probe is whole steps of data.global_batch "
                              f"samples, and data.ramp_tokens={self.data.ramp_tokens} ramps it; drop one of them")
        if self.faults.flip_step and self.faults.flip_rank >= self.world_size:
            raise ConfigError(f"faults.flip_rank={self.faults.flip_rank} is not a rank of world_size={self.world_size}")

    # --- derived objects ------------------------------------------------------------------------

    def thermometer_config(self):
        from thermowatch.monitors.thermometers.config import ThermometerConfig

        try:
            return ThermometerConfig(**self.thermometers)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"thermometers: {exc}") from exc

    def precise(self):
        """The PreciseSkip the run controller searches with, or None (off)."""
        from thermowatch.precise_skip import PreciseSkip

        if self.precise_skip is None:
            return None
        try:
            return PreciseSkip(**self.precise_skip)
        except ValueError as exc:  # its own messages name the key
            raise ConfigError(str(exc)) from exc
        except TypeError as exc:
            raise ConfigError(f"precise_skip: {exc}") from exc

    def lr_schedule(self) -> LRSchedule:
        o = self.optim
        return LRSchedule(o.lr, self.steps, o.warmup_steps, o.schedule, o.min_lr_ratio)

    # --- (de)serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any] | None) -> "TrainConfig":
        """Defaults, overridden by whatever `obj` lists (nested dicts merge). A key or type that
        does not fit, at any depth, is one ConfigError naming its dotted path (config_tree)."""
        _check(obj or {})
        return _build(cls, obj or {}, "")

    @classmethod
    def load(cls, path: str | Path) -> "TrainConfig":
        text = Path(path).read_text()
        if str(path).endswith((".yaml", ".yml")):
            import yaml

            try:
                obj = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ConfigError(f"not valid YAML: {exc}") from None
        else:
            obj = json.loads(text)
        return cls.from_dict(obj)

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with top-level fields (or nested dicts, merged) changed."""
        merged = _merge(self.to_dict(), changes)
        _check(merged)
        return _build(TrainConfig, merged, "")


def _check(obj: Any) -> None:
    try:
        check_tree(TrainConfig, obj)
    except ConfigTreeError as exc:
        raise ConfigError(str(exc)) from None


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, val in over.items():
        if isinstance(val, Mapping) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], val)
        else:
            out[key] = val
    return out


def _shallow(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def _build(cls: type, obj: Mapping[str, Any], where: str):
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{where or 'config'} must be a mapping, got {type(obj).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(obj) - set(names))
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where or 'config'}; valid keys are {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for key, val in obj.items():
        default = names[key].default_factory() if names[key].default_factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(default) and isinstance(val, Mapping):
            # Merge onto the field's own default (e.g. data.seq_len=64), not the class defaults.
            val = _build(type(default), {**_shallow(default), **val}, f"{where}.{key}".lstrip("."))
        kwargs[key] = val
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:  # a nested class's own check (GPTConfig's) names its field
        raise ConfigError(f"{where or 'config'}: {exc}") from exc
