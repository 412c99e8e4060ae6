"""`thermowatch simulate`'s output: a readable table, or one JSON object (--json)."""

from __future__ import annotations

import dataclasses
import json
from typing import TextIO

from thermowatch.supervisor.simulate.compare import SimReport


def print_table(rep: SimReport, out: TextIO) -> None:
    c = rep.config
    steps = c.days * 86_400 / c.step_s
    print(f"thermowatch simulate: {c.gpus} GPUs for {c.days:g} days, {c.step_s:g} s/step (~{steps / 1e3:.0f}k steps "
          f"if nothing fails), a checkpoint every {c.checkpoint_every} steps (save {c.save_s:g} s, load "
          f"{c.load_s:g} s, restart {c.restart_s:g} s, rollback in place {c.rollback_s:g} s), keep last {c.keep_last} + one per {c.keep_every} steps; "
          f"{c.divergences_per_step * 1e5:.1f} divergences per 100k steps (PaLM), rollback margin "
          f"{c.rollback_margin_steps} steps; {c.replicas} runs per row, seed {rep.seed}", file=out)
    print(f"detector figures: {rep.detector_source}\n", file=out)
    head = (f"{'crash rate':<10} {'strategy':<31}{'goodput':>8}{'± sd':>7}{'saving':>8}{'lost':>7}{'down':>7}"
            f"{'crashes':>8}{'diverg.':>8}{'rollb.':>7}{'false':>7}{'deep':>6}")
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rep.rows:
        print(f"{r.scenario:<10} {r.label:<31}{r.goodput:>8.3f}{r.goodput_sd:>7.3f}{r.save_frac:>8.3f}"
              f"{r.lost_frac:>7.3f}{r.down_frac:>7.3f}{r.crashes:>8.1f}{r.divergences:>8.1f}{r.rollbacks:>7.1f}"
              f"{r.false_actions:>7.1f}{r.deep_rollbacks:>6.1f}", file=out)
    print("\nsaving / lost / down: shares of the wall time spent saving checkpoints, training steps later thrown "
          "away, and noticing + restarting + loading; deep: rollbacks past the newest keep_last checkpoints.\n",
          file=out)
    print("checkpoint interval for the thermowatch policy (steps; C = save cost, M = mean time between restarts):",
          file=out)
    for rec in rep.recommendations:
        ret = (f"{rec.retention_steps:.0f}" if rec.retention_steps is not None
               else "none: with keep_last < 3 no interval keeps the target; raise keep_last")
        print(f"  {rec.scenario:<10} M {rec.mtbf_h:4.1f} h: Young/Daly sqrt(2CM) {rec.young_daly_steps:.0f}, retention "
              f"bound (lag + margin)/(K - 2) {ret}; analytic {rec.analytic_steps}: goodput {rec.analytic_goodput:.3f}; "
              f"simulated best {rec.best_steps}: {rec.best_goodput:.3f}; configured {c.checkpoint_every}: "
              f"{rec.configured_goodput:.3f}", file=out)
        print(f"  {'':<10} -> recommend a checkpoint every {rec.recommended_steps} steps "
              f"({rec.recommended_steps * c.step_s / 60:.0f} min)", file=out)


def to_json(rep: SimReport) -> str:
    return json.dumps({
        "config": dataclasses.asdict(rep.config), "seed": rep.seed, "detector_source": rep.detector_source,
        "rows": [dataclasses.asdict(r) for r in rep.rows],
        "recommendations": [dataclasses.asdict(r) for r in rep.recommendations],
    })
