"""Attention logits for attention nobody wrote a probe for (issue 22, item 5): a nanoGPT-style
model on F.scaled_dot_product_attention, Hugging Face GPT-2 and Llama (eager and sdpa), a class
named in attn_types, and the bundled model's LSE without its private op. Each figure is checked
against a max of q k^T * scale under the mask, written out here from q and k captured by the
test's own hooks."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.fixtures.nanogpt import NanoConfig, NanoGPT
from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from thermowatch.monitors.thermometers.intercept import AttentionNotProbed

T = 16


def nano(**kw) -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(NanoConfig(**{**dict(block_size=T, n_layer=2, n_head=4, n_embd=32), **kw}))


def tokens(b: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (b, T + 1), generator=torch.Generator().manual_seed(seed))


def run(model, th, x, step: int = 0, **fw) -> dict[str, float]:
    th.begin_step(step)
    out = model(x, **fw)
    loss = out[1] if isinstance(out, tuple) and out[1] is not None else out[0].float().square().mean()
    loss.backward()
    th.end_step(loss=loss)
    return th.as_dict(th.collect())


def reference(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Per-head max of the logits, [B, H, L, E] x [B, Hk, S, E] -> [B, H]; `allowed` broadcasts
    to [B, H, L, S] (True = the key takes part)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # GQA: each query head's key head
    s = torch.einsum("bhld,bhsd->bhls", q.double(), k.double()) * scale
    return s.masked_fill(~allowed, -math.inf).amax(dim=(2, 3))


def nano_qk(model: NanoGPT, x: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's q and k, split from its c_attn output as the module does."""
    got = []
    hs = [blk.attn.c_attn.register_forward_hook(lambda m, a, o: got.append(o.detach())) for blk in model.transformer.h]
    with torch.no_grad():
        model(x)
    for h in hs:
        h.remove()
    a = model.transformer.h[0].attn
    b, t = x.shape
    out = []
    for qkv in got:
        q, k, _ = qkv.split([a.n_head * a.hd, a.n_kv * a.hd, a.n_kv * a.hd], dim=2)
        out.append((q.view(b, t, a.n_head, a.hd).transpose(1, 2), k.view(b, t, a.n_kv, a.hd).transpose(1, 2)))
    return out


def nano_qk_padded(model: NanoGPT, x: torch.Tensor, pad: torch.Tensor):
    """nano_qk with the padding mask in the forward (layer 1 sees layer 0's masked output)."""
    got = []
    hs = [blk.register_forward_pre_hook(lambda m, a: got.append(a[0].detach())) for blk in model.transformer.h]
    with torch.no_grad():
        model(x, pad=pad)
    for h in hs:
        h.remove()
    out = []
    for blk, h in zip(model.transformer.h, got):
        a, (b, t, _) = blk.attn, h.shape
        q, k, _ = a.c_attn(blk.ln_1(h)).split([a.n_head * a.hd, a.n_kv * a.hd, a.n_kv * a.hd], dim=2)
        out.append((q.view(b, t, a.n_head, a.hd).transpose(1, 2), k.view(b, t, a.n_kv, a.hd).transpose(1, 2)))
    return out


CAUSAL = torch.ones(T, T, dtype=torch.bool).tril()


def reference_lse(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row's log-sum-exp of the logits, [B, H, L] (reference's shapes and mask)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = torch.einsum("bhld,bhsd->bhls", q.double(), k.double()) * scale
    return torch.logsumexp(s.masked_fill(~allowed, -math.inf), dim=-1)


@pytest.mark.parametrize("kv, padded", [(None, False), (2, False), (None, True), (1, True)])
def test_nanogpt_sdpa_is_found_and_read_from_the_kernel_or_exactly(kv, padded):
    """Found with no configuration. The default ("lse") is the attention kernel's own row
    log-sum-exp, max <= lse <= max + ln(keys), over the whole batch, for a call the fused op
    takes (is_causal, no mask); a call it does not take (an explicit boolean attn_mask for padded
    keys, GQA through enable_gqa) gets the same figure from an explicit q k^T of the first
    attn_entropy_batch sequences. "exact": the max over every sequence."""
    x = tokens()[:, :-1]
    pad = None
    if padded:
        pad = torch.zeros(3, T, dtype=torch.bool)
        pad[1:, 3:] = True  # right padding to 3 tokens: every query keeps a key, most keys go
    model = nano(n_kv_head=kv)
    qk = nano_qk(model, x)  # layer 1's q, k depend on layer 0's mask; captured without one
    if pad is not None:
        qk = nano_qk_padded(model, x, pad)
    allowed = CAUSAL if pad is None else CAUSAL & ~pad[:, None, None, :]
    fw = {} if pad is None else {"pad": pad}
    fused = kv is None and pad is None
    for cfg, rows, metric in ((ThermometerConfig(), 3 if fused else 1, "attn_logit_lse"),
                              (ThermometerConfig(attn_entropy_batch=2), 3 if fused else 2, "attn_logit_lse"),
                              (ThermometerConfig(attn_mode="exact"), 3, "attn_logit_max")):
        names = [f"{metric}/transformer.h.{i}.attn" for i in range(2)]
        with instrument(model, cfg) as th:
            assert [n for n in th.names if n.startswith("attn_logit")] == names
            v = run(model, th, x, **fw)
        for i, (q, k) in enumerate(qk):
            scale = 1 / math.sqrt(q.shape[-1])
            ref = reference(q, k, allowed, scale)
            if metric == "attn_logit_lse":
                lse = reference_lse(q, k, allowed, scale)
                assert v[names[i]] == pytest.approx(lse[:rows].max().item(), rel=1e-5, abs=1e-5), (i, cfg)
                assert ref[:rows].max().item() - 1e-5 <= v[names[i]] <= ref.max().item() + math.log(T) + 1e-5
            else:
                assert v[names[i]] == pytest.approx(ref.max().item(), rel=1e-5, abs=1e-5), (i, cfg)
        if pad is not None:  # the padding mask mattered: some sequence-head max moves without it
            unmasked = reference(q, k, CAUSAL, 1 / math.sqrt(q.shape[-1]))
            assert (unmasked[1:] > ref[1:]).any()


def _trained_step(model, th, x, targets, autocast: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    for p in model.parameters():
        p.grad = None
    if th is not None:
        th.begin_step(0)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(x, targets=targets)[1]
    loss.backward()
    if th is not None:
        th.end_step(loss=loss)
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("autocast", [False, True])
def test_the_kernel_path_leaves_the_users_output_and_gradient_bit_identical(autocast):
    """On a read step the found module's SDPA call runs through the private op that hands out
    the lse: the loss and every gradient are the plain model's to the bit, in fp32 and under
    bf16 autocast (the inputs cast as autocast casts SDPA's), and the figure is read."""
    model = nano()
    g = torch.Generator().manual_seed(4)
    xy = torch.randint(0, 256, (3, T + 1), generator=g)
    plain = _trained_step(model, None, xy[:, :-1], xy[:, 1:], autocast)
    with instrument(model) as th:
        read = _trained_step(model, th, xy[:, :-1], xy[:, 1:], autocast)
        v = th.as_dict(th.collect())
    assert torch.equal(plain[0], read[0])
    assert all(torch.equal(a, b) for a, b in zip(plain[1], read[1]))
    assert all(math.isfinite(v[f"attn_logit_lse/transformer.h.{i}.attn"]) for i in range(2))


def test_entropy_of_the_kernel_path_equals_explicit_softmax():
    """The default path's entropy: one more fused pass (lse - E_p[s]) over the first
    attn_entropy_batch sequences, equal to the explicit softmax's over those sequences."""
    model = nano()
    x = tokens()[:, :-1]
    qk = nano_qk(model, x)
    with instrument(model, ThermometerConfig(attn_entropy_batch=2)) as th:
        v = run(model, th, x)
    for i, (q, k) in enumerate(qk):
        s = (q[:2] @ k[:2].transpose(-1, -2) / math.sqrt(8)).masked_fill(~CAUSAL, -math.inf)
        ent = torch.special.entr(torch.softmax(s, -1)).sum(-1).mean(dim=(0, 2)).min().item()
        assert v[f"attn_entropy_min/transformer.h.{i}.attn"] == pytest.approx(ent, rel=1e-4)


def test_a_found_module_falls_back_when_torch_lacks_the_op(monkeypatch):
    """A torch without the private op: warned once, naming the module; the SDPA call then runs
    as written and the lse comes from an explicit q k^T of the first sequence."""
    model = nano()
    x = tokens()[:, :-1]
    qk = nano_qk(model, x)

    def gone(*a, **k):
        raise AttributeError("'_OpNamespace' 'aten' object has no attribute '_scaled_dot_product_flash_attention_for_cpu'")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", gone)
    with instrument(model) as th, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        v = run(model, th, x)
        v2 = run(model, th, x, step=1)
    said = [str(w.message) for w in caught if "fused attention-with-lse op refused" in str(w.message)]
    assert len(said) == 2 and "'transformer.h.0.attn'" in said[0], said  # once per module
    for i, (q, k) in enumerate(qk):
        lse = reference_lse(q, k, CAUSAL, 1 / math.sqrt(8))
        key = f"attn_logit_lse/transformer.h.{i}.attn"
        assert v[key] == pytest.approx(lse[:1].max().item(), rel=1e-5) == v2[key]


def test_per_head_rotation_under_gqa():
    model = nano(n_kv_head=2)
    x = tokens()[:, :-1]
    qk = nano_qk(model, x)
    with instrument(model, ThermometerConfig(attn_mode="exact", per_head=True, attn_heads=2)) as th:
        v = run(model, th, x, step=1)  # heads 2, 3 this step
    per_head = reference(*qk[0], CAUSAL, 1 / math.sqrt(8)).amax(dim=0)
    got = [v[f"attn_logit_max/transformer.h.0.attn.heads.{h}"] for h in range(4)]
    assert math.isnan(got[0]) and math.isnan(got[1])
    assert got[2:] == pytest.approx(per_head[2:].tolist(), rel=1e-5)


def test_entropy_of_found_attention_equals_explicit_softmax():
    model = nano()
    x = tokens()[:, :-1]
    qk = nano_qk(model, x)
    with instrument(model, ThermometerConfig(attn_mode="exact")) as th:
        v = run(model, th, x)
    q, k = qk[1]
    s = (q @ k.transpose(-1, -2) / math.sqrt(8)).masked_fill(~CAUSAL, -math.inf)
    ent = torch.special.entr(torch.softmax(s, -1)).sum(-1).mean(dim=(0, 2)).min().item()
    assert v["attn_entropy_min/transformer.h.1.attn"] == pytest.approx(ent, rel=1e-5)


def test_unsampled_steps_leave_no_mode_on_and_no_figure():
    model = nano()
    with instrument(model, ThermometerConfig(attn_every=2, budget=None)) as th:
        v = run(model, th, tokens()[:, :-1], step=1)
        assert "attn_logit_lse/transformer.h.0.attn" not in v and math.isfinite(v["loss"])
        assert th.pending_steps == []
    assert torch._C._len_torch_function_stack() == 0


class _Raises(nn.Module):
    def forward(self, x):
        y = F.scaled_dot_product_attention(x, x, x, is_causal=True)
        raise RuntimeError("boom")
        return y


def test_an_exception_in_forward_leaves_no_mode_on():
    mod = nn.Sequential(_Raises())
    with instrument(mod) as th:
        th.begin_step(0)
        with pytest.raises(RuntimeError, match="boom"):
            mod(torch.randn(1, 2, 4, 8))
        assert torch._C._len_torch_function_stack() == 0


# --- a user's class named in attn_types ------------------------------------------------------


class ManualAttn(nn.Module):
    """nanoGPT's non-flash path: its own masked softmax, no SDPA."""

    def __init__(self, d: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head, self.qkv = n_head, nn.Linear(d, 3 * d)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, c // self.n_head).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        att = F.softmax(att, dim=-1)
        return (att @ v).transpose(1, 2).reshape(b, t, c)


class Einsum(nn.Module):
    """Attention nothing can see into: no SDPA, no softmax (exp / sum by hand)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(32, 32)

    def forward(self, x):
        s = torch.einsum("btc,bsc->bts", self.w(x), x).exp()
        return (s / s.sum(-1, keepdim=True)) @ x


@pytest.mark.parametrize("mode", ["lse", "exact"])
def test_named_class_with_its_own_softmax_is_read_from_its_input(mode):
    """The softmax's input is the masked logits: their rows' log-sum-exp ("lse", the default) or
    their max ("exact"), exactly, over the whole batch."""
    torch.manual_seed(0)
    model = nn.Sequential(ManualAttn())
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        q, k, _ = model[0].qkv(x).view(2, T, 3, 4, 8).permute(2, 0, 3, 1, 4)
    ref = (reference_lse if mode == "lse" else reference)(q, k, CAUSAL, 1 / math.sqrt(8)).max().item()
    assert not any(n.startswith("attn_") for n in instrument(model).names)  # not found by itself: no SDPA
    key = f"attn_logit_{'lse' if mode == 'lse' else 'max'}/0"
    with instrument(model, ThermometerConfig(attn_types=(ManualAttn,), attn_mode=mode)) as th:
        th.begin_step(0)
        model(x).sum().backward()
        th.end_step()
        v = th.as_dict(th.collect())
    assert v[key] == pytest.approx(ref, rel=1e-5)


def _attend(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class ThroughHelper(nn.Module):
    def forward(self, x):
        return _attend(x, x, x)


def test_sdpa_through_a_helper_function_is_found():
    mod = nn.Sequential(ThroughHelper())
    x = torch.randn(2, 3, T, 8)
    with instrument(mod, ThermometerConfig(attn_mode="exact")) as th:
        th.begin_step(0)
        mod(x)
        th.end_step()
        v = th.as_dict(th.collect())
    assert v["attn_logit_max/0"] == pytest.approx(reference(x, x, CAUSAL, 1 / math.sqrt(8)).max().item(), rel=1e-5)


def test_named_class_that_cannot_be_probed_fails_at_instrument_naming_it():
    model = nn.Sequential(nn.Linear(32, 32), Einsum())
    with pytest.raises(AttentionNotProbed) as err:
        instrument(model, ThermometerConfig(attn_types=(Einsum,)))
    msg = str(err.value)
    assert "'1'" in msg and "Einsum" in msg and "attn_types=()" in msg and "thermo_probe" in msg
    instrument(model).detach()  # not named: not attention, nothing to say
    assert "attn_logit_lse/transformer.h.0.attn" in instrument(nano(), ThermometerConfig(attn_types=())).names
    names = instrument(nano(), ThermometerConfig(attn_find=False, attn_types=())).names
    assert not any(n.startswith("attn_") for n in names)


# --- Hugging Face ------------------------------------------------------------------------------


def _hf(kind: str, impl: str):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=64, n_positions=T, n_layer=2, n_embd=32, n_head=2,
                                      bos_token_id=0, eos_token_id=0, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=T)
        model = transformers.LlamaForCausalLM(cfg)
    model.set_attn_implementation(impl)
    return model


def _hf_reference(model, x, am, allowed) -> dict[str, float]:
    """Max logit per attention module, from the q and k Hugging Face hands its attention
    function (a function registered through its public AttentionInterface)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    names = {m: n for n, m in model.named_modules()}
    got: dict[str, float] = {}

    def ref(module, query, key, value, attention_mask, **kw):
        got[names[module]] = reference(query.detach(), key.detach(), allowed, kw["scaling"]).max().item()
        # HF hands a registered function no mask here: attend under ours, as the real run does
        return sdpa_attention_forward(module, query, key, value, allowed.expand(query.shape[0], 1, T, T), **kw)

    AttentionInterface.register("thermo_reference", ref)
    impl = model.config._attn_implementation
    model.set_attn_implementation("thermo_reference")
    with torch.no_grad():
        model(x, attention_mask=am)
    model.set_attn_implementation(impl)
    return got


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hugging_face_attention_is_found_and_exact(kind, impl):
    model = _hf(kind, impl)
    x = torch.randint(0, 64, (2, T), generator=torch.Generator().manual_seed(3))
    am = torch.ones(2, T, dtype=torch.long)
    am[1, -4:] = 0  # right padding
    allowed = CAUSAL & am.bool()[:, None, None, :]
    want = _hf_reference(model, x, am, allowed)
    assert len(want) == 2
    with instrument(model, ThermometerConfig(attn_mode="exact")) as th:
        keys = [n for n in th.names if n.startswith("attn_logit_max/")]
        assert sorted(k.split("/", 1)[1] for k in keys) == sorted(want)
        th.begin_step(0)
        model(x, attention_mask=am, labels=x).loss.backward()
        th.end_step()
        v = th.as_dict(th.collect())
    for name, ref in want.items():
        assert v[f"attn_logit_max/{name}"] == pytest.approx(ref, rel=1e-5), name
        assert math.isfinite(v[f"attn_entropy_min/{name}"])


def test_hugging_face_kernel_without_logits_fails_at_instrument():
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    transformers.AttentionInterface.register("opaque_kernel", sdpa_attention_forward)
    model = _hf("llama", "opaque_kernel")
    with pytest.raises(AttentionNotProbed, match=r"'model\.layers\.0\.self_attn' \(.*LlamaAttention\).*"
                                                 r"attn_implementation='sdpa' or 'eager'.*attn_find=False"):
        instrument(model)
    instrument(model, ThermometerConfig(attn_find=False)).detach()


# --- the bundled model's LSE without its private op -----------------------------------------


def test_bundled_lse_falls_back_to_public_ops(monkeypatch):
    from thermowatch.trainer import model as tm

    torch.manual_seed(0)
    gpt = tm.GPT(tm.GPTConfig(seq_len=T, n_layer=2, n_head=4, d_model=32, dtype="float32"))
    x = torch.randint(0, 256, (3, T + 1), generator=torch.Generator().manual_seed(5))
    qkv = []
    hs = [b.attn.qkv.register_forward_hook(lambda m, a, o: qkv.append(o.detach())) for b in gpt.blocks]
    with instrument(gpt) as th:
        fused = run(gpt, th, x[:, :-1])
    for h in hs:
        h.remove()

    def gone(*a, **k):
        raise AttributeError("'_OpNamespace' 'aten' object has no attribute '_scaled_dot_product_flash_attention_for_cpu'")

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", gone)
    with instrument(gpt) as th, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        public = run(gpt, th, x[:, :-1])
    assert any("fused attention-with-lse op is unavailable" in str(w.message) for w in caught)
    for i in range(2):
        key = f"attn_logit_lse/blocks.{i}.attn"
        q, k, _ = qkv[i].view(3, T, 3, 4, 8).unbind(2)
        true_max = reference(q.transpose(1, 2), k.transpose(1, 2), CAUSAL, 1 / math.sqrt(8)).max().item()
        assert true_max - 1e-4 <= public[key] <= true_max + math.log(T) + 1e-4
        assert public[key] == pytest.approx(fused[key], rel=1e-5)
    assert public["loss"] == pytest.approx(fused["loss"], rel=1e-6)


# --- a real divergence -------------------------------------------------------------------------


def test_huge_learning_rate_grows_found_attention_logits():
    """Adam at lr 0.1 on random tokens: the default figure (the kernel's log-sum-exp bound) of a
    plain nanoGPT climbs ~40-fold in 15 steps (measured: 3.9 -> 160; the exact max 1.4 -> 150);
    at 1e-3 it stays near its start, the max under 2 plus at most ln(32 keys)."""
    curves = {}
    for lr in (0.1, 1e-3):
        model = nano(block_size=32)
        opt = torch.optim.Adam(model.parameters(), lr=lr)
        th = instrument(model)
        keys = [n for n in th.names if n.startswith("attn_logit_lse/")]
        g = torch.Generator().manual_seed(1)
        curve = []
        for s in range(15):
            x = torch.randint(0, 256, (8, 33), generator=g)
            v = run(model, th, x[:, :-1], step=s, targets=x[:, 1:])
            opt.step()
            opt.zero_grad(set_to_none=True)
            curve.append(max(v[k] for k in keys))
        curves[lr] = curve
    hot, calm = curves[0.1], curves[1e-3]
    assert hot[-1] > 30 * hot[0], hot
    assert max(calm) < 2.0 + math.log(32), calm
