"""Outlier rank over arrays (issue 10: a step's rank keys judged across keys at once, a batch's
quiet keys in one pass) gives the findings and the state of the per-key design it replaced,
kept here as the reference, through rewinds, latches and clears, new ranks mid-run, keys that
come and go, and batches judged through DetectorBank.observe_many."""

from __future__ import annotations

import json
from collections import Counter, deque
from typing import Any

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from thermowatch.monitors.contract import Finding, Outcome, Severity, Signal, StepRecord
from thermowatch.monitors.detectors import BankConfig, DetectorBank, OutlierRankConfig, OutlierRankDetector


class _PerKey:
    """The design before the arrays (commit 5098047): one deque and one Counter per key."""

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
                       detect_step=step, metric=key, evidence=evidence, outcome=Outcome.ACT)

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


def _stream(seed: int, n: int, n_keys: int, world: int):
    """(step, ranks) events and ("reset", to_step) ones: one key's extreme sticks to one rank
    for a while (a bad rank), then wanders; steps go back now and then (a re-sent or rolled-back
    stretch); some steps miss a key; a rank larger than any before appears mid-run."""
    rng = np.random.default_rng(seed)
    step, out = 0, []
    bad = {f"act_max/blocks.{k}": (int(rng.integers(0, n)), int(rng.integers(20, 120)), int(rng.integers(0, world)))
           for k in range(n_keys)}
    for i in range(n):
        if rng.random() < 0.02:
            out.append(("reset", max(0, step - int(rng.integers(1, 40)))))
            step = out[-1][1]
            continue
        if rng.random() < 0.02:
            step = max(0, step - int(rng.integers(1, 10)))  # an unannounced rewind
        ranks = {}
        for key, (start, length, r) in bad.items():
            if rng.random() < 0.05:
                continue
            held = start <= i < start + length and rng.random() < 0.95
            w = world + (2 if i > n // 2 else 0)
            ranks[key] = r if held else int(rng.integers(0, w))
        out.append((step, ranks))
        step += 1
    return out


def _cfg(world_size):
    return OutlierRankConfig(window=20, min_points=10, min_share=0.8, clear_share=0.5, world_size=world_size)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32 - 1), st.integers(1, 4), st.integers(1, 5), st.sampled_from([None, 4]))
def test_the_arrays_judge_as_the_per_key_design(seed, n_keys, world, world_size):
    ref, new = _PerKey(_cfg(world_size)), OutlierRankDetector(_cfg(world_size))
    for ev in _stream(seed, 300, n_keys, world):
        if ev[0] == "reset":
            ref.reset(ev[1])
            new.reset(ev[1])
            continue
        rec = StepRecord(step=ev[0], values={}, ranks=ev[1])
        assert [f.to_json() for f in new.observe(rec)] == [f.to_json() for f in ref.observe(rec)], ev
    assert new.state_dict() == ref.state_dict()
    back = OutlierRankDetector(_cfg(world_size))
    back.load_state_dict(json.loads(json.dumps(new.state_dict())))
    assert back.state_dict() == ref.state_dict()


def test_a_bad_rank_is_found_and_the_stream_raises_findings():
    """The property test above compares streams that do raise findings (not only silence)."""
    ref = _PerKey(_cfg(None))
    found = [f for ev in _stream(3, 300, 4, 4) if ev[0] != "reset"
             for f in ref.observe(StepRecord(step=ev[0], values={}, ranks=ev[1]))]
    assert found and all(f.signal is Signal.OUTLIER_RANK for f in found)


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 2**32 - 1), st.sampled_from([7, 20, 50]), st.sampled_from([8, 100]))
def test_batches_judge_as_one_step_at_a_time(seed, size, world):
    """Through DetectorBank.observe_many: quiet keys go in bulk (OutlierRankDetector.observe_many:
    its bound from running counts per rank, or, with 64 ranks or more, from sorted spans), the
    rest step by step; the findings and state equal one record at a time."""
    rng = np.random.default_rng(seed)
    keys = [f"act_max/blocks.{k}" for k in range(12)]
    records, held = [], {k: None for k in keys}
    for step in range(400):
        ranks = {}
        for k in keys:
            if held[k] is None and rng.random() < 0.003:
                held[k] = (int(rng.integers(0, world)), step + int(rng.integers(10, 80)))
            if held[k] is not None and step >= held[k][1]:
                held[k] = None
            ranks[k] = held[k][0] if held[k] is not None and rng.random() < 0.95 else int(rng.integers(0, world))
        records.append(StepRecord(step=step, values={k: 1.0 for k in keys}, ranks=ranks))
    cfg = BankConfig.from_dict({"outlier": {"window": 30, "min_points": 20}})
    one, many = DetectorBank(cfg), DetectorBank(cfg)
    want = [f.to_json() for r in records for f in one.observe(r, 0)]
    bulk = 0
    real = many.outlier.observe_many

    def counting(steps, ks, ranks):
        nonlocal bulk
        done = real(steps, ks, ranks)
        bulk += int(done.sum())
        return done

    many.outlier.observe_many = counting
    got = [f.to_json() for i in range(0, len(records), size) for f in many.observe_many(records[i:i + size], 0)]
    assert got == want
    assert any(f["signal"] == Signal.OUTLIER_RANK.value for f in want)
    assert bulk > 0
    assert many.outlier.state_dict() == one.outlier.state_dict()


def test_a_huge_or_negative_rank_costs_no_table_and_counts_as_none():
    """A rank is an index, not a size: 10**9 allocates nothing by it; a negative one is none."""
    det = OutlierRankDetector(_cfg(None))
    for step in range(30):
        det.observe(StepRecord(step=step, values={}, ranks={"act_max/a": 10**9 if step % 2 else 1, "act_max/b": -1}))
    assert "act_max/b" not in det.state_dict()["seen"]
    assert det.state_dict()["max_rank"] == 10**9


def _reduced_run(per_rank, steps: int = 120) -> list[Finding]:
    """Rank vectors reduced as the run controller and thermowatch.watch reduce them (Reducer,
    which the collective path equals bit for bit: tests/trainer/test_collective.py), then judged
    by a default bank's outlier-rank detector, step by step."""
    from thermowatch.monitors.reduce import Reducer

    names = ["act_max/blocks.0", "act_min/blocks.0", "attn_entropy_min/blocks.0.attn", "grad_norm"]
    red, det = Reducer(names), OutlierRankDetector()
    rng = np.random.default_rng(0)
    found = []
    for step in range(1, steps + 1):
        vals = per_rank(rng, step)
        row, ranks = red(vals)
        found += det.observe(StepRecord(step=step, values=dict(zip(names, row.tolist())), ranks=ranks))
    return found


def _healthy(rng, step, world=2):
    """Two healthy data-parallel ranks: different samples, so different extremes, the holder
    wandering; attn_entropy_min read every 10th step (NaN on every rank in between, as the
    thermometers leave a sampled group's off-steps); the global grad norm the same on both."""
    vals = np.empty((world, 4))
    vals[:, 0] = 5 + rng.standard_normal(world)
    vals[:, 1] = -5 + rng.standard_normal(world)
    vals[:, 2] = 1.8 + 0.02 * rng.standard_normal(world) if step % 10 == 0 else np.nan
    vals[:, 3] = 0.7
    return vals


def test_a_figure_no_rank_measured_names_no_rank():
    """Issue 35: a healthy 2-rank FSDP2 run was paged for outlier_rank on attn_entropy_min at
    step 30: on its 9 unmeasured steps of 10 the figure was NaN on every rank, and NaN, which wins
    a max or a min, named rank 0 each time. Ranks that agree (NaN included) name no rank now."""
    assert _reduced_run(_healthy) == []


def test_a_rank_far_out_of_line_is_still_found():
    def rank1_hot(rng, step):  # rank 1's activations run 3x hotter from step 20 on: a sick device
        vals = _healthy(rng, step)
        if step >= 20:
            vals[1, 0] *= 3
        return vals

    found = _reduced_run(rank1_hot)
    assert [(f.module, f.evidence["rank"]) for f in found] == [("act_max/blocks.0", 1)], found

    def rank1_nan(rng, step):  # rank 1 alone produces NaN: a disagreement, named
        vals = _healthy(rng, step)
        if step >= 20:
            vals[1, 1] = np.nan
        return vals

    found = _reduced_run(rank1_nan)
    assert [(f.module, f.evidence["rank"]) for f in found] == [("act_min/blocks.0", 1)], found
