"""Thermometer overhead on a user's own model (issue 22, item 5): a nanoGPT-style GPT whose
attention calls F.scaled_dot_product_attention (tests/fixtures/nanogpt.py), trained plain and
instrumented, side by side in one run.

The method of bench/thermometer_overhead.py: identical copies of one model train in one process,
in blocks of steps whose order rotates every round; a variant's figure is the median over rounds
of its block's process CPU time / the plain block's in that round (one torch thread).

Variants:
  plain        no thermometers
  default      ThermometerConfig(): attention found by interception, the default figure (the
               kernel's own log-sum-exp: each SDPA call runs through the private op that hands it
               out), every group every step, update ratio every 10th
  no_attn      the same without the attention group (attn_find=False): what attention adds
  attn_exact   default with attn_mode="exact": q k^T over the whole batch every step
  no_entropy, no_act, no_grad, no_update
               default with one group off: the attention entropy, activation max/min, the
               gradient norms, the update ratio (what each costs: default / it)

  no_z         default without z/<head> (logsumexp over the vocabulary of every token)
  budget_1pct  ThermometerConfig(budget=0.01): each group's cadence chosen by the client from its
               own measured cost (issue 36); its own figure and the cadences are printed
  every_step   budget=None: every group every step (the variants above but default set budget=None,
               so they say what each group costs when read every step)

On a GPU (--device cuda: bf16 autocast, a block timed by the wall clock after a sync, the values
read a step late with collect(block=False), as thermowatch.watch reads them):

    python bench/thermometer_overhead_any.py [--steps 100] [--json]
    python bench/thermometer_overhead_any.py --device cuda --layers 12 --d-model 768 --heads 12 \
        --seq-len 1024 --vocab 50304 --batch 16 --threads 4
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time

import torch

from common import add_model_flags, nano_model, paired_ratios, rotating_rounds  # first: this checkout on sys.path
from thermowatch.monitors.thermometers import ThermometerConfig, instrument

_NEVER = 10**9  # a sampling interval no step reaches: the group is off
_EVERY = {"budget": None}  # every group every step
VARIANTS = {"plain": None, "default": {}, "every_step": _EVERY, "budget_1pct": {"budget": 0.01},
            "no_attn": {**_EVERY, "attn_find": False}, "attn_exact": {**_EVERY, "attn_mode": "exact"},
            # each group off in turn: where the every-step cost goes (issue 22's <= 3% goal)
            "no_entropy": {**_EVERY, "attn_entropy": False}, "no_act": {**_EVERY, "act_every": _NEVER},
            "no_grad": {**_EVERY, "grad_every": _NEVER}, "no_update": {**_EVERY, "update_ratio": False},
            "no_z": {**_EVERY, "z_patterns": ()},
            # the cadence issue 22's <= 3% at d128 would need (a product decision: half the steps
            # carry no attention figure, which the attention detectors' windows are tuned on)
            "attn_every_2": {**_EVERY, "attn_every": 2}}


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100, help="measured steps per variant")
    ap.add_argument("--block", type=int, default=10, help="steps per block (a multiple of update_every)")
    ap.add_argument("--warmup", type=int, default=3)
    add_model_flags(ap)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variants (plain always runs)")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def main() -> None:
    args = parse()
    base, dev = nano_model(args)
    cuda = dev.type == "cuda"
    models, thermos, opts = {}, {}, {}
    chosen = {k: v for k, v in VARIANTS.items()
              if k == "plain" or not args.variants or k in args.variants.split(",")}
    for name, over in chosen.items():
        models[name] = copy.deepcopy(base)
        if over is not None:
            thermos[name] = instrument(models[name], ThermometerConfig(**over))
        opts[name] = torch.optim.AdamW(models[name].parameters(), lr=1e-3, fused=cuda or None)
    data = torch.randint(0, args.vocab, (64, args.seq_len + 1), device=dev)
    clock = time.perf_counter if cuda else time.process_time
    counter = dict.fromkeys(models, 0)

    def run(name: str, n: int) -> float:
        model, opt, th = models[name], opts[name], thermos.get(name)
        if cuda:
            torch.cuda.synchronize()
        c0 = clock()
        for _ in range(n):
            s = counter[name]
            counter[name] += 1
            rows = torch.arange(s * args.batch, (s + 1) * args.batch, device=dev) % len(data)
            x, y = data[rows, :-1], data[rows, 1:]
            if th is not None:
                th.begin_step(s)
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cuda):
                _, loss = model(x, y)
            loss.backward()
            if th is None:
                opt.step()
            else:
                with th.measure_update():
                    opt.step()
                th.end_step(loss=loss, lr=1e-3)
                while th.collect(block=not cuda) is not None:  # on a GPU a step late, as watch reads
                    pass
            opt.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        return (clock() - c0) / n * 1e3

    names = list(models)
    cpu = rotating_rounds(names, run, warmup=args.warmup, steps=args.steps, block=args.block)
    ratio = paired_ratios(cpu)
    some = next(iter(thermos.values()))
    found = [n for n in some.names if n.startswith(("attn_logit_max/", "attn_logit_lse/"))]
    print(f"nanoGPT (SDPA) {args.layers}L d{args.d_model} h{args.heads} T{args.seq_len} B{args.batch} "
          f"V{args.vocab} {'bf16 autocast on ' + torch.cuda.get_device_name() if cuda else 'fp32'}, {len(found)} attention modules found, {len(cpu['plain'])} rounds of "
          f"{args.block} steps, torch threads {torch.get_num_threads()}")
    print(f"  {'variant':<12}{'wall ms/step' if cuda else 'CPU ms/step':>12}{'ratio':>8}")
    for k in names:
        th = thermos.get(k)
        own = f"  {th.cost:.4f} {th.cadence}{' over budget' if th.over_budget else ''}" if th is not None else ""
        print(f"  {k:<12}{statistics.median(cpu[k]):>12.2f}{ratio[k]:>8.3f}{own}")
    if args.json:
        print(json.dumps({"bench": "thermometer_overhead_any", "ratio": {k: round(v, 4) for k, v in ratio.items()},
                          "step_ms": {k: round(statistics.median(v), 3) for k, v in cpu.items()},
                          "reported_cost": {k: th.cost for k, th in thermos.items()},
                          "cadence": {k: th.cadence for k, th in thermos.items()},
                          "config": {k: v for k, v in vars(args).items() if k != "json"}}))


if __name__ == "__main__":
    main()
