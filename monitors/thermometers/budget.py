"""The thermometers' cost budget (issue 36): each group's cost measured on the device it runs on,
and cadences that keep the thermometers within a fraction of the step.

Measuring. A `Timer` times the regions the hooks and probes spend working on read steps (on
off-steps a hook returns at its branch and calls no timer) and the step, from one `begin_step`
to the next (data loading and logging included: the step the user waits for):
- CPU (`ThreadTimer`): the training thread's CPU time, `time.thread_time_ns`. Blind to the
  other processes on a shared machine, which wall time is not. On the Linux machine this was
  written on a call costs 0.63 us and two readings differ by 0.7 us at least (the call itself):
  fine enough for regions of tens of microseconds.
- CUDA (`CudaTimer`): events recorded around each region and at each step boundary, read once
  `query()` says they are done, usually a step later: the device's time, never a sync.
Nested regions count once, in the outermost one's group.

Deciding. Every DECIDE_EVERY steps, from the steps measured since the last decision: each
budgeted group's share of the step per read (its time per read step / the median step time),
the share of what the budget cannot thin (the update ratio at `update_every`, begin_step's and
end_step's own work), and `decide()`: from each group's fastest cadence, double the `every` of
the group whose share is largest until the sum fits the budget or every group is at its
slowest (then the floors win: `over_budget`, warned once two windows running are over).
Cadences are powers of two, so a step read by a slow group is read by the faster ones, and
DECIDE_EVERY (a multiple of every cadence) is a step every group reads. Under torch.distributed
the ranks decide from the max of their shares (`all_ranks_max`), so all read the same steps: a
rank reading a figure the others skip would look like an outlier rank (monitors.reduce).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import Callable, Iterator, Protocol, Sequence

import numpy as np
import torch
import torch.distributed as dist

from thermowatch.monitors.thermometers.config import ThermometerConfig

log = logging.getLogger("thermowatch")

# The groups a timer tells apart. The budget sets the cadence of the first three; UPDATE runs at
# update_every, BASE (begin_step's and end_step's own work: slot reset, scalars, host copy) every step.
GROUPS = ("act", "attn", "grad", "update", "base")
ACT, ATTN, GRAD, UPDATE, BASE = range(len(GROUPS))
BUDGETED = GROUPS[:3]

# Steps between decisions: a multiple of every cadence (<= 16 by default), so the decision step
# reads every group; 32 steps hold 2 reads of a group at 16, enough for its cost per read.
DECIDE_EVERY = 32
# Steps a decision needs measured: fewer (the first window on a GPU, a rollback) keep the cadence.
MIN_STEPS = 8
# The attention figure at least every 4th step (issue 36: 23 real runs replayed with it on every
# 4th step only were judged exactly as with every step: every damaged run caught, same lead).
ATTN_MAX_EVERY = 4


class Timer(Protocol):
    """Times regions of work, by group, and the steps they fall in."""

    def mark(self, tag: tuple) -> None:
        """A step begins, carrying `tag`: closes the step open until now."""

    def tag(self, tag: tuple) -> None:
        """The open step's tag, where it is known only after its mark (begin_step's plan)."""

    def start(self) -> None:
        """A region of thermometer work begins (nested regions count once)."""

    def stop(self, group: int) -> None:
        """The region ends; its time counts in `group` (GROUPS)."""

    def finished(self) -> Iterator[tuple[tuple, float, list[float]]]:
        """(tag, step ns, ns per group) of each closed step whose times are known, oldest first, once."""


class NullTimer:
    """No budget: nothing measured."""

    def mark(self, tag: tuple) -> None:
        pass

    def tag(self, tag: tuple) -> None:
        pass

    def start(self) -> None:
        pass

    def stop(self, group: int) -> None:
        pass

    def finished(self) -> Iterator[tuple[tuple, float, list[float]]]:
        return iter(())


class ThreadTimer:
    """The training thread's CPU time (time.thread_time_ns); see the module docstring."""

    def __init__(self) -> None:
        self._depth = 0
        self._t0 = 0
        self._open: tuple[tuple, int, list[float]] | None = None  # (tag, start ns, ns per group)
        self._done: deque[tuple[tuple, float, list[float]]] = deque()

    def mark(self, tag: tuple) -> None:
        now = time.thread_time_ns()
        self._depth = 0  # a region an exception left open ends with its step
        if self._open is not None:
            t, t0, ns = self._open
            self._done.append((t, float(now - t0), ns))
        self._open = (tag, now, [0.0] * len(GROUPS))

    def tag(self, tag: tuple) -> None:
        if self._open is not None:
            self._open = (tag, *self._open[1:])

    def start(self) -> None:
        if self._depth == 0:
            self._t0 = time.thread_time_ns()
        self._depth += 1

    def stop(self, group: int) -> None:
        self._depth -= 1
        if self._depth == 0 and self._open is not None:
            self._open[2][group] += time.thread_time_ns() - self._t0

    def finished(self) -> Iterator[tuple[tuple, float, list[float]]]:
        while self._done:
            yield self._done.popleft()


class CudaTimer:
    """CUDA events around each region and at each step boundary, on the current stream, read
    when done (event.query(): no sync). A step's end event is the next step's start."""

    MAX_PENDING = 64  # steps awaiting their events; older ones are dropped, unread

    def __init__(self) -> None:
        self._depth = 0
        self._ev0: torch.cuda.Event | None = None
        self._free: list[torch.cuda.Event] = []
        self._open: tuple | None = None  # (tag, start event, [(group, ev0, ev1), ...])
        self._closed: deque[tuple] = deque()  # (tag, start event, end event, regions)

    def _event(self) -> torch.cuda.Event:
        ev = self._free.pop() if self._free else torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def tag(self, tag: tuple) -> None:
        if self._open is not None:
            self._open = (tag, *self._open[1:])

    def mark(self, tag: tuple) -> None:
        self._depth = 0
        ev = self._event()
        if self._open is not None:
            self._closed.append((*self._open[:2], ev, self._open[2]))
            if len(self._closed) > self.MAX_PENDING:
                self._closed.popleft()  # its events are not reused: they may still be pending
        self._open = (tag, ev, [])

    def start(self) -> None:
        if self._depth == 0:
            self._ev0 = self._event()
        self._depth += 1

    def stop(self, group: int) -> None:
        self._depth -= 1
        if self._depth == 0 and self._open is not None:
            self._open[2].append((group, self._ev0, self._event()))

    def finished(self) -> Iterator[tuple[tuple, float, list[float]]]:
        while self._closed:
            tag, e0, e1, regions = self._closed[0]
            if not (e1.query() and all(b.query() for _, _, b in regions)):
                return  # still running: read it at a later step
            self._closed.popleft()
            ns = [0.0] * len(GROUPS)
            for g, a, b in regions:
                ns[g] += a.elapsed_time(b) * 1e6  # ms -> ns
                self._free += (a, b)
            yield tag, e0.elapsed_time(e1) * 1e6, ns
            self._free.append(e0)  # the step before, which ended at e0, was read already


def timer_for(device: torch.device) -> Timer:
    return CudaTimer() if device.type == "cuda" else ThreadTimer()


def decide(share: Sequence[float], fixed: float, budget: float, fastest: Sequence[int],
           slowest: Sequence[int]) -> tuple[list[int], bool]:
    """Cadences within `budget`. share[g]: the fraction of a step one read of budgeted group g
    costs; fixed: the fraction per step of what the budget cannot thin. From `fastest`, double
    the `every` of the group with the largest share (share / every) that is below its `slowest`
    until fixed + sum(share / every) <= budget. Returns (every, over_budget): over_budget when
    every group is at its slowest and the sum still exceeds the budget (the floors win)."""
    every = list(fastest)
    while fixed + sum(s / e for s, e in zip(share, every)) > budget:
        can = [g for g in range(len(every)) if every[g] < slowest[g] and share[g] > 0]
        if not can:
            return every, True
        g = max(can, key=lambda g: share[g] / every[g])  # ties: the first group, on every rank alike
        every[g] *= 2
    return every, False


def all_ranks_max(x: np.ndarray, device: torch.device) -> np.ndarray:
    """The max over the default process group's ranks of `x` (x itself in one process), so every
    rank decides the same cadences. Once per DECIDE_EVERY steps; on NCCL the result's copy to the
    host waits for the step's queued work: one short stall per decision, none between."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x
    t = torch.from_numpy(x).to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu().numpy()


def bounds(cfg: ThermometerConfig) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(fastest, slowest) act, attn and grad cadences under the budget: a group left at 1 spans
    1 .. its floor, one set above 1 by hand stays where it was set."""
    floors = (cfg.budget_max_every, ATTN_MAX_EVERY, cfg.budget_max_every)
    fixed = (cfg.act_every, cfg.attn_every, cfg.grad_every)
    return fixed, tuple(f if e > 1 else cap for e, cap, f in zip(fixed, floors, fixed))


class Budget:
    """The measured cost per group and the cadences in force (see the module docstring).

    `fastest`/`slowest`: the act, attn and grad cadences' bounds (powers of two). The grad
    group's slowest applies only while the caller hands end_step the global gradient norm
    (`grad_norm_given`): otherwise that norm comes from the group's per-parameter norms and the
    group reads every `fastest` step."""

    def __init__(self, budget: float, fastest: Sequence[int], slowest: Sequence[int], timer: Timer,
                 device: torch.device, agree: Callable[[np.ndarray, torch.device], np.ndarray] = all_ranks_max) -> None:
        self.budget, self.timer, self.device, self.agree = budget, timer, device, agree
        self.fastest, self.slowest = tuple(fastest), tuple(slowest)
        self.every = list(fastest)  # act, attn, grad cadences in force
        self.grad_norm_given = False
        self.cost = math.nan  # the thermometers' fraction of the step over the last window
        self.over_budget = False
        self.version = 0  # bumped when cost or every change
        self.shares: list[float] = [math.nan] * len(BUDGETED)  # per read, as of the last decision
        self._warned = False
        self._per_read = [0.0] * len(BUDGETED)  # ns per read, kept for a group not read in a window
        self._new_window()

    def _new_window(self) -> None:
        self._ns = np.zeros(len(GROUPS))
        self._reads = np.zeros(len(GROUPS))
        self._steps: list[float] = []

    def plan(self, step: int) -> list[int]:
        """The act, attn and grad cadences for `step`: takes in the steps measured since the
        last call, and decides on every DECIDE_EVERY-th step."""
        for tag, step_ns, ns in self.timer.finished():
            self._steps.append(step_ns)
            self._ns += ns
            self._reads += tag
        if step % DECIDE_EVERY == 0:
            self._decide()
        return self.every

    def _decide(self) -> None:
        self.version += 1
        n = len(self._steps)
        step_ns = float(np.median(self._steps)) if n else 0.0
        mine = np.full(len(BUDGETED) + 1, -1.0)  # -1: too few steps measured to say
        if n >= MIN_STEPS and step_ns > 0:
            for g in range(len(BUDGETED)):
                if self._reads[g]:
                    self._per_read[g] = self._ns[g] / self._reads[g]
            fixed = (self._ns[UPDATE] + self._ns[BASE]) / n / step_ns
            mine = np.array([*(c / step_ns for c in self._per_read), fixed])
            self.cost = float(self._ns.sum() / n / step_ns)
            self._new_window()
        # Every rank takes part alike; one that could not say keeps every rank's cadence.
        agreed = self.agree(mine, self.device)
        if agreed.min() < 0:
            return
        share, fixed = agreed[:-1].tolist(), float(agreed[-1])
        slowest = list(self.slowest)
        if not self.grad_norm_given:
            slowest[GRAD] = self.fastest[GRAD]
        self.every, over = decide(share, fixed, self.budget, self.fastest, slowest)
        self.shares = share
        # Warned once the floors exceed the budget in two windows running (over_budget still holds
        # the previous decision's): the first window holds the run's warm-up (on an H200 a 61 ms
        # median step and 3.3% at the floors, then 44 ms and 0.9% for good), which alone would warn
        # every run that is in fact within it.
        if over and self.over_budget and not self._warned:
            self._warned = True
            at = ", ".join(f"{g} every {e} ({s / e:.2%})" for g, e, s in zip(BUDGETED, self.every, share))
            log.warning(
                "thermowatch: the thermometers' floors exceed their budget (%.3g of the step): at the slowest "
                "cadences they may take (%s; the update ratio and the step's own work %.2f%%) they cost %.2f%% of "
                "a %.3g ms step. They run at those floors. Raise ThermometerConfig.budget, or read less on a read "
                "step (fewer act_patterns, attn_heads, attn_entropy=False)",
                self.budget, at, 100 * fixed, 100 * (fixed + sum(s / e for s, e in zip(share, self.every))), step_ns / 1e6)
        self.over_budget = over
