"""Thermometers against direct computations, on real tiny models trained on CPU."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn as nn

from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from thermowatch.trainer.model import GPT, GPTConfig

TEXT = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 8), dtype=torch.long)
T = 32


def gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(seq_len=T, n_layer=2, n_head=4, d_model=32), **kw}))


def batch(offset: int = 0, b: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    starts = [(offset * 5 + 7 * i) % (len(TEXT) - T - 1) for i in range(b)]
    return (torch.stack([TEXT[s : s + T] for s in starts]), torch.stack([TEXT[s + 1 : s + T + 1] for s in starts]))


def step(model, th, s: int, opt=None, **end):
    th.begin_step(s)
    x, y = batch(s)
    _, loss = model(x, y)
    loss.backward()
    th.end_step(loss=loss, **end)
    if opt is not None:
        opt.step()
        opt.zero_grad(set_to_none=True)
    return th.as_dict(th.collect())


def capture(model: nn.Module, names) -> dict[str, torch.Tensor]:
    """Outputs of the named modules in one forward, by the test's own hooks."""
    got: dict[str, torch.Tensor] = {}
    mods = dict(model.named_modules())
    hs = [mods[n].register_forward_hook(lambda m, a, o, n=n: got.__setitem__(n, o.detach())) for n in names]
    model(*batch(0))
    for h in hs:
        h.remove()
    return got


def qkv_outputs(model: GPT, offset: int) -> dict[int, torch.Tensor]:
    """Each block's qkv projection output on batch(offset), by the test's own hooks."""
    got: dict[int, torch.Tensor] = {}
    hs = [b.attn.qkv.register_forward_hook(lambda m, a, o, i=i: got.__setitem__(i, o.detach()))
          for i, b in enumerate(model.blocks)]
    model(*batch(offset))
    for h in hs:
        h.remove()
    return got


def eager_logit_max(qkv: torch.Tensor, n_head: int) -> torch.Tensor:
    """Per-head max of the causal QK^T/sqrt(d), written out in full (the reference)."""
    b, t, three_c = qkv.shape
    hd = three_c // 3 // n_head
    q, k, _ = qkv.float().view(b, t, 3, n_head, hd).unbind(2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
    causal = torch.arange(t)[:, None] >= torch.arange(t)[None, :]
    return s.masked_fill(~causal, -math.inf).amax(dim=(0, 2, 3))


def test_activation_max_min_and_z_equal_direct_capture():
    model = gpt()
    th = instrument(model)
    vals = step(model, th, 0)
    acts = [n for n in th.names if n.startswith("act_max/")]
    mods = [n.split("/", 1)[1] for n in acts]
    assert set(mods) == {"embed_norm", "blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1",
                         "blocks.1.attn", "blocks.1.mlp", "final_norm", "head"}
    th.detach()
    ref = capture(model, mods)
    for m in mods:
        assert vals[f"act_max/{m}"] == ref[m].float().max().item(), m
        assert vals[f"act_min/{m}"] == ref[m].float().min().item(), m
    z = torch.logsumexp(ref["head"].float(), dim=-1).max().item()
    assert vals["z/head"] == pytest.approx(z, rel=1e-6)
    assert vals["loss"] == pytest.approx(model(*batch(0))[1].item(), rel=1e-6)


def test_attention_lse_bounds_the_eager_max():
    model = gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # train a little: logits far from 0
    th = instrument(model, ThermometerConfig(per_head=True))
    for s in range(4):
        step(model, th, s, opt)
    vals = step(model, th, 4)
    th.detach()
    ref = qkv_outputs(model, 4)  # the batch the thermometer saw at step 4
    for i in range(2):
        per_head = eager_logit_max(ref[i], 4)
        lse = vals[f"attn_logit_lse/blocks.{i}.attn"]
        mx = per_head.max().item()
        assert mx - 1e-3 <= lse <= mx + math.log(T) + 1e-3, (i, mx, lse)
        for h in range(4):
            lse_h = vals[f"attn_logit_lse/blocks.{i}.attn.heads.{h}"]
            assert per_head[h].item() - 1e-3 <= lse_h <= per_head[h].item() + math.log(T) + 1e-3


def test_explicit_path_equals_eager_max_and_rotates_heads():
    model = gpt()
    th = instrument(model, ThermometerConfig(attn_mode="exact", per_head=True))
    vals = step(model, th, 0)
    th.detach()
    ref = qkv_outputs(model, 0)
    for i in range(2):
        per_head = eager_logit_max(ref[i], 4)
        assert vals[f"attn_logit_max/blocks.{i}.attn"] == pytest.approx(per_head.max().item(), abs=1e-6)
        got = [vals[f"attn_logit_max/blocks.{i}.attn.heads.{h}"] for h in range(4)]
        np.testing.assert_allclose(got, per_head.numpy(), atol=1e-6)

    # Two heads per step, rotating: step 1 measures heads 2 and 3 only.
    with instrument(model, ThermometerConfig(attn_mode="exact", attn_heads=2, per_head=True)) as th2:
        v1 = step(model, th2, 1)
    ref1 = qkv_outputs(model, 1)
    per_head = eager_logit_max(ref1[0], 4)
    got = np.array([v1[f"attn_logit_max/blocks.0.attn.heads.{h}"] for h in range(4)])
    assert np.isnan(got[:2]).all()
    np.testing.assert_allclose(got[2:], per_head[2:].numpy(), atol=1e-6)
    assert v1["attn_logit_max/blocks.0.attn"] == pytest.approx(per_head[2:].max().item(), abs=1e-6)


def test_grad_norms_equal_vector_norm_of_grads():
    model = gpt(untied_head=True)
    th = instrument(model)
    vals = step(model, th, 0)  # no optimizer step: .grad still holds this step's gradients
    for name in ("embed", "blocks.0", "blocks.1", "head"):
        mod = dict(model.named_modules())[name]
        ref = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in mod.parameters()]))
        assert vals[f"grad_norm/{name}"] == pytest.approx(ref.item(), rel=1e-5), name
    total = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    assert vals["grad_norm"] == pytest.approx(total.item(), rel=1e-5)
    vals2 = step(model, th, 1, grad_norm=1.25, lr=3e-4)  # the caller's global norm wins
    assert vals2["grad_norm"] == 1.25 and vals2["lr"] == pytest.approx(3e-4)


@pytest.mark.parametrize("mode", ["lse", "exact"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_instrumented_model_is_bit_identical(mode, dtype):
    plain = gpt(dtype=dtype, value_residual=True)
    inst = copy.deepcopy(plain)
    th = instrument(inst, ThermometerConfig(attn_mode=mode, per_head=True))
    opt_p, opt_i = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (plain, inst))
    x, y = batch(0)
    th.begin_step(0)
    logits_i, loss_i = inst(x, y)
    loss_i.backward()
    with th.measure_update():
        opt_i.step()
    th.end_step(loss=loss_i, lr=1e-3)
    logits_p, loss_p = plain(x, y)
    loss_p.backward()
    opt_p.step()
    assert torch.equal(logits_i, logits_p) and torch.equal(loss_i, loss_p)
    for (n, pp), pi in zip(plain.named_parameters(), inst.parameters()):
        assert torch.equal(pp.grad, pi.grad) and torch.equal(pp, pi), n
    read = th.as_dict(th.collect())  # the budget's own figures are unmeasured at the first step: absent
    assert all(np.isfinite(v) for v in read.values())  # every thermometer, entropy and update ratio included
    assert any(k.startswith("attn_entropy_min/") for k in read) and "update_ratio" in read


def _hook_state(model: nn.Module):
    mods = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]
    params = [len(p._backward_hooks or {}) for p in model.parameters()]
    probes = [(getattr(m, "thermo_probe", None), getattr(m, "thermo_z_probe", None)) for m in model.modules()]
    return mods, params, probes


def test_detach_removes_every_hook():
    model = gpt()
    before = _hook_state(model)
    ref = model(*batch(0))[0]
    with instrument(model) as th:
        assert _hook_state(model) != before
        th.begin_step(0)
        model(*batch(0))
        th.end_step()
    assert _hook_state(model) == before
    assert torch.equal(model(*batch(0))[0], ref)
    with pytest.raises(RuntimeError, match="detached"):
        th.begin_step(1)
    with instrument(model):
        once = _hook_state(model)
        with pytest.raises(RuntimeError, match="instrumented twice"):
            instrument(model)
        assert _hook_state(model) == once  # the failed second instrument() left nothing behind
    assert _hook_state(model) == before


def test_sampling_intervals_leave_the_unread_out():
    model = gpt()
    # fixed cadences, no budget: what a step did not read is absent from the record, as under a
    # budget (test_unread.py), never NaN (a non-finite finding); the global gradient norm is read
    # every step while the loop does not hand its own over (here it never does)
    th = instrument(model, ThermometerConfig(act_every=2, attn_every=3, grad_every=2, budget=None))
    v1 = step(model, th, 1)
    assert "act_max/blocks.0" not in v1 and "attn_logit_lse/blocks.0.attn" not in v1
    assert math.isfinite(v1["loss"]) and math.isfinite(v1["grad_norm"]) and math.isfinite(v1["grad_norm/blocks.0"])
    assert v1["thermometer_every/act"] == 2 and v1["thermometer_every/attn"] == 3
    v2 = step(model, th, 2)
    assert math.isfinite(v2["act_max/blocks.0"]) and math.isfinite(v2["grad_norm/blocks.0"])
    assert "attn_logit_lse/blocks.0.attn" not in v2
    assert th.collect() is None  # each step is handed out once
    # Forwards outside begin_step/end_step (eval) write nothing.
    model(*batch(0))
    assert th.collect() is None


def test_read_a_step_late_hands_out_the_oldest_ended_step_once():
    """The trainer ends step k, then collects step k-1 (its copy finished while k ran): ended
    steps wait oldest first, at most two (one per pinned host buffer on a GPU)."""
    model = gpt()
    th = instrument(model, ThermometerConfig())
    on_time = {s: step(model, th, s)["loss"] for s in (1, 2)}  # no optimizer: the weights stay
    late_model = gpt()  # the same weights (seeded)
    th2 = instrument(late_model, ThermometerConfig())
    for s in (1, 2):
        th2.begin_step(s)
        x, y = batch(s)
        _, loss = late_model(x, y)
        loss.backward()
        th2.end_step(loss=loss)
        late_model.zero_grad(set_to_none=True)
    assert th2.pending_steps == [1, 2]
    late = th2.as_dict(th2.collect())
    assert th2.last_step == 1 and th2.pending_steps == [2] and late["loss"] == on_time[1]
    assert th2.as_dict(th2.collect())["loss"] == on_time[2] and th2.pending_steps == []
    for s, loss in ((3, 0.5), (4, 0.25), (5, 0.125)):
        th2.begin_step(s)
        th2.end_step(loss=loss)  # the third ended step overwrites the oldest buffer: counted, not silent
    assert th2.pending_steps == [4, 5] and th2.dropped == 1
    assert th2.as_dict(th2.collect())["loss"] == 0.25 and th2.last_step == 4
    assert th2.discard_pending() == 1 and th2.collect() is None


def test_micro_batches_combine_and_nonfinite_is_data():
    model = gpt(dtype="float32")
    th = instrument(model)
    th.begin_step(0)
    outs = []
    hook = model.blocks[0].register_forward_hook(lambda m, a, o: outs.append(o.detach()))
    for off in (0, 3):  # two micro-batches in one step
        model(*batch(off))[1].backward()
    hook.remove()
    th.end_step()
    v = th.as_dict(th.collect())
    assert v["act_max/blocks.0"] == max(o.max().item() for o in outs)
    assert v["act_min/blocks.0"] == min(o.min().item() for o in outs)
    with torch.no_grad():
        model.blocks[1].mlp.proj.weight[0, 0] = math.inf
    v = step(model, th, 1)
    assert v["act_max/blocks.1.mlp"] == math.inf or math.isnan(v["act_max/blocks.1.mlp"])
    assert math.isnan(v["act_max/head"]) and math.isnan(v["loss"])


class _Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.attention = nn.MultiheadAttention(32, 4, batch_first=True)
        self.head = nn.Linear(32, 256)

    def forward(self, x):
        h = self.embed(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        return self.head(h + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0])


def _mha_reference(mha: nn.MultiheadAttention, x: torch.Tensor, mask: torch.Tensor | None, heads: int | None = None) -> float:
    """Max causal logit of the first `heads` heads (all by default), from the full projections."""
    e, nh = mha.embed_dim, mha.num_heads
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q = (x @ w[:e].T + b[:e]).unflatten(-1, (nh, e // nh))
    k = (x @ w[e : 2 * e].T + b[e : 2 * e]).unflatten(-1, (nh, e // nh))
    s = torch.einsum("bqhd,bkhd->bhqk", q, k)[:, :heads] / math.sqrt(e // nh)
    return (s if mask is None else s.masked_fill(mask, -math.inf)).max().item()


def test_foreign_models_get_act_and_attention_metrics():
    torch.manual_seed(0)
    custom = _Custom()
    captured = {}
    custom.attention.register_forward_pre_hook(lambda m, a, kw: captured.__setitem__("x", a[0].detach()), with_kwargs=True)
    with instrument(custom, ThermometerConfig(attn_heads=2)) as th:
        assert "attn_logit_max/attention" in th.names and "act_max/attention" in th.names
        th.begin_step(0)  # heads 0, 1 this step
        x = batch(0)[0]
        nn.functional.cross_entropy(custom(x).flatten(0, 1), x.flatten()).backward()
        th.end_step()
        v = th.as_dict(th.collect())
    mask = torch.ones(T, T, dtype=torch.bool).triu(1)
    ref = _mha_reference(custom.attention, captured["x"], mask, heads=2)  # heads 0, 1 sampled
    assert v["attn_logit_max/attention"] == pytest.approx(ref, abs=1e-5)
    assert math.isfinite(v["act_max/head"]) and math.isfinite(v["grad_norm/head"])

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)
    enc = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    pad = torch.zeros(3, T, dtype=torch.bool)
    pad[1, -4:] = True  # padded keys must not count
    with instrument(enc) as th:
        th.begin_step(0)
        src = torch.randn(T, 3, 32)  # (S, B, E): batch_first=False
        src[-4:, 1] = 50.0  # huge values on the padded positions: visible if the mask were ignored
        enc(src, src_key_padding_mask=pad).square().mean().backward()
        th.end_step()
        v = th.as_dict(th.collect())
    for i in range(2):
        for key in (f"act_max/layers.{i}", f"act_max/layers.{i}.self_attn", f"attn_logit_max/layers.{i}.self_attn",
                    f"grad_norm/layers.{i}"):
            assert math.isfinite(v[key]), key
    x0 = src.transpose(0, 1)  # layer 0's self-attention input (norm_first=False: raw src)
    ref = _mha_reference(enc.layers[0].self_attn, x0, pad[:, None, None, :])
    assert v["attn_logit_max/layers.0.self_attn"] == pytest.approx(ref, rel=1e-5)
    assert _mha_reference(enc.layers[0].self_attn, x0, None) > ref  # the mask mattered


def test_huge_learning_rate_really_grows_attention_logits():
    """Real divergence: AdamW at lr=0.1 on the tiny GPT; the exact max logit climbs step over
    step, while the same run at lr=3e-3 stays near its start."""
    curves = {}
    for lr in (0.1, 3e-3):
        model = gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        th = instrument(model, ThermometerConfig(attn_mode="exact"))
        keys = [n for n in th.names if n.startswith("attn_logit_max/")]
        curves[lr] = [max(step(model, th, s, opt)[k] for k in keys) for s in range(10)]
    hot, calm = curves[0.1], curves[3e-3]
    rises = sum(b > a for a, b in zip(hot, hot[1:]))
    assert rises >= 8, hot
    assert hot[-1] > 20 * max(hot[1], 1.0), hot
    assert max(calm) < 2.0, calm


_ZERO_SCRIPT = r"""
import json, os, sys
import torch, deepspeed
from thermowatch.monitors.thermometers import instrument
from thermowatch.trainer.model import GPT, GPTConfig

stage = int(sys.argv[1])
cfg = GPTConfig(seq_len=32, n_layer=2, n_head=4, d_model=32)
torch.manual_seed(0)
model, ref = GPT(cfg), GPT(cfg)
ref.load_state_dict(model.state_dict())
ds = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True}, "zero_optimization": {"stage": stage},
      "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
from thermowatch.trainer.engine import decline_shm_comm_op
decline_shm_comm_op()  # inference-only op: no 30 s build, no /dev/shm file left behind
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
th = instrument(model)  # after initialize, as the trainer does: ZeRO-3 params are partitioned now
x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
th.begin_step(0)
_, loss = engine(x, y)
engine.backward(loss)
th.end_step(loss=loss)
grads_gone = all(p.grad is None for p in model.parameters())
engine.step()
got = th.as_dict(th.collect())
ref(x, y)[1].backward()
mods = dict(ref.named_modules())
want = {n: torch.stack([p.grad.float().norm() for p in mods[n].parameters()]).norm().item()
        for n in ("embed", "blocks.0", "blocks.1")}
print("RESULT " + json.dumps({"grads_gone": grads_gone, "want": want,
                              "got": {n: got["grad_norm/" + n] for n in want}}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_grad_norms_under_deepspeed_zero(stage, tmp_path):
    """ZeRO 2/3 leave .grad None after backward; the tensor hooks still see every gradient.
    One CPU rank (gloo) in a subprocess so no process group leaks into this pytest process."""
    import json
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    proc = subprocess.run([sys.executable, "-c", _ZERO_SCRIPT, str(stage)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    res = json.loads(lines[-1][len("RESULT "):])
    assert res["grads_gone"]  # ZeRO really took the gradients away from .grad
    for name, want in res["want"].items():
        assert res["got"][name] == pytest.approx(want, rel=2e-2), name  # bf16 rounding of ref .grad


def test_grad_norms_read_from_grad_equal_the_hooks_and_are_the_optimizers_gradient_under_accumulation():
    """instrument(..., grad_hooks=False) + grads_from_params() (thermowatch.watch's way, and FSDP2's
    only way): on one micro-batch the same figures as the per-parameter hooks; over two, the norm
    of the summed gradient the optimizer steps with (what clip_grad_norm_ reports), where the
    hooks combine the micro-batches' norms."""
    from tests.fixtures.nanogpt import NanoConfig, NanoGPT

    torch.manual_seed(0)
    a = NanoGPT(NanoConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    b = copy.deepcopy(a)
    hooks, read = instrument(a), instrument(b, grad_hooks=False)
    x = torch.randint(0, 64, (3, 4, 17))

    def step(model, th, micro: int) -> dict[str, float]:
        th.begin_step(1)
        model.zero_grad(set_to_none=True)
        for i in range(micro):
            model(x[i, :, :-1], x[i, :, 1:])[1].backward()
        if th is read:
            th.grads_from_params()
        th.end_step(loss=0.0)
        return {k: v for k, v in th.as_dict(th.collect()).items() if k.startswith("grad_norm")}

    one_h, one_r = step(a, hooks, 1), step(b, read, 1)
    assert one_h.keys() == one_r.keys() and len(one_h) > 3
    for k in one_h:
        assert one_r[k] == pytest.approx(one_h[k], rel=1e-5), k
    two_r = step(b, read, 2)
    want = float(torch.nn.utils.get_total_norm([p.grad for p in b.parameters() if p.grad is not None]))
    assert two_r["grad_norm"] == pytest.approx(want, rel=1e-5)
    assert two_r["grad_norm"] != pytest.approx(step(a, hooks, 2)["grad_norm"], rel=1e-3)
