"""When thermowatch.watch saves a checkpoint, what it puts in it, and what a load or a resume puts
back in the loop (the files themselves: thermowatch/checkpoint_dir.py).

A checkpoint holds the weights, the optimizer, the scheduler, the RNG, the step and the sample
cursor, and under precise skip the newest losses (the healthy trail a rollback back to it
compares with). The skip ledger and the LR changes are absolute and outlive every rollback: they
live in the run's command book beside the checkpoints (`checkpoint_dir/commands.json`), not in
them, so a relaunch has the newest. A resume or a rollback opens the run's next attempt."""

from __future__ import annotations

from typing import Any

from thermowatch.checkpoint_dir import KEEP_BEHIND, KEEP_EVERY
from thermowatch.monitors.contract import LRChange
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.ranks import rng_state


class Checkpointing:
    """The checkpoints of `w`, the Watch (thermowatch/loop.py; not imported here: the loop imports
    this module). `losses`: the newest losses before the checkpoint loaded last (precise skip)."""

    def __init__(self, w: Any) -> None:
        self.w = w
        self.losses: list[float] = []

    def due(self) -> None:
        """Save the step just trained when it falls on `checkpoint_every` and is not saved yet."""
        w = self.w
        if w.step and w.step % w.checkpoint_every == 0 and w.batch_step == w.step and not w.ckpts.exists(w.step):
            self.save(w.step)

    def save(self, step: int) -> None:
        w = self.w
        w.recorder.drain(True)  # the health of the steps before it is known before it is registered
        extra = {"step": step, "cursor": w.cursor,
                 "scheduler": w.scheduler.state_dict() if w.scheduler is not None else None, "rng": rng_state()}
        if w.precise is not None:  # a precise skip's healthy trail, should a rollback come back here
            extra["losses"] = w.recorder.trail.newest(w.precise.window)
        healthy = w.recorder.healthy
        path = w.ckpts.save(step, extra, w.cursor, healthy)
        if path is not None:  # rank 0: registered, the book kept, retention, then the others go on
            self.save_book()
            w.run.checkpoint_saved(step, path.resolve(), w.cursor, healthy=healthy,
                                   manifest={"attempt": w.run.attempt, "client": "thermowatch.watch"})
            old = w.ckpts.prune(step)
            w.run.checkpoints_deleted(old, f"retention: keep_checkpoints={w.ckpts.keep}, one per "
                                           f"{KEEP_EVERY} steps, the newest {KEEP_BEHIND}+ steps old")
            w.ckpts.released()
        w.recorder.healthy = True

    def load(self, step: int) -> int:
        return self._adopt(self.w.ckpts.load(step))

    def load_newest(self, steps: list[int], healthy_fallback: bool = False) -> int | None:
        """The step of the newest of `steps` that loaded (CheckpointDir.load_newest), or None."""
        state = self.w.ckpts.load_newest(steps, healthy_fallback)
        return self._adopt(state) if state is not None else None

    def _adopt(self, state: dict[str, Any]) -> int:
        """A loaded checkpoint's own state: the step, the cursor and the precise skip's trail."""
        w = self.w
        self.losses = [float(v) for v in state.get("losses") or []]
        w.move_to(int(state["step"]), int(state["cursor"]))
        return w.step

    def save_book(self) -> None:
        """The ledger and the LR changes, into the run's command book (rank 0 keeps it)."""
        w = self.w
        if w.dist.rank == 0:
            w.run.book.save(w.lr_changes, w.ledger.ranges)

    def open_attempt(self, start_step: int) -> None:
        """A new attempt from `start_step` (a resume, a rollback): every rank takes rank 0's
        number, and the schedule's forecast is made again from there."""
        w = self.w
        w.run.start(start_step=start_step)
        w.run.attempt = w.dist.from_rank0(lambda: w.run.attempt)
        w.forecast.make(w.optimizer, w.scheduler, w.lr_schedule, w.step, w.total)

    def resume(self) -> None:
        """The command book's ledger and LR changes, then the newest checkpoint that loads (rank 0's
        listing), and the attempt opened from it (from step 0 with none)."""
        w = self.w
        book = w.dist.from_rank0(lambda: {"skip_ranges": [r.to_json() for r in w.run.book.skip_ranges],
                                          "lr_changes": [c.to_json() for c in w.run.book.lr_changes]})
        w.ledger = SkipLedger(book["skip_ranges"], period=w.dataset_size, index=w.data_index)
        w.lr_changes = [LRChange.from_json(c) for c in book["lr_changes"]]
        self.open_attempt(self.load_newest(w.dist.from_rank0(w.ckpts.steps)) or 0)
