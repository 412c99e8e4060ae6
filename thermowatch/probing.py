"""A precise skip under way in thermowatch.watch's loop (thermowatch/loop.py): the rollback it
answers, the search (thermowatch/precise_skip.py: pure group testing and replay triage), and the
probe being trained, re-trained from the rollback's checkpoint with its own ledger (the base
ledger with the other suspects skipped). `advance` readies the next probe step or ends the search;
`result` says what was found and what it cost, as the rollback's Outcome.

The loop is the host: it trains the probe steps its `steps()` yields like any other, reports
each one's loss (`observe`, the mean over the ranks under torchrun, so every rank's search takes
the same turn), and loads the checkpoint again when a probe ends."""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any, Protocol

import numpy as np

from thermowatch.monitors.contract import Bisected, Cause, Command, Replay
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.precise_skip import PreciseSkip, Search, SpikeBar, first_spike, ids_of, ranges_of
from thermowatch.protocol import Outcome
from thermowatch.ranks import Ranks

log = logging.getLogger(__name__)


def suspects_of(skip: Any, trained_to: int, ledger: SkipLedger) -> np.ndarray:
    """A rollback's suspects (both hosts: thermowatch/loop.py, trainer/probes.py): its skip ranges,
    the samples the abandoned path trained after them (between the detection and the command: a
    poisoned stretch can run past the detection step), less what the ledger skips already."""
    ids = ids_of(skip)
    if not len(ids):
        return ids
    ids = np.union1d(ids, np.arange(ids[-1] + 1, max(trained_to, int(ids[-1]) + 1)))
    return ids[~ledger.contains(ids)]


def lone_rank(values: dict[str, float], ranks: dict[str, int]) -> int | None:
    """The one rank that held a broken step's non-finite extremes (replay triage's evidence for
    hardware), or None when none or several did."""
    named = {r for k, r in ranks.items() if not math.isfinite(values.get(k, 0.0))}
    return named.pop() if len(named) == 1 else None


class LossTrail:
    """The path's newest (step, loss) and the steps one rank broke alone on, as both hosts keep them
    (thermowatch/recorder.py, trainer/controller.py): a precise skip's spike bar starts from the
    losses, replay triage compares the abandoned path's with its replay, and a rank that broke
    alone is its evidence for hardware. A non-finite gradient norm is a spike at its step, as in
    the probes (a flipped bit shows in grad_norm a step before the loss); `grad` None: not read."""

    def __init__(self, kept: int = 256) -> None:
        self.losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=kept)
        self.lone: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)

    def add(self, step: int, loss: float, grad: float | None, values: dict[str, float],
            ranks: dict[str, int] | None) -> None:
        broken = not (math.isfinite(loss) and (grad is None or math.isfinite(grad)))
        self.losses.append((step, math.nan if grad is not None and not math.isfinite(grad) else loss))
        if broken and ranks:  # rare: the one rank that held the non-finite extremes, if one did
            lone = lone_rank(values, ranks)
            if lone is not None:
                self.lone.append((step, lone))

    def newest(self, n: int | None = None) -> list[float]:
        """The newest `n` losses (all kept, with None), oldest first."""
        kept = [v for _, v in self.losses]
        return kept if n is None else kept[-n:]

    def abandon(self, loaded: int) -> tuple[list[tuple[int, float]], set[int]]:
        """A rollback loaded checkpoint `loaded`: the path after it is forgotten. Returns its
        losses and the ranks that broke alone on it."""
        left = [(s, v) for s, v in self.losses if s > loaded]
        lone = {r for s, r in self.lone if s > loaded}
        self.lone.clear()
        self.keep_to(loaded)
        return left, lone

    def keep_to(self, step: int) -> None:
        """Forget the losses after `step` (a resume from it)."""
        self.losses = collections.deque(((s, v) for s, v in self.losses if s <= step), maxlen=self.losses.maxlen)


class ProbeHost(Protocol):
    """What the search reads and moves on its loop (thermowatch.loop.Watch)."""

    step: int  # the last step trained
    total: int
    cursor: int  # the next sample id to consider
    global_batch: int
    dist: Ranks

    def _load(self, step: int) -> int: ...


class Probing:
    """One precise skip's search, from the rollback's checkpoint to its verdict."""

    def __init__(self, checkpoint: int, base: SkipLedger, suspects: np.ndarray, search: Search,
                 healthy: list[float], cfg: PreciseSkip, budget: int,
                 recorded: tuple[int, float, float | None] | None = None, rank: int | None = None) -> None:
        self.cmd: Command | None = None  # the rollback it answers, and its Outcome: set once the executor said it
        self.out: Outcome | None = None
        self.checkpoint, self.base = checkpoint, base
        self.rank = rank  # the one rank whose figures broke on the abandoned path (torchrun), if one did
        self.suspects, self.search, self.healthy, self.cfg, self.budget = suspects, search, healthy, cfg, budget
        self.recorded = recorded  # (step, loss, level) of the abandoned path's spike: what triage replays
        self.replays: list[Replay] = []  # triage's evidence, one per replay
        self.replay_s = 0.0
        self.t0 = time.monotonic()
        self.steps = 0
        self.probe: np.ndarray | None = None
        self.clean: tuple[int, int] | None = None
        self.ledger = base

    @classmethod
    def begin(cls, cfg: PreciseSkip, suspects: np.ndarray, checkpoint: int, base: SkipLedger,
              healthy: list[float], left: list[tuple[int, float]], global_batch: int,
              rank: int | None = None) -> "Probing":
        """The search for a rollback to `checkpoint` whose suspects are `suspects`: `healthy`, the
        spike bar's trail (the newest losses of the path up to the checkpoint, kept in it when it
        was saved); `left`, the abandoned path's (step, loss), where replay triage looks for the
        spike to replay (a path whose loss never spiked gives it nothing to compare with)."""
        budget = cfg.max_steps or 4 * max(1, -(-len(suspects) // global_batch))
        recorded = first_spike(healthy, left, cfg) if cfg.triage else None
        if recorded is not None:
            budget += 2 * (recorded[0] - checkpoint)  # the replays' own budget, beside the search's
        # whole steps per probe; past the suspects, the ids the loop would train next
        search = Search(suspects, cfg.min_samples or global_batch, align=global_batch,
                        follow=lambda after, n: base.take(after + 1, n), triage=recorded is not None)
        return cls(checkpoint, base, suspects, search, healthy, cfg, budget, recorded, rank)

    # --- the loop's side ----------------------------------------------------------------------

    def advance(self, w: ProbeHost) -> bool:
        """Ready the next probe step on `w` (True: train step w.step + 1), or end the search
        (False, the checkpoint loaded again: `result()`)."""
        # out of time on any rank is out of time on every rank (each rank's clock is its own)
        over = not w.dist.all_ok(self.steps < self.budget and time.monotonic() - self.t0 < self.cfg.max_seconds)
        if self.under_way():
            ended = (self.spiked or w.step >= w.total
                     or (w.step >= self.through if self.through is not None else self.after >= self.cfg.settle))
            if not (ended or over):
                return True
            if ended:  # its verdict (a probe cut short by the budget has none)
                self.close()
            w._load(self.checkpoint)
        if over:
            self.search.give_up()  # what is not cleared yet, the probe cut short included, is skipped
        replaying = self.search.replaying
        probe = self.search.next()
        if probe is None:
            return False
        # a replay of triage runs through the abandoned path's spike, a search's probe through its last sample
        self.open(probe, through=self.recorded[0] if replaying else None)
        if replaying and not len(probe) and w.cursor >= w.global_batch:
            # Without the suspects, in their place the samples the healthy path trained last
            # before the checkpoint, round and round (a young checkpoint has fewer steps of them
            # than the replay needs): known clean. The ones after the suspects are unknown, and
            # a poisoned stretch running on into them spiked this replay and passed for the
            # optimizer (test_quarantine's stretch, with skip_ahead_steps 0).
            n = min(self.recorded[0] - self.checkpoint, w.cursor // w.global_batch) * w.global_batch
            self.clean = (w.cursor - n, w.cursor)
            w.cursor = self.clean[0]
        return True

    def result(self) -> Outcome:
        """The rollback's Outcome: its own words, then the search's (probes, steps, seconds, the
        cause, what is skipped); its `skipped`, the offenders' ranges."""
        found = self.search.offenders()
        skipped = ranges_of(found)
        # the suspects reported: every sample searched, the blocks past the rollback's window included
        searched = self.search.universe
        cause = None
        if self.search.cause is not None:
            step, loss, _ = self.recorded
            cause = Cause(self.search.cause, step, loss if math.isfinite(loss) else None, tuple(self.replays),
                          sum(r.steps for r in self.replays), round(self.replay_s, 3), rank=self.rank)
        bisected = Bisected(ranges_of(searched), self.search.probes, self.steps, round(time.monotonic() - self.t0, 3),
                            self.search.outcome, cause)
        past = len(searched) - len(self.suspects)
        what = (f"{len(found):,} of {len(searched):,} suspect samples" if len(found) < len(searched)
                else f"all {len(searched):,} suspect samples ({bisected.outcome})")
        what += f" ({past:,} of them past the window: the bad stretch went on)" if past else ""
        if bisected.outcome == "cleared":
            what = "nothing: the cause is not the data"
        detail = (self.out.detail + f"; precise skip: {bisected.probes} probes, {bisected.steps} steps, "
                  f"{bisected.seconds:.1f} s"
                  + (f"; cause {cause.words()}" if cause is not None else "") + f"; skipping {what}"
                  + (f": {', '.join(map(str, skipped[:8]))}{' ...' if len(skipped) > 8 else ''}" if skipped else ""))
        return Outcome(detail, checkpoint=self.out.checkpoint, lr_change=self.out.lr_change, lr_seq=self.out.lr_seq,
                       skip_ranges=skipped, bisected=bisected)

    # --- one probe ----------------------------------------------------------------------------

    def under_way(self) -> bool:
        return self.probe is not None

    def open(self, probe: np.ndarray, through: int | None = None) -> None:
        """`through`: a replay of triage's, trained through this step (the abandoned path's spike)."""
        self.probe, self.last, self.through = probe, int(probe[-1]) if len(probe) else -1, through
        self.clean = None  # [lo, hi) cursors the replay without the suspects goes round
        self.opened = time.monotonic()
        self.at = self.loss = None  # the step trained last, and its loss
        self.ledger = self.base.copy()
        # the rest of what the search covers is skipped: the suspects and the blocks past them
        self.ledger.add_many([r.to_json() for r in ranges_of(np.setdiff1d(self.search.universe, probe,
                                                                          assume_unique=True))])
        self.bar = SpikeBar(self.healthy, self.cfg)
        self.trained: list[np.ndarray] = []
        self.spiked = False
        self.after = -1  # steps trained since the probe's last sample was (-1: not yet)

    def observe(self, step: int, ids: np.ndarray, loss: float) -> None:
        self.steps += 1
        self.trained.append(ids)
        self.spiked = self.bar.spiked(loss)
        self.at, self.loss = step, float(loss)
        if self.through is not None:
            return
        if self.after >= 0:
            self.after += 1
        elif int(ids[-1]) >= self.last:
            self.after = 0

    def close(self) -> None:
        seen = np.intersect1d(self.probe, np.concatenate(self.trained)) if self.spiked else np.zeros(0, np.int64)
        last = np.intersect1d(self.probe, self.trained[-1]) if self.spiked else None
        log.debug("thermowatch: precise skip probe %s: %d steps, %s", ranges_of(self.probe), len(self.trained),
                  f"spiked, {len(seen)} of its samples trained by then" if self.spiked else "clean")
        if self.through is not None:  # a replay of triage: its evidence
            self.replays.append(Replay(suspects_skipped=len(self.probe) == 0, spiked=self.spiked,
                                       step=self.at if self.at is not None else self.checkpoint,
                                       loss=self.loss if self.loss is not None and math.isfinite(self.loss) else None,
                                       level=self.bar.level, steps=len(self.trained)))
            self.replay_s += time.monotonic() - self.opened
        self.search.report(self.spiked, seen, last)
        self.probe = None
