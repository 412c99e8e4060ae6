"""What a step's record costs the loop in the embedded mode (`thermowatch train` without
--supervisor, `thermowatch demo`): the in-process Supervisor as the sink, which stores and judges
on the caller's thread. Side by side in one run, alternating by block of steps:

  one by one   each step handed straight to Supervisor.write (a transaction and a judge pass a step)
  Batched      each step handed to thermowatch.transport.Batched in front of it, which writes every
               `--every` steps (the controller's default flush_every_steps: 10), as deployed

The figure is ms of the loop's wall time per step spent handing records over (no training here:
the sink is the whole step), median over blocks, and the ratio between the two.

    python bench/batched_sink.py [--steps 2000] [--values 50] [--every 10] [--db sqlite|postgres] [--json]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thermowatch.monitors.contract import RunInfo, StepRecord  # noqa: E402
from thermowatch.supervisor.app.config import SupervisorConfig  # noqa: E402
from thermowatch.supervisor.app.service import Supervisor  # noqa: E402
from thermowatch.supervisor.notify.console import ConsoleNotifier  # noqa: E402
from thermowatch.transport import Batched  # noqa: E402

PG_URL = os.environ.get("THERMOWATCH_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2000, help="steps per sink, in blocks")
    ap.add_argument("--block", type=int, default=100)
    ap.add_argument("--values", type=int, default=50, help="thermometer values per step (a 12-layer model: ~50)")
    ap.add_argument("--every", type=int, default=10, help="Batched's every_steps (flush_every_steps)")
    ap.add_argument("--db", choices=("sqlite", "postgres"), default="sqlite")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="tw-batched-"))
    url = f"sqlite:///{tmp}/tw.db" if args.db == "sqlite" else PG_URL
    sup = Supervisor(SupervisorConfig(data_dir=tmp, db_url=url), notifier=ConsoleNotifier(io.StringIO()))
    kinds = ("act_max", "act_min", "attn_logit_max", "grad_norm")  # per layer, as the thermometers name them
    names = [f"{kinds[i % 4]}/blocks.{i // 4}" for i in range(args.values - 2)] + ["loss", "grad_norm"]
    rng = np.random.default_rng(0)
    sinks = {"one by one": sup, "Batched": Batched(sup, every_steps=args.every, every_s=3600)}
    runs = {label: f"bench-{uuid.uuid4().hex[:8]}" for label in sinks}
    for run in runs.values():
        sup.open_run(RunInfo(run, 0, world_size=1))
    step = {label: 0 for label in sinks}
    times: dict[str, list[float]] = {label: [] for label in sinks}

    def block(label: str) -> None:
        sink, run = sinks[label], runs[label]
        recs = []
        for _ in range(args.block):
            step[label] += 1
            k = step[label]
            vals = dict(zip(names, (3.0 + 0.01 * rng.standard_normal(len(names))).tolist()))
            recs.append(StepRecord(step=k, values=vals, sample_lo=8 * k, sample_hi=8 * k + 8, tokens=512,
                                   wall_time=time.time()))
        t = time.perf_counter()
        for r in recs:  # the loop's side: one write a step
            sink.write(run, 0, [r])
        times[label].append((time.perf_counter() - t) / args.block)

    try:
        block("one by one"), block("Batched")  # warm-up, unmeasured
        for v in times.values():
            v.clear()
        order = [("one by one", "Batched"), ("Batched", "one by one")]
        for i in range(max(1, args.steps // args.block)):
            for label in order[i % 2]:
                block(label)
        sinks["Batched"].drain()
    finally:
        sup.close()
    one, batched = (1e3 * statistics.median(times[k]) for k in ("one by one", "Batched"))
    load = os.getloadavg()[0]
    print(f"embedded sink, {args.db}: {len(names)} values a step, blocks of {args.block} steps, "
          f"Batched every {args.every} steps, load average {load:.1f}")
    print(f"  one by one  {one:7.3f} ms a step")
    print(f"  Batched     {batched:7.3f} ms a step   ({one / batched:.1f}x less)")
    if args.json:
        print(json.dumps({"db": args.db, "values_per_step": len(names), "every": args.every,
                          "one_by_one_ms": round(one, 3), "batched_ms": round(batched, 3),
                          "ratio": round(one / batched, 2), "load_avg": round(load, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
