"""The strategies side by side, and the checkpoint interval to recommend.

Every strategy meets the same crashes and divergences (replica i of every row uses the seed
(seed, i); each random process has its own stream), so the differences between rows are the
strategies', not the dice's.

The interval: Young (1974) / Daly (2006) put the optimum at sqrt(2 C M) for a save cost C and a
mean time between failures M. A divergence costs what a crash costs plus a constant (the
detection lag and the margin before the onset), so it enters M like a crash does, and so does a
false action. Two things move the optimum off that formula: the rollback must reach a checkpoint
at or before onset - margin, detected `detect_steps` after the onset, and retention keeps only
the newest K (plus one per keep_every span). At detection the newest checkpoint can be up to
lag steps after the onset and the target up to one interval before onset - margin, so the
target is always among the newest K only if (K - 2) x interval >= detect_steps + margin;
otherwise it may have been pruned and the rollback falls back to a span checkpoint, thousands
of steps back. So the analytic recommendation is max(Young/Daly, (detect_steps + margin) /
(K - 2)) (no interval guarantees it with K < 3), and the simulation sweeps intervals around it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from thermowatch.supervisor.simulate.config import DetectorFigures, SimConfig, detector_figures
from thermowatch.supervisor.simulate.engine import RunResult, Strategy, run_once


def strategies(figs: dict[str, DetectorFigures]) -> list[Strategy]:
    return [
        Strategy("supervisor", "thermowatch policy", True, figs["policy"]),
        Strategy("olmo_rule", "auto rollback, OLMo-core rule", True, figs["olmo_core"]),
        Strategy("crash_only", "restart on crash only", True, None),
        Strategy("human", "a person restarts by hand", False, None),
    ]


@dataclass
class Row:
    scenario: str
    strategy: str
    label: str
    goodput: float  # mean over replicas
    goodput_sd: float
    save_frac: float  # shares of the wall time (means)
    lost_frac: float
    down_frac: float
    crashes: float
    divergences: float
    rollbacks: float
    false_actions: float
    deep_rollbacks: float


@dataclass
class Recommendation:
    scenario: str
    mtbf_h: float  # mean time between events that cost a restart (crash, divergence, false action)
    young_daly_steps: float  # sqrt(2 C M) / step_s
    retention_steps: float | None  # (detect_steps + margin) / (keep_last - 2): the rollback always finds its target
    analytic_steps: int  # max of the two
    analytic_goodput: float  # simulated at analytic_steps
    recommended_steps: int  # analytic_steps, or the simulated best where retention cannot be met (keep_last < 3)
    best_steps: int  # the simulated optimum over the sweep (noisy where the curve is flat)
    best_goodput: float
    configured_goodput: float  # at cfg.checkpoint_every, for comparison
    curve: list[tuple[int, float]]  # (interval, mean goodput) over the sweep


@dataclass
class SimReport:
    config: SimConfig
    seed: int
    detector_source: str
    rows: list[Row]
    recommendations: list[Recommendation]


def runs(cfg: SimConfig, strategy: Strategy, crash_rate_s: float, every: int, seed: int) -> list[RunResult]:
    """cfg.replicas runs, replica i with the seed (seed, i): the same failures for every strategy."""
    return [run_once(cfg, strategy, crash_rate_s, every, (seed, i)) for i in range(cfg.replicas)]


def _row(scenario: str, strategy: Strategy, results: list[RunResult], wall: float) -> Row:
    g = np.array([r.goodput for r in results])

    def mean(attr: str) -> float:
        return float(np.mean([getattr(r, attr) for r in results]))

    return Row(scenario, strategy.name, strategy.label, float(g.mean()), float(g.std()),
               mean("save_s") / wall, mean("lost_s") / wall, mean("down_s") / wall, mean("crashes"),
               mean("divergences"), mean("rollbacks"), mean("false_actions"), mean("deep_rollbacks"))


def young_daly_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum sqrt(2 C M) (Daly's refinement differs by < C when C << M)."""
    return math.sqrt(2.0 * save_s * mtbf_s)


def recommend(cfg: SimConfig, strategy: Strategy, scenario: str, crash_rate_s: float, seed: int) -> Recommendation:
    det = strategy.detector
    fa_per_step = det.false_actions_per_10k / 1e4 if det else 0.0
    rate_s = crash_rate_s + (cfg.divergences_per_step + fa_per_step) / cfg.step_s
    mtbf_s = 1.0 / rate_s if rate_s > 0 else math.inf
    yd = young_daly_s(cfg.save_s, mtbf_s) / cfg.step_s
    lag = det.detect_steps if det else 0
    ret = (lag + cfg.rollback_margin_steps) / (cfg.keep_last - 2) if cfg.keep_last > 2 and det else None
    analytic = max(yd, ret or 0.0)
    if not math.isfinite(analytic):  # no failures at all: the longest interval wins; show the configured one
        analytic = float(cfg.checkpoint_every)
    analytic = max(1, round(analytic))
    grid = sorted({max(1, round(x)) for x in np.geomspace(analytic / 3, analytic * 3, cfg.sweep_points)} | {analytic})
    curve = [(every, float(np.mean([r.goodput for r in runs(cfg, strategy, crash_rate_s, every, seed)])))
             for every in grid]
    best, best_g = max(curve, key=lambda c: c[1])
    at_analytic = dict(curve)[analytic]
    configured = float(np.mean([r.goodput for r in runs(cfg, strategy, crash_rate_s, cfg.checkpoint_every, seed)]))
    recommended = analytic if ret is not None or det is None else best
    return Recommendation(scenario, mtbf_s / 3600.0, yd, ret, analytic, at_analytic, recommended, best, best_g,
                          configured, curve)


def simulate(cfg: SimConfig, seed: int = 0) -> SimReport:
    figs = detector_figures(cfg)
    wall = cfg.days * 86_400.0
    rows, recs = [], []
    for scenario, rate in cfg.scenarios().items():
        for strat in strategies(figs):
            rows.append(_row(scenario, strat, runs(cfg, strat, rate, cfg.checkpoint_every, seed), wall))
        recs.append(recommend(cfg, strategies(figs)[0], scenario, rate, seed))
    return SimReport(cfg, seed, figs["policy"].source, rows, recs)
