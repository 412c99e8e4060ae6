"""The judge path alone: DetectorBank.observe over --series values per step (the ingest bench's
781 keys, standard-normal values, so half the attention/grad series are skipped as non-positive
just as in bench/ingest.py), and the detector state bytes a save writes.

    python bench/detectors.py                      # 781 series x 1,000 steps
    python bench/detectors.py --steps 300 --json   # ... ends with one JSON line of figures
    python bench/detectors.py --positive           # |values|: every series appends every step

`state bytes per save`: what the responder writes to the database when it saves after `k` new
steps (k = 1, the steps of one 50-step batch, and everything): the bank's `state_parts(dirty)`
if it has one (incremental rows), else the whole state JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from thermowatch.monitors.contract import StepRecord
from thermowatch.monitors.detectors import BankConfig, DetectorBank


def keys(n: int) -> list[str]:
    metrics = ["act_max", "act_min", "attn_logit_max", "grad_norm", "update_ratio", "z", "param_norm", "act_rms",
               "attn_logit_lse", "grad_max"]
    # The run's own loss and global gradient norm come first, as every real record has them (the
    # record-level detectors read them: lr_jump.py, co_rise.py).
    return ["loss", "grad_norm", *(f"{metrics[i % 10]}/blocks.{i // 10}.mlp" for i in range(max(0, n - 2)))]


WORLD = 8  # the ranks the benches' runs open with


def ranked(ks: list[str]) -> list[str]:
    """The keys the run controller names a rank for: those reduced by max or min across ranks
    (contract.reduction), whose extreme some rank held (trainer/reduce.py; with float values the
    ranks nearly always disagree, so nearly every such key carries one)."""
    from thermowatch.monitors.contract import Reduce, reduction

    return [k for k in ks if reduction(k) in (Reduce.MAX, Reduce.MIN)]


def records(steps: int, n: int, seed: int = 0, positive: bool = False) -> list[StepRecord]:
    rng = np.random.default_rng(seed)
    ks = keys(n)
    vals = rng.standard_normal((steps, n))
    if positive:
        vals = np.abs(vals)
    rk = ranked(ks)
    holders = rng.integers(0, WORLD, (steps, len(rk)))
    return [StepRecord(step=i, values=dict(zip(ks, vals[i].tolist())), wall_time=1.0,
                       ranks=dict(zip(rk, holders[i].tolist()))) for i in range(steps)]


def save_bytes(bank: DetectorBank) -> int:
    """Bytes the next save writes (and marks the bank saved)."""
    parts = getattr(bank, "state_parts", None)
    if parts is None:
        return len(json.dumps(bank.state_dict(), separators=(",", ":")))
    n = sum(len(v) for v in parts(dirty_only=True).values())
    bank.mark_saved()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--series", type=int, default=781)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--batch", type=int, default=50, help="steps per observe_many call (the ingest batch)")
    ap.add_argument("--positive", action="store_true",
                    help="|values|, as real logits and norms are: every series appends every step, so a save's "
                         "dirty ring chunks are the same in every row (with signed values the attention and grad "
                         "rows skip the negative half, their ring positions drift apart and a save touches more chunks)")
    a = ap.parse_args()
    recs = records(a.steps, a.series, positive=a.positive)
    # One record at a time (observe), then as the daemon's judge gets them: batches of --batch
    # steps through observe_many, which takes window statistics for the whole batch at once.
    one = DetectorBank(BankConfig())
    t = time.perf_counter()
    for r in recs:
        one.observe(r, attempt=0)
    rate_one = a.steps * a.series / (time.perf_counter() - t)
    bank = DetectorBank(BankConfig())
    t = time.perf_counter()
    for i in range(0, len(recs), a.batch):
        bank.observe_many(recs[i:i + a.batch], attempt=0)
    dt = time.perf_counter() - t
    rate = a.steps * a.series / dt
    save_bytes(bank)  # the first save writes everything; the figures below are the saves after it
    more = records(a.steps + 60, a.series, seed=1, positive=a.positive)[a.steps:]
    sizes = {}
    for k, chunk in (("1", more[:1]), ("50", more[1:51])):
        bank.observe_many(chunk, attempt=0)
        sizes[k] = save_bytes(bank)
    full = len(json.dumps(bank.state_dict(), separators=(",", ":")))
    load = os.getloadavg()[0]
    print(f"detectors alone: {a.series} series x {a.steps} steps, batches of {a.batch}: {rate:,.0f} values/s "
          f"({1e6 * dt / (a.steps * a.series):.2f} us per value); one record at a time: {rate_one:,.0f} "
          f"({rate / rate_one:.2f}x)")
    print(f"state bytes per save: after 1 step {sizes['1']:,}; after 50 steps {sizes['50']:,}; "
          f"whole state_dict JSON {full:,}")
    print(f"load average: {load:.1f}")
    if a.json:
        print(json.dumps({"bench": "detectors", "series": a.series, "steps": a.steps, "positive": a.positive,
                          "batch": a.batch, "values_per_s": round(rate), "one_at_a_time_values_per_s": round(rate_one),
                          "save_bytes_after_1_step": sizes["1"], "save_bytes_after_50_steps": sizes["50"],
                          "state_json_bytes": full, "load": load}))


if __name__ == "__main__":
    main()
