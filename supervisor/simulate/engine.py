"""One long run as a discrete-event simulation: crashes, divergences, false actions, saves.

The run trains at `step_s` a step and saves a checkpoint every `checkpoint_every` steps, which
blocks training for `save_s` (a synchronous ZeRO save). Three random processes, each from its
own stream of the seed so that strategies compared side by side meet the same failures
(common random numbers):

- crashes: Poisson in wall time while the job runs (training or saving). Recovery: notice it
  (automatic: `crash_detect_s`; a person: `human_delay`), restart and load, resume from the
  newest checkpoint. A crash during a save loses that checkpoint.
- divergences: an onset at a Poisson step of healthy training (PaLM's spike rate). Every step
  after the onset is wasted until someone rolls back to a retained checkpoint at or before
  `onset - rollback_margin_steps` and skips the data, so that divergence does not come back.
  The supervisor acts `detect_steps` after the onset unless it misses it (`miss_rate`); a miss,
  or a strategy without a detector, leaves it to a person, who notices it after `human_delay`.
  A crash restart before anyone acts resumes from the newest checkpoint, diverged or not.
- false actions: a detector acting on a healthy run (`false_actions_per_10k` healthy steps)
  rolls back `rollback_margin_steps` for nothing.

A rollback costs `rollback_s` where the supervisor runs (it reloads in the live gang), and a
relaunch (`restart_s + load_s`) where a person does it by hand.

Retention is the trainer's (trainer/checkpoint.py): the newest `keep_last` checkpoints plus the
first one of every `keep_every`-step span; a rollback deeper than what the newest ones cover
lands on an older span checkpoint, which is what a detection lag of hours costs.

Goodput = steps that survive into the final model x step_s / wall time. Not modelled: crashes
during a restart, a divergence recurring after its data was skipped, planned maintenance windows.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from thermowatch.supervisor.simulate.config import DetectorFigures, SimConfig

INF = math.inf


@dataclass(frozen=True)
class Strategy:
    name: str
    label: str
    auto_restart: bool  # a crash is noticed by the machine (crash_detect_s), else by a person
    detector: DetectorFigures | None  # None: every divergence is left to a person


@dataclass
class RunResult:
    goodput: float
    useful_s: float  # steps kept x step_s
    save_s: float  # wall time spent saving checkpoints
    lost_s: float  # steps trained and then thrown away (rollback, crash, diverged tail) x step_s
    down_s: float  # noticing, restarting and loading
    crashes: int
    divergences: int  # onsets reached
    rollbacks: int  # rollbacks for a divergence (automatic or by hand)
    false_actions: int
    deep_rollbacks: int  # rollbacks that had to go past the newest keep_last checkpoints


class _Retention:
    """The checkpoints on disk: the newest `keep_last` plus the first of each `keep_every` span;
    step 0 (the initial weights) is always there."""

    def __init__(self, keep_last: int, keep_every: int) -> None:
        self.recent: deque[int] = deque(maxlen=keep_last)
        self.keep_every = keep_every
        self.span_steps: list[int] = []  # sorted: the first checkpoint of each span
        self.spans: set[int] = set()

    def add(self, step: int) -> None:
        self.recent.append(step)
        if self.keep_every:
            span = step // self.keep_every
            if span not in self.spans:
                self.spans.add(span)
                self.span_steps.append(step)

    def newest(self) -> int:
        return max(self.recent[-1] if self.recent else 0, self.span_steps[-1] if self.span_steps else 0)

    def newest_at_or_before(self, step: float) -> tuple[int, bool]:
        """The rollback target and whether it came from the newest `keep_last` checkpoints."""
        recent = max((r for r in self.recent if r <= step), default=-1)
        i = bisect.bisect_right(self.span_steps, step)
        span = self.span_steps[i - 1] if i else 0
        return (recent, True) if recent >= span else (span, False)

    def drop_after(self, step: int) -> None:
        """A rollback abandons every checkpoint after its target."""
        kept = [r for r in self.recent if r <= step]
        self.recent.clear()
        self.recent.extend(kept)
        while self.span_steps and self.span_steps[-1] > step:
            self.spans.discard(self.span_steps.pop() // self.keep_every)


def _exp(rng: np.random.Generator, rate: float) -> float:
    return rng.exponential(1.0 / rate) if rate > 0 else INF


def run_once(cfg: SimConfig, strategy: Strategy, crash_rate_s: float, every: int,
             seed: int | tuple[int, ...]) -> RunResult:
    """Simulate one run of cfg.days with a checkpoint every `every` steps; deterministic in seed
    (an int, or (seed, replica) as compare.py passes it)."""
    crash_rng, div_rng, fa_rng, miss_rng, human_rng = (np.random.default_rng(s)
                                                        for s in np.random.SeedSequence(seed).spawn(5))
    wall, step_s, margin = cfg.days * 86_400.0, cfg.step_s, cfg.rollback_margin_steps
    det = strategy.detector
    fa_rate = det.false_actions_per_10k / 1e4 if det else 0.0
    rollback_cost = cfg.rollback_s if det else cfg.restart_s + cfg.load_s  # in place, or a relaunch by hand
    day_lo, day_hi = cfg.human_day_hours

    def human_delay(t: float) -> float:
        hour = (cfg.start_hour + t / 3600.0) % 24.0
        wait = 0.0 if day_lo <= hour < day_hi else ((day_lo - hour) % 24.0) * 3600.0
        return wait + human_rng.exponential(cfg.human_day_latency_h * 3600.0)

    keep = _Retention(cfg.keep_last, cfg.keep_every)
    t, s = 0.0, 0.0
    save = lost = down = 0.0
    crashes = divergences = rollbacks = false_actions = deep = 0
    next_crash = _exp(crash_rng, crash_rate_s)
    onset = _exp(div_rng, cfg.divergences_per_step)  # absolute step of the next divergence
    onset_reached = False
    detect_step = INF  # the supervisor acts when training reaches this step
    human_t = INF  # a person acts at this wall time
    next_fa = _exp(fa_rng, fa_rate)

    def restart(t: float, cost: float) -> float:
        nonlocal down, next_crash
        cost = min(cost, wall - t)
        down += cost
        if next_crash <= t + cost:  # no crash while down (memoryless: draw the next from the restart)
            next_crash = t + cost + _exp(crash_rng, crash_rate_s)
        return t + cost

    def roll_back(before: float) -> None:
        """To the newest checkpoint at or before step `before` (those after it are dropped); the
        next false action is drawn from there."""
        nonlocal s, t, lost, deep, next_fa
        target, shallow = keep.newest_at_or_before(before)
        deep += not shallow
        lost += (s - target) * step_s
        s = float(target)
        keep.drop_after(target)
        t = restart(t, rollback_cost)
        next_fa = s + _exp(fa_rng, fa_rate)

    while t < wall:
        next_ck = (int(s) // every + 1) * every
        ev_step = min(next_ck, detect_step, onset if s < onset else INF, next_fa if next_fa < onset else INF)
        t_step = t + (ev_step - s) * step_s
        t_ev = max(t, min(t_step, next_crash, human_t, wall))  # max: a person's time passed during a restart
        if t_ev == t_step:
            s = float(ev_step)
        else:
            s += (t_ev - t) / step_s
        t = t_ev
        if t >= wall:
            break
        if next_crash <= t:
            crashes += 1
            next_crash = t  # drawn again from the end of the restart
            t = restart(t, (cfg.crash_detect_s if strategy.auto_restart else human_delay(t))
                        + cfg.restart_s + cfg.load_s)
            target = keep.newest()
            lost += (s - target) * step_s
            s = float(target)
        elif human_t <= t or (t == t_step and ev_step == detect_step):
            rollbacks += 1
            roll_back(onset - margin)
            onset, onset_reached = s + _exp(div_rng, cfg.divergences_per_step), False
            detect_step, human_t = INF, INF
        elif ev_step == next_ck and t == t_step:
            if next_crash < t + cfg.save_s:  # the save never finishes
                save += next_crash - t
                t = next_crash
                continue
            dt = min(cfg.save_s, wall - t)
            save += dt
            t += dt
            if dt == cfg.save_s:
                keep.add(next_ck)
        elif ev_step == onset:
            if not onset_reached:  # a crash restart behind the onset reaches it again: one divergence
                onset_reached = True
                divergences += 1
                if det is not None and miss_rng.random() >= det.miss_rate:
                    detect_step = onset + det.detect_steps
                else:
                    human_t = t + human_delay(t)
        else:  # a false action on a healthy run
            false_actions += 1
            roll_back(s - margin)
    kept = min(s, onset)  # trained past an onset nobody acted on: wasted
    lost += (s - kept) * step_s
    useful = kept * step_s
    return RunResult(goodput=useful / wall, useful_s=useful, save_s=save, lost_s=lost, down_s=down,
                     crashes=crashes, divergences=divergences, rollbacks=rollbacks,
                     false_actions=false_actions, deep_rollbacks=deep)
