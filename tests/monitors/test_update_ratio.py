"""update_ratio/<module>: against an explicit before/after weight diff, plain torch and ZeRO."""

from __future__ import annotations

import math

import pytest
import torch

from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from tests.monitors.test_thermometers import batch, gpt


def _ratio(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor], names: list[str]) -> float:
    d = sum((after[n].float() - before[n].float()).square().sum() for n in names)
    w = sum(before[n].float().square().sum() for n in names)
    return math.sqrt(d / w)


def _groups(model) -> dict[str, list[str]]:
    """Parameter names per measured module, a tied weight under the name named_parameters gives it."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    mods = dict(model.named_modules())
    return {g: sorted({name_of[id(p)] for p in mods[g].parameters()}) for g in ("embed", "blocks.0", "blocks.1", "head")}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_update_ratio_equals_explicit_weight_diff(dtype):
    model = gpt(dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2, weight_decay=0.1)
    th = instrument(model, ThermometerConfig(update_every=2))
    groups = _groups(model)
    assert [n for n in th.names if n.startswith("update_ratio")] == ["update_ratio"] + [
        f"update_ratio/{g}" for g in ("embed", "blocks.0", "blocks.1", "head")]
    for s in range(4):
        th.begin_step(s)
        model(*batch(s))[1].backward()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        with th.measure_update():
            opt.step()
        opt.zero_grad(set_to_none=True)
        after = {n: p.detach().clone() for n, p in model.named_parameters()}
        th.end_step()
        v = th.as_dict(th.collect())
        if s % 2:  # not sampled: nothing copied, nothing measured
            assert all(math.isnan(v[k]) for k in th.names if k.startswith("update_ratio")), s
            continue
        for g, names in groups.items():
            assert v[f"update_ratio/{g}"] == pytest.approx(_ratio(before, after, names), rel=1e-4), (s, g)
        assert v["update_ratio"] == pytest.approx(_ratio(before, after, list(before)), rel=1e-4)
        assert 1e-4 < v["update_ratio"] < 1.0  # AdamW at lr 3e-2 on N(0, 0.02) weights: a real move


def test_update_ratio_without_measure_update_is_nan_and_can_be_off():
    model = gpt()
    th = instrument(model)
    th.begin_step(0)
    model(*batch(0))[1].backward()
    th.end_step()
    assert math.isnan(th.as_dict(th.collect())["update_ratio/blocks.0"])
    th.detach()
    with instrument(model, ThermometerConfig(update_ratio=False)) as th2:
        assert not any(n.startswith("update_ratio") for n in th2.names)
        th2.begin_step(0)
        with th2.measure_update():  # a no-op context when off
            pass
    with pytest.raises(ValueError, match="update_every"):
        ThermometerConfig(update_every=0)


_ZERO_SCRIPT = r"""
import contextlib, json, math, os, sys
import torch, deepspeed
from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from thermowatch.trainer.engine import decline_shm_comm_op
from thermowatch.trainer.model import GPT, GPTConfig

stage = int(sys.argv[1])
torch.set_num_threads(1)
decline_shm_comm_op()
deepspeed.init_distributed(dist_backend="gloo")
rank = torch.distributed.get_rank()
torch.manual_seed(0)
model = GPT(GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=32))
ds = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
      "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}}
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
# ZeRO 2 ranks hold identical weights: each measures half of every tensor (as the worker sets it).
th = instrument(model, ThermometerConfig(update_every=1, update_split=stage < 3))
upd = th._update
part = sum(t.numel() for t in upd._parts())
name_of = {id(p): n for n, p in model.named_parameters()}
mods = dict(model.named_modules())
groups = {g: [name_of[id(p)] for p in mods[g].parameters()] for g in ("embed", "blocks.0", "blocks.1")}
groups[""] = list(name_of.values())

def full():  # every rank's view of the whole weights (ZeRO-3 gathers its shards; a collective)
    ctx = deepspeed.zero.GatheredParameters(list(model.parameters())) if stage == 3 else contextlib.nullcontext()
    with ctx:
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}

torch.manual_seed(1 + rank)
out = []
for s in range(2):
    x, y = torch.randint(0, 256, (2, 32)), torch.randint(0, 256, (2, 32))
    th.begin_step(s)
    _, loss = engine(x, y)
    engine.backward(loss)
    before = full()
    with th.measure_update():
        engine.step()
    after = full()
    th.end_step(loss=loss)
    got = th.as_dict(th.collect())
    for g, names in groups.items():
        d = sum(float((after[n] - before[n]).square().sum()) for n in names)
        w = sum(float(before[n].square().sum()) for n in names)
        key = "update_ratio/" + g if g else "update_ratio"
        out.append([key, got[key], math.sqrt(d / w)])
sharded = any(getattr(p, "ds_tensor", None) is not None for p in model.parameters())
total = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
print("RESULT " + json.dumps({"rank": rank, "sharded": sharded, "rows": out, "part": part, "total": total}), flush=True)
# Both ranks are done with every collective; then leave without the interpreter's teardown, where
# ZeRO-3's gloo group now and then aborts (SIGABRT, no message) after the result was printed.
torch.distributed.barrier()
torch.distributed.destroy_process_group()
os._exit(0)
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_update_ratio_under_deepspeed_zero_two_ranks(stage, tmp_path):
    """Two CPU ranks (gloo). ZeRO-3 shards every weight, and under ZeRO 2 update_split has each
    rank copy half of every tensor: either way the all-reduced sums must give the ratio of the
    whole weights, the same on both ranks."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(2):
        env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_SIZE": "2"}
        procs.append(subprocess.Popen([sys.executable, "-c", _ZERO_SCRIPT, str(stage)], env=env, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert p.returncode == 0 and lines, err[-3000:]
        results.append(json.loads(lines[-1][len("RESULT "):]))
    assert all(r["sharded"] == (stage == 3) for r in results)
    assert all(r["part"] < 0.6 * r["total"] for r in results)  # each rank copied about half
    for r in results:
        for key, got, want in r["rows"]:
            assert 1e-4 < want < 1.0, (key, want)
            assert got == pytest.approx(want, rel=1e-3), (r["rank"], key)
    assert results[0]["rows"] == results[1]["rows"]  # identical on every rank: the mean keeps it
