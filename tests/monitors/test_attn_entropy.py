"""attn_entropy_min/<module> against an explicit softmax, and z/head against torch.logsumexp."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from tests.monitors.test_thermometers import T, _Custom, batch, gpt, qkv_outputs, step
from thermowatch.trainer.model import attention_entropy


def eager_entropy(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Mean over batch and query positions of each head's causal softmax entropy, written out:
    q, k [B, H, T, D] -> [H] (float64, the reference)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) / math.sqrt(q.shape[-1])
    t = s.shape[-1]
    s = s.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    p = torch.softmax(s, dim=-1)
    ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(-1)
    return ent.mean(dim=(0, 2))


def split_qk(qkv: torch.Tensor, n_head: int) -> tuple[torch.Tensor, torch.Tensor]:
    b, t, three_c = qkv.shape
    q, k, _ = qkv.view(b, t, 3, n_head, three_c // 3 // n_head).permute(2, 0, 3, 1, 4)
    return q, k


@pytest.mark.parametrize("mode", ["lse", "exact"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_entropy_min_equals_explicit_softmax(mode, dtype):
    model = gpt(dtype=dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)  # train a little: heads stop being uniform
    th = instrument(model, ThermometerConfig(attn_mode=mode, attn_entropy_batch=None, attn_entropy_every=1))  # every sequence
    for s in range(4):
        step(model, th, s, opt)
    vals = step(model, th, 4)
    th.detach()
    with instrument(model, ThermometerConfig(attn_mode=mode, attn_entropy_every=1)) as th1:  # the first sequence
        first = step(model, th1, 4)
    ref = qkv_outputs(model, 4)
    tol = 1e-4 if dtype == "float32" else 2e-3  # bf16: the kernel's bf16 output in the second pass
    spread = []
    for i in range(2):
        per_head = eager_entropy(*split_qk(ref[i], 4))
        spread.append((per_head.max() - per_head.min()).item())
        got = vals[f"attn_entropy_min/blocks.{i}.attn"]
        assert got == pytest.approx(per_head.min().item(), abs=tol), (i, per_head)
        assert 0.0 < got < math.log(T)
        q, k = split_qk(ref[i], 4)
        # lse: the extra pass covers sequence 0 only; exact: the T x T scores cover the batch
        seq0 = eager_entropy(q[:1], k[:1]).min().item() if mode == "lse" else per_head.min().item()
        assert first[f"attn_entropy_min/blocks.{i}.attn"] == pytest.approx(seq0, abs=tol), i
    assert max(spread) > 10 * tol  # the heads differ: taking the min (not the mean) is tested


def test_entropy_of_a_collapsed_distribution_stays_accurate_in_bf16():
    """Large logits (the case that matters): lse and E_p[s] are both ~100 while the entropy is
    ~0; centring the keys keeps the difference accurate with bf16 inputs and output."""
    torch.manual_seed(0)
    q = torch.randn(2, 3, 64, 16)
    k = torch.randn(2, 3, 64, 16) + 3.0  # a shared key component: big q.k for every pair
    q[:, 0] *= 8.0  # head 0: sharp (near one-hot) attention
    ent = attention_entropy(q.bfloat16(), k.bfloat16(), 0.25)
    ref = eager_entropy(q.bfloat16(), k.bfloat16())
    torch.testing.assert_close(ent.double(), ref, atol=1e-2, rtol=0)
    assert ref[0] < 0.3 * ref[1:].min()  # head 0 really collapsed


def test_entropy_rotating_heads_and_micro_batches_take_the_min():
    model = gpt(dtype="float32")
    th = instrument(model, ThermometerConfig(attn_mode="exact", attn_heads=2, attn_entropy_every=1))
    th.begin_step(1)  # heads 2 and 3 this step
    for off in (0, 3):  # two micro-batches
        model(*batch(off))[1].backward()
    th.end_step()
    got = th.as_dict(th.collect())["attn_entropy_min/blocks.0.attn"]
    th.detach()
    want = min(eager_entropy(*split_qk(qkv_outputs(model, off)[0], 4))[2:].min().item() for off in (0, 3))
    assert got == pytest.approx(want, abs=1e-5)


@pytest.mark.parametrize("model_kind", ["bundled", "sdpa"])
def test_entropy_is_sampled_every_attn_entropy_every_steps(model_kind):
    """The default cadence (10): the entropy on steps 0, 10, 20, NaN in between (which the
    witness skips), while the attention logits are read every step; every step with 1."""
    from tests.fixtures.nanogpt import NanoConfig, NanoGPT

    torch.manual_seed(0)
    model = gpt(dtype="float32") if model_kind == "bundled" else NanoGPT(NanoConfig(block_size=T))
    x, y = batch(0)
    for every, seen in ((None, {0, 10, 20}), (1, set(range(21)))):
        cfg = ThermometerConfig() if every is None else ThermometerConfig(attn_entropy_every=every)
        with instrument(model, cfg) as th:
            ent, logits = set(), set()
            for s in range(21):
                th.begin_step(s)
                model(x, y)[1].backward()
                th.end_step()
                vals = th.as_dict(th.collect())
                key = next(k for k in vals if k.startswith("attn_entropy_min/"))
                if math.isfinite(vals[key]):
                    ent.add(s)
                if all(math.isfinite(v) for k, v in vals.items() if k.startswith("attn_logit")):
                    logits.add(s)
        assert ent == seen, every
        assert logits == set(range(21))
    with pytest.raises(ValueError, match="attn_entropy_every"):
        ThermometerConfig(attn_entropy_every=0)


def test_entropy_on_foreign_multihead_attention():
    torch.manual_seed(0)
    custom = _Custom()
    captured = {}
    custom.attention.register_forward_pre_hook(lambda m, a, kw: captured.__setitem__("x", a[0].detach()), with_kwargs=True)
    with instrument(custom) as th:
        th.begin_step(0)
        custom(batch(0)[0]).square().mean().backward()
        th.end_step()
        got = th.as_dict(th.collect())["attn_entropy_min/attention"]
    mha, x = custom.attention, captured["x"]
    e, nh = mha.embed_dim, mha.num_heads
    w, b = mha.in_proj_weight, mha.in_proj_bias
    q = (x @ w[:e].T + b[:e]).unflatten(-1, (nh, e // nh)).transpose(1, 2)
    k = (x @ w[e : 2 * e].T + b[e : 2 * e]).unflatten(-1, (nh, e // nh)).transpose(1, 2)
    assert got == pytest.approx(eager_entropy(q, k).min().item(), abs=1e-5)


def test_huge_learning_rate_collapses_attention_entropy():
    """Real divergence (lr 0.1, as in test_thermometers): the entropy minimum falls well below
    where the same model at lr 3e-3 keeps it."""
    ends = {}
    for lr in (0.1, 3e-3):
        model = gpt()
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        th = instrument(model)  # the default cadence: the entropy of steps 0 and 10
        keys = [n for n in th.names if n.startswith("attn_entropy_min/")]
        vals = [step(model, th, s, opt) for s in range(11)]
        ends[lr] = [min(vals[s][k] for k in keys) for s in (0, 10)]
    assert ends[0.1][-1] < 0.5 * ends[3e-3][-1], ends
    assert ends[3e-3][-1] > 0.8 * ends[3e-3][0], ends[3e-3]


@pytest.mark.parametrize("kw", [{}, {"logit_softcap": 5.0}], ids=["plain", "softcap"])
def test_z_is_the_logsumexp_of_the_head_output(kw):
    """Our GPT hands the z thermometer the loss's own log-normaliser (no pass over the vocab);
    with a soft-cap, or without targets, a logsumexp of the pre-cap logits. Either way z/head
    is the max over tokens of logsumexp(head output) in fp32."""
    model = gpt(**kw)
    head_out = {}
    model.head.register_forward_hook(lambda m, a, o: head_out.__setitem__("o", o.detach()))
    th = instrument(model)
    for targets in (True, False):
        th.begin_step(0)
        x, y = batch(0)
        model(x, y if targets else None)
        th.end_step()
        got = th.as_dict(th.collect())["z/head"]
        want = torch.logsumexp(head_out["o"].float(), dim=-1).max().item()
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6), (kw, targets)
    assert isinstance(model.head.thermo_z_probe, object) and model.head.thermo_z_probe is not None
    th.detach()
    assert model.head.thermo_z_probe is None


@pytest.mark.parametrize("z_batch", [1, 2, None])
def test_z_hook_still_serves_models_without_a_probe(z_batch):
    """A foreign head: the max over the first z_batch sequences' tokens (None: the whole batch)."""
    torch.manual_seed(0)
    custom = _Custom()
    out = {}
    custom.head.register_forward_hook(lambda m, a, o: out.__setitem__("o", o.detach()))
    x = batch(0)[0]
    assert x.shape[0] > 2
    with instrument(custom, ThermometerConfig(z_batch=z_batch)) as th:
        th.begin_step(0)
        custom(x)
        th.end_step()
        got = th.as_dict(th.collect())["z/head"]
    assert not hasattr(custom.head, "thermo_z_probe") and isinstance(custom.head, nn.Linear)
    per_seq = torch.logsumexp(out["o"], -1).amax(-1)
    assert got == pytest.approx(per_seq[:z_batch].max().item(), rel=1e-6)
    if z_batch == 1:
        assert got < per_seq.max().item()  # a sample: the batch's max sits in another sequence here

