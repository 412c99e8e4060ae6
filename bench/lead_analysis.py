"""Which thermometer tells, at the moment the attention logits cross a fixed ceiling of 100, a run
that will be damaged from one that will not? (issue 8, the lead-time goal)

Reads the runs bench/divergence.py recorded (--out, default /tmp/divbench; run that first) and
labels them with its loss-only ground truth. Two groups, both crossing the ceiling:

  damaged   the logits crossed 100 BEFORE the damage step (the runs the lead ratio is about)
  healthy   never damaged, crossed 100 anyway (a ceiling action there is a false action)

For each run, every feature is computed from the records up to a step t only (what an online
detector could know), at t = the crossing step and at t = the 0.9x deadline (crossing + 10 % of
the crossing-to-damage span; for healthy runs, the median span of the damaged ones). A feature
separates the groups at t only if every damaged run lies beyond every healthy one (overlap 0),
so the printed "gap" (damaged side minus healthy side, in the feature's units, either
direction) is positive for a witness and negative when the ranges overlap.

    python bench/lead_analysis.py [--out /tmp/divbench] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _divergence_grid as grid_mod
import _divergence_runs as runs
import divergence as div

from thermowatch.monitors.detectors.attn_logit import theil_sen_slope
from thermowatch.monitors.replay import read_records

SLOPE = 16  # points in a growth-rate fit (the growth detector's slope_window)
RECENT, BASE = 8, 64  # recent median against a baseline median (the witnesses' windows)


def _col(r: div.Run, key: str) -> np.ndarray:
    return np.array([rec.values.get(key, math.nan) for rec in r.records], dtype=float)


def _keys(r: div.Run, prefix: str) -> list[str]:
    return [k for k in r.records[0].values if k.split("/")[0] == prefix]


def _shift(y: np.ndarray, i: int, log: bool = True) -> float:
    """median of the last RECENT finite points up to i minus the median of the BASE before."""
    y = y[: i + 1]
    y = y[np.isfinite(y) & ((y > 0) if log else True)]
    if log:
        y = np.log(y)
    if y.size < RECENT + BASE // 2:
        return math.nan
    return float(np.median(y[-RECENT:]) - np.median(y[-RECENT - BASE:-RECENT]))


def _slope(steps: np.ndarray, y: np.ndarray, i: int, n: int = SLOPE, lag: int = 0) -> float:
    lo, hi = i + 1 - n - lag, i + 1 - lag
    if lo < 0:
        return math.nan
    ys, xs = y[lo:hi], steps[lo:hi]
    ok = np.isfinite(ys) & (ys > 0)
    if ok.sum() < 4:
        return math.nan
    return theil_sen_slope(xs[ok].astype(float), np.log(ys[ok]))


def features(r: div.Run, step: int) -> dict[str, float]:
    """Every feature of run r from its records up to `step` (1-based step numbers)."""
    i = int(np.searchsorted(r.steps, step, side="right")) - 1
    steps = r.steps
    attn_keys = _keys(r, "attn_logit_lse") + _keys(r, "attn_logit_max")
    attn = {k: _col(r, k) for k in attn_keys}
    top = max(attn_keys, key=lambda k: np.nan_to_num(attn[k][i], nan=-1))
    lr = _col(r, "lr")
    f: dict[str, float] = {}
    f["lr"] = lr[i]
    f["lr_rise_100"] = math.log(lr[i] / lr[max(0, i - 100)]) if lr[max(0, i - 100)] > 0 else math.nan
    # The forecast the trainer sends (`lr_peak_ahead`, issue 8): how much more LR the schedule holds.
    f["lr_ahead_ratio"] = _col(r, "lr_peak_ahead")[i] / lr[i] if lr[i] > 0 else math.nan  # NaN without the key
    f["logit_max"] = float(np.nanmax([a[i] for a in attn.values()]))
    f["layers_over_50"] = float(sum(a[i] >= 50 for a in attn.values()))
    f["layers_over_100"] = float(sum(a[i] >= 100 for a in attn.values()))
    # growth rate of the top layer's log logit, per step, and its change (curvature): an
    # exponential keeps its rate, a saturating rise loses it.
    f["growth_top"] = _slope(steps, attn[top], i)
    f["growth_top_prev"] = _slope(steps, attn[top], i, lag=SLOPE)
    f["accel_top"] = f["growth_top"] - f["growth_top_prev"]
    f["growth_max_layer"] = float(np.nanmax([_slope(steps, a, i) for a in attn.values()]))
    f["growth_min_layer"] = float(np.nanmin([_slope(steps, a, i) for a in attn.values()]))
    # elasticity of the logit to the LR over the last SLOPE steps: d log logit / d log lr
    dlr = math.log(lr[i] / lr[i - SLOPE]) if i >= SLOPE and lr[i - SLOPE] > 0 else math.nan
    f["logit_lr_elasticity"] = (math.log(attn[top][i] / attn[top][i - SLOPE]) / dlr) if dlr and dlr > 1e-6 else math.nan
    f["grad_norm_shift"] = _shift(_col(r, "grad_norm"), i)
    f["grad_norm"] = float(np.nanmedian(_col(r, "grad_norm")[max(0, i - 7): i + 1]))
    f["z_shift"] = _shift(_col(r, "z/head"), i, log=False)
    f["z"] = _col(r, "z/head")[i]
    ent = {k: _col(r, k) for k in _keys(r, "attn_entropy_min")}
    f["entropy_min"] = float(np.nanmin([np.nanmedian(e[max(0, i - 7): i + 1]) for e in ent.values()]))
    f["entropy_shift_min"] = float(np.nanmin([_shift(e, i) for e in ent.values()]))
    ur = {k: _col(r, k) for k in _keys(r, "update_ratio")}

    def last(y: np.ndarray) -> float:
        y = y[: i + 1]
        y = y[np.isfinite(y)]
        return float(y[-1]) if y.size else math.nan

    f["update_ratio"] = last(ur["update_ratio"]) if "update_ratio" in ur else math.nan
    f["update_ratio_max_layer"] = float(np.nanmax([last(y) for y in ur.values()])) if ur else math.nan
    f["update_per_lr"] = f["update_ratio"] / lr[i] if lr[i] > 0 else math.nan
    loss = r.smooth
    f["loss_smooth"] = loss[i]
    f["loss_slope_50"] = float(loss[i] - loss[max(0, i - 50)]) if i >= 50 else math.nan
    acts = [k for k in _keys(r, "act_max") if k.split("/")[1].startswith("blocks.") and k.count(".") == 1]
    f["resid_act_max"] = float(np.nanmax([_col(r, k)[i] for k in acts])) if acts else math.nan
    f["resid_act_shift"] = float(np.nanmax([_shift(_col(r, k), i) for k in acts])) if acts else math.nan
    return f


def separation(dmg: list[dict], ok: list[dict]) -> list[tuple[str, float, str, float, float]]:
    """(feature, gap, direction, damaged range, healthy range) sorted by gap, best first. The gap is
    in the feature's own units, normalised by the pooled spread so features compare."""
    out = []
    for k in dmg[0]:
        a = np.array([d[k] for d in dmg], float)
        b = np.array([d[k] for d in ok], float)
        a, b = a[np.isfinite(a)], b[np.isfinite(b)]
        if not a.size or not b.size:
            continue
        spread = float(np.std(np.concatenate([a, b]))) or 1.0
        up = (a.min() - b.max()) / spread  # damaged above every healthy run
        down = (b.min() - a.max()) / spread  # damaged below every healthy run
        gap, way = (up, "higher") if up >= down else (down, "lower")
        auc = float(np.mean([(x > y) + 0.5 * (x == y) for x in a for y in b]))
        out.append((k, gap, way, (float(a.min()), float(a.max())), (float(b.min()), float(b.max())), auc))
    return sorted(out, key=lambda t: -t[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/divbench")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    specs = [s for s in grid_mod.grid(args.seeds, list(grid_mod.ARCHS)) if runs.paths(out, s)[0].is_file()]
    all_runs = [div.Run(s, runs.paths(out, s)[0], [rec for _, rec in read_records(runs.paths(out, s)[0])])
                for s in specs]
    div.label(all_runs)
    dmg = [r for r in all_runs if r.damaged and r.ceiling_step is not None and r.ceiling_step < r.div_step]
    ok = [r for r in all_runs if not r.damaged and r.ceiling_step is not None]
    if not dmg or not ok:
        sys.exit(f"need damaged and healthy runs that cross the ceiling in {out}; record the grid first")
    span = statistics.median(r.div_step - r.ceiling_step for r in dmg)
    print(f"{len(dmg)} damaged runs crossing 100 before the damage, {len(ok)} healthy runs crossing 100; "
          f"median crossing-to-damage span {span:.0f} steps\n")
    print(f"{'run':<28}{'cross@':>7}{'damage@':>8}{'0.9x by':>8}{'lr@cross':>9}{'peak lr':>8}{'max logit':>10}")
    for r in dmg + ok:
        dl = r.ceiling_step + (0.1 * (r.div_step - r.ceiling_step) if r.damaged else 0.1 * span)
        print(f"{r.label:<28}{r.ceiling_step:>7}{div._fmt(r.div_step):>8}{dl:>8.0f}"
              f"{_col(r, 'lr')[r.ceiling_step - 1]:>9.4f}{np.nanmax(_col(r, 'lr')):>8.3f}{np.nanmax(r.attn):>10.0f}")
    report: dict = {"damaged": [r.label for r in dmg], "healthy": [r.label for r in ok], "span": span, "at": {}}
    for when in ("crossing", "deadline_0.9x"):
        fd, fo = [], []
        for r in dmg:
            t = r.ceiling_step if when == "crossing" else int(r.ceiling_step + 0.1 * (r.div_step - r.ceiling_step))
            fd.append(features(r, t))
        for r in ok:
            t = r.ceiling_step if when == "crossing" else int(r.ceiling_step + 0.1 * span)
            fo.append(features(r, t))
        sep = separation(fd, fo)
        print(f"\nat the {when}: gap > 0 separates (every damaged run beyond every healthy one); AUC = "
              "P(damaged > healthy)")
        print(f"{'feature':<24}{'gap/sd':>8}{'damaged':>8}{'AUC':>6}  {'damaged range':<24}{'healthy range':<24}")
        for k, gap, way, a, b, auc in sep:
            print(f"{k:<24}{gap:>8.2f}{way:>8}{auc:>6.2f}  [{a[0]:.4g}, {a[1]:.4g}]".ljust(70)
                  + f"[{b[0]:.4g}, {b[1]:.4g}]")
        report["at"][when] = [{"feature": k, "gap_sd": round(g, 3), "damaged": w, "auc": round(u, 3),
                               "damaged_range": a, "healthy_range": b} for k, g, w, a, b, u in sep]
    if args.json:
        print(json.dumps(report))


if __name__ == "__main__":
    main()
