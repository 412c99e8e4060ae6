"""Precise skip (issue 24, item 5): which of the samples a rollback was told to skip did it?

The policy skips every sample from its onset margin to the detection (1,152 samples for the
demo's two-step spike). With `thermowatch.watch(..., precise_skip=True)` the client finds the
offending ones before it resumes, by re-training from the rollback's checkpoint:

- The suspects S (the rollback's new skip ranges, and the samples the abandoned path trained
  after them, between the detection and the command) are halved. Each half is *probed*: training
  from the checkpoint with the other half skipped, through the half's last sample (and `settle`
  steps more), or until the loss spikes: a non-finite loss, or one above the median of the
  newest 4 by max(z robust sigmas of the step-to-step change, min_rise x that median). The
  trailing window starts with the losses of the steps up to the checkpoint, the healthy path.
- A half that spiked holds an offender among the samples it had trained by the spike's step (a
  later sample cannot have caused it). Those are split again: the samples of the spike's own
  step, probed first (bad data shows in its own batch's loss: one step), and the rest; the
  half's samples after that step are probed on their own (a poisoned stretch may go on past
  it). A part that ran clean is released. Every half that spikes is followed (a poisoned
  stretch cut in two by a halving is found in both). A group of `min_samples` or fewer is an
  offender as it is.
- A halving cuts at a whole number of steps (`align`, the global batch, from the group's
  start): a probe of whole steps ends on a batch of its own. Cut mid-step, its last batch would
  be filled with the samples after the suspects (the rest of them skipped): unknown data,
  poisoned where the stretch runs past them, and the spike blamed on the probe's clean half-step.
- The stretch, whole: the suspects end where the spike was seen (and the command came), and a
  poisoned stretch may go on past them. When an offender group reaches the end of what was
  searched, the samples that follow it (the ids the loop would train next, `follow`) are probed
  as a block of one step's worth (`max(align, min_samples)`), with everything else searched
  skipped; each further time an offender reaches the new end the next block is twice as big,
  until a block runs clean. The blocks join what is searched (`universe`, reported as the
  suspects), and the offenders found in them are skipped with the rest.
- Neither half spiking alone means the divergence needs both, or was not the data at all (PaLM
  found that replaying the same batches from an earlier checkpoint often did not spike): the
  group is skipped whole and the result says "inseparable".
- The search is bounded by `max_steps` probe steps and `max_seconds`: the rollback's ack leaves
  only when it ends (it says what was really skipped), and the daemon retries a command not
  acknowledged within its `ack_timeout_s` (120 s by default). Past the budget every group not
  yet cleared is skipped, a block past the suspects under way or queued included; the budget
  (4x the suspects' steps by default) covers the blocks too, so the stretch is followed only
  as far as it allows.
- The spike bar's trailing window is the newest `window` losses of the path up to the
  checkpoint, kept in the checkpoint when it was saved, not read from the losses sent: after a
  couple of rollbacks to the same checkpoint the abandoned paths' losses have pushed the healthy
  ones out, so the bar would start empty, take a probe's first (poisoned) losses for its level
  and release them, and a one-step probe could never spike.

Replay triage (issue 39) comes first, when the path the rollback abandoned showed a loss spike
(by the same bar, `recorded`): two replays from the checkpoint, each through the step where it
spiked, label the cause (CAUSES in monitors/commands.py):

- the same samples, nothing skipped. It runs clean: the divergence did not reproduce, so it was
  not the data nor the optimizer but a transient fault -> **hardware** (PaLM and Gemini saw
  replays that did not spike; Gemini found 6% of its replayed steps were real corruption).
  Nothing is skipped;
- it spiked: every suspect skipped, and in their place the samples the healthy path trained
  last before the checkpoint (known clean: the samples after the suspects are not, a poisoned
  stretch may run on into them). It spikes again: the data is not the reason, the optimizer
  state or the LR is -> **optimizer**. Nothing is skipped (the supervisor cuts the LR:
  supervisor/act/respond.py);
- it ran clean without them: -> **data**, and the search above bisects, starting from what the
  replay showed (the suspects it had trained by its spike hold an offender).

A divergence the loss never showed (attention logits growing under a calm loss) cannot be told
apart by replaying the loss: triage does not run and the search bisects the suspects directly. The
replays have their own budget (twice the abandoned path's steps to its spike) beside the
search's; `max_seconds` covers both.

Then the checkpoint is loaded once more, only the offenders join the skip ledger, and the ack
carries `skipped` (the offenders) and `bisected` (the suspects, probes, steps and seconds spent,
and triage's `cause`).
`Search` is the pure part (no torch): the loop (thermowatch/loop.py) trains its probes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from thermowatch.monitors.contract import SampleRange
from thermowatch.monitors.detectors.base import MAD_TO_SIGMA


@dataclass(frozen=True)
class PreciseSkip:
    """`thermowatch.watch(..., precise_skip=PreciseSkip(...))`; `precise_skip=True` is the defaults."""

    max_steps: int | None = None  # probe steps in all; None: 4x the suspects' steps (4 x len(S) / global batch)
    max_seconds: float = 90.0  # keep it under the daemon's ack_timeout_s (120 s by default)
    # Replay triage (issue 39) first: two replays from the checkpoint name the cause (hardware,
    # optimizer, data) before the search. Off by default for now: the replays cost about twice the
    # steps from the checkpoint to the spike and share `max_seconds` with the search, and on a
    # poisoned stretch running past its window (tests/client/test_quarantine.py) they left the
    # search its budget's end, a second rollback instead of one (session 21).
    triage: bool = False
    min_samples: int | None = None  # a group this small is not halved again; None: one step's global batch
    # Steps trained past a probe's last sample before it is called clean. 0: what comes after a
    # probe is data no path has trained yet (the other suspects are skipped), and a spike there is
    # not the probe's (a poisoned stretch running past the suspects spiked every probe at 2).
    settle: int = 0
    z: float = 6.0
    min_rise: float = 0.25  # the spike bar is at least this fraction above the trailing median
    window: int = 16  # trailing losses the bar is computed from

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"precise_skip.max_steps must be >= 1, got {self.max_steps}")
        if self.min_samples is not None and self.min_samples < 1:
            raise ValueError(f"precise_skip.min_samples must be >= 1, got {self.min_samples}")
        if not (self.max_seconds > 0 and self.z > 0 and self.min_rise > 0):
            raise ValueError("precise_skip: max_seconds, z and min_rise must be > 0")
        if self.settle < 0 or self.window < 4:
            raise ValueError(f"precise_skip: settle must be >= 0 and window >= 4, got {self.settle}, {self.window}")


def ids_of(ranges: Iterable[SampleRange | Sequence[int]]) -> np.ndarray:
    """The sorted unique ids of [lo, hi) ranges (int64)."""
    parts = [np.arange(r.lo, r.hi) if isinstance(r, SampleRange) else np.arange(int(r[0]), int(r[1]))
             for r in ranges]
    return np.unique(np.concatenate(parts)).astype(np.int64) if parts else np.zeros(0, np.int64)


def ranges_of(ids: np.ndarray) -> tuple[SampleRange, ...]:
    """Sorted unique ids as merged [lo, hi) ranges (vectorised)."""
    ids = np.unique(np.asarray(ids, dtype=np.int64))
    if not len(ids):
        return ()
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    lo = ids[np.concatenate([[0], breaks])]
    hi = ids[np.concatenate([breaks - 1, [len(ids) - 1]])] + 1
    return tuple(SampleRange(int(a), int(b)) for a, b in zip(lo, hi))


class SpikeBar:
    """Judges a probe's losses one by one against a trailing window seeded with healthy ones."""

    def __init__(self, healthy: Sequence[float], cfg: PreciseSkip) -> None:
        self.cfg = cfg
        self.trail: deque[float] = deque((float(v) for v in healthy if math.isfinite(v)), maxlen=cfg.window)
        self.level: float | None = None  # the level the newest loss was judged against (None: too few yet)

    def spiked(self, loss: float) -> bool:
        self.level = float(np.median(np.fromiter(self.trail, float)[-4:])) if len(self.trail) >= 4 else None
        if not math.isfinite(loss):
            return True
        if len(self.trail) >= 4:
            # the level: the newest few; the spread: of the step-to-step changes, so the early
            # steps' steep fall (a checkpoint may sit there) does not pass for noise
            t = np.fromiter(self.trail, float)
            level = self.level
            d = np.diff(t)
            sigma = MAD_TO_SIGMA * float(np.median(np.abs(d - np.median(d)))) / math.sqrt(2.0)
            if loss > level + max(self.cfg.z * sigma, self.cfg.min_rise * abs(level)):
                return True
        self.trail.append(loss)
        return False


def first_spike(healthy: Sequence[float], losses: Iterable[tuple[int, float]],
                cfg: PreciseSkip) -> tuple[int, float, float | None] | None:
    """Where the path a rollback abandoned spiked by the probes' own bar, seeded as theirs are:
    (step, loss, level) of its first spike, or None when its loss never did (triage then does not
    run: a replay that is compared with nothing proves nothing)."""
    bar = SpikeBar(healthy, cfg)
    for step, loss in losses:
        if bar.spiked(loss):
            return int(step), float(loss), bar.level
    return None


class Search:
    """Adaptive group testing over sorted suspect ids. `next()` gives the ids the next probe
    trains on (the rest of the suspects skipped), or None when done; `report(spiked, seen)`
    gives its result, `seen` the probe's ids trained up to the spike's step. `give_up()` ends it
    with every group not yet cleared counted as an offender.

    The work is groups of two kinds: *known* to hold an offender (the suspects; the part of a
    probe trained by its spike) and *untested* (the part of a spiking probe after the spike's
    step: a poisoned stretch may go on past it). A known group is split in two and both parts
    are probed; an untested group is probed whole. A known group from a spike is split into the
    samples of the spike's own step (`last`: a batch of bad data shows in its own loss, so they
    are probed first, in one step) and the rest; the suspects are halved. Halving alone failed
    on real data: a halving that cuts a poisoned stretch spreads it over two batches, each too
    diluted to spike, and the whole group had to be skipped.

    With `triage`, two replays come first (the module docstring): `next()` gives all the
    suspects (the same samples: nothing skipped), then none of them (every suspect skipped);
    `report()` takes whether each spiked. `cause` is then "hardware" or "optimizer" (the search
    ends, nothing found) or "data" (it bisects, from the replay's spike on). `replaying` says a
    replay is the probe under way: the loop runs it through the abandoned path's spike, not
    through the probe's last sample."""

    def __init__(self, suspects: np.ndarray, min_samples: int, align: int = 1,
                 follow: Callable[[int, int], np.ndarray] | None = None, triage: bool = False) -> None:
        """`align`: a halving cuts at a multiple of this many ids from the group's start (the
        loop's global batch: a probe of whole steps ends on a step of its own, never beside the
        unknown data after the search's samples). `follow(after, n)`: the n ids the data gives
        after id `after` (the loop's: its ledger's next unskipped ones; by default consecutive)."""
        self.suspects = np.asarray(suspects, dtype=np.int64)
        self.min_samples = max(1, int(min_samples))
        self.align = max(1, int(align))
        self.follow = follow or (lambda after, n: np.arange(after + 1, after + 1 + n, dtype=np.int64))
        empty = np.zeros(0, np.int64)
        self.work: deque[tuple[np.ndarray, bool, np.ndarray]] = (
            deque([(self.suspects, True, empty)]) if len(self.suspects) else deque())
        self.found: list[np.ndarray] = []
        self.group: np.ndarray | None = None  # the known group being halved, or None for an untested one
        self.probes_due: list[np.ndarray] = []
        self.results: list[tuple[bool, np.ndarray, np.ndarray, np.ndarray]] = []
        self.probes = 0
        self.inseparable = 0  # known groups where neither half spiked alone
        self.gave_up = False
        # past the suspects: the blocks of the samples that follow them, probed when an offender
        # reached the end of what was searched (`beyond`: their ids; `block`: the next one's size)
        self.beyond: list[np.ndarray] = []
        self.end = int(self.suspects[-1]) if len(self.suspects) else -1  # the newest id searched
        self.block = max(self.align, self.min_samples)
        # replay triage: the replays' spikes (the same samples', then without the suspects'), the
        # replay's seen and last, and the label once known
        self.triage = bool(triage) and len(self.suspects) > 0
        self.replays: list[bool] = []
        self._replay_seen: tuple[np.ndarray, np.ndarray] | None = None
        self.cause: str | None = None

    @property
    def replaying(self) -> bool:
        """A replay of triage is the next probe (or the one under way)."""
        return self.triage and self.cause is None and not self.gave_up

    def _triage(self, spiked: bool, seen: np.ndarray, last: np.ndarray) -> None:
        """A replay's result. The label is pure logic on the two spikes (issue 39):
        same samples clean -> hardware; spiked without the suspects too -> optimizer; else data."""
        self.probes += 1
        self.replays.append(bool(spiked))
        if len(self.replays) == 1:
            if not spiked:
                self.cause = "hardware"
                self.work.clear()
            else:
                self._replay_seen = (seen, last)
            return
        if spiked:
            self.cause = "optimizer"
            self.work.clear()
            return
        self.cause = "data"
        seen, last = self._replay_seen
        if len(seen):  # the replay was the search's first probe of them all: go on from its spike
            rest = np.setdiff1d(self.suspects, seen, assume_unique=True)
            self.work = deque([(seen, True, last)] + ([(rest, False, np.zeros(0, np.int64))] if len(rest) else []))

    @property
    def universe(self) -> np.ndarray:
        """Every id searched: the suspects and the blocks past them (sorted). A probe trains its
        own and skips the rest of these."""
        return np.unique(np.concatenate([self.suspects, *self.beyond])) if self.beyond else self.suspects

    def _offender(self, g: np.ndarray, follow: bool = True) -> None:
        """A known group small enough: an offender. One that reaches the end of what was
        searched says the stretch may go on past it: the next block of the samples that follow
        is probed (twice the last one's size), until one runs clean."""
        self.found.append(g)
        if follow and len(g) and int(g[-1]) >= self.end and not self.gave_up:
            nxt = np.asarray(self.follow(self.end, self.block), dtype=np.int64)
            if len(nxt):
                self.beyond.append(nxt)
                self.end = int(nxt[-1])
                self.block *= 2
                self.work.append((nxt, False, np.zeros(0, np.int64)))

    def _halve(self, g: np.ndarray) -> int:
        """Where a known group is cut: near its middle, at a multiple of `align` from its start."""
        mid = (len(g) // 2) // self.align * self.align
        return mid if 0 < mid < len(g) else (self.align if self.align < len(g) else len(g) // 2)

    def next(self) -> np.ndarray | None:
        if self.replaying:  # the same samples (all of them), then none of them
            return self.suspects if not self.replays else self.suspects[:0]
        while not self.probes_due:
            if not self.work:
                return None
            g, known, last = self.work.popleft()
            if known and len(g) <= self.min_samples:
                # the suspects themselves, this small, were never probed: no spike says the stretch
                # reaches their end (the recurrence rule is there for that)
                self._offender(g, follow=g is not self.suspects)
            elif known and 0 < len(last) < len(g):
                self.group, self.probes_due, self.results = g, [last, np.setdiff1d(g, last, assume_unique=True)], []
            elif known:
                mid = self._halve(g)
                self.group, self.probes_due, self.results = g, [g[:mid], g[mid:]], []
            else:
                self.group, self.probes_due, self.results = None, [g], []
        return self.probes_due[len(self.results)]

    def report(self, spiked: bool, seen: np.ndarray, last: np.ndarray | None = None) -> None:
        """A probe's result: whether it spiked, its ids trained by the spike's step (`seen`) and
        those of that step itself (`last`)."""
        if self.replaying:
            seen = np.asarray(seen, dtype=np.int64)
            self._triage(spiked, seen, np.zeros(0, np.int64) if last is None else np.intersect1d(last, seen))
            return
        if not self.probes_due:
            raise RuntimeError("report() without a probe under way")
        self.probes += 1
        probe = self.probes_due[len(self.results)]
        seen = np.asarray(seen, dtype=np.int64)
        last = np.zeros(0, np.int64) if last is None else np.intersect1d(last, seen)
        # a spike before any of the probe was trained is not the probe's doing
        self.results.append((bool(spiked) and len(seen) > 0, seen, probe, last))
        if len(self.results) < len(self.probes_due):
            return
        hit = False
        for spiked, seen, probe, last in self.results:
            if spiked:
                hit = True
                self.work.append((seen, True, last))
                rest = np.setdiff1d(probe, seen, assume_unique=True)
                if len(rest):
                    self.work.append((rest, False, np.zeros(0, np.int64)))
        if not hit and self.group is not None:  # neither half alone: both together, or not the data
            self.found.append(self.group)
            self.inseparable += 1
        self.group, self.probes_due, self.results = None, [], []

    def give_up(self) -> None:
        self.gave_up = True
        if self.probes_due:
            self.found.append(self.group if self.group is not None else self.probes_due[0])
        self.found.extend(g for g, _, _ in self.work)
        self.work.clear()
        self.group, self.probes_due, self.results = None, [], []

    def offenders(self) -> np.ndarray:
        return np.unique(np.concatenate(self.found)) if self.found else np.zeros(0, np.int64)

    @property
    def outcome(self) -> str:
        """narrowed (fewer than the suspects), inseparable (all of them: no half spiked alone),
        budget (the budget ran out; what was not cleared is skipped), or cleared (triage found the
        cause was not the data: nothing skipped)."""
        if self.cause in ("hardware", "optimizer"):
            return "cleared"
        if self.gave_up:
            return "budget"
        found = np.intersect1d(self.offenders(), self.suspects, assume_unique=True)
        return "narrowed" if len(found) < len(self.suspects) else "inseparable"
