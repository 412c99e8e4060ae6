"""Outlier rank: the same rank holds the extreme of a metric step after step.

The run controller reduces each max/min metric across ranks and records which rank held the
extreme (`StepRecord.ranks`). With data parallelism each rank sees different samples, so the
holder of the max wanders over the ranks; one rank holding it in `min_share` of the last
`window` steps points at that rank's hardware (OPT-175B's bad-node hunts), not at the data.

Limits, said plainly: the record carries only the reduced value, so "far above the others" is
judged by persistence, not by the gap (add a per-rank spread key if that is wanted). Under
tensor/pipeline parallelism different ranks own different layers/heads, so a per-module key can
legitimately live on one rank: restrict `metrics` to data-parallel-replicated keys then.
Finding: module = the metric key (per the contract's "module field can hold the key"), the
rank is in evidence["rank"].
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

from monitors.contract import Finding, Outcome, Severity, Signal, StepRecord, split_key

from .base import at_least, jsonable


@dataclass
class OutlierRankConfig:
    window: int = 50  # steps judged; with 2 ranks P(>= 40 of 50 by chance) ~ 1e-5
    min_share: float = 0.8  # share of the window one rank must hold
    clear_share: float = 0.5  # below this share the latch clears (hysteresis)
    min_points: int = 30  # no verdict on fewer steps than this
    world_size: int | None = None  # None: inferred as max rank seen + 1
    # Metric names (before "/") judged; empty = every key the controller reports a rank for.
    metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        at_least("window", self.window, 2)
        at_least("min_points", self.min_points, 1)
        if self.min_points > self.window:
            raise ValueError(f"min_points ({self.min_points}) must not exceed window ({self.window})")
        if not 0.0 < self.clear_share < self.min_share <= 1.0:
            raise ValueError(f"need 0 < clear_share < min_share <= 1, got {self.clear_share}, {self.min_share}")
        if self.world_size is not None:
            at_least("world_size", self.world_size, 1)
        self.metrics = tuple(self.metrics)


class OutlierRankDetector:
    """Record-level: `observe(record)` looks at every key in `record.ranks`."""

    signal = Signal.OUTLIER_RANK

    def __init__(self, config: OutlierRankConfig | None = None) -> None:
        self.config = config or OutlierRankConfig()
        self._seen: dict[str, deque[tuple[int, int]]] = {}  # key -> (step, rank)
        self._latched: dict[str, int] = {}  # key -> rank already reported
        self._max_rank = -1

    def observe(self, record: StepRecord) -> list[Finding]:
        out = []
        for key, rank in record.ranks.items():
            if self.config.metrics and split_key(key)[0] not in self.config.metrics:
                continue
            f = self.update(key, record.step, int(rank))
            if f is not None:
                out.append(f)
        return out

    def update(self, key: str, step: int, rank: int) -> Finding | None:
        c = self.config
        buf = self._seen.setdefault(key, deque(maxlen=c.window))
        if buf and step <= buf[-1][0]:
            self._rewind_key(key, step)
        buf.append((step, rank))
        self._max_rank = max(self._max_rank, rank)
        world = c.world_size if c.world_size is not None else self._max_rank + 1
        if world < 2 or len(buf) < c.min_points:
            return None
        top, count = Counter(r for _, r in buf).most_common(1)[0]
        share = count / len(buf)
        held = self._latched.get(key)
        if held is not None:
            held_share = sum(1 for _, r in buf if r == held) / len(buf)
            if held_share < c.clear_share:
                del self._latched[key]
            return None
        if share < c.min_share:
            return None
        self._latched[key] = top
        onset = next(s for s, r in buf if r == top)
        evidence = {"rank": top, "share": share, "window": len(buf), "world_size": world,
                    "expected_share": 1.0 / world}
        # Outcome act: persistence over a whole window is the evidence a restart without the rank
        # needs; the policy only does that with restart_without_outlier (off by default).
        return Finding(signal=self.signal, module=key, severity=Severity.WARN, onset_step=onset,
                       detect_step=step, metric=key, evidence=jsonable(evidence), outcome=Outcome.ACT)

    def _rewind_key(self, key: str, to_step: int | None) -> None:
        buf = self._seen[key]
        while buf and (to_step is None or buf[-1][0] >= to_step):
            buf.pop()
        self._latched.pop(key, None)

    def reset(self, to_step: int | None = None) -> None:
        for key in list(self._seen):
            self._rewind_key(key, to_step)
        self._latched.clear()
        if to_step is None:
            self._max_rank = -1

    def state_dict(self) -> dict[str, Any]:
        return {"seen": {k: [list(p) for p in v] for k, v in self._seen.items()},
                "latched": dict(self._latched), "max_rank": self._max_rank}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._seen = {k: deque(((int(s), int(r)) for s, r in v), maxlen=self.config.window)
                      for k, v in d["seen"].items()}
        self._latched = {k: int(r) for k, r in d["latched"].items()}
        self._max_rank = int(d["max_rank"])
