"""Tokens/s and MFU of the Ray + DeepSpeed trainer (2 CPU ranks over gloo by default).

    python bench/trainer_throughput.py                  # ZeRO 1, 2, 3 side by side
    python bench/trainer_throughput.py --stages 2 --steps 40 --json
    python bench/trainer_throughput.py --repeats 3        # interleaved rounds, medians

Throughput is end to end, as the run controller sees it: tokens of the timed steps over the
wall time between the first and last of them (Ray round trips, cross-rank reduction and record
batching included), after `--warmup` untimed steps. The peak for MFU is measured in the same
run on the same Ray placement: a bf16 matmul per rank with that rank's threads, summed over
ranks (trainer/profile.py says why); `--peak-tflops` replaces it with a number you trust.
Stages are compared as ratios to the first one listed (this machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--steps", type=int, default=30, help="timed steps per stage")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before them")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch in samples")
    p.add_argument("--repeats", type=int, default=1, help="rounds over the stages (interleaved); medians are reported")
    p.add_argument("--cpus-per-rank", type=int, default=1)
    p.add_argument("--peak-tflops", type=float, default=None, help="total peak over all ranks; default: measure")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    args = p.parse_args(argv)

    import ray

    from thermowatch.trainer.config import TrainConfig
    from thermowatch.trainer.model import GPT
    from thermowatch.trainer.profile import matmul_peak

    ray.init(num_cpus=max(4, args.world_size * args.cpus_per_rank), include_dashboard=False, log_to_driver=False)
    model = {"n_layer": args.n_layer, "d_model": args.d_model, "n_head": args.n_head, "seq_len": args.seq_len}
    flops_per_token = GPT(TrainConfig.from_dict({"model": model}).model).flops_per_token()
    if args.peak_tflops is not None:
        peak, peak_source = args.peak_tflops * 1e12, "given (--peak-tflops)"
    else:
        probe = ray.remote(num_cpus=args.cpus_per_rank)(matmul_peak)
        per_rank = ray.get([probe.remote(1024, "bfloat16", args.cpus_per_rank, 1.0) for _ in range(args.world_size)])
        peak, peak_source = sum(per_rank), f"measured: bf16 1024^3 matmul, {args.cpus_per_rank} thread(s) x {args.world_size} ranks"

    total = args.warmup + args.steps
    runs: dict[int, list[dict]] = {stage: [] for stage in args.stages}
    for _ in range(args.repeats):  # interleaved rounds: machine noise hits every stage alike
        for stage in args.stages:
            runs[stage].append(_measure(args, stage, model, total, flops_per_token, peak))
    rows = []
    for stage in args.stages:
        ms = sorted(runs[stage], key=lambda r: r["tokens_per_s"])
        rows.append({**ms[len(ms) // 2], "all_tokens_per_s": [r["tokens_per_s"] for r in runs[stage]]})
    ray.shutdown()
    base = rows[0]["tokens_per_s"]
    for r in rows:
        r["ratio_to_first"] = r["tokens_per_s"] / base
    print(f"model {model}, global batch {args.batch}, {args.world_size} ranks, {flops_per_token / 1e6:.2f} MFLOP/token")
    print(f"peak {peak / 1e9:.1f} GFLOP/s ({peak_source})")
    print(f"{'ZeRO':>4} {'tokens/s':>10} {'step ms':>8} {'rank tok/s':>11} {'MFU':>7} {'ratio':>6} {'loss':>6}")
    for r in rows:
        print(
            f"{r['zero_stage']:>4} {r['tokens_per_s']:>10.0f} {r['step_ms']:>8.1f} {r['rank_tokens_per_s']:>11.0f} "
            f"{100 * r['mfu']:>6.2f}% {r['ratio_to_first']:>6.2f} {r['final_loss']:>6.3f}"
        )
    out = {
        "bench": "trainer_throughput",
        "model": model,
        "global_batch": args.batch,
        "world_size": args.world_size,
        "flops_per_token": flops_per_token,
        "peak_flops": peak,
        "peak_source": peak_source,
        "timed_steps": args.steps,
        "repeats": args.repeats,
        "stages": rows,
    }
    if args.json:
        print(json.dumps(out))
    return out


def _measure(args, stage: int, model: dict, total: int, flops_per_token: int, peak: float) -> dict:
    from thermowatch.trainer.config import TrainConfig
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import ListSink, QueueCommands
    from thermowatch.trainer.profile import mfu

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig.from_dict(
            {
                "run_id": f"bench-z{stage}",
                "zero_stage": stage,
                "world_size": args.world_size,
                "cpus_per_rank": args.cpus_per_rank,
                "steps": total,
                "model": model,
                "data": {"seq_len": args.seq_len, "global_batch": args.batch, "max_bytes": 4 << 20},
                "optim": {"warmup_steps": min(5, total)},
                "checkpoint": {"dir": tmp, "every": 0},
                "flush_every_steps": 50,
            }
        )
        sink = ListSink()
        RunController(cfg, sink, QueueCommands()).run()
    recs = sorted(sink.attempt(cfg.run_id, 0), key=lambda r: r.step)
    timed = recs[args.warmup :]
    # Wall time from the end of the last warmup step to the end of the last timed one.
    span = timed[-1].wall_time - (recs[args.warmup - 1].wall_time if args.warmup else recs[0].wall_time)
    n = len(timed) if args.warmup else len(timed) - 1
    tokens = sum(r.tokens for r in timed[len(timed) - n :])
    tps = tokens / span
    return {
        "zero_stage": stage,
        "tokens_per_s": tps,
        "step_ms": 1e3 * span / n,
        "rank_tokens_per_s": sum(r.values["tokens_per_s"] for r in timed) / len(timed),  # ranks' own step time
        "mfu": mfu(flops_per_token, tps, peak),
        "final_loss": timed[-1].values["loss"],
    }


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
