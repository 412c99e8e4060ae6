"""Thermometer overhead: the same GPT trained plain, with each thermometer group alone, and with
all of them, side by side in one run.

Identical copies of one model train in one process, in blocks of steps whose order rotates
every round (plain, act, z, ..., then act, z, ..., plain, ...), so machine noise hits every
variant alike. Each step is forward + backward + AdamW (+ begin_step / measure_update /
end_step / collect when instrumented). Per block we take the process CPU time (robust to the
other jobs on a shared machine, with one torch thread) and the wall time; a variant's figure is
the median over rounds of its block's CPU time / the plain block's CPU time in that round.

Variants (a group "alone" means every other group is off):
  act             act_max / act_min per module
  z_hook          z/head the old way: a forward hook's logsumexp over an fp32 copy of the logits
  z               z/head from the loss's own log-softmax (what trainer.model does now)
  attn_logit      the attention-logit LSE probe (per layer)
  attn_entropy    the LSE probe + attn_entropy_min, default: the extra fused attention forward
                  over the first sequence of the batch
  attn_entropy_all  the same over every sequence (attn_entropy_batch=None, exact)
  grad_norm       grad_norm per module and global
  update_ratio_every1  update_ratio per module and global, every step
  update_ratio    the same every 10th step (the default, update_every=10; NaN in between)
  all             ThermometerConfig() defaults: under the 1% budget (the client picks each group's
                  cadence from its measured cost; give --warmup >= 64 so it has decided)
  all_every_step  budget=None: every group every step, update ratio every 10th (the default
                  before issue 36)
  all_before      what "all" was before issue 8: no entropy, no update ratio, z by the hook

    python bench/thermometer_overhead.py [--vocab 256 32768] [--steps 100] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from common import add_model_flags, paired_ratios, rotating_rounds  # first: this checkout on sys.path
from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from thermowatch.trainer.model import GPT, GPTConfig

OFF = 10**9  # an interval never reached after step 0 (which falls in the warm-up)
# Each group alone is read every step (budget=None): what it costs when read (issue 36's budget
# thins the groups by these costs; "all" is the default, under the budget).
_NONE = dict(act_patterns=(), act_types=(), z_patterns=(), attn_every=OFF, attn_entropy=False,
             grad_every=OFF, update_ratio=False, budget=None)


def variants() -> dict[str, dict | None]:
    return {
        "plain": None,
        "act": {**_NONE, "act_patterns": ThermometerConfig().act_patterns, "act_types": ThermometerConfig().act_types},
        "z_hook": {**_NONE, "z_patterns": ThermometerConfig().z_patterns},
        "z": {**_NONE, "z_patterns": ThermometerConfig().z_patterns},
        "attn_logit": {**_NONE, "attn_every": 1},
        "attn_entropy": {**_NONE, "attn_every": 1, "attn_entropy": True},
        "attn_entropy_all": {**_NONE, "attn_every": 1, "attn_entropy": True, "attn_entropy_batch": None},
        "grad_norm": {**_NONE, "grad_every": 1},
        "update_ratio_every1": {**_NONE, "update_ratio": True, "update_every": 1},
        "update_ratio": {**_NONE, "update_ratio": True},
        "all": {},  # the defaults: under the 1% budget (issue 36)
        "all_every_step": {"budget": None},  # every group every step, as "all" was before the budget
        "all_before": {"attn_entropy": False, "update_ratio": False, "budget": None},
    }


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, nargs="+", default=[256, 32768], help="one case per vocabulary size")
    ap.add_argument("--steps", type=int, default=100, help="measured steps per variant and case")
    # 10: a multiple of update_every's default (10), so every block of a sampled thermometer
    # holds the same number of sampled steps (with 5, half the blocks would hold none and the
    # median over rounds would pick one of two modes, not the average cost).
    ap.add_argument("--block", type=int, default=10, help="steps per block")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured steps per variant first")
    add_model_flags(ap)
    ap.add_argument("--big-vocab-batch", type=int, default=4, help="batch for vocab >= 32768 (CPU time)")
    ap.add_argument("--big-vocab-seq-len", type=int, default=64)
    # fp32 by default: on CPUs without AVX-512 BF16 (this project's AMD EPYC runners) bf16
    # matmuls run 12-25x slower than fp32 and would hide every thermometer behind them.
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: CPU time is then a clean measure)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    return ap.parse_args()


def run_case(args: argparse.Namespace, vocab: int) -> dict:
    big = vocab >= 32768
    batch = args.big_vocab_batch if big else args.batch
    seq_len = args.big_vocab_seq_len if big else args.seq_len
    dtype = args.dtype
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=vocab, seq_len=seq_len, n_layer=args.layers, n_head=args.heads,
                    d_model=args.d_model, dtype=dtype)
    base = GPT(cfg)
    models, thermos, opts = {}, {}, {}
    for name, over in variants().items():
        model = copy.deepcopy(base)
        if over is not None:
            if name in ("z_hook", "all_before"):  # without the probe attribute the thermometers fall back to a hook
                del model.head.thermo_z_probe
            thermos[name] = instrument(model, ThermometerConfig(**over))
        models[name] = model
        opts[name] = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.randint(0, vocab, (64, seq_len + 1))
    counter = dict.fromkeys(models, 0)

    def run(name: str, n: int) -> tuple[float, float]:
        model, opt, th = models[name], opts[name], thermos.get(name)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(n):
            s = counter[name]
            counter[name] += 1
            rows = torch.arange(s * batch, (s + 1) * batch) % len(data)
            x, y = data[rows, :-1], data[rows, 1:]
            if th is None:
                _, loss = model(x, y)
                loss.backward()
                opt.step()
            else:
                th.begin_step(s)
                _, loss = model(x, y)
                loss.backward()
                with th.measure_update():
                    opt.step()
                th.end_step(loss=loss, lr=1e-3)
                th.collect()
            opt.zero_grad(set_to_none=True)
        return (time.process_time() - c0) / n * 1e3, (time.perf_counter() - t0) / n * 1e3

    names = list(models)
    rounds = rotating_rounds(names, run, warmup=args.warmup, steps=args.steps, block=args.block)
    cpu = {k: [c for c, _ in v] for k, v in rounds.items()}
    wall = {k: [w for _, w in v] for k, v in rounds.items()}
    ratio, wratio = paired_ratios(cpu), paired_ratios(wall)
    return {
        "model": f"GPT {args.layers}L d{args.d_model} h{args.heads} T{seq_len} B{batch} V{vocab} {dtype}",
        "params": base.num_params(),
        "n_thermometers_all": len(thermos["all"].names),
        "step_ms": {k: round(statistics.median(v), 3) for k, v in cpu.items()},
        "overhead_pct": {k: round(100 * (ratio[k] - 1), 2) for k in names if k != "plain"},
        "wall_overhead_pct": {k: round(100 * (wratio[k] - 1), 2) for k in names if k != "plain"},
        "rounds": len(cpu["plain"]),
    }


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    cases = []
    for vocab in args.vocab:
        case = run_case(args, vocab)
        cases.append(case)
        print(f"{case['model']}, {case['params'] / 1e6:.2f}M params, {case['n_thermometers_all']} thermometers "
              f"in 'all', {case['rounds']} rounds of {args.block} steps, torch threads {torch.get_num_threads()}")
        print(f"  {'variant':<18}{'CPU ms/step':>12}{'overhead CPU':>14}{'(wall)':>10}")
        for k, ms in case["step_ms"].items():
            ov = case["overhead_pct"].get(k)
            wov = case["wall_overhead_pct"].get(k)
            print(f"  {k:<18}{ms:>12.2f}" + ("" if ov is None else f"{ov:>+13.2f}%{wov:>+9.2f}%"))
    if args.json:
        print(json.dumps({
            "bench": "thermometer_overhead",
            "cases": cases,
            "config": {k: v for k, v in vars(args).items() if k != "json"},
        }))


if __name__ == "__main__":
    main()
