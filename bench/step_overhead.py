"""What watching costs the training step: the HTTP sink to a live daemon against a null sink.

One instrumented GPT trains in this process; every step's thermometers become a StepRecord that
is handed to the sink at once, as the run controller and thermowatch.Run do; HttpSink batches up
to `--flush-every` steps per request itself (the one place records wait). The sink
alternates by block of steps (null, http, http, null, ...) in the same run, so machine noise
hits both alike. The daemon is the real `thermowatch serve` in a subprocess (SQLite in a
temporary data dir, default detectors and policy on, i.e. the daemon as deployed), then the
same is measured with the daemon stopped (the sink spools to disk).

The headline is the median over block pairs of (http wall time / null wall time - 1), in
percent: `overhead_pct` with the daemon up, `overhead_pct_spooling` with it down. Wall time,
not CPU time: the question is whether the step waits. The trainer uses one torch thread and is
pinned to one core, the daemon to the other (on a cluster they are different machines; on
these 2-core machines the daemon's detectors would otherwise compete with the step for a core).

    python bench/step_overhead.py [--steps 600] [--json]
"""

from __future__ import annotations

import argparse
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

from common import add_model_flags, free_port, new_token, repo_env, wait_up  # first: this checkout on sys.path
from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.monitors.thermometers import instrument
from thermowatch.transport import HttpSink
from thermowatch.trainer.model import GPT, GPTConfig


class NullSink:
    def open_run(self, info) -> None: ...

    def write(self, run_id, attempt, records) -> None: ...

    def checkpoint_saved(self, run_id, attempt, ckpt) -> None: ...

    def close(self) -> None: ...


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=600, help="measured steps per sink and phase")
    ap.add_argument("--block", type=int, default=20, help="steps per alternating block")
    ap.add_argument("--flush-every", type=int, default=10, help="steps per batch (HttpSink's batch_steps; the controller's flush_every_steps default)")
    add_model_flags(ap, heads=False, seq_len=64)
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    return ap.parse_args()


TOKEN = new_token()  # the daemon's admin token for this run (auth on, as deployed)


def start_daemon(data_dir: Path, port: int, cpu: int | None) -> subprocess.Popen:
    env = repo_env(THERMOWATCH_API_TOKEN=TOKEN)
    cmd = [sys.executable, "-c", "import sys; from thermowatch.cli import main; sys.exit(main(sys.argv[1:]))",
           "serve", "--data-dir", str(data_dir), "--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(data_dir / "daemon.log", "ab"),
                            preexec_fn=(lambda: os.sched_setaffinity(0, {cpu})) if cpu is not None else None)
    wait_up(lambda: httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200, proc,
            f"thermowatch serve did not start; see {data_dir / 'daemon.log'}")
    return proc


def main() -> None:
    args = parse()
    cpus = sorted(os.sched_getaffinity(0))
    trainer_cpu, daemon_cpu = (cpus[0], cpus[1]) if len(cpus) > 1 else (None, None)
    if trainer_cpu is not None:
        os.sched_setaffinity(0, {trainer_cpu})
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # fp32: this CPU has no bf16 matmul units, and a slower step would hide the sink behind it.
    cfg = GPTConfig(seq_len=args.seq_len, n_layer=args.layers, n_head=4, d_model=args.d_model, dtype="float32")
    model = GPT(cfg)
    th = instrument(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, cfg.vocab_size, (256, args.seq_len + 1))
    tmp = Path(tempfile.mkdtemp(prefix="tw-step-overhead-"))
    port = free_port()
    (tmp / "daemon").mkdir()
    daemon = start_daemon(tmp / "daemon", port, daemon_cpu)
    # As deployed: the loop hands over each step, the sink batches (RunController, Run).
    http = HttpSink(f"http://127.0.0.1:{port}", tmp / "spool", TOKEN, retry_interval=1.0,
                    batch_steps=args.flush_every)
    null = NullSink()
    run = "step-overhead"
    http.open_run(RunInfo(run, 0, world_size=1, config={"bench": "step_overhead"}))
    state = {"step": 0}

    def train(sink, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            state["step"] += 1
            step = state["step"]
            i = (step * args.batch) % (len(data) - args.batch)
            x, y = data[i:i + args.batch, :-1], data[i:i + args.batch, 1:]
            th.begin_step(step)
            _, loss = model(x, y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            th.end_step(loss=loss, lr=3e-4, grad_norm=gn)
            vals = th.collect()
            sink.write(run, 0, [StepRecord(step=step, values=th.as_dict(vals), sample_lo=i, sample_hi=i + args.batch,
                                           tokens=args.batch * args.seq_len, wall_time=time.time())])
        return time.perf_counter() - t

    def phase() -> tuple[float, float, float]:
        ratios, t_null, t_http = [], [], []
        train(null, args.block)  # warm-up, unmeasured
        order = [(null, http), (http, null)]
        for k in range(max(1, args.steps // args.block // 2)):
            a, b = order[k % 2]
            ta, tb = train(a, args.block), train(b, args.block)
            tn, th_ = (ta, tb) if a is null else (tb, ta)
            t_null.append(tn)
            t_http.append(th_)
            ratios.append(th_ / tn - 1.0)
        return (100 * statistics.median(ratios), 1e3 * statistics.median(t_null) / args.block,
                1e3 * statistics.median(t_http) / args.block)

    try:
        up = phase()
        assert http.drain(120), "the sink did not catch up with a live daemon"
        daemon.terminate()
        daemon.wait(30)
        down = phase()
        spooled = http.drain(120) and http.spooled
    finally:
        if daemon.poll() is None:
            daemon.terminate()
        http.close()
    load = os.getloadavg()[0]
    n_keys = len(th.names)
    print(f"step overhead of the HTTP sink (live `thermowatch serve`, detectors on) vs a null sink; "
          f"{n_keys} thermometer values per step, {args.flush_every} steps per batch, load average {load:.1f}")
    print(f"{'phase':<22}{'null ms/step':>14}{'http ms/step':>14}{'overhead':>10}")
    print(f"{'daemon up':<22}{up[1]:>14.2f}{up[2]:>14.2f}{up[0]:>9.2f}%")
    print(f"{'daemon down (spool)':<22}{down[1]:>14.2f}{down[2]:>14.2f}{down[0]:>9.2f}%")
    print(f"messages spooled while the daemon was down: {spooled}")
    if args.json:
        print(json.dumps({"overhead_pct": round(up[0], 3), "overhead_pct_spooling": round(down[0], 3),
                          "null_ms_per_step": round(up[1], 3), "http_ms_per_step": round(up[2], 3),
                          "values_per_step": n_keys, "spooled_messages": spooled, "load_avg": round(load, 2)}))


if __name__ == "__main__":
    main()
