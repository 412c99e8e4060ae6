"""What the trainer adapters share: a `Watch` driven from a framework's step callbacks, and the
dataset that serves the framework the samples the Watch says each step trains.

A framework that owns the loop (HF `Trainer`, Lightning) calls us at two points per optimizer
step; the Watch's own generator (`Watch.steps()`) is advanced at the step's end, so checkpoints,
commands, pause and stop are carried out by exactly the code a plain loop runs:

    on the step's start:  begin()                  the thermometers (re)armed for this step
    each micro-batch:     add_loss(loss)           a device tensor, summed, never synced
    on the step's end:    boundary = end()         record; checkpoint; commands; pause; next step

The data is the hard part: the framework's DataLoader fetches ahead (accelerate's DataLoaderShard
and Lightning's fetcher hold one batch, workers hold `prefetch_factor` each), so a batch fetched
before a rollback or a skip is stale by the time it would be trained. We never patch a fetched
batch: a boundary that changes the data (a rollback, a skip) ends the framework's epoch, whose
next one opens a new iterator, and `WatchedDataset.__iter__` starts again from the Watch's cursor
with its ledger. The batches fetched ahead are dropped with the old iterator.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from thermowatch.loop import Watch
from thermowatch.ranks import rng_state, set_rng_state
from thermowatch.monitors.ledger import SkipLedger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Plan:
    """The sample order from the step after `step` on: what a fresh data iterator serves. Plain
    data, so a DataLoader worker (forked or spawned) carries it without the Watch."""

    cursor: int  # the next absolute sample id to consider
    skip_ranges: tuple[tuple[int, int], ...]
    global_batch: int  # ids per optimizer step
    micro_batch: int  # ids per DataLoader batch (global_batch / gradient accumulation)
    steps: int  # how many steps are left to serve (0 once stopped or complete)
    dataset_size: int | None = None  # the Watch's: skips stand for data indices, in every pass


@dataclass(frozen=True)
class Boundary:
    """What the end of a step did, for the adapter to tell its framework."""

    next_step: int | None  # None: stop (a stop command, or every step trained)
    rolled_back: bool  # the framework's step counter must go back to `step`
    restart: bool  # the data changed: end the framework's epoch so the next iterator re-plans
    step: int  # the last step trained (after a rollback: the checkpoint's)


class WatchedDataset(torch.utils.data.IterableDataset):
    """Your map-style dataset (`data[i]`, `len(data)`), in the order the Watch trains it.

    Absolute sample id `i` is `data[i % len(data)]`: pass `i // len(data)` is a pass over the data,
    in order, or shuffled per pass with `shuffle_seed` (the same permutation every time that pass
    is served, so a re-trained step sees the same samples). Each step's ids are the Watch's
    `batch_ids`: the skip ledger applied, the cursor restored by a rollback."""

    def __init__(self, data: Any, adapter: "Adapter", *, shuffle_seed: int | None = None,
                 batch_size: int | None = None) -> None:
        if not hasattr(data, "__getitem__") or not hasattr(data, "__len__") or len(data) == 0:
            raise ValueError(f"{type(data).__name__}: need a non-empty map-style dataset (data[i] and len(data)); "
                             "an iterable one has no sample ids to skip or to re-train")
        self.data, self.adapter, self.shuffle_seed, self.batch_size = data, adapter, shuffle_seed, batch_size
        self._plan: Plan | None = None  # set in a spawned worker's copy (the adapter stays behind)
        self._perm: tuple[int, np.ndarray] | None = None

    def __getstate__(self) -> dict[str, Any]:
        # A spawned DataLoader worker gets the plan of this moment (the iterator is being made),
        # not the adapter with its Watch, model and background thread.
        state = dict(self.__dict__)
        state["_plan"] = self._plan or self.adapter.plan()
        state["adapter"] = None
        return state

    def __iter__(self) -> Iterator[Any]:
        plan = self._plan or self.adapter.plan()
        info = torch.utils.data.get_worker_info()
        workers, me = (info.num_workers, info.id) if info is not None else (1, 0)
        ledger = SkipLedger(plan.skip_ranges) if plan.dataset_size is None else \
            SkipLedger(plan.skip_ranges, period=plan.dataset_size, index=self.data_index_fn())
        cursor, per_step = plan.cursor, plan.global_batch // plan.micro_batch
        for k in range(plan.steps):
            ids = ledger.take(cursor, plan.global_batch)
            cursor = int(ids[-1]) + 1
            # DataLoader workers hand out batches round-robin: worker w serves micro-batches w, w+W, ...
            for m in range(per_step):
                if (k * per_step + m) % workers == me:
                    for i in ids[m * plan.micro_batch:(m + 1) * plan.micro_batch].tolist():
                        yield self.data[self._index(i)]

    def _index(self, i: int) -> int:
        n = len(self.data)
        if self.shuffle_seed is None:
            return i % n
        return int(self._pass_order(i // n)[i % n])

    def _pass_order(self, epoch: int) -> np.ndarray:
        if self._perm is None or self._perm[0] != epoch:
            self._perm = (epoch, np.random.default_rng([self.shuffle_seed, epoch]).permutation(len(self.data)))
        return self._perm[1]

    def data_index(self, ids: np.ndarray) -> np.ndarray:
        """The data index (`data[...]`) each absolute sample id is served from (vectorised: a loop
        over the passes the ids span, not over ids)."""
        ids = np.asarray(ids, dtype=np.int64)
        n = len(self.data)
        if self.shuffle_seed is None:
            return ids % n
        out = np.empty_like(ids)
        passes = ids // n
        for e in np.unique(passes).tolist():
            here = passes == e
            out[here] = self._pass_order(e)[ids[here] % n]
        return out

    def data_index_fn(self):
        """The skip ledger's `index`: None when an id's data index is `id % len(data)`."""
        return None if self.shuffle_seed is None else self.data_index


def check_fit(framework: str, set_it: str, max_steps: int | None, world_size: int) -> None:
    """What every adapter needs of the framework's fit before the Watch starts: a run length in
    optimizer steps (`set_it` says where it is set) and one process."""
    if max_steps is None or max_steps <= 0:
        raise ValueError(f"thermowatch: set {set_it}: the run's length in optimizer steps "
                         "(the watched data has no end of its own; a pass over the data is sample ids, not epochs)")
    if world_size > 1:
        raise ValueError(f"thermowatch: world_size {world_size}: the {framework} adapter runs in one process for now "
                         "(torchrun support is issue 22's next item)")


class Adapter:
    """A Watch driven by a framework's callbacks. Subclasses translate the framework's hooks."""

    client = "thermowatch.integrations"

    def __init__(self, *, run: str, checkpoint_dir: str | Path | None = None, **watch_kwargs: Any) -> None:
        for k in ("model", "optimizer", "steps", "global_batch", "scheduler"):
            if k in watch_kwargs:
                raise TypeError(f"{k}= comes from the trainer; pass only run=, checkpoint_dir= and watch's other keywords")
        self.run_id, self.checkpoint_dir, self.watch_kwargs = run, checkpoint_dir, watch_kwargs
        self.watch: Watch | None = None
        self._steps: Iterator[int] | None = None
        self._next: int | None = None
        self._micro_batch = 0
        self._loss: torch.Tensor | None = None
        self._losses = 0
        self._rng_after_boundary: dict[str, Any] | None = None
        self._warned_no_loss = False
        self.datasets: list[WatchedDataset] = []

    def dataset(self, data: Any, *, shuffle_seed: int | None = None, batch_size: int | None = None) -> WatchedDataset:
        """Your dataset, served in the Watch's order (see WatchedDataset)."""
        ds = WatchedDataset(data, self, shuffle_seed=shuffle_seed, batch_size=batch_size)
        self.datasets.append(ds)
        return ds

    # --- the Watch's life ---------------------------------------------------------------------

    def start(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *, steps: int,
              micro_batch: int, accumulation: int) -> int:
        """Build the Watch and resume it (the newest checkpoint in checkpoint_dir, if any). The
        step resumed from (0 for a new run): the framework's step counter must read it."""
        cfg = {"client": self.client, **self.watch_kwargs.pop("config", {})}
        self._micro_batch = int(micro_batch)
        kwargs = dict(self.watch_kwargs)
        served = self._served()
        if served is not None and "dataset_size" not in kwargs:  # the loader's length (issue 35)
            kwargs["dataset_size"] = len(served.data)
        self.watch = Watch(model, optimizer, run=self.run_id, steps=steps, global_batch=micro_batch * accumulation,
                           checkpoint_dir=self.checkpoint_dir, scheduler=scheduler, config=cfg,
                           data_index=served.data_index_fn() if served is not None else None, **kwargs)
        self._steps = self.watch.steps()
        self._next = next(self._steps, None)
        return self.watch.step

    def _served(self) -> "WatchedDataset | None":
        """The one order every watched dataset serves (one dataset, or copies alike in length and
        shuffle): skips then follow its data across passes. None when there is none or they differ."""
        kinds = {(len(d.data), d.shuffle_seed) for d in self.datasets}
        return self.datasets[0] if len(kinds) == 1 else None

    def plan(self) -> Plan:
        w = self.watch
        if w is None:
            raise RuntimeError("the dataset was iterated before training started; iterate it through the trainer "
                               "that has this callback in its callbacks=[...]")
        left = 0 if self._next is None else w.total - w.step
        # the ledger the next step is taken through: a precise skip's probe has its own (issue 39)
        return Plan(w.cursor, tuple(w.serving.ranges), w.global_batch, self._micro_batch, left, w.dataset_size)

    def begin(self) -> None:
        """The step's first micro-batch is about to run: whatever ran between the boundary and now
        (an evaluation, a new data iterator drawing its base seed) does not count in it."""
        if self._rng_after_boundary is not None:
            set_rng_state(self._rng_after_boundary)
            self._rng_after_boundary = None
        if self.watch is not None and self.watch.th is not None and self._next is not None and not self.watch.probing:
            self.watch.th.begin_step(self._next)

    def add_loss(self, loss: Any) -> None:
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float().reshape(())
            self._loss = loss if self._loss is None else self._loss + loss
            self._losses += 1

    def end(self, *, mean: bool) -> Boundary:
        """Record the step (its loss: the micro-batch losses summed, or averaged with `mean`) and
        run the Watch to the next step: checkpoint, commands, pause. Blocks while paused."""
        w = self.watch
        assert w is not None and self._steps is not None
        loss: Any = self._loss
        if loss is None:
            loss = math.nan
            if not self._warned_no_loss:
                self._warned_no_loss = True
                log.warning("thermowatch: step %d: no training loss seen (the model's output has no `loss`); "
                            "steps are recorded with a NaN loss", w._ids_step)
        elif mean and self._losses > 1:
            loss = loss / self._losses
        self._loss, self._losses = None, 0
        attempt, ranges, step = w.attempt, w.serving.to_json(), w._ids_step
        w.record(loss)
        served_to = w.cursor  # the iterator's next sample id, had nothing changed
        self._next = next(self._steps, None)
        # back to a checkpoint: a rollback, or a precise skip's probe starting again from it
        rolled_back = self._next is not None and (w.attempt != attempt or self._next != step + 1)
        # The iterator serves on from served_to through the ledger it was planned with: a new
        # ledger (a skip, a probe's), a rollback, or a cursor moved (a replay going round its
        # known-clean samples) needs a new one.
        restart = self._next is not None and (rolled_back or w.serving.to_json() != ranges or w.cursor != served_to)
        if restart:
            # The new data iterator draws from the global RNG; the step after the boundary must
            # see the RNG the boundary left (a rollback's: the checkpoint's), as in a plain loop.
            self._rng_after_boundary = rng_state()
        return Boundary(self._next, rolled_back, restart, w.step)

    def close(self, *, finished: bool = True) -> None:
        if self.watch is not None:
            self.watch.close(finished=finished)

    @property
    def step(self) -> int:
        """The last step trained (0 before training starts)."""
        return 0 if self.watch is None else self.watch.step

    @property
    def attempt(self) -> int:
        return 0 if self.watch is None else self.watch.attempt

    @property
    def final_loss(self) -> float:
        """The loss of the last step recorded (one step's, not a mean: the value the run's finish
        report carries); NaN before training and when it ended diverged."""
        return math.nan if self.watch is None else self.watch.final_loss
