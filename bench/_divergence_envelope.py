"""The peer envelope's lead on the grid, rule against rule in one replay (issue 39, item 4: "the
verdict comes within 100 steps of the run falling behind, with no healthy run paged").

Each run is judged as supervisor.app.jobs.peer_envelope judges it: against every other run of its
model config (a sweep in one database). Per rule: the no-growth degradations paged and how many
steps after they fell behind, and the healthy runs paged.

Fell behind, read without any rule's start, lag or confirm: the first step at which the run's
trailing-10 loss stands `gap_nats` (0.25) above the same-step envelope (the best peer that had
trained with no more LR) after the last step at which it was within half of that (0.125) of it,
so from there on it never came back near its peers. Lead = verdict step - that step.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from thermowatch.monitors.envelope import Curve, EnvelopeConfig, behind_peers, envelope

# The rule before issue 39 (no verdict before step 150, the envelope of the same step), and now.
RULES: tuple[tuple[str, EnvelopeConfig], ...] = (
    ("before (start 150, lag 0)", EnvelopeConfig(start=150, lag=0)),
    ("now (defaults)", EnvelopeConfig()),
)


@dataclass
class Judged:
    label: str
    model: tuple
    curve: Curve
    kind: str  # "degraded" (a no-growth degradation: paging is the goal), "damaged", "healthy"


def fell_behind(run: Curve, peers: list[Curve], gap: float) -> int | None:
    env = envelope(run, peers, EnvelopeConfig(lag=0))
    g = env.own - env.best
    near = np.flatnonzero(~(g >= gap / 2))  # within gap/2, no envelope, or no loss
    after = int(near[-1]) + 1 if near.size else 0
    hit = np.flatnonzero(g[after:] >= gap)
    return int(run.steps[after + hit[0]]) if hit.size else None


def compare(runs: list[Judged]) -> dict:
    peers = {id(r): [p.curve for p in runs if p is not r and p.model == r.model] for r in runs}
    verdict = {name: {r.label: (f.detect_step if (f := behind_peers(r.curve, peers[id(r)], cfg)) else None)
                      for r in runs} for name, cfg in RULES}
    degraded = [r for r in runs if r.kind == "degraded"]
    fell = {r.label: fell_behind(r.curve, peers[id(r)], RULES[0][1].gap_nats) for r in degraded}
    print("\nThe peer envelope, rule against rule (bench/_divergence_envelope.py; fell behind = the first step "
          "0.25 nats above the same-step envelope after the last one within 0.125 of it; lead = verdict - that)")
    print(f"{'rule':<30}{'degraded paged':>15}{'lead min':>9}{'median':>7}{'max':>5}{'<=100':>7}"
          f"{'healthy paged':>15}{'damaged paged':>15}")
    rows = {}
    for name, _ in RULES:
        v = verdict[name]
        leads = [v[r.label] - fell[r.label] for r in degraded if v[r.label] is not None and fell[r.label] is not None]
        healthy = [f"{r.label}@{v[r.label]}" for r in runs if r.kind == "healthy" and v[r.label] is not None]
        n_h = sum(r.kind == "healthy" for r in runs)
        dmg = [r for r in runs if r.kind == "damaged"]
        row = rows[name] = {
            "degraded_paged": sum(v[r.label] is not None for r in degraded), "n_degraded": len(degraded),
            "lead_min": min(leads, default=None), "lead_median": statistics.median(leads) if leads else None,
            "lead_max": max(leads, default=None), "lead_le_100": sum(x <= 100 for x in leads),
            "healthy_paged": healthy, "n_healthy": n_h,
            "damaged_paged": sum(v[r.label] is not None for r in dmg), "n_damaged": len(dmg)}
        print(f"{name:<30}{row['degraded_paged']:>11}/{len(degraded):<3}{_f(row['lead_min']):>9}"
              f"{_f(row['lead_median']):>7}{_f(row['lead_max']):>5}{row['lead_le_100']:>5}/{len(leads):<1}"
              f"{len(healthy):>11}/{n_h:<3}{row['damaged_paged']:>11}/{len(dmg):<3} {', '.join(healthy)}")
    print(f"{'degraded run':<30}{'fell behind @':>14}" + "".join(f"{f'verdict [{i}]':>13}" for i in range(len(RULES))))
    per_run = []
    for r in degraded:
        got = [verdict[name][r.label] for name, _ in RULES]
        per_run.append({"run": r.label, "fell_behind": fell[r.label], "verdict": got})
        print(f"{r.label:<30}{_f(fell[r.label]):>14}" + "".join(f"{_f(x):>13}" for x in got))
    return {"rules": rows, "degraded": per_run}


def _f(x) -> str:
    return "-" if x is None else f"{x:g}" if isinstance(x, float) else str(x)
