"""Divergence detection on real training runs: our detectors and default policy against a fixed
QK-clip ceiling and three peer rules, on a grid that is hard to pass by tuning (issue 8).

The grid (bench/_divergence_grid.py): two architectures (LayerNorm + GELU; RMSNorm + ReLU^2),
three seeds each; healthy runs at several LRs (one of 1,500 steps with slow logit drift, a
cosine run whose logits rise to ~300 and fall back while the loss improves); logit growth at a
high constant LR; a late divergence after a long warm-up to a high LR; loss spikes from a mid-run
LR jump, with and without qk-LN; qk-LN at too high an LR (no logit growth). Each run trains once
(bench/_divergence_runs.py, cached as JSONL by settings and code fingerprint), then every
detector replays every run in seconds.

Scored, per detector signal and for the full default policy (DetectorBank(BankConfig()) and
PolicyConfig() through `thermowatch replay`'s decider): damaged runs acted on, acted on before
the damage, healthy runs acted on (goal 0), false actions per 10k healthy steps, lead against a
fixed ceiling of 100 on the runs whose logits crossed it before the damage (goal >= 0.9x), and
the damaged runs missed; on those runs also the rollback's reach (how far before the damage the
first act's rollback goes, against a ceiling action at the crossing). Peers (each finding of theirs counts as an action: they stop or flag):

  olmo_core     loss and grad_norm > mean + 6 std of the previous 128 steps
  llm_foundry   loss >= 2 x mean of the previous 100 steps for > 4 steps (or >= 10 persistently)
  megatron_lm   loss >= 10 x the max of the first 100 losses

    python bench/divergence.py [--reuse] [--seeds 3] [--archs ln-gelu,rms-relu2] [--json]
    python bench/divergence.py --reuse --drop-keys lr_peak_ahead   # as a trainer without the forecast
    python bench/divergence.py --reuse --thin attn=4,act=16,grad=16,update=10   # + as a budget reads it

`--thin` (repeatable; bench/_divergence_thin.py) replays the grid again with each thermometer group's
keys only on the steps its cadence reads (absent on the others, as the client sends them, issue 36)
and prints the default policy's figures side by side with the every-step reading's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import _divergence_envelope as envelope_rules
import _divergence_grid as grid_mod
import _divergence_runs as runs
import _divergence_thin as thinning

from thermowatch.monitors.contract import ATTN_LOGIT_LSE, ATTN_LOGIT_MAX, Finding, Outcome, Severity, StepRecord
from thermowatch.monitors.detectors import BankConfig, DetectorBank
from thermowatch.monitors.detectors.baselines import PeerBank
from thermowatch.monitors.envelope import Curve, behind_peers
from thermowatch.monitors.replay import read_records
from thermowatch.supervisor.decide.replay_policy import replay_decider

SIGNALS = ("attn_logit_growth", "attn_logit_ceiling", "loss_spike", "loss_degradation", "grad_spike", "non_finite",
           "lr_jump", "loss_grad_rise", "loss_behind_peers")
PEERS = ("olmo_core", "llm_foundry", "megatron_lm")
ACTS = ("rollback", "set_lr", "pause")
CEILING = 100.0  # the fixed reference: QK-clip tau (Kimi K2), Megatron-LM's --qk-clip

# --- ground truth (from the loss only) --------------------------------------------------------
SMOOTH = 10  # trailing mean over 10 steps: one noisy batch is ~0.1 nats here
RISE = 0.25  # RISE: smoothed loss >= its own running minimum + 0.25 nats ...
RISE_STEPS = 5  # ... for 5 consecutive steps
GAP = 0.25  # BEHIND: the gap to the best run of the same (architecture, seed) at the same step
GAP_STEPS = 10  # grew by 0.25 nats over its smallest value since GAP_FROM, for 10 steps
GAP_FROM = 200  # runs at different LRs separate in their first ~2 warm-ups; judged after it
RULE = (f"damaged = RISE (trailing-{SMOOTH} mean loss >= its running min + {RISE} for {RISE_STEPS}+ steps) or "
        f"BEHIND (gap to the lowest trailing-{SMOOTH} loss of the same architecture and seed at that step grew "
        f"by >= {GAP} over its smallest value since step {GAP_FROM}, for {GAP_STEPS}+ steps); damage step = the "
        "first step of either. Loss only: no detector, attention logit or gradient norm enters it.")


@dataclass
class Run:
    spec: runs.RunSpec
    path: Path
    records: list[StepRecord]
    loss: np.ndarray = field(init=False)
    steps: np.ndarray = field(init=False)
    attn: np.ndarray = field(init=False)  # max over attention modules per step
    smooth: np.ndarray = field(init=False)  # NaN for the first SMOOTH-1 steps
    rise_step: int | None = None
    behind_step: int | None = None
    div_step: int | None = None
    ceiling_step: int | None = None  # first step any attention logit >= CEILING
    findings: dict[str, list[Finding]] = field(default_factory=dict)
    decisions: list[tuple[Finding, dict]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.steps = np.array([r.step for r in self.records])
        self.loss = np.array([r.values.get("loss", math.nan) for r in self.records])
        keys = [k for k in self.records[0].values if k.split("/")[0] in (ATTN_LOGIT_MAX, ATTN_LOGIT_LSE)]
        # The trainer's budget (issue 36) reads attention every few steps: a record without its keys
        # is unread (-inf), not a crossing; a read that is NaN still counts as one.
        read = [[r.values[k] for k in keys if k in r.values] for r in self.records]
        self.attn = np.array([np.nanmax(v) if v else -np.inf for v in read])
        finite = np.where(np.isfinite(self.loss), self.loss, np.inf)  # a NaN loss counts as +inf
        c = np.convolve(finite, np.ones(SMOOTH) / SMOOTH, mode="valid")
        self.smooth = np.concatenate([np.full(SMOOTH - 1, np.nan), c])
        over = np.nonzero(np.nan_to_num(self.attn, nan=np.inf) >= CEILING)[0]
        self.ceiling_step = int(self.steps[over[0]]) if over.size else None

    @property
    def damaged(self) -> bool:
        return self.div_step is not None

    @property
    def label(self) -> str:
        return f"{self.spec.arch}/{self.spec.tag}/s{self.spec.seed}"


def _first_run(mask: np.ndarray, length: int) -> int | None:
    """Index of the first of `length` consecutive True values."""
    n = 0
    for i, m in enumerate(mask):
        n = n + 1 if m else 0
        if n >= length:
            return i - length + 1
    return None


def label(all_runs: list[Run]) -> None:
    """Apply RULE to every run, in place."""
    for r in all_runs:
        s = r.smooth[SMOOTH - 1:]
        i = _first_run(s >= np.minimum.accumulate(s) + RISE, RISE_STEPS)
        r.rise_step = None if i is None else int(r.steps[SMOOTH - 1 + i])
    groups: dict[tuple, list[Run]] = {}
    for r in all_runs:
        groups.setdefault((r.spec.arch, r.spec.seed), []).append(r)
    for group in groups.values():
        n = max(len(r.smooth) for r in group)
        padded = np.stack([np.concatenate([r.smooth, np.full(n - len(r.smooth), np.nan)]) for r in group])
        best = np.fmin.reduce(padded, axis=0)  # NaN-skipping min at each step
        for r in group:
            gap = r.smooth - best[:len(r.smooth)]
            start = int(np.searchsorted(r.steps, GAP_FROM))
            g = np.nan_to_num(gap[start:], nan=0.0, posinf=1e9)
            j = _first_run(g >= np.minimum.accumulate(g) + GAP, GAP_STEPS) if g.size else None
            r.behind_step = None if j is None else int(r.steps[start + j])
    for r in all_runs:
        found = [x for x in (r.rise_step, r.behind_step) if x is not None]
        r.div_step = min(found) if found else None


# --- replay --------------------------------------------------------------------------------------

def replay(r: Run, detectors: dict | None = None) -> None:
    bank = DetectorBank(BankConfig.from_dict(detectors))
    decide = replay_decider({})  # PolicyConfig() defaults, a checkpoint every 100 steps
    found = []
    for rec in r.records:
        for f in bank.observe(rec):
            found.append(f)
            r.decisions.append((f, decide(f)))
    r.findings["ours"] = found
    for name in PEERS:
        r.findings[name] = PeerBank(name).observe_many(r.records)


def _model(r: Run) -> tuple:
    return (r.spec.norm, r.spec.activation, r.spec.qk_layernorm)


def _curve(r: Run) -> Curve:
    return Curve(r.label, np.array([x.step for x in r.records]), r.loss,
                 np.array([x.values.get("lr", math.nan) for x in r.records]))


def envelope(all_runs: list[Run]) -> None:
    """supervisor.app.jobs.peer_envelope on the grid: every other run of the same model config is in
    the database already (a sweep); its finding joins the run's own (an alert that pages)."""
    curves = {id(r): _curve(r) for r in all_runs}
    for r in all_runs:
        peers = [curves[id(p)] for p in all_runs if p is not r and _model(p) == _model(r)]
        f = behind_peers(curves[id(r)], peers)
        if f is not None:
            r.findings["ours"].append(f)
            r.decisions.append((f, {"kind": "alert"}))


DEGRADED = 0.3  # nats: issue 24's "the final loss ends >= 0.3 nats behind"


def degraded(r: Run, all_runs: list[Run]) -> bool:
    """Not damaged by the ground truth, yet at its last step its trailing-10 loss stands >= 0.3
    nats above the lowest one, at that step, of the runs of its model config and seed (any LR)."""
    if r.damaged:
        return False
    k = len(r.records) - 1
    others = [o.smooth[k] for o in all_runs if o is not r and _model(o) == _model(r) and o.spec.seed == r.spec.seed
              and len(o.records) > k]
    return bool(others) and r.smooth[k] - min(others) >= DEGRADED


def _acts(r: Run, det: str) -> list[int]:
    """Steps at which `det` would change the run."""
    if det == "policy":
        return [f.detect_step for f, d in r.decisions if d.get("kind") in ACTS]
    if det in PEERS:
        return [f.detect_step for f in r.findings[det]]
    return [f.detect_step for f in r.findings["ours"] if f.signal.value == det and f.outcome is Outcome.ACT]


def _alerts(r: Run, det: str) -> list[int]:
    if det == "policy":
        return [f.detect_step for f, d in r.decisions if d.get("kind") in ACTS + ("alert",)]
    if det in PEERS:
        return _acts(r, det)
    return [f.detect_step for f in r.findings["ours"] if f.signal.value == det and f.outcome is not Outcome.WATCH]


def rollback_reach(r: Run) -> dict:
    """How far back the default policy's first action reaches, against a fixed ceiling of 100
    acting at the crossing: the onset each rolls back before (the policy takes the newest healthy
    checkpoint at or before onset - rollback_margin_steps), and the checkpoint each would load
    (the ceiling's first finding decided as `act` by the same policy, alone; None = no checkpoint
    that old, the policy pauses instead)."""
    first = next(((f, d) for f, d in r.decisions if d.get("kind") in ACTS), None)
    ceil = next((f for f in r.findings["ours"] if f.signal.value == "attn_logit_ceiling"), None)
    out = {"act_onset": first[0].onset_step if first else None, "target": first[1].get("to_step") if first else None,
           "ceiling_onset": ceil.onset_step if ceil else None, "ceiling_target": None}
    if ceil is not None:
        forced = dataclasses.replace(ceil, outcome=Outcome.ACT, severity=Severity.CRITICAL)
        out["ceiling_target"] = replay_decider({})(forced).get("to_step")
    return out


def target_lead(all_runs: list[Run]) -> list[dict]:
    """Per damaged run whose logits crossed the ceiling before the damage: the first act's lead
    and the rollback's reach (damage - act onset over damage - ceiling onset; 1.0 = the rollback
    goes back as far as a ceiling action at the crossing would have)."""
    out = []
    for r in all_runs:
        if not (r.damaged and r.ceiling_step is not None and r.ceiling_step < r.div_step):
            continue
        reach = rollback_reach(r)
        first = min(_acts(r, "policy"), default=None)
        a, c = reach["act_onset"], reach["ceiling_onset"]
        out.append({
            "run": r.label, "crossing": r.ceiling_step, "damage": r.div_step, "first_act": first,
            "act_lead": round((r.div_step - first) / (r.div_step - r.ceiling_step), 2) if first is not None else 0.0,
            **reach,
            "reach_lead": round((r.div_step - a) / (r.div_step - c), 2) if a is not None and c is not None else None,
        })
    return out


def score(all_runs: list[Run], det: str) -> dict:
    dmg = [r for r in all_runs if r.damaged]
    ok = [r for r in all_runs if not r.damaged]
    caught, early, missed, ratios = 0, 0, [], []
    for r in dmg:
        acts = _acts(r, det)
        if not acts:
            missed.append(r.label)
            continue
        caught += 1
        first = min(acts)
        early += first < r.div_step
        if r.ceiling_step is not None and r.ceiling_step < r.div_step:
            ratios.append((r.div_step - first) / (r.div_step - r.ceiling_step))
    logit_runs = [r for r in dmg if r.ceiling_step is not None and r.ceiling_step < r.div_step]
    healthy_steps = sum(len(r.records) for r in ok)
    false_acts = sum(len(set(_acts(r, det))) for r in ok)
    return {
        "caught": caught, "n_damaged": len(dmg), "caught_before_damage": early,
        "alerted": sum(1 for r in dmg if _alerts(r, det)),
        "healthy_acted_on": sum(1 for r in ok if _acts(r, det)), "n_healthy": len(ok),
        "healthy_alerted": sum(1 for r in ok if _alerts(r, det)),
        "false_actions_per_10k": round(1e4 * false_acts / healthy_steps, 2) if healthy_steps else None,
        # Lead vs the fixed ceiling, on damaged runs whose logits crossed 100 before the damage;
        # a run not acted on counts as 0 (no lead at all).
        "lead_vs_ceiling_runs": len(logit_runs),
        "lead_ratio_min": round(min(ratios + [0.0] * (len(logit_runs) - len(ratios))), 2) if logit_runs else None,
        "lead_ratio_median": round(statistics.median(ratios + [0.0] * (len(logit_runs) - len(ratios))), 2)
        if logit_runs else None,
        "lead_ratio_ge_0.9": sum(1 for x in ratios if x >= 0.9),
        "missed": missed,
    }


# --- driver --------------------------------------------------------------------------------------

def _has_arch_options() -> bool:
    from thermowatch.trainer.model import GPTConfig

    names = {f.name for f in dataclasses.fields(GPTConfig)}
    return {"norm", "activation"} <= names


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/divbench", help="where the run JSONL files go")
    ap.add_argument("--reuse", action="store_true", help="serve runs from --out when settings and code match")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--archs", default=None, help="comma-separated, from " + ",".join(grid_mod.ARCHS)
                    + " (default: both, or ln-gelu where trainer.model lacks the norm/activation options)")
    ap.add_argument("--jobs", type=int, default=2, help="runs trained side by side, one torch thread each")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    ap.add_argument("--drop-keys", default="", metavar="KEYS",
                    help="comma-separated record keys removed before the replay, e.g. lr_peak_ahead: the grid as "
                         "a trainer that does not send the schedule's forecast (issue 24, items 4 and 6)")
    ap.add_argument("--thin", action="append", default=[], metavar="GROUP=EVERY,...",
                    help="also replay the grid with each group's keys only on the steps its cadence reads, e.g. "
                         "attn=4,act=16,grad=16,update=10 (groups: " + ", ".join(thinning.GROUPS) + "; repeatable), "
                         "and print the default policy's figures side by side with every-step reading")
    ap.add_argument("--detectors", default=None, metavar="JSON",
                    help='detector settings that differ from the defaults, as in the supervisor config\'s '
                         '`detectors:` section, e.g. \'{"witness": {"lr_rise": 3}}\' (default: the defaults)')
    args = ap.parse_args()
    if args.archs is None:
        args.archs = ",".join(grid_mod.ARCHS) if _has_arch_options() else "ln-gelu"
    bad = set(args.archs.split(",")) - set(grid_mod.ARCHS)
    if bad:
        ap.error(f"unknown --archs {sorted(bad)}; choose from {sorted(grid_mod.ARCHS)}")
    try:
        args.thin = [thinning.parse_thin(t) for t in args.thin]
    except ValueError as e:
        ap.error(str(e))
    return args


def train_grid(specs: list[runs.RunSpec], out: Path, reuse: bool, jobs: int) -> tuple[int, float]:
    todo = sorted((s for s in specs if not (reuse and runs.cached(out, s))), key=lambda s: -s.steps)
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


def replay_grid(specs: list[runs.RunSpec], out: Path, drop: list[str], every: dict[str, int],
                detectors: dict | None) -> list[Run]:
    """Read the cached runs, remove the `drop` keys and thin the groups of `every`
    (_divergence_thin.py), label, replay, add the peer envelope."""
    all_runs = [Run(s, runs.paths(out, s)[0], [rec for _, rec in read_records(runs.paths(out, s)[0])]) for s in specs]
    # After Run(): its crossing of the ceiling (ceiling_step) is the every-step reading's, so the
    # lead of a thinned reading is measured against the same reference. Before label(): the
    # ground truth reads the loss only, never these keys.
    for r in all_runs:
        for rec in r.records:
            for k in drop:
                rec.values.pop(k, None)
        if every:
            thinning.thin(r.records, every)
    label(all_runs)
    for r in all_runs:
        replay(r, detectors)
    envelope(all_runs)
    return all_runs


def side_by_side(readings: list[tuple[str, list[Run]]]) -> dict:
    """The default policy on each reading of the same runs: its figures, then per run where the
    readings differ or the run is damaged, the first act of each."""
    print("\nThe default policy, every step against thinned readings (bench/_divergence_thin.py: a group's keys "
          "only on the steps with step % EVERY == 0, absent on the others; lead against the every-step crossing)")
    w = max(24, *(len(name) + 2 for name, _ in readings))
    print(f"{'reading':<{w}}{'acted':>8}{'before':>7}{'healthy acted':>14}{'FA/10k':>8}{'lead min':>9}{'median':>7}"
          f"{'>=0.9':>7}  missed")
    rows = {}
    for name, rs in readings:
        m = rows[name] = score(rs, "policy")
        print(f"{name:<{w}}{m['caught']:>4}/{m['n_damaged']:<3}{m['caught_before_damage']:>7}"
              f"{m['healthy_acted_on']:>9}/{m['n_healthy']:<4}{_fmt(m['false_actions_per_10k']):>8}"
              f"{_fmt(m['lead_ratio_min']):>9}{_fmt(m['lead_ratio_median']):>7}"
              f"{m['lead_ratio_ge_0.9']:>4}/{m['lead_vs_ceiling_runs']:<2} {', '.join(m['missed']) or '-'}")
    base = readings[0][1]
    first = {name: [min(_acts(r, "policy"), default=None) for r in rs] for name, rs in readings}
    print("\nfirst act per run (damaged runs, and any run where the readings differ); "
          + "; ".join(f"[{i}] {name}" for i, (name, _) in enumerate(readings)))
    print(f"{'run':<32}{'cross@':>7}{'damage@':>8}" + "".join(f"{f'[{i}]':>8}" for i in range(len(readings))))
    per_run = []
    for j, r in enumerate(base):
        acts = [first[name][j] for name, _ in readings]
        if not r.damaged and len(set(acts)) == 1:
            continue
        per_run.append({"run": r.label, "crossing": r.ceiling_step, "damage": r.div_step, "first_act": acts})
        print(f"{r.label:<32}{_fmt(r.ceiling_step):>7}{_fmt(r.div_step):>8}" + "".join(f"{_fmt(a):>8}" for a in acts))
    return {"policy": rows, "runs": per_run}


def _fmt(x, nd=2) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def main() -> None:
    args = parse()
    t_start = time.perf_counter()
    out = Path(args.out)
    specs = grid_mod.grid(args.seeds, args.archs.split(","))
    n_trained, train_s = train_grid(specs, out, args.reuse, args.jobs)

    t_replay = time.perf_counter()
    drop = [k for k in args.drop_keys.split(",") if k]
    detectors = json.loads(args.detectors) if args.detectors else None
    all_runs = replay_grid(specs, out, drop, {}, detectors)
    replay_s = time.perf_counter() - t_replay

    dets = ["policy", *SIGNALS, *PEERS]
    rows = {d: score(all_runs, d) for d in dets}
    wall_s = time.perf_counter() - t_start
    command = "python bench/" + Path(sys.argv[0]).name + "".join(f" {a}" for a in sys.argv[1:])
    n_records = sum(len(r.records) for r in all_runs)
    s0 = specs[0]
    print(f"Divergence benchmark: {len(all_runs)} real runs, archs {args.archs}, {args.seeds} seeds (GPT {s0.n_layer}L "
          f"d{s0.d_model} h{s0.n_head} T{s0.seq_len} B{s0.batch}, AdamW wd {s0.weight_decay}, clip {s0.grad_clip}, fp32, "
          f"stdlib bytes), {n_records} steps")
    print(f"runs in {out} ({n_trained} trained in {train_s:.0f} s, {len(all_runs) - n_trained} reused); replay "
          f"{replay_s:.1f} s\n\nGROUND TRUTH: {RULE}\n")
    print(f"{'run':<30}{'steps':>6}{'final':>7}{'max attn':>9}{'>=100 @':>8}{'damage @':>9}{'(rise/behind)':>14}"
          f"{'first act':>10}{'first alert':>12}")
    for r in all_runs:
        acts, alerts = _acts(r, "policy"), _alerts(r, "policy")
        kind = "/".join(str(x) if x is not None else "-" for x in (r.rise_step, r.behind_step))
        print(f"{r.label:<30}{len(r.records):>6}{float(np.mean(r.loss[-30:])):>7.3f}{np.nanmax(r.attn):>9.0f}"
              f"{_fmt(r.ceiling_step):>8}{_fmt(r.div_step):>9}{kind:>14}{_fmt(min(acts, default=None)):>10}"
              f"{_fmt(min(alerts, default=None)):>12}")
    n_dmg = sum(r.damaged for r in all_runs)
    print(f"\n{n_dmg} damaged, {len(all_runs) - n_dmg} healthy ({sum(len(r.records) for r in all_runs if not r.damaged)} "
          f"healthy steps). 'policy' = the full default policy's rollback/lower-LR/pause decisions; a signal row counts "
          "its findings with outcome act; peers: every finding.\n")
    print(f"{'detector':<20}{'acted':>8}{'before':>7}{'alerted':>8}{'healthy acted':>14}{'FA/10k':>8}"
          f"{'healthy alerted':>16}{'lead/ceiling min':>17}{'median':>7}{'>=0.9':>7}")
    for name, m in rows.items():
        print(f"{name:<20}{m['caught']:>4}/{m['n_damaged']:<3}{m['caught_before_damage']:>7}{m['alerted']:>8}"
              f"{m['healthy_acted_on']:>9}/{m['n_healthy']:<4}{_fmt(m['false_actions_per_10k']):>8}"
              f"{m['healthy_alerted']:>11}/{m['n_healthy']:<4}{_fmt(m['lead_ratio_min']):>17}"
              f"{_fmt(m['lead_ratio_median']):>7}{m['lead_ratio_ge_0.9']:>4}/{m['lead_vs_ceiling_runs']:<2}")
    print(f"\nmissed by the default policy: {', '.join(rows['policy']['missed']) or 'none'}")
    deg = [r for r in all_runs if degraded(r, all_runs)]
    calm = [r for r in all_runs if not r.damaged and r not in deg]
    paged = lambda r: bool(_alerts(r, "loss_behind_peers"))  # noqa: E731
    degradation = {"degraded": [r.label for r in deg], "degraded_alerted": sum(map(paged, deg)),
                   "other_healthy_alerted": [r.label for r in calm if paged(r)], "n_other_healthy": len(calm)}
    print(f"degraded (healthy by the ground truth, the last trailing-10 loss >= {DEGRADED} nats behind a run of the "
          f"same model and seed): {len(deg)}; alerted by loss_behind_peers: {degradation['degraded_alerted']}/{len(deg)}"
          f"; the other healthy runs alerted by it: {len(degradation['other_healthy_alerted'])}/{len(calm)} "
          f"{degradation['other_healthy_alerted'] or ''}")
    # The envelope's rule before issue 39 beside today's: degraded = the runs above and the damaged
    # runs no act caught (no-growth: only the envelope pages them).
    rules = envelope_rules.compare([envelope_rules.Judged(
        r.label, _model(r), _curve(r), "degraded" if r in deg or (r.damaged and not _acts(r, "policy"))
        else "damaged" if r.damaged else "healthy") for r in all_runs])
    tl = target_lead(all_runs)
    print("\nRuns whose logits crossed 100 before the damage. act lead = (damage - first act) / (damage - "
          "crossing); reach = (damage - onset the first act rolls back before) / (damage - onset of the ceiling's "
          "finding at the crossing): 1.00 = the rollback reaches back as far as a ceiling action would. Targets: "
          "the checkpoint each would load (a checkpoint every 100 steps, margin 100; '-' = none that old: pause)")
    print(f"{'run':<30}{'cross@':>7}{'damage@':>8}{'act@':>6}{'act lead':>9}{'onset':>6}{'ceil onset':>11}"
          f"{'reach':>7}{'target':>7}{'ceil target':>12}")
    for t in tl:
        print(f"{t['run']:<30}{t['crossing']:>7}{t['damage']:>8}{_fmt(t['first_act']):>6}{t['act_lead']:>9.2f}"
              f"{_fmt(t['act_onset']):>6}{_fmt(t['ceiling_onset']):>11}{_fmt(t['reach_lead']):>7}"
              f"{_fmt(t['target']):>7}{_fmt(t['ceiling_target']):>12}")
    compared = None
    if args.thin:
        t_thin = time.perf_counter()
        readings = [("every step", all_runs)] + [(thinning.describe(e), replay_grid(specs, out, drop, e, detectors))
                                                 for e in args.thin]
        compared = side_by_side(readings)
        replay_s += time.perf_counter() - t_thin
        wall_s = time.perf_counter() - t_start
    print(f"command: {command}\nwall time: {wall_s:.0f} s (training {train_s:.0f} s, replay {replay_s:.1f} s)")
    summary = json.dumps({
        "bench": "divergence", "command": command, "wall_s": round(wall_s, 1), "train_s": round(train_s, 1),
        "replay_s": round(replay_s, 2), "runs_trained": n_trained, "ground_truth": RULE, "detectors": rows,
        "target_lead": tl, "degradation": degradation, "envelope_rules": rules,
        # The every-step figures above stay what `thermowatch simulate` reads; the thinned ones beside.
        "thinned": compared,
        "runs": [{"name": r.spec.name, "label": r.label, "steps": len(r.records), "damage_step": r.div_step,
                  "rise_step": r.rise_step, "behind_step": r.behind_step, "ceiling_step": r.ceiling_step,
                  "attn_max": float(np.nanmax(r.attn)), "first_act": min(_acts(r, "policy"), default=None),
                  "path": str(r.path)} for r in all_runs],
        "config": {k: v for k, v in vars(args).items() if k != "json"},
    })
    # Cached beside the runs: `thermowatch simulate` reads its false-action rate, miss rate and
    # detection lag from here (supervisor/simulate/config.py, divergence_json).
    (out / "divergence.json").write_text(summary + "\n")
    if args.json:
        print(summary)


if __name__ == "__main__":
    main()
