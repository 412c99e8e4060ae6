"""thermowatch.watch's checkpoints (thermowatch/loop.py): one directory of `step_XXXXXXXX.pt`
files (one process) or torch.distributed.checkpoint directories (torchrun), each with a manifest
of checksums and the health of the steps before it (thermowatch/checkpoint_trust.py), written
atomically, read as data (thermowatch/checkpoint_io.py), pruned by the bundled trainer's
retention rule, and loaded newest first with a fallback past a corrupt, refused or unreadable one.

The Watch decides when to save and what the state besides the model is (step, cursor, scheduler,
RNG, a precise skip's trail); this module does the files. Under torchrun every rank makes the
same calls; rank 0 alone renames, writes the manifest and prunes."""

from __future__ import annotations

import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from thermowatch import checkpoint_trust
from thermowatch.checkpoint_io import CheckpointRefused, load_as_data, refused_reason, set_aside
from thermowatch.monitors.durable import fsync_dir
from thermowatch.monitors.retention import retained
from thermowatch.ranks import Ranks, set_rng_state

log = logging.getLogger(__name__)

_CKPT = re.compile(r"^step_(\d{8,})\.pt$")
_CKPT_DIR = re.compile(r"^step_(\d{8,})$")  # a torch.distributed.checkpoint directory (torchrun)
# Retention (monitors/retention.py, the bundled trainer's rule): besides the newest `keep`, one per
# KEEP_EVERY-step span and the newest checkpoint at least KEEP_BEHIND steps old: the policy's
# target for a divergence found now (onset - 100 steps by default, + 10 for the detection and the
# command's trip) is still there when its rollback arrives.
KEEP_EVERY, KEEP_BEHIND = 1000, 110


class CheckpointDir:
    """The checkpoints of one loop: its model, optimizer and scheduler, saved and loaded whole."""

    def __init__(self, root: Path, dist: Ranks, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 scheduler: Any, keep: int) -> None:
        self.root, self.dist, self.model, self.optimizer, self.scheduler = root, dist, model, optimizer, scheduler
        self.keep = keep
        self.passed_over: list[str] = []  # why the last load_newest passed over the ones it did
        self._checked_loads = False  # the first checkpoint saved was read back as data

    def path(self, step: int) -> Path:
        return self.root / (f"step_{step:08d}.pt" if self.dist.world == 1 else f"step_{step:08d}")

    def steps(self) -> list[int]:
        """This rank's listing, oldest first (a choice every rank must share: `dist.from_rank0`)."""
        pattern = _CKPT if self.dist.world == 1 else _CKPT_DIR
        return sorted(int(m.group(1)) for p in self.root.iterdir() if (m := pattern.match(p.name)))

    def exists(self, step: int) -> bool:
        return self.path(step).exists()

    def healthy(self, step: int) -> bool:
        return checkpoint_trust.healthy(self.path(step))

    def remove(self, step: int) -> None:
        path = self.path(step)
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
            checkpoint_trust.remove_manifest(path)

    def save(self, step: int, extra: dict[str, Any], cursor: int, healthy: bool) -> Path | None:
        """Write checkpoint `step` (the model, the optimizer and `extra`) with its manifest. The
        path on rank 0, once it is in place; None on the other ranks, which wait for rank 0."""
        path = self.path(step)
        tmp = path.with_name(path.name + ".partial")
        if self.dist.world > 1:
            self.dist.save(self.model, self.optimizer, extra, tmp)
        else:
            with open(tmp, "wb") as f:  # its checksum taken as it is written: nothing is read back
                hashed = checkpoint_trust.HashingWriter(f)
                torch.save({**extra, "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()},
                           hashed)
                f.flush()
                os.fsync(f.fileno())
        # Once a run, on rank 0 (every rank's part holds the same types; the others' parts are
        # renamed away under them): the types a loop's state holds do not change.
        if not self._checked_loads and self.dist.rank == 0:
            self._checked_loads = True
            why = refused_reason(tmp if self.dist.world == 1 else tmp / "extra_rank0.pt")
            if why is not None:
                log.error("thermowatch: checkpoint step %d holds a type outside the checkpoint allow-list (%s), so "
                          "a resume or rollback will refuse it and fall back past it: keep plain values in your "
                          "scheduler's and optimizer's state, or allow the type with "
                          "torch.serialization.add_safe_globals before thermowatch.watch", step, why)
        if self.dist.world > 1 and self.dist.rank != 0:
            self.dist.barrier()  # rank 0 renames, registers and prunes; then every rank goes on
            return None
        if self.dist.world > 1:  # every rank's files are written (dcp.save is collective): list them
            checkpoint_trust.write_manifest(tmp, step, cursor, healthy, checkpoint_trust.listing(tmp))
        os.replace(tmp, path)
        fsync_dir(self.root)
        if self.dist.world == 1:  # after the file: a manifest never vouches for a file not in place
            checkpoint_trust.write_manifest(path, step, cursor, healthy, {path.name: hashed.digest()})
        return path

    def prune(self, now: int) -> list[int]:
        """Retention after checkpoint `now` (rank 0, after save): the steps deleted. Under
        torchrun the other ranks wait in `save` for this barrier."""
        steps = self.steps()
        keep = retained(steps, self.keep, KEEP_EVERY, now=now, behind=KEEP_BEHIND)
        # Never the newest checkpoint saved healthy, however many unhealthy ones came since
        # (pocket-tts #262: after a NaN, keep-last-3 deleted every healthy checkpoint and the
        # resume reloaded NaN weights). The store's guard too (trainer/checkpoint.py, prune).
        newest_healthy = next((s for s in reversed(steps) if self.healthy(s)), None)
        if newest_healthy is not None:
            keep.add(newest_healthy)
        old = [s for s in steps if s not in keep]
        for s in old:
            self.remove(s)
        return old

    def released(self) -> None:
        """Rank 0 is done with save and prune: the other ranks, waiting in `save`, go on."""
        if self.dist.world > 1:
            self.dist.barrier()

    def load(self, step: int) -> dict[str, Any]:
        """Checkpoint `step` into the model, the optimizer, the scheduler and the RNG; the rest of
        its state (step, cursor, losses) returned."""
        if self.dist.world > 1:
            state = self.dist.load(self.model, self.optimizer, self.path(step))
        else:
            state = load_as_data(self.path(step))  # as data: a planted pickle is refused, not run
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        return state

    def load_newest(self, steps: list[int], healthy_fallback: bool = False) -> dict[str, Any] | None:
        """Load the newest of these checkpoints that matches its manifest's checksums and reads;
        one that does not falls back to an older one (with `healthy_fallback`, a rollback's: only
        to one saved healthy). Its state, or None when none loads; `passed_over` says why each one
        before it was passed over. Under torchrun every rank tries the same ones in the same
        order and keeps one only when every rank read it.

        A file refused for holding code (thermowatch/checkpoint_io.py) is set aside as
        `<name>.refused`: kept for whoever looks into it, never tried again, and out of the way
        of the checkpoint this run saves at that step when it trains there again."""
        self.passed_over = []
        for i, s in enumerate(sorted(steps, reverse=True)):
            refused = False
            if i and healthy_fallback and not self.healthy(s):
                log.warning("thermowatch: passing over checkpoint step %d: saved after a non-finite loss", s)
                self.passed_over.append(f"{s} (saved after a non-finite loss)")
                continue
            why = checkpoint_trust.problem(self.path(s))
            if not self.dist.all_ok(why is None):
                why = why or "another rank found its files corrupt"
                log.error("thermowatch: checkpoint step %d does not match its manifest (%s); trying an older one",
                          s, why)
                self.passed_over.append(f"{s} ({why})")
                continue
            state = None
            try:
                state = self.load(s)
            except CheckpointRefused as exc:
                log.error("thermowatch: checkpoint step %d was refused, not loaded: %s; trying an older one", s, exc)
                refused = True
                self.passed_over.append(f"{s} (refused: it names code or types outside the allow-list)")
            except Exception as exc:  # noqa: BLE001 - a torn or foreign file: say so, try the next
                log.error("thermowatch: checkpoint %s is unreadable (%s); trying an older one", self.path(s), exc)
                self.passed_over.append(f"{s} (unreadable: {type(exc).__name__})")
            if self.dist.all_ok(state is not None):
                return state
            if state is not None:  # read here, not on another rank
                self.passed_over.append(f"{s} (unreadable on another rank)")
            if not self.dist.all_ok(not refused) and self.dist.rank == 0:  # any rank refused it
                set_aside(self.path(s))
        return None
