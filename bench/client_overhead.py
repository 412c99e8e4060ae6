"""What `thermowatch.watch` costs a user's loop (issue 22): a nanoGPT-style GPT whose attention
calls F.scaled_dot_product_attention (tests/fixtures/nanogpt.py), trained three ways side by side
in one process, against a real `thermowatch serve` daemon started here (auth on, SQLite):

  plain     the loop alone
  thermo    the same with instrument(model) (default thermometers), read every step
  watch     thermowatch.watch(...): default thermometers, the LR hooks, batch_ids, records sent
            by the background thread to the daemon over HTTP, commands polled every second
  watch-bare  the same without thermometers (thermometers=False): what the client's machinery
            alone costs (the LR hooks, batch_ids, the sender and poller threads, the daemon beside it)
  watch-idle  the same with the thermometers' hooks in place and no activation, attention or
            per-layer figure ever read: what the hooks cost on steps they do not read, plus the
            global gradient norm (read every step: the loop does not hand its own over)
  watch@B   the same with ThermometerConfig(budget=B), one per --budget (B "off": budget=None,
            the fixed every-step cadences); the client's own figure for its cost
            (Thermometers.cost) and the cadences it chose are printed beside the measured one

Identical copies of one model train in blocks of steps whose order rotates every round; a
variant's figure is the median over rounds of its block's wall time (and process CPU time, both
threads) / the plain block's in that round (one torch thread). No checkpoints are saved
(checkpoint_every is past the end): saving is the user's cost with or without thermowatch.

    python bench/client_overhead.py [--steps 200] [--json]
    python bench/client_overhead.py --device cuda --layers 12 --d-model 768 --heads 12 --seq-len 1024 \
        --vocab 50304 --batch 16 --threads 4      # a GPU: GPT-2 small, bf16 autocast, fused AdamW
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

from common import add_model_flags, free_port, nano_model, paired_ratio_ci, paired_ratios, rotating_rounds  # first: sys.path
from tests.live_server import wait_healthy
from thermowatch.monitors.thermometers import ThermometerConfig, instrument

import thermowatch

TOKEN = "tw_bench-client-overhead-0123456789abcdef"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="measured steps per variant")
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    add_model_flags(ap)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (a GPU: bf16 autocast, blocks timed after a sync)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (the default on cuda)")
    ap.add_argument("--data-rows", type=int, default=4096)
    ap.add_argument("--sync-debug", action="store_true",
                    help="cuda: one more block per variant under torch.cuda.set_sync_debug_mode, printing "
                         "where each host-device synchronisation came from")
    ap.add_argument("--budget", action="append", default=[],
                    help="another watch variant with ThermometerConfig(budget=B) (a fraction, or off); repeatable")
    ap.add_argument("--variants", default=None,
                    help="comma-separated subset of the variants to run (plain is always run): "
                         "a 1B-class model holds few copies in memory")
    ap.add_argument("--clip", type=float, default=None,
                    help="every variant clips its gradients to this norm (clip_grad_norm_), as GPT trainers do; "
                         "watch variants hand the norm to record(loss, grad_norm=...)")
    ap.add_argument("--lr", type=float, default=1e-3,
                    help="AdamW's constant LR; a 1B-class shape at 1e-3 with no warm-up really diverges and "
                         "the daemon pauses it (BENCHMARKS.md), which stops the measurement")
    ap.add_argument("--json", action="store_true")
    return ap.parse_args()


def serve(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, THERMOWATCH_API_TOKEN=TOKEN)
    proc = subprocess.Popen([sys.executable, "-m", "thermowatch", "serve", "--data-dir", str(tmp / "srv"),
                             "--port", str(port)], env=env, stdout=open(tmp / "serve.log", "w"),
                            stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, tmp / "serve.log")
    return proc, url


def syncs(names: list[str], run_block) -> None:
    """Where each variant makes the host wait for the GPU: torch's sync debug mode warns at every
    synchronising call; one block per variant, the calls counted by their innermost frame here."""
    import collections
    import traceback
    import warnings

    for name in names:
        seen: collections.Counter = collections.Counter()

        def show(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            ours = [f for f in frames if "/torch/" not in f.filename][-3:]
            seen[" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(ours))] += 1

        old = warnings.showwarning
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                run_block(name)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = old
        print(f"  syncs in one block of {name}: {sum(seen.values())}")
        for where, n in seen.most_common(8):
            print(f"    {n:4d}  {where}")


def main() -> None:
    args = parse()
    base, dev = nano_model(args)
    cuda = dev.type == "cuda"
    bf16 = args.bf16 or cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    # The batch is gathered on the host and copied as a loader with pin_memory does (pinned,
    # non_blocking): the same for every variant, and no copy that waits for the GPU.
    data = torch.randint(0, args.vocab, (args.data_rows, args.seq_len + 1))
    tmp = Path(tempfile.mkdtemp(prefix="tw-client-bench-"))
    daemon, url = serve(tmp)
    total = args.warmup + args.steps + 2 * args.block  # a spare block: the rounds, and --sync-debug
    try:
        budgets = {f"watch@{b}": (None if b == "off" else float(b)) for b in args.budget}
        names = ["plain", "thermo", "watch", "watch-bare", "watch-idle", *budgets]
        if args.variants:
            keep = set(args.variants.split(","))
            names = [n for n in names if n == "plain" or n in keep]
        models = {k: copy.deepcopy(base) for k in names}
        del base
        opts = {k: torch.optim.AdamW(m.parameters(), lr=args.lr, fused=cuda or None) for k, m in models.items()}
        th = instrument(models["thermo"]) if "thermo" in models else None
        never = 10**9  # watch-idle: every group's cadence past the end
        thermometers = {"watch": True, "watch-bare": False,
                        "watch-idle": ThermometerConfig(budget=None, act_every=never, attn_every=never,
                                                        grad_every=never, update_every=never),
                        **{n: ThermometerConfig(budget=b) for n, b in budgets.items()}}
        tws, steps = {}, {}
        for name in names:
            if name in thermometers:
                tws[name] = thermowatch.watch(models[name], opts[name], run=f"bench-{len(tws)}", steps=total,
                                              global_batch=args.batch, server=url, token=TOKEN,
                                              checkpoint_dir=tmp / f"ckpt{len(tws)}", checkpoint_every=total + 1,
                                              thermometers=thermometers[name])
                steps[name] = tws[name].steps()
        counter = dict.fromkeys(models, 0)

        def one(name: str) -> None:
            model, opt = models[name], opts[name]
            if name in tws:
                s = next(steps[name])
                rows = torch.as_tensor(tws[name].batch_ids(s)) % len(data)
            else:
                s = counter[name] = counter[name] + 1
                rows = torch.arange((s - 1) * args.batch, s * args.batch) % len(data)
                if name == "thermo":
                    th.begin_step(s)
            xy = data[rows]
            if cuda:
                xy = xy.pin_memory().to(dev, non_blocking=True)
            x, y = xy[:, :-1], xy[:, 1:]
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
                _, loss = model(x, y)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip) if args.clip else None
            if name == "thermo":
                with th.measure_update():
                    opt.step()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            if name == "thermo":
                th.end_step(loss=loss, lr=args.lr, grad_norm=gn)
                while th.collect(block=False) is not None:  # a step late, as watch reads them
                    pass
            elif name in tws:
                tws[name].record(loss, grad_norm=gn)

        def block(name: str, n: int) -> tuple[float, float]:
            sync()
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                one(name)
            sync()
            return (time.perf_counter() - w0) / n * 1e3, (time.process_time() - c0) / n * 1e3

        rounds = rotating_rounds(names, block, warmup=args.warmup, steps=args.steps, block=args.block)
        wall = {k: [w for w, _ in v] for k, v in rounds.items()}
        cpu = {k: [c for _, c in v] for k, v in rounds.items()}
        if args.sync_debug and cuda:
            syncs(names, lambda name: block(name, args.block))
        told = {n: (tw.th.cost, tw.th.cadence, tw.th.over_budget) for n, tw in tws.items() if tw.th is not None}
        sent_ok = all([tw.run.flush(60) for tw in tws.values()])
        for tw in tws.values():
            tw.close()
        stored = {n: httpx.get(f"{url}/api/runs/bench-{i}", headers={"Authorization": f"Bearer {TOKEN}"}).json()
                  for i, n in enumerate(tws)}
    finally:
        daemon.terminate()
        daemon.wait(30)
    ratio, cratio = paired_ratios(wall), paired_ratios(cpu)
    ci = paired_ratio_ci(wall)
    where = torch.cuda.get_device_name() if cuda else "CPU"
    print(f"nanoGPT (SDPA) {args.layers}L d{args.d_model} h{args.heads} T{args.seq_len} B{args.batch} "
          f"{'bf16 autocast' if bf16 else 'fp32'} on {where}, "
          f"{len(wall['plain'])} rounds of {args.block} steps, torch threads {torch.get_num_threads()}"
          f"{f', gradients clipped to {args.clip}' if args.clip else ''}; "
          f"the daemon stored {[s.get('last_step') for s in stored.values()]} steps (all sent: {sent_ok})")
    print(f"  {'variant':<12}{'wall ms/step':>14}{'wall ratio':>12}{'~95% interval':>16}{'CPU ratio':>11}"
          "  its own figure, cadence")
    for k in names:
        own = ""
        if k in told:
            cost, cad, over = told[k]
            own = f"  {cost:.4f} {cad}{' over budget' if over else ''}"
        band = f"{ci[k][0]:.3f}-{ci[k][1]:.3f}"
        print(f"  {k:<12}{statistics.median(wall[k]):>14.2f}{ratio[k]:>12.3f}{band:>16}{cratio[k]:>11.3f}{own}")
    if args.json:
        print(json.dumps({"bench": "client_overhead", "wall_ratio": {k: round(v, 4) for k, v in ratio.items()},
                          "wall_ratio_ci95": {k: [round(a, 4), round(b, 4)] for k, (a, b) in ci.items()},
                          "cpu_ratio": {k: round(v, 4) for k, v in cratio.items()},
                          "step_ms": {k: round(statistics.median(v), 3) for k, v in wall.items()},
                          "stored_last_step": {k: v.get("last_step") for k, v in stored.items()},
                          "reported_cost": {k: v[0] for k, v in told.items()},
                          "cadence": {k: v[1] for k, v in told.items()},
                          "config": {k: v for k, v in vars(args).items() if k != "json"}}))


if __name__ == "__main__":
    main()
