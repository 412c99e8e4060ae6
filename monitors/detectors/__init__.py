"""Streaming detectors and the bank that routes a step record's metric keys to them: one bank per
run judges each step once, with a few numpy operations per route rather than Python per series.

    bank = DetectorBank(BankConfig())
    for record in records:                 # one StepRecord per step, already reduced over ranks
        for finding in bank.observe(record):
            policy(finding)
    bank.check(now)                        # wall-clock stall test, called by the scheduler
    bank.reset(first_step)                 # after a rollback: steps >= first_step will repeat

Routing (ROUTES): every key -> non_finite; attn_logit_max/* and attn_logit_lse/* -> attention
growth + ceiling; loss -> loss spike + loss degradation; grad_norm and grad_norm/* -> grad spike;
act_max/* and act_min/* -> activation overflow; record.ranks -> outlier rank; record.wall_time ->
stall; lr with loss -> LR jump (lr_jump.py); loss with grad_norm -> a building blow-up (co_rise.py). One bank per route (series.py): every key of the route is a row in it, added on first
sight of the key, and a record is judged with a few numpy operations per route across all its
keys (issue 10 item 4); `Route.build(key)` gives one series alone (a bank of one row). Before them,
the run's witnesses of harm (witness.py) read the whole record: the attention detectors ask
them whether a growth may act.

Per-series Python stays where it is rare or sequential: the loss degradation trend (one `loss`
row, a sequential fit), the outlier-rank and stall detectors (record-level already), and the
decision of a row that may fire (latch, onset search, evidence).

State: `state_parts(dirty_only=True)` gives what changed since `mark_saved()` (the counters and
the ring chunks written since) as named parts, which the supervisor upserts as rows.

Judged once: `observe(record, attempt=...)` skips a step this bank has already judged for the
same attempt (a batch the sink delivered twice), so a re-sent batch gives no second finding.
A new attempt (after a rollback or restart) may repeat steps; `reset(first_step)` announces it.

Across ranks: the record's values are already reduced (max of maxima, min of minima, mean of
losses; contract.reduction), so a spike on one rank shows in the reduced series and nothing more
is needed here; outlier_rank.py names the rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from thermowatch.monitors.contract import ACT_MAX, ACT_MIN, ATTN_LOGIT_LSE, ATTN_LOGIT_MAX, GRAD_NORM, LOSS
from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import Finding, Signal, StepRecord, split_key

from .act_overflow import ActOverflowBank, ActOverflowConfig, ActOverflowDetector
from .arrays import as_rows, parts_from_json, parts_to_json
from .attn_logit import AttnLogitCeilingBank, AttnLogitCeilingDetector, AttnLogitConfig, AttnLogitGrowthBank
from .attn_logit import AttnLogitGrowthDetector
from .base import SeriesDetector
from .degradation import DegradationBank, DegradationConfig, DegradationDetector
from .grad_spike import GradSpikeBank, GradSpikeConfig, GradSpikeDetector
from .co_rise import CoRiseConfig, CoRiseDetector
from .lr_jump import LrJumpConfig, LrJumpDetector
from .loss_spike import LossSpikeBank, LossSpikeConfig, LossSpikeDetector
from .non_finite import NonFiniteBank, NonFiniteConfig, NonFiniteDetector
from .series import SeriesBank, Single
from .outlier_rank import OutlierRankConfig, OutlierRankDetector
from .stall import StallConfig, StallDetector
from .witness import WitnessConfig, Witnesses

# Detectors that read the whole record rather than one route's series (disable by these names).
RECORD_LEVEL = ("outlier_rank", "stall", "lr_jump", "co_rise")
# 2: witnesses, degradation, the judged (attempt, step); 3: rows in arrays, saved as parts; 4: the
# outlier-rank windows as rows too (saved incrementally, no longer one JSON of every key's window)
STATE_VERSION = 4
# Steps per piece while a bank's windows are still filling (DetectorBank._observe_columns).
YOUNG_SPLIT = 10


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
    lr_jump: LrJumpConfig = field(default_factory=LrJumpConfig)
    co_rise: CoRiseConfig = field(default_factory=CoRiseConfig)
    # Route names (ROUTES, plus the record-level RECORD_LEVEL) to switch off, e.g. for a benchmark.
    disabled: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.disabled = tuple(self.disabled)
        known = {r.name for r in ROUTES} | set(RECORD_LEVEL)
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
    make: Callable[[BankConfig, Witnesses], SeriesBank]  # the detector over all the route's series

    def build(self, key: str, config: BankConfig, witnesses: Witnesses) -> SeriesDetector:
        """One series alone (replay of one key, tests): a bank of one row."""
        return Single(self.make(config, witnesses), key)


ROUTES: tuple[Route, ...] = (
    Route("non_finite", None, lambda c, w: NonFiniteBank(c.non_finite)),
    Route("attn_growth", frozenset({ATTN_LOGIT_MAX, ATTN_LOGIT_LSE}), lambda c, w: AttnLogitGrowthBank(c.attn, w)),
    Route("attn_ceiling", frozenset({ATTN_LOGIT_MAX, ATTN_LOGIT_LSE}), lambda c, w: AttnLogitCeilingBank(c.attn, w)),
    Route("loss_spike", frozenset({LOSS}), lambda c, w: LossSpikeBank(c.loss)),
    Route("loss_degradation", frozenset({LOSS}), lambda c, w: DegradationBank(c.degradation, w)),
    Route("grad_spike", frozenset({GRAD_NORM}), lambda c, w: GradSpikeBank(c.grad)),
    Route("act_overflow", frozenset({ACT_MAX, ACT_MIN}), lambda c, w: ActOverflowBank(c.act)),
)

def run_witnesses(config: BankConfig) -> Witnesses:
    """One run's witnesses. The attention episode (witness.py) lasts while a logit stays at or
    above the attention detectors' act_level, one level for "this needs a human" and "the
    episode goes on", and ends on the attention detectors' clear_steps and window."""
    return Witnesses(config.witness, episode_level=config.attn.act_level, clear=config.attn.clear_steps,
                     stale=config.attn.window)


# A record's keys -> per route, (positions in the record, rows in the route's bank). Records of
# one run carry the same keys step after step, so the routing is worked out once per key set.
Plan = list[tuple[int, SeriesBank, np.ndarray, np.ndarray]]


class DetectorBank:
    def __init__(self, config: BankConfig | None = None) -> None:
        self.config = config or BankConfig()
        self._routes = [r for r in ROUTES if r.name not in self.config.disabled]
        self.outlier = OutlierRankDetector(self.config.outlier)
        self.stall = StallDetector(self.config.stall)
        self.lr_jump = LrJumpDetector(self.config.lr_jump)
        self.co_rise = CoRiseDetector(self.config.co_rise)
        self.witnesses = run_witnesses(self.config)
        # One bank per route: every series of that route is a row in it.
        self.series: dict[str, SeriesBank] = {r.name: r.make(self.config, self.witnesses) for r in self._routes}
        self._plans: dict[tuple[str, ...], Plan] = {}
        # The newest (attempt, step) judged: a step at or before it in the same attempt is a
        # re-delivery and is not judged again.
        self.judged: tuple[int, int] | None = None

    @property
    def lost(self) -> bool:
        """An in-process bank never loses its state; the daemon's RemoteBank does, with its child
        process (supervisor/judge/bank_process.py), and the responder then reloads it."""
        return False

    def _plan(self, keys: tuple[str, ...]) -> Plan:
        plan = self._plans.get(keys)
        if plan is None:
            if len(self._plans) > 16:
                self._plans.clear()
            plan = []
            metrics = [split_key(k)[0] for k in keys]
            for i, route in enumerate(self._routes):
                pos = [p for p, m in enumerate(metrics) if route.metrics is None or m in route.metrics]
                if pos:
                    bank = self.series[route.name]
                    plan.append((i, bank, as_rows(pos), as_rows([bank.row(keys[p]) for p in pos])))
            self._plans[keys] = plan
        return plan

    def _judged_before(self, step: int, attempt: int | None) -> bool:
        return attempt is not None and self.judged is not None and attempt == self.judged[0] and step <= self.judged[1]

    def observe(self, record: StepRecord, attempt: int | None = None) -> list[Finding]:
        """Judge one record. With `attempt`, a step already judged in that attempt is skipped
        (returns []); without it (replay), a step going back is an unannounced rollback."""
        if self._judged_before(record.step, attempt):
            return []
        self._went_back(record.step)
        keys = tuple(record.values)
        values = np.fromiter(record.values.values(), np.float64, len(keys))
        return self._observe(record.step, keys, values, record.wall_time, record.values.get, record.ranks, attempt)

    def _observe(self, step: int, keys: tuple[str, ...], values: np.ndarray, wall_time: float,
                 get: Callable[[str], float | None], ranks: dict[str, int], attempt: int | None,
                 rest: dict[int, tuple[np.ndarray, np.ndarray]] | None = None, plan: Plan | None = None
                 ) -> list[Finding]:
        """One step: its keys, their values, `get` (key -> value or None) and the ranks to judge.
        `rest`: per route, the (positions, rows) left after a batch judged its quiet rows in bulk;
        `plan`: the keys' routing, when the caller has it (a batch works it out once)."""
        if attempt is not None:
            self.judged = (attempt, step)
        findings: list[Finding] = []
        self.witnesses.observe_row(step, keys, values, get)
        wall = wall_time if wall_time and math.isfinite(wall_time) else None
        if wall is not None and "stall" not in self.config.disabled:
            # A gap between this record and the previous one is a stall that already happened
            # (replay sees it this way; live, the scheduler's check(now) sees it first).
            stalled = self.stall.check(wall)
            if stalled is not None:
                findings.append(stalled)
        found: list[tuple[int, int, Finding]] = []
        for i, bank, pos, rows in (plan if plan is not None else self._plan(keys)):
            if rest is not None:
                pos, rows = rest.get(i, (pos, rows))
                if not rows.size:
                    continue  # every row of the route was judged in bulk for this batch
            for j, f in bank.observe(step, rows, values[pos]):
                found.append((int(pos[j]), i, f))
        # In record order, then route order: the order one object per series gave.
        findings.extend(f for _, _, f in sorted(found, key=lambda t: t[:2]))
        if any(f.signal is Signal.NON_FINITE for f in findings):
            _note_origin(findings, keys, values)
        if "outlier_rank" not in self.config.disabled and ranks:
            findings.extend(self.outlier.observe_ranks(step, ranks))
        if "lr_jump" not in self.config.disabled:
            jumped = self.lr_jump.observe(step, get)
            if jumped is not None:
                findings.append(jumped)
        if "co_rise" not in self.config.disabled:
            rose = self.co_rise.observe(step, get)
            if rose is not None:
                findings.append(rose)
        self.stall.update(step, math.nan, wall)
        return findings

    def observe_many(self, batch: Iterable[StepRecord] | StepColumns, attempt: int | None = None) -> list[Finding]:
        """Judge a batch, in step order: StepRecords, or the columns ingest stores (monitors.columns).
        A plain batch (rising steps, the same keys at every step) goes as arrays (_observe_columns:
        quiet rows in bulk, the witnesses' shifts in one pass); any other goes one record at a
        time. The findings and the state are those of observing one record at a time
        (tests/monitors/test_batch_judge.py)."""
        if isinstance(batch, StepColumns):
            if batch.present is None and len(batch) > 1 and bool((np.diff(batch.steps) > 0).all()):
                return self._observe_columns(batch, attempt)
            records = batch.to_records()
        else:
            records = list(batch)
            if len(records) > 1 and _plain(records):
                return self._observe_columns(StepColumns.from_records(records), attempt)
        return [f for record in records for f in self.observe(record, attempt)]

    def _observe_columns(self, cols: StepColumns, attempt: int | None) -> list[Finding]:
        """A plain batch as arrays. Ahead of its steps: the witnesses' shifts; per bank, the rows
        that stay quiet through the whole batch are judged in bulk (SeriesBank.judge_bulk: no
        finding, no latch, so nothing depends on the order of steps across rows), and the window
        medians of the others are taken for all steps at once; likewise the outlier ranks. Then
        step by step over the others only."""
        if attempt is not None and self.judged is not None and attempt == self.judged[0]:
            fresh = cols.steps > self.judged[1]  # a re-sent batch: only the steps not judged yet
            if not fresh.all():
                cols = cols.select(fresh)
        if not len(cols):
            return []
        keys, steps, values = tuple(cols.keys), cols.steps, cols.values
        self._went_back(int(steps[0]))  # before any row is judged in bulk past it
        plan = self._plan(keys)
        if len(cols) > YOUNG_SPLIT and (any(b.filling(rows, len(cols), YOUNG_SPLIT) for _, b, _, rows in plan)
                                        or self.witnesses.filling(len(cols), YOUNG_SPLIT)
                                        or (cols.ranks is not None and self.outlier.empty)):
            # Windows still filling: a row can be judged in bulk only from the step its window is
            # full, so a young bank takes the batch in short pieces (each judged as arrays, as a
            # batch is: the same findings and state as one step at a time, whatever the cut).
            out = []
            for lo in range(0, len(cols), YOUNG_SPLIT):
                piece = np.zeros(len(cols), bool)
                piece[lo:lo + YOUNG_SPLIT] = True
                out.extend(self._observe_columns(cols.select(piece), attempt))
            return out
        rest: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        out: list[Finding] = []
        try:
            ranked: list[tuple[str, int]] = []
            if len(cols) > 1:
                self.witnesses.prepare_arrays(keys, steps, values)
                if "co_rise" not in self.config.disabled and LOSS in keys and GRAD_NORM in keys:
                    self.co_rise.prepare(steps, values[:, keys.index(LOSS)], values[:, keys.index(GRAD_NORM)])
                for i, bank, pos, rows in plan:
                    done = bank.judge_bulk(steps, rows, values[:, pos])
                    if done.any():
                        pos, rows = pos[~done], rows[~done]
                        rest[i] = (pos, rows)
                    bank.begin_batch(steps, rows, values[:, pos])
            if cols.ranks is not None and "outlier_rank" not in self.config.disabled:
                has = np.flatnonzero((cols.ranks >= 0).any(axis=0))
                done = self.outlier.observe_many(steps, [keys[j] for j in has.tolist()], cols.ranks[:, has])
                ranked = [(keys[j], j) for j, d in zip(has.tolist(), done.tolist()) if not d]
            col = {k: j for j, k in enumerate(keys)}
            rk = cols.ranks
            for i, (step, wall) in enumerate(zip(steps.tolist(), cols.wall_time.tolist())):
                row = values[i]
                ranks = {k: r for k, j in ranked if (r := int(rk[i, j])) >= 0} if ranked else {}
                out.extend(self._observe(step, keys, row, wall, _getter(col, row), ranks, attempt, rest, plan))
        finally:
            self.witnesses.prepare([])  # nothing judged ahead outlives its batch
            self.co_rise.end_batch()
            for bank in self.series.values():
                bank.end_batch()
        return out

    def _went_back(self, step: int) -> None:
        """A step at or before the newest one judged, without reset(): an unannounced rollback
        (a replay) or a re-sent record. Every series forgets its points from `step` on, those the
        record does not carry too: a figure read every few steps (issue 36) is absent from most
        records, and a point of the abandoned path must not stay in its window. (A series the
        record carries would be rewound by its bank anyway; the witnesses rewind themselves.)"""
        newest = self.witnesses.step  # the newest step observed (-1: none; a reset rewinds it)
        if newest < 0 or step > newest:
            return
        for bank in self.series.values():
            bank.step_back(step)
        self.outlier.step_back(step)

    def check(self, now: float) -> list[Finding]:
        """Wall-clock checks (stall). `now` must be on the same clock as record.wall_time."""
        if "stall" in self.config.disabled:
            return []
        f = self.stall.check(now)
        return [f] if f is not None else []

    def release_latches(self) -> None:
        """Every detector fires again on a condition that persists, from its next point; nothing
        judged is forgotten. The responder calls it when a step cooldown that held a finding
        back ends: a latched detector would otherwise stay silent for the rest of the excursion."""
        for bank in self.series.values():
            bank.release_latches()
        self.outlier.release_latches()

    def reset(self, first_step: int | None = None) -> None:
        """After a rollback whose first re-trained step is `first_step` (the checkpoint's + 1):
        forget buffered points at/after it and all latches, keep the healthy history before it
        (no new warm-up). None forgets everything."""
        for bank in self.series.values():
            bank.reset(first_step)
        self.outlier.reset(first_step)
        self.stall.reset(first_step)
        self.lr_jump.reset(first_step)
        self.co_rise.reset(first_step)
        self.witnesses.reset(first_step)
        if self.judged is not None:
            # The steps from first_step on are trained again (in a new attempt, or this one).
            self.judged = None if first_step is None else (self.judged[0], min(self.judged[1], first_step - 1))

    # --- state: named parts, saved incrementally ------------------------------------------

    def state_parts(self, dirty_only: bool = False) -> dict[str, bytes]:
        """The state as named parts. With `dirty_only`, the ring chunks not written since the
        last `mark_saved()` are left out (the store keeps their previous rows): a save after k
        steps writes O(k x series) bytes plus the per-row counters, not the whole history."""
        meta = {"version": STATE_VERSION, "stall": self.stall.state_dict(), "lr_jump": self.lr_jump.state_dict(),
                "co_rise": self.co_rise.state_dict(),
                "judged": list(self.judged) if self.judged is not None else None,
                "routes": [r.name for r in self._routes]}
        parts = {"meta": json.dumps(meta, separators=(",", ":")).encode()}
        parts.update(self.witnesses.parts("witnesses", dirty_only))
        parts.update(self.outlier.parts("outlier", dirty_only))
        for name, bank in self.series.items():
            parts.update(bank.parts(name, dirty_only))
        return parts

    def mark_saved(self) -> None:
        self.witnesses.mark_saved()
        self.outlier.mark_saved()
        for bank in self.series.values():
            bank.mark_saved()

    def load_state_parts(self, parts: dict[str, bytes]) -> None:
        meta = json.loads(parts["meta"]) if "meta" in parts else {}
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"detector state version {meta.get('version')!r} != {STATE_VERSION}; start with a fresh bank")
        self._plans.clear()
        self.witnesses.load("witnesses", parts)
        for route in self._routes:
            bank = self.series[route.name] = route.make(self.config, self.witnesses)
            if f"{route.name}.rows" in parts:  # else: a route enabled since the state was saved
                bank.load(route.name, parts)
        self.outlier.load("outlier", parts)
        self.stall.load_state_dict(meta["stall"])
        self.lr_jump.load_state_dict(meta.get("lr_jump") or {})  # absent in a state saved before it existed
        self.co_rise.load_state_dict(meta.get("co_rise") or {})
        self.judged = (int(meta["judged"][0]), int(meta["judged"][1])) if meta.get("judged") else None
        self.mark_saved()

    def state_dict(self) -> dict[str, Any]:
        """Strict JSON: the same parts, base64."""
        return {"version": STATE_VERSION, "parts": parts_to_json(self.state_parts())}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"detector state version {d.get('version')!r} != {STATE_VERSION}; start with a fresh bank")
        self.load_state_parts(parts_from_json(d["parts"]))


def _plain(records: list[StepRecord]) -> bool:
    """Rising steps, the same keys in the same order at every step, ranks only for those keys:
    a batch that columns hold as one [steps, keys] array (StepColumns.from_records)."""
    keys = list(records[0].values)
    return (all(a.step < b.step for a, b in zip(records, records[1:]))
            and all(list(r.values) == keys and r.ranks.keys() <= r.values.keys() for r in records))


def _getter(col: dict[str, int], row: np.ndarray) -> Callable[[str], float | None]:
    """record.values.get for one row of a batch's array."""
    def get(key: str) -> float | None:
        j = col.get(key)
        return None if j is None else float(row[j])
    return get


_FORWARD = (ACT_MAX, ACT_MIN, ATTN_LOGIT_MAX, ATTN_LOGIT_LSE)  # measured on a module's output, in the forward pass


def _note_origin(findings: list[Finding], keys: tuple[str, ...], values: np.ndarray) -> None:
    """Where a step's NaN/Inf began: the first module in forward order whose output is
    non-finite, not counting a module whose child is (a block's output holds its MLP's). Every
    non-finite finding of the step carries it as evidence (`origin`), so the incident that the
    loss's finding opens still says which layer broke (the loss and the gradients of every layer
    turn NaN with it; the activations before that module do not)."""
    bad = [(k, split_key(k)[1]) for k, v in zip(keys, values.tolist())
           if not math.isfinite(v) and split_key(k)[0] in _FORWARD and split_key(k)[1]]
    if not bad:
        return
    mods = {m for _, m in bad}
    key = next((k for k, m in bad if not any(o.startswith(m + ".") for o in mods)), bad[0][0])
    for f in findings:
        if f.signal is Signal.NON_FINITE:
            f.evidence["origin"] = key


__all__ = [
    "ActOverflowConfig", "ActOverflowDetector", "AttnLogitCeilingDetector", "AttnLogitConfig",
    "AttnLogitGrowthDetector", "BankConfig", "DegradationConfig", "DegradationDetector", "DetectorBank",
    "WitnessConfig", "Witnesses", "run_witnesses", "GradSpikeConfig", "GradSpikeDetector",
    "CoRiseConfig", "CoRiseDetector", "LossSpikeConfig", "LossSpikeDetector", "LrJumpConfig", "LrJumpDetector", "NonFiniteConfig", "NonFiniteDetector", "OutlierRankConfig",
    "OutlierRankDetector", "ROUTES", "Route", "SeriesDetector", "StallConfig", "StallDetector",
]
