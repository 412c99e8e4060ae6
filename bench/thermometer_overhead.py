"""Thermometer overhead: the same GPT trained with and without every thermometer on every step.

Two identical models train side by side in one process, in alternating blocks of steps
(plain, instrumented, instrumented, plain, ...), so machine noise hits both alike. Each step
is forward + backward + AdamW (+ begin_step/end_step/collect when instrumented). Per block we
take the process CPU time (robust to the other jobs on a shared machine, with one torch
thread) and the wall time; the headline figure is the median over block pairs of
instrumented / plain CPU time.

    python bench/thermometer_overhead.py [--steps 400] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from monitors.thermometers import ThermometerConfig, instrument  # noqa: E402
from trainer.model import GPT, GPTConfig  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=400, help="measured steps per variant")
    ap.add_argument("--block", type=int, default=10, help="steps per alternating block")
    ap.add_argument("--warmup", type=int, default=10, help="unmeasured steps per variant first")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--attn-mode", default="lse", choices=["lse", "exact"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is then a clean measure)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    return ap.parse_args()


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=args.heads, d_model=args.d_model, dtype=args.dtype)
    plain = GPT(cfg)
    inst = copy.deepcopy(plain)
    th = instrument(inst, ThermometerConfig(attn_mode=args.attn_mode))
    opts = {m: torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (plain, inst)}
    data = torch.randint(0, cfg.vocab_size, (64, args.seq_len + 1))
    counter = {"plain": 0, "instrumented": 0}

    def run(kind: str, n: int) -> tuple[float, float]:
        model = inst if kind == "instrumented" else plain
        opt = opts[model]
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            s = counter[kind]
            counter[kind] += 1
            rows = torch.arange(s * args.batch, (s + 1) * args.batch) % len(data)
            x, y = data[rows, :-1], data[rows, 1:]
            if model is inst:
                th.begin_step(s)
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if model is inst:
                th.end_step(loss=loss, lr=1e-3)
                th.collect()
        return (time.process_time() - c0) / n * 1e3, (time.perf_counter() - t0) / n * 1e3

    run("plain", args.warmup)
    run("instrumented", args.warmup)
    cpu: dict[str, list[float]] = {"plain": [], "instrumented": []}
    wall: dict[str, list[float]] = {"plain": [], "instrumented": []}
    for b in range(max(1, args.steps // args.block)):
        order = ("plain", "instrumented") if b % 2 == 0 else ("instrumented", "plain")
        for kind in order:
            c, w = run(kind, args.block)
            cpu[kind].append(c)
            wall[kind].append(w)

    med = {k: statistics.median(v) for k, v in cpu.items()}
    wmed = {k: statistics.median(v) for k, v in wall.items()}
    # Paired per block pair: the two variants ran back to back, so this cancels slow drifts.
    paired = statistics.median(i / p for i, p in zip(cpu["instrumented"], cpu["plain"]))
    wall_paired = statistics.median(i / p for i, p in zip(wall["instrumented"], wall["plain"]))
    n_params = plain.num_params()
    print(f"GPT {args.layers}L d{args.d_model} h{args.heads} T{args.seq_len} B{args.batch} {args.dtype}, "
          f"{n_params / 1e6:.2f}M params, {len(th.names)} thermometers every step (attn: {args.attn_mode}), "
          f"torch threads {torch.get_num_threads()}")
    print(f"{'variant':<14}{'CPU ms/step':>12}{'min':>9}{'max':>9}{'wall ms/step':>14}{'blocks':>8}")
    for k, v in cpu.items():
        print(f"{k:<14}{med[k]:>12.2f}{min(v):>9.2f}{max(v):>9.2f}{wmed[k]:>14.2f}{len(v):>8}")
    print(f"overhead (median of paired block ratios): CPU time {100 * (paired - 1):+.2f}%, "
          f"wall time {100 * (wall_paired - 1):+.2f}% (wall is at the mercy of other jobs)")
    if args.json:
        print(json.dumps({
            "bench": "thermometer_overhead",
            "step_ms_plain": round(med["plain"], 3),
            "step_ms_instrumented": round(med["instrumented"], 3),
            "overhead_ratio": round(paired, 4),
            "wall_step_ms_plain": round(wmed["plain"], 3),
            "wall_step_ms_instrumented": round(wmed["instrumented"], 3),
            "wall_overhead_ratio": round(wall_paired, 4),
            "n_thermometers": len(th.names),
            "params": n_params,
            "config": {k: v for k, v in vars(args).items() if k != "json"},
        }))


if __name__ == "__main__":
    main()
