"""The cross-rank reduction of the thermometer vectors: on the device with collectives
(`reduction: collective`, trainer/collective.py) against today's driver-side path (`reduction:
driver`: every rank's vector to the Ray driver, reduced there by trainer/reduce.py), at 2, 8
and 64 ranks. The vector is the real one: the names `instrument()` gives a GPT of --layers
layers with the default thermometers, plus tokens_per_s.

What runs, per world size W (this is a 2-core machine; nothing here trains):

- driver CPU: what the driver does per step on each path, W rank results serialised as Ray
  serialises actor returns (pickle protocol 5), deserialised, stacked and reduced (driver) or
  one packed vector and W-1 Nones deserialised and unpacked (collective); bytes to the driver
  are the serialised results' sizes. Real code, simulated ranks, all W.
- Ray gather: W real Ray actors (trivial, no torch) hand out their step result, the driver
  ray.get()s all W and reduces: the per-step round trip both paths pay, the driver path with W
  vectors, the collective with one. W = 2 and 8 (64 actor processes do not fit this machine).
- collective on the ranks: CollectiveReducer.__call__ (two gloo all-reduces plus the packing)
  per step, median over rank 0's steps. W = 2 and 8: W real processes, one gloo group. W = 64:
  64 gloo groups as threads of ONE process on 2 cores (gloo's TCP transport over loopback,
  all 64 ranks timesliced on 2 cores and one GIL), so its figure is an upper bound dominated by
  oversubscription, not what 64 GPUs on NCCL would see.

    python bench/reduction.py [--layers 12] [--steps 200] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from thermowatch.monitors.contract import TOKENS_PER_S  # noqa: E402
from thermowatch.monitors.reduce import Reducer  # noqa: E402


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12, help="GPT layers whose thermometers make the vector (GPT-2 124M: 12)")
    ap.add_argument("--steps", type=int, default=200, help="measured steps per path and world size")
    ap.add_argument("--worlds", default="2,8,64")
    ap.add_argument("--ray-worlds", default="2,8", help="world sizes run with real Ray actors")
    ap.add_argument("--process-worlds", default="2,8", help="world sizes run as real gloo processes (others: threads)")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of figures")
    return ap.parse_args()


def thermometer_names(layers: int) -> tuple[list[str], int]:
    """The worker's names for a GPT of `layers` layers (the width does not change them)."""
    from thermowatch.monitors.thermometers import instrument
    from thermowatch.trainer.config import TrainConfig
    from thermowatch.trainer.model import GPT

    cfg = TrainConfig.from_dict({"model": {"n_layer": layers, "n_head": 4, "d_model": 32, "seq_len": 32},
                                 "data": {"seq_len": 32}})
    th = instrument(GPT(cfg.model), cfg.thermometer_config())
    names = list(th.names) + [TOKENS_PER_S]
    th.detach()
    return names, len(names) - 1


def rank_vectors(world: int, m: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((world, m)).astype(np.float32).astype(np.float64)


META = {"sample_lo": 123456, "sample_hi": 123464, "tokens": 4096, "global_batch": 8, "seq_len": 512,
        "time_s": 0.1, "lr_multiplier": 1.0, "ledger_digest": "0" * 16, "step": 1000, "loss": 2.5}


def driver_cpu(names: list[str], world: int, steps: int, packed: np.ndarray) -> dict:
    """Per step: the driver's deserialise + reduce on both paths, alternating by step."""
    red = Reducer(names)
    vals = rank_vectors(world, len(names))
    old = [pickle.dumps((vals[r], META), protocol=5) for r in range(world)]
    new = [pickle.dumps((packed, META), protocol=5)] + [pickle.dumps(None, protocol=5)] * (world - 1)
    t_old, t_new = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = [pickle.loads(b) for b in old]
        values, ranks = red(np.stack([v for v, _ in outs]))
        dict(zip(names, values.tolist()))
        t1 = time.perf_counter()
        outs = [pickle.loads(b) for b in new]
        values, ranks = red.unpack(outs[0][0])
        dict(zip(names, values.tolist()))
        t2 = time.perf_counter()
        t_old.append(t1 - t0)
        t_new.append(t2 - t1)
    return {"driver_bytes": sum(map(len, old)), "collective_bytes": sum(map(len, new)),
            "driver_cpu_us": statistics.median(t_old) * 1e6, "collective_cpu_us": statistics.median(t_new) * 1e6}


class _Rank:
    """A Ray actor that hands out a step result the way TrainWorker.step does."""

    def __init__(self, rank: int, driver: tuple, collective: tuple | None) -> None:
        self.rank, self.driver, self.collective = rank, driver, collective

    def step(self, collective: bool):
        return self.collective if collective else self.driver


def ray_gather(names: list[str], world: int, steps: int, packed: np.ndarray) -> dict:
    import ray

    red = Reducer(names)
    vals = rank_vectors(world, len(names))
    actor = ray.remote(num_cpus=0)(_Rank)
    ranks = [actor.remote(r, (vals[r], META), (packed, META) if r == 0 else None) for r in range(world)]
    ray.get([a.step.remote(False) for a in ranks])  # up
    t_old, t_new = [], []
    for i in range(steps + 10):
        t0 = time.perf_counter()
        outs = ray.get([a.step.remote(False) for a in ranks])
        red(np.stack([v for v, _ in outs]))
        t1 = time.perf_counter()
        outs = ray.get([a.step.remote(True) for a in ranks])
        red.unpack(outs[0][0])
        t2 = time.perf_counter()
        if i >= 10:  # warm-up
            t_old.append(t1 - t0)
            t_new.append(t2 - t1)
    for a in ranks:
        ray.kill(a)
    return {"ray_driver_ms": statistics.median(t_old) * 1e3, "ray_collective_ms": statistics.median(t_new) * 1e3}


def _collective_steps(red, buf, steps: int, extras=(1234.5,)) -> list[float]:
    out = []
    for _ in range(steps + 5):
        t0 = time.perf_counter()
        red(buf, extras)
        out.append(time.perf_counter() - t0)
    return out[5:]


def _process_rank(rank: int, world: int, port: int, names: list[str], n_device: int, steps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from thermowatch.monitors.collective import CollectiveReducer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    red = CollectiveReducer(names, n_device, torch.device("cpu"))
    buf = torch.tensor(rank_vectors(world, n_device)[rank], dtype=torch.float32)
    times = _collective_steps(red, buf, steps)
    packed = red(buf, (1234.5,)).numpy()
    if rank == 0:
        np.save(out, np.array([statistics.median(times)] + packed.tolist()))
    dist.destroy_process_group()


def collective_processes(names, n_device, world, steps) -> tuple[float, np.ndarray]:
    import torch.multiprocessing as mp

    from thermowatch.trainer.worker import _free_port

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r0.npy")
        mp.spawn(_process_rank, args=(world, _free_port(), names, n_device, steps, out), nprocs=world, join=True)
        res = np.load(out)
    return res[0], res[1:]


def collective_threads(names, n_device, world, steps) -> tuple[float, np.ndarray]:
    import torch
    import torch.distributed as dist
    from torch.distributed import AllreduceOptions, HashStore, ProcessGroupGloo

    from thermowatch.monitors.collective import CollectiveReducer

    store = HashStore()
    groups: list = [None] * world

    def make(r: int) -> None:
        opts = ProcessGroupGloo._Options()
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        groups[r] = ProcessGroupGloo(store, r, world, opts)

    def run_all(fn) -> None:
        ths = [threading.Thread(target=fn, args=(r,)) for r in range(world)]
        for t in ths:
            t.start()
        for t in ths:
            t.join()

    run_all(make)
    vals = rank_vectors(world, n_device)
    times: dict[int, list[float]] = {}
    packed: dict[int, np.ndarray] = {}

    def rank_main(r: int) -> None:
        def all_reduce(t, op, pg=groups[r]):
            o = AllreduceOptions()
            o.reduceOp = op
            pg.allreduce([t], o).wait()

        red = CollectiveReducer(names, n_device, torch.device("cpu"), r, world, all_reduce=all_reduce)
        buf = torch.tensor(vals[r], dtype=torch.float32)
        times[r] = _collective_steps(red, buf, steps)
        packed[r] = red(buf, (1234.5,)).numpy()

    run_all(rank_main)
    del dist
    return statistics.median(times[0]), packed[0]


def main() -> None:
    args = parse()
    import torch

    torch.set_num_threads(1)
    names, n_device = thermometer_names(args.layers)
    worlds = [int(w) for w in args.worlds.split(",")]
    ray_worlds = {int(w) for w in args.ray_worlds.split(",") if w}
    proc_worlds = {int(w) for w in args.process_worlds.split(",") if w}
    rows = []
    if ray_worlds:
        import ray

        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    try:
        for w in worlds:
            how = "processes" if w in proc_worlds else "threads"
            steps = args.steps if how == "processes" else max(20, args.steps // 10)
            on_rank, packed = (collective_processes if how == "processes" else collective_threads)(
                names, n_device, w, steps)
            # the collective's answer is the driver's (trainer/collective.py; tests/trainer/test_collective.py)
            red = Reducer(names)
            want = red(np.concatenate([rank_vectors(w, n_device), np.full((w, 1), 1234.5)], axis=1))
            got = red.unpack(packed)
            assert got[1] == want[1] and np.array_equal(got[0], want[0]), "collective != driver reduction"
            row = {"world": w, "metrics": len(names), "collective_ranks_as": how,
                   "collective_on_rank_ms": on_rank * 1e3, **driver_cpu(names, w, args.steps, packed)}
            if w in ray_worlds:
                row.update(ray_gather(names, w, args.steps, packed))
            rows.append(row)
    finally:
        if ray_worlds:
            ray.shutdown()

    print(f"thermometer vector: {len(names)} metrics ({args.layers}-layer GPT, default thermometers + tokens_per_s)")
    hdr = (f"{'W':>3} {'bytes->driver':>22} {'driver CPU us/step':>24} {'Ray gather+reduce ms':>24} "
           f"{'collective on rank ms':>22}")
    print(hdr)
    print(f"{'':>3} {'driver / coll. (ratio)':>22} {'driver / coll. (ratio)':>24} {'driver / coll. (ratio)':>24} "
          f"{'(ranks as)':>22}")
    for r in rows:
        ray_cell = (f"{r['ray_driver_ms']:.2f} / {r['ray_collective_ms']:.2f} ({r['ray_driver_ms'] / r['ray_collective_ms']:.2f}x)"
                    if "ray_driver_ms" in r else "not run")
        print(f"{r['world']:>3} "
              f"{r['driver_bytes']:>7} / {r['collective_bytes']:>5} ({r['driver_bytes'] / r['collective_bytes']:.1f}x) "
              f"{r['driver_cpu_us']:>8.0f} / {r['collective_cpu_us']:>5.0f} ({r['driver_cpu_us'] / r['collective_cpu_us']:.1f}x) "
              f"{ray_cell:>24} {r['collective_on_rank_ms']:>10.3f} ({r['collective_ranks_as']})")
    if args.json:
        print(json.dumps({"layers": args.layers, "metrics": len(names), "rows": rows}))


if __name__ == "__main__":
    main()
