"""What `thermowatch.watch` costs a user's loop (issue 22): a nanoGPT-style GPT whose attention
calls F.scaled_dot_product_attention (tests/fixtures/nanogpt.py), trained three ways side by side
in one process, against a real `thermowatch serve` daemon started here (auth on, SQLite):

  plain     the loop alone
  thermo    the same with instrument(model) (default thermometers), read every step
  watch     thermowatch.watch(...): default thermometers, the LR hooks, batch_ids, records sent
            by the background thread to the daemon over HTTP, commands polled every second

Identical copies of one model train in blocks of steps whose order rotates every round; a
variant's figure is the median over rounds of its block's wall time (and process CPU time, both
threads) / the plain block's in that round (one torch thread). No checkpoints are saved
(checkpoint_every is past the end): saving is the user's cost with or without thermowatch.

    python bench/client_overhead.py [--steps 200] [--json]
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fixtures.nanogpt import NanoConfig, NanoGPT  # noqa: E402
from tests.live_server import free_port, wait_healthy  # noqa: E402
from thermowatch.monitors.thermometers import instrument  # noqa: E402

import thermowatch  # noqa: E402

TOKEN = "tw_bench-client-overhead-0123456789abcdef"


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="measured steps per variant")
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--threads", type=int, default=1)
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


def main() -> None:
    args = parse()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = NanoConfig(vocab_size=args.vocab, block_size=args.seq_len, n_layer=args.layers, n_head=args.heads,
                     n_embd=args.d_model)
    base = NanoGPT(cfg)
    data = torch.randint(0, args.vocab, (4096, args.seq_len + 1))
    tmp = Path(tempfile.mkdtemp(prefix="tw-client-bench-"))
    daemon, url = serve(tmp)
    total = args.warmup + args.steps + args.block
    try:
        models = {k: copy.deepcopy(base) for k in ("plain", "thermo", "watch")}
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
        th = instrument(models["thermo"])
        tw = thermowatch.watch(models["watch"], opts["watch"], run="bench", steps=total, global_batch=args.batch,
                               server=url, token=TOKEN, checkpoint_dir=tmp / "ckpt", checkpoint_every=total + 1)
        steps = tw.steps()
        counter = dict.fromkeys(models, 0)

        def one(name: str) -> None:
            model, opt = models[name], opts[name]
            if name == "watch":
                s = next(steps)
                rows = torch.as_tensor(tw.batch_ids(s)) % len(data)
            else:
                s = counter[name] = counter[name] + 1
                rows = torch.arange((s - 1) * args.batch, s * args.batch) % len(data)
                if name == "thermo":
                    th.begin_step(s)
            x, y = data[rows, :-1], data[rows, 1:]
            _, loss = model(x, y)
            loss.backward()
            if name == "thermo":
                with th.measure_update():
                    opt.step()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            if name == "thermo":
                th.end_step(loss=loss, lr=1e-3)
                th.collect()
            elif name == "watch":
                tw.record(loss)

        def block(name: str, n: int) -> tuple[float, float]:
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                one(name)
            return (time.perf_counter() - w0) / n * 1e3, (time.process_time() - c0) / n * 1e3

        names = list(models)
        for name in names:
            block(name, args.warmup)
        wall: dict[str, list[float]] = {k: [] for k in names}
        cpu: dict[str, list[float]] = {k: [] for k in names}
        for r in range(max(1, args.steps // args.block)):
            k = r % len(names)
            for name in names[k:] + names[:k]:
                w, c = block(name, args.block)
                wall[name].append(w)
                cpu[name].append(c)
        sent_ok = tw.run.flush(60)
        tw.close()
        stored = httpx.get(f"{url}/api/runs/bench", headers={"Authorization": f"Bearer {TOKEN}"}).json()
    finally:
        daemon.terminate()
        daemon.wait(30)
    ratio = {k: statistics.median(a / p for a, p in zip(wall[k], wall["plain"])) for k in names}
    cratio = {k: statistics.median(a / p for a, p in zip(cpu[k], cpu["plain"])) for k in names}
    print(f"nanoGPT (SDPA) {args.layers}L d{args.d_model} h{args.heads} T{args.seq_len} B{args.batch} fp32, "
          f"{len(wall['plain'])} rounds of {args.block} steps, torch threads {torch.get_num_threads()}; "
          f"the daemon stored {stored.get('last_step')} steps (all sent: {sent_ok})")
    print(f"  {'variant':<8}{'wall ms/step':>14}{'wall ratio':>12}{'CPU ratio':>11}")
    for k in names:
        print(f"  {k:<8}{statistics.median(wall[k]):>14.2f}{ratio[k]:>12.3f}{cratio[k]:>11.3f}")
    if args.json:
        print(json.dumps({"bench": "client_overhead", "wall_ratio": {k: round(v, 4) for k, v in ratio.items()},
                          "cpu_ratio": {k: round(v, 4) for k, v in cratio.items()},
                          "step_ms": {k: round(statistics.median(v), 3) for k, v in wall.items()},
                          "stored_last_step": stored.get("last_step"),
                          "config": {k: v for k, v in vars(args).items() if k != "json"}}))


if __name__ == "__main__":
    main()
