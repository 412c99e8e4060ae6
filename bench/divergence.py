"""Divergence detection on real training runs: our detector bank against three peer rules.

A grid of tiny GPTs trains on CPU (bench/_divergence_runs.py: 4 layers, d_model 128, 4 heads,
64-token windows, batch 16, AdamW, clip 1.0, linear warmup over 100 steps then constant LR,
fp32 master weights with bf16 autocast) at peak LRs that end badly and LRs that do not, with
and without qk_layernorm, over several seeds. Every step's full thermometer record is written
as JSONL (`thermowatch replay FILE` reads each one). Then every detector replays every run:

  ours/default    DetectorBank(BankConfig())                 (the defaults, set for 1e5-step runs)
  ours/short-run  DetectorBank with SHORT_RUN below           (attention growth scaled to 300 steps)
  olmo_core       loss and grad_norm > mean + 6 std of the previous 128 steps
  llm_foundry     loss >= 2 x mean of the previous 100 steps for > 4 steps (or >= 10 persistently)
  megatron_lm     loss >= 10 x the max of the first 100 losses

Ground truth comes from the loss curves alone, never from a detector's findings nor from the
attention logits or gradient norms (GROUND TRUTH in the output states the rule): a run diverged if its loss rose well above its own running minimum,
or if it ended well above the best run of its seed. The step that lead time is measured
against is the first step of that rise, or else the step where the loss left the envelope of
the healthy runs. Attention-logit blow-ups are shown beside it, but they do not define it.

    python bench/divergence.py [--quick] [--reuse] [--out /tmp/divbench] [--json]

Cost on 2 shared CPU cores: the default grid (4 LRs x 2 x 3 seeds = 24 runs of 300 steps) trains
in ~7 minutes, two runs side by side; --quick (1 seed, 8 runs) in ~80 s; --reuse with a warm
cache replays in seconds. Every run is deterministic (seeded model, data order and autocast).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _divergence_runs as runs

from monitors.contract import ATTN_LOGIT_LSE, ATTN_LOGIT_MAX, Finding, StepRecord
from monitors.detectors import BankConfig, DetectorBank
from monitors.detectors.baselines import PeerBank
from monitors.replay import read_records

# The bank scaled to a 300-step run: the demo's and the test fixture's attention settings
# (tests/fixtures/diverging.py DETECTORS). Growth may fire after 20 points instead of 200, but
# only above a logit of 80; the ceiling moves from 100 to 150.
SHORT_RUN = {"attn": {"warmup": 20, "min_level": 80.0, "ceiling": 150.0}}
SIGNALS = ("attn_logit_growth", "attn_logit_ceiling", "loss_spike", "grad_spike", "non_finite")
PEERS = ("olmo_core", "llm_foundry", "megatron_lm")

# --- ground truth (from the loss only) --------------------------------------------------------
SMOOTH = 10  # trailing mean over 10 steps: one noisy batch is ~0.1 nats here
RISE = 0.25  # loss rise: smoothed loss >= its running minimum + 0.25 nats ...
RISE_STEPS = 5  # ... for 5 consecutive steps (healthy runs here rise <= ~0.15)
TAIL = 30  # final loss = mean of the last 30 steps
GAP = 0.25  # degraded: final loss >= best final loss of the same seed + 0.25 nats
ENVELOPE = 0.10  # departure: smoothed loss > max of the healthy runs' smoothed losses + 0.1 ...
ENVELOPE_STEPS = 10  # ... for 10 consecutive steps
ATTN_BLOWUP = 20.0  # context only: attention logit bound >= 20 x its step-1..10 median
# (10x is too low here: a healthy lr 3e-3 run without qk_layernorm drifts from ~4 to ~50)
RULE = (f"diverged = loss RISE (trailing-{SMOOTH} mean >= its running min + {RISE} for {RISE_STEPS}+ steps) "
        f"or DEGRADED (mean of last {TAIL} losses >= best run of the same seed + {GAP}); "
        f"divergence step = first step of the rise, else first step of {ENVELOPE_STEPS}+ steps with the smoothed "
        f"loss > the healthy runs' envelope (per-step max, same seed) + {ENVELOPE}. "
        f"Attention blow-up (bound >= {ATTN_BLOWUP:g}x its step 1-10 median) is context, not ground truth.")


@dataclass
class Run:
    spec: runs.RunSpec
    path: Path
    records: list[StepRecord]
    loss: np.ndarray = field(init=False)
    steps: np.ndarray = field(init=False)
    attn: np.ndarray = field(init=False)  # max over attention modules per step
    smooth: np.ndarray = field(init=False)  # NaN for the first SMOOTH-1 steps
    final_loss: float = math.nan
    rise_step: int | None = None
    diverged: bool = False
    kind: str = ""
    div_step: int | None = None
    attn_blowup_step: int | None = None
    findings: dict[str, list[Finding]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.steps = np.array([r.step for r in self.records])
        self.loss = np.array([r.values.get("loss", math.nan) for r in self.records])
        keys = [k for k in self.records[0].values if k.split("/")[0] in (ATTN_LOGIT_MAX, ATTN_LOGIT_LSE)]
        self.attn = np.array([np.nanmax([r.values.get(k, math.nan) for k in keys]) for r in self.records])
        finite = np.where(np.isfinite(self.loss), self.loss, np.inf)  # a NaN loss counts as +inf
        c = np.convolve(finite, np.ones(SMOOTH) / SMOOTH, mode="valid")
        self.smooth = np.concatenate([np.full(SMOOTH - 1, np.nan), c])
        self.final_loss = float(np.mean(finite[-TAIL:]))


def _first_run(mask: np.ndarray, length: int) -> int | None:
    """Index of the first `length` consecutive True values."""
    n = 0
    for i, m in enumerate(mask):
        n = n + 1 if m else 0
        if n >= length:
            return i - length + 1
    return None


def label(all_runs: list[Run]) -> None:
    """Apply RULE (module constants) to every run, in place."""
    for r in all_runs:
        s = r.smooth[SMOOTH - 1:]
        i = _first_run(s >= np.minimum.accumulate(s) + RISE, RISE_STEPS)
        r.rise_step = None if i is None else int(r.steps[SMOOTH - 1 + i])
        base = np.median(r.attn[:10])
        j = _first_run(r.attn >= ATTN_BLOWUP * base, 1)
        r.attn_blowup_step = None if j is None else int(r.steps[j])
    for seed in sorted({r.spec.seed for r in all_runs}):
        group = [r for r in all_runs if r.spec.seed == seed]
        best = min(r.final_loss for r in group)
        for r in group:
            degraded = r.final_loss >= best + GAP
            r.diverged = r.rise_step is not None or degraded
            r.kind = "rise" if r.rise_step is not None else ("degraded" if degraded else "")
        healthy = [r for r in group if not r.diverged]
        if not healthy:
            continue
        envelope = np.fmax.reduce(np.stack([h.smooth for h in healthy]), axis=0)  # NaN-skipping max
        for r in group:
            if not r.diverged:
                continue
            k = _first_run(np.nan_to_num(r.smooth - envelope, nan=-np.inf) > ENVELOPE, ENVELOPE_STEPS)
            dep = None if k is None else int(r.steps[k])
            found = [x for x in (r.rise_step, dep) if x is not None]
            r.div_step = min(found) if found else None


# --- detectors ---------------------------------------------------------------------------------

def detectors() -> dict[str, Callable[[], DetectorBank | PeerBank]]:
    """Fresh detector sets by name; each replays one run from its first record."""
    out = {"ours/default": lambda: DetectorBank(BankConfig()),
           "ours/short-run": lambda: DetectorBank(BankConfig.from_dict(SHORT_RUN))}
    for name in PEERS:
        out[name] = partial(PeerBank, name)
    return out


def replay_all(all_runs: list[Run]) -> None:
    for r in all_runs:
        for name, build in detectors().items():
            r.findings[name] = build().observe_many(r.records)


def score(all_runs: list[Run], det: str, signal: str | None) -> dict:
    """caught / n_diverging, false alarms per 10k healthy steps, lead = div_step - first detection."""
    div = [r for r in all_runs if r.diverged]
    ok = [r for r in all_runs if not r.diverged]
    pick = (lambda fs: fs) if signal is None else (lambda fs: [f for f in fs if f.signal.value == signal])
    leads, caught, early = [], 0, 0
    for r in div:
        fs = pick(r.findings[det])
        if not fs:
            continue
        caught += 1
        first = min(f.detect_step for f in fs)
        if r.div_step is not None:
            leads.append(r.div_step - first)
            early += r.div_step - first > 0
    healthy_steps = sum(len(r.records) for r in ok)
    alarms = sum(len(pick(r.findings[det])) for r in ok)
    # Findings on several modules at one step are one alarm to whoever is paged.
    alarm_steps = sum(len({f.detect_step for f in pick(r.findings[det])}) for r in ok)
    flagged = sum(1 for r in ok if pick(r.findings[det]))
    return {
        "caught": caught, "n_diverging": len(div), "caught_before_divergence": early,
        "false_alarms": alarms, "healthy_steps": healthy_steps,
        "false_alarms_per_10k": round(1e4 * alarms / healthy_steps, 1) if healthy_steps else None,
        "false_alarm_steps_per_10k": round(1e4 * alarm_steps / healthy_steps, 1) if healthy_steps else None,
        "healthy_runs_flagged": flagged, "n_healthy": len(ok),
        "lead_median": statistics.median(leads) if leads else None, "lead_min": min(leads) if leads else None,
    }


# --- driver --------------------------------------------------------------------------------------

def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/divbench", help="where the run JSONL files go")
    ap.add_argument("--reuse", action="store_true", help="serve runs from --out when settings and code match")
    ap.add_argument("--quick", action="store_true", help="1 seed instead of 3 (~2 minutes)")
    ap.add_argument("--seeds", type=int, default=None, help="seeds per (LR, qk_layernorm); default 3, --quick 1")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lrs", default="1e-3,3e-3,3e-2,1e-1", help="peak LRs, comma-separated")
    ap.add_argument("--jobs", type=int, default=2, help="runs trained side by side, one torch thread each")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    args = ap.parse_args()
    if args.seeds is None:
        args.seeds = 1 if args.quick else 3
    return args


def train_grid(specs: list[runs.RunSpec], out: Path, reuse: bool, jobs: int) -> tuple[int, float]:
    todo = [s for s in specs if not (reuse and runs.cached(out, s))]
    t0 = time.perf_counter()
    if todo:
        work = [(asdict(s), str(out)) for s in todo]
        if jobs > 1:
            with mp.get_context("spawn").Pool(min(jobs, len(todo))) as pool:
                for i, meta in enumerate(pool.imap_unordered(runs.train_job, work), 1):
                    print(f"  trained {i}/{len(todo)}: {runs.RunSpec(**meta['spec']).name} ({meta['train_s']:.0f} s)",
                          file=sys.stderr, flush=True)
        else:
            for w in work:
                runs.train_job(w)
    return len(todo), time.perf_counter() - t0


def _fmt(x, nd=0) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def main() -> None:
    args = parse()
    t_start = time.perf_counter()
    out = Path(args.out)
    lrs = [float(x) for x in args.lrs.split(",")]
    specs = [runs.RunSpec(peak_lr=lr, qk_layernorm=qk, seed=s, steps=args.steps)
             for s in range(args.seeds) for lr in lrs for qk in (False, True)]
    n_trained, train_s = train_grid(specs, out, args.reuse, args.jobs)

    t_replay = time.perf_counter()
    all_runs = []
    for s in specs:
        path = runs.paths(out, s)[0]
        all_runs.append(Run(s, path, [rec for _, rec in read_records(path)]))  # the reader `thermowatch replay` uses
    label(all_runs)
    replay_all(all_runs)
    replay_s = time.perf_counter() - t_replay

    rows: dict[str, dict] = {}
    for det in ("ours/default", "ours/short-run"):
        rows[f"{det} (any signal)"] = score(all_runs, det, None)
        for sig in SIGNALS:
            rows[f"{det} {sig}"] = score(all_runs, det, sig)
    for det in PEERS:
        rows[det] = score(all_runs, det, None)
    wall_s = time.perf_counter() - t_start
    command = "python bench/" + Path(sys.argv[0]).name + "".join(f" {a}" for a in sys.argv[1:])

    spec0 = specs[0]
    print(f"Divergence benchmark: {len(all_runs)} real runs (GPT {spec0.n_layer}L d{spec0.d_model} h{spec0.n_head} "
          f"T{spec0.seq_len} B{spec0.batch}, {spec0.steps} steps, warmup {spec0.warmup_steps} then constant LR, "
          f"AdamW wd {spec0.weight_decay}, clip {spec0.grad_clip}, fp32 master weights + bf16 autocast, stdlib bytes)")
    print(f"runs in {out} ({n_trained} trained in {train_s:.0f} s, {len(all_runs) - n_trained} reused); "
          f"replay of {len(detectors())} detector sets over {sum(len(r.records) for r in all_runs)} records: {replay_s:.1f} s")
    print(f"\nGROUND TRUTH: {RULE}\n")
    short = {"ours/default": "default", "ours/short-run": "short", "olmo_core": "olmo", "llm_foundry": "foundry",
             "megatron_lm": "megatron"}
    print(f"{'run':<22}{'final':>7}{'gap':>7}{'rise':>6}{'max attn':>9}{f'x{ATTN_BLOWUP:g} @':>7}"
          f"{'diverged':>10}{'div @':>6}   first alarm: " + " ".join(f"{v:>8}" for v in short.values()))
    best = {s: min(r.final_loss for r in all_runs if r.spec.seed == s) for s in range(args.seeds)}
    for r in all_runs:
        s = r.smooth[SMOOTH - 1:]
        rise = float(np.max(s - np.minimum.accumulate(s)))
        first = [min((f.detect_step for f in r.findings[d]), default=None) for d in short]
        print(f"{r.spec.name[:-5]:<22}{r.final_loss:>7.3f}{r.final_loss - best[r.spec.seed]:>+7.2f}{rise:>6.2f}"
              f"{np.nanmax(r.attn):>9.0f}{_fmt(r.attn_blowup_step):>7}{(r.kind or 'no'):>10}{_fmt(r.div_step):>6}"
              f"{'':>16}" + " ".join(f"{_fmt(x):>8}" for x in first))
    n_div = sum(r.diverged for r in all_runs)
    print(f"\n{n_div} diverging, {len(all_runs) - n_div} healthy. lead = divergence step - first detection step "
          "(positive = before it); caught = any finding in a diverging run, whenever it came.\n")
    print(f"{'detector':<38}{'caught':>8}{'early':>7}{'FA/10k':>8}{'FA steps':>9}{'FA runs':>9}"
          f"{'lead med':>10}{'lead min':>10}")
    for name, m in rows.items():
        lead = m["lead_median"]
        print(f"{name:<38}{m['caught']:>4}/{m['n_diverging']:<3}{m['caught_before_divergence']:>7}"
              f"{_fmt(m['false_alarms_per_10k'], 1):>8}{_fmt(m['false_alarm_steps_per_10k'], 1):>9}"
              f"{m['healthy_runs_flagged']:>5}/{m['n_healthy']:<3}"
              f"{_fmt(float(lead), 1) if lead is not None else '-':>10}{_fmt(m['lead_min']):>10}")
    print(f"\nearly = caught before the divergence step; FA/10k = findings on healthy runs per 10k healthy steps "
          f"(one per module); FA steps = distinct steps with a finding, per 10k; FA runs = healthy runs with any finding."
          f"\nshort-run bank settings: {json.dumps(SHORT_RUN)}")
    print(f"command: {command}\nwall time: {wall_s:.0f} s (training {train_s:.0f} s, replay {replay_s:.1f} s)")
    if args.json:
        print(json.dumps({
            "bench": "divergence",
            "command": command,
            "wall_s": round(wall_s, 1),
            "train_s": round(train_s, 1),
            "replay_s": round(replay_s, 2),
            "runs_trained": n_trained,
            "ground_truth": RULE,
            "short_run_config": SHORT_RUN,
            "detectors": rows,
            "runs": [{"name": r.spec.name, "lr": r.spec.peak_lr, "qk_ln": r.spec.qk_layernorm, "seed": r.spec.seed,
                      "steps": r.spec.steps, "final_loss": round(r.final_loss, 4), "diverged": r.diverged,
                      "kind": r.kind, "spike_step": r.div_step, "rise_step": r.rise_step,
                      "attn_max": float(np.nanmax(r.attn)), "attn_blowup_step": r.attn_blowup_step,
                      "path": str(r.path)} for r in all_runs],
            "config": {k: v for k, v in vars(args).items() if k != "json"},
        }))


if __name__ == "__main__":
    main()
