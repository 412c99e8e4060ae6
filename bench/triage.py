"""Replay triage's three causes, each made real on CPU, through both trainers (issue 39 item 1).

Each row is a run with one fault, the embedded supervisor on SQLite, precise skip with triage on:

- thermowatch.watch: a user's nanoGPT loop (tests/client/test_replay_triage.py's `train`, the
  faults of tests/client/faults.py: a gradient element's exponent bits stuck at one once; a
  poisoned sample range; the base LR x300 from a step on);
- the bundled trainer: the RunController on real DeepSpeed (tests/faults/test_replay_triage.py's
  `train`, the fault drills of TrainConfig.faults: one activation NaN in rank 1's forward once,
  on 2 Ray ranks; a poisoned sample range; the LR x300 from a step on), in-process for one rank.

For each: the verdict (and the rank it names), what was done (samples skipped, the LR cut, the
restart asked without a node), the replays' steps and seconds, the whole search's, the run's wall
time.

    python bench/triage.py [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thermowatch.monitors.commands import CommandKind  # noqa: E402
from thermowatch.monitors.contract import Ack  # noqa: E402


def _row(trainer: str, fault: str, acts: list, wall: float) -> dict:
    rb = next(a for a in acts if a.kind is CommandKind.ROLLBACK)
    b = Ack.from_json(rb.result).bisected
    c = b.cause if b is not None else None
    skipped = sum(hi - lo for lo, hi in rb.result["skip_ranges"])
    after = [a for a in acts if a.id > rb.id and a.incident_id == rb.incident_id]
    done = [f"skipped {skipped} samples" if skipped else "skipped nothing"]
    done += [f"LR x{a.args['lr_multiplier']:g} ({a.state.value})" for a in after if a.kind is CommandKind.SET_LR]
    done += [f"restart without rank {a.args['exclude_rank']} ({a.state.value})" for a in after
             if a.kind is CommandKind.ROLLBACK and a.args.get("exclude_rank") is not None]
    return {"trainer": trainer, "fault": fault, "verdict": c.label if c else None, "rank": c.rank if c else None,
            "done": "; ".join(done), "replay_steps": c.steps if c else 0, "replay_s": c.seconds if c else 0.0,
            "search_probes": b.probes if b else 0, "search_steps": b.steps if b else 0,
            "search_s": b.seconds if b else 0.0, "outcome": b.outcome if b else None, "wall_s": round(wall, 1)}


def client_rows(tmp: Path) -> list[dict]:
    from tests.client import test_replay_triage as t
    from tests.client.faults import Faults

    cases = [("hardware: a gradient exponent stuck at one, once", Faults(grad_step=t.AT), None),
             ("data: 2 steps of random bytes", Faults(poison=range((t.AT - 1) * t.B, (t.AT + 1) * t.B)), None),
             ("optimizer: LR x300 from a step on", Faults(lr_step=t.AT, lr_factor=300.0),
              {"lr_factor": 0.005, "min_lr_multiplier": 0.001})]
    rows = []
    for i, (name, faults, policy) in enumerate(cases):
        d = tmp / f"client{i}"
        d.mkdir()
        t0 = time.perf_counter()
        acts, _, _ = t.train(SimpleNamespace(url=f"sqlite:///{d}/db.sqlite"), d, f"c{i}", faults, policy)
        rows.append(_row("thermowatch.watch", name, acts, time.perf_counter() - t0))
    return rows


def bundled_rows(tmp: Path) -> list[dict]:
    from tests.faults import test_replay_triage as t
    from tests.trainer.conftest import init_local_ray

    init_local_ray()
    cases = [("hardware: one NaN in rank 1's forward, once (2 Ray ranks)", {"flip_step": t.AT, "flip_rank": 1}, 2,
              {"restart_without_outlier": True}),
             ("data: 2 steps of random tokens", {"poison": [(t.AT - 1) * t.B, (t.AT + 1) * t.B]}, 1, None),
             ("optimizer: LR x300 from a step on", {"lr_step": t.AT, "lr_factor": 300.0}, 1,
              {"lr_factor": 0.01, "min_lr_multiplier": 0.001})]
    rows = []
    for i, (name, faults, world, policy) in enumerate(cases):
        d = tmp / f"bundled{i}"
        d.mkdir()
        t0 = time.perf_counter()
        _, acts, _, _, _, _ = t.train(SimpleNamespace(url=f"sqlite:///{d}/db.sqlite"), d, f"b{i}", faults,
                                      world_size=world, policy=policy)
        rows.append(_row("bundled trainer", name, acts, time.perf_counter() - t0))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory() as tmp:
        rows = client_rows(Path(tmp)) + bundled_rows(Path(tmp))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    print("| trainer | fault | verdict | what was done | replays: steps, s | search: probes, steps, s | run wall s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        verdict = f"{r['verdict']}" + (f", rank {r['rank']}" if r["rank"] is not None else "")
        print(f"| {r['trainer']} | {r['fault']} | {verdict} ({r['outcome']}) | {r['done']} | {r['replay_steps']}, "
              f"{r['replay_s']:.1f} | {r['search_probes']}, {r['search_steps']}, {r['search_s']:.1f} | {r['wall_s']} |")


if __name__ == "__main__":
    main()
