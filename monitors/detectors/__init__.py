"""Streaming detectors and the bank that routes a step record's metric keys to them.

    bank = DetectorBank(BankConfig())
    for record in records:                 # one StepRecord per step, already reduced over ranks
        for finding in bank.observe(record):
            policy(finding)
    bank.check(now)                        # wall-clock stall test, called by the scheduler
    bank.reset(to_step)                    # after a rollback: steps >= to_step will repeat

Routing (ROUTES): every key -> non_finite; attn_logit_max/* and attn_logit_lse/* -> attention
growth + ceiling; loss -> loss spike + loss degradation; grad_norm and grad_norm/* -> grad spike;
act_max/* and act_min/* -> activation overflow; record.ranks -> outlier rank; record.wall_time ->
stall. One detector instance per (route, key), created on first sight of the key. Before them,
the run's witnesses of harm (witness.py) read the whole record: the attention detectors ask
them whether a growth may act.

Judged once: `observe(record, attempt=...)` skips a step this bank has already judged for the
same attempt (a batch the sink delivered twice), so a re-sent batch gives no second finding.
A new attempt (after a rollback or restart) may repeat steps; `reset(to_step)` announces it.

Across ranks: the record's values are already reduced (max of maxima, min of minima, mean of
losses; contract.reduction), so a spike on one rank shows in the reduced series and nothing more
is needed here; outlier_rank.py names the rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from monitors.contract import ACT_MAX, ACT_MIN, ATTN_LOGIT_LSE, ATTN_LOGIT_MAX, GRAD_NORM, LOSS
from monitors.contract import Finding, StepRecord, split_key

from .act_overflow import ActOverflowConfig, ActOverflowDetector
from .attn_logit import AttnLogitCeilingDetector, AttnLogitConfig, AttnLogitGrowthDetector
from .base import SeriesDetector
from .degradation import DegradationConfig, DegradationDetector
from .grad_spike import GradSpikeConfig, GradSpikeDetector
from .loss_spike import LossSpikeConfig, LossSpikeDetector
from .non_finite import NonFiniteConfig, NonFiniteDetector
from .outlier_rank import OutlierRankConfig, OutlierRankDetector
from .stall import StallConfig, StallDetector
from .witness import WitnessConfig, Witnesses

STATE_VERSION = 2  # 2: witnesses, degradation, the judged (attempt, step)


@dataclass
class BankConfig:
    """One config per detector; YAML lists only what differs (`BankConfig.from_dict`)."""

    attn: AttnLogitConfig = field(default_factory=AttnLogitConfig)
    loss: LossSpikeConfig = field(default_factory=LossSpikeConfig)
    grad: GradSpikeConfig = field(default_factory=GradSpikeConfig)
    non_finite: NonFiniteConfig = field(default_factory=NonFiniteConfig)
    act: ActOverflowConfig = field(default_factory=ActOverflowConfig)
    stall: StallConfig = field(default_factory=StallConfig)
    outlier: OutlierRankConfig = field(default_factory=OutlierRankConfig)
    degradation: DegradationConfig = field(default_factory=DegradationConfig)
    witness: WitnessConfig = field(default_factory=WitnessConfig)
    # Route names (ROUTES, plus "outlier_rank", "stall") to switch off, e.g. for a benchmark.
    disabled: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.disabled = tuple(self.disabled)
        known = {r.name for r in ROUTES} | {"outlier_rank", "stall"}
        unknown = set(self.disabled) - known
        if unknown:
            raise ValueError(f"unknown detector names in disabled: {sorted(unknown)}; known: {sorted(known)}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> "BankConfig":
        """{"attn": {"ceiling": 50}, "disabled": ["stall"]} -> BankConfig with those changes."""
        d = dict(d or {})
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in d:
                continue
            val = d.pop(f.name)
            if f.name == "disabled":
                kwargs[f.name] = tuple(val)
            else:
                sub = f.default_factory()  # type: ignore[misc]
                kwargs[f.name] = dataclasses.replace(sub, **val)
        if d:
            raise ValueError(f"unknown detector config sections: {sorted(d)}")
        return cls(**kwargs)


@dataclass(frozen=True)
class Route:
    name: str
    metrics: frozenset[str] | None  # metric names (key before "/"); None = every key
    build: Callable[[str, BankConfig, Witnesses], SeriesDetector]


ROUTES: tuple[Route, ...] = (
    Route("non_finite", None, lambda k, c, w: NonFiniteDetector(k, c.non_finite)),
    Route("attn_growth", frozenset({ATTN_LOGIT_MAX, ATTN_LOGIT_LSE}),
          lambda k, c, w: AttnLogitGrowthDetector(k, c.attn, w)),
    Route("attn_ceiling", frozenset({ATTN_LOGIT_MAX, ATTN_LOGIT_LSE}),
          lambda k, c, w: AttnLogitCeilingDetector(k, c.attn, w)),
    Route("loss_spike", frozenset({LOSS}), lambda k, c, w: LossSpikeDetector(k, c.loss)),
    Route("loss_degradation", frozenset({LOSS}), lambda k, c, w: DegradationDetector(k, c.degradation, w)),
    Route("grad_spike", frozenset({GRAD_NORM}), lambda k, c, w: GradSpikeDetector(k, c.grad)),
    Route("act_overflow", frozenset({ACT_MAX, ACT_MIN}), lambda k, c, w: ActOverflowDetector(k, c.act)),
)


class DetectorBank:
    def __init__(self, config: BankConfig | None = None) -> None:
        self.config = config or BankConfig()
        self._routes = [r for r in ROUTES if r.name not in self.config.disabled]
        self._by_metric: dict[str, list[Route]] = {}
        self.series: dict[str, dict[str, SeriesDetector]] = {r.name: {} for r in self._routes}
        self.outlier = OutlierRankDetector(self.config.outlier)
        self.stall = StallDetector(self.config.stall)
        self.witnesses = Witnesses(self.config.witness)
        # The newest (attempt, step) judged: a step at or before it in the same attempt is a
        # re-delivery and is not judged again.
        self.judged: tuple[int, int] | None = None

    def _routes_for(self, metric: str) -> list[Route]:
        routes = self._by_metric.get(metric)
        if routes is None:
            routes = [r for r in self._routes if r.metrics is None or metric in r.metrics]
            self._by_metric[metric] = routes
        return routes

    def _detector(self, route: Route, key: str) -> SeriesDetector:
        per_key = self.series[route.name]
        det = per_key.get(key)
        if det is None:
            det = per_key[key] = route.build(key, self.config, self.witnesses)
        return det

    def already_judged(self, record: StepRecord, attempt: int | None) -> bool:
        return (attempt is not None and self.judged is not None and attempt == self.judged[0]
                and record.step <= self.judged[1])

    def observe(self, record: StepRecord, attempt: int | None = None) -> list[Finding]:
        """Judge one record. With `attempt`, a step already judged in that attempt is skipped
        (returns []); without it (replay), a step going back is an unannounced rollback."""
        if self.already_judged(record, attempt):
            return []
        if attempt is not None:
            self.judged = (attempt, record.step)
        findings: list[Finding] = []
        self.witnesses.observe(record)
        wall = record.wall_time if record.wall_time and math.isfinite(record.wall_time) else None
        if wall is not None and "stall" not in self.config.disabled:
            # A gap between this record and the previous one is a stall that already happened
            # (replay sees it this way; live, the scheduler's check(now) sees it first).
            stalled = self.stall.check(wall)
            if stalled is not None:
                findings.append(stalled)
        for key, value in record.values.items():
            for route in self._routes_for(split_key(key)[0]):
                f = self._detector(route, key).update(record.step, value, wall)
                if f is not None:
                    findings.append(f)
        if "outlier_rank" not in self.config.disabled:
            findings.extend(self.outlier.observe(record))
        self.stall.update(record.step, math.nan, wall)
        return findings

    def observe_many(self, records: Iterable[StepRecord], attempt: int | None = None) -> list[Finding]:
        out: list[Finding] = []
        for record in records:
            out.extend(self.observe(record, attempt))
        return out

    def check(self, now: float) -> list[Finding]:
        """Wall-clock checks (stall). `now` must be on the same clock as record.wall_time."""
        if "stall" in self.config.disabled:
            return []
        f = self.stall.check(now)
        return [f] if f is not None else []

    def reset(self, to_step: int | None = None) -> None:
        """After a rollback to `to_step`: forget buffered points at/after it and all latches,
        keep the healthy history before it (no new warm-up). None forgets everything."""
        for per_key in self.series.values():
            for det in per_key.values():
                det.reset(to_step)
        self.outlier.reset(to_step)
        self.stall.reset(to_step)
        self.witnesses.reset(to_step)
        if self.judged is not None:
            # The steps from to_step on are trained again (in a new attempt, or this one).
            self.judged = None if to_step is None else (self.judged[0], min(self.judged[1], to_step - 1))

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "series": {name: {k: d.state_dict() for k, d in per_key.items()} for name, per_key in self.series.items()},
            "outlier": self.outlier.state_dict(),
            "stall": self.stall.state_dict(),
            "witnesses": self.witnesses.state_dict(),
            "judged": list(self.judged) if self.judged is not None else None,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"detector state version {d.get('version')!r} != {STATE_VERSION}; start with a fresh bank")
        routes = {r.name: r for r in self._routes}
        for name, per_key in d["series"].items():
            if name not in routes:
                continue  # a route disabled since the state was saved
            self.series[name] = {}
            for key, state in per_key.items():
                self._detector(routes[name], key).load_state_dict(state)
        self.outlier.load_state_dict(d["outlier"])
        self.stall.load_state_dict(d["stall"])
        self.witnesses.load_state_dict(d["witnesses"])
        self.judged = (int(d["judged"][0]), int(d["judged"][1])) if d.get("judged") else None


__all__ = [
    "ActOverflowConfig", "ActOverflowDetector", "AttnLogitCeilingDetector", "AttnLogitConfig",
    "AttnLogitGrowthDetector", "BankConfig", "DegradationConfig", "DegradationDetector", "DetectorBank",
    "WitnessConfig", "Witnesses", "GradSpikeConfig", "GradSpikeDetector",
    "LossSpikeConfig", "LossSpikeDetector", "NonFiniteConfig", "NonFiniteDetector", "OutlierRankConfig",
    "OutlierRankDetector", "ROUTES", "Route", "SeriesDetector", "StallConfig", "StallDetector",
]
