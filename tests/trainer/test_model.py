"""The GPT model: real training on CPU, tiny sizes."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from thermowatch.trainer.model import GPT, GPTConfig

TEXT = b"the quick brown fox jumps over the lazy dog. " * 8


def tiny(**kw) -> GPTConfig:
    base = dict(seq_len=32, n_layer=2, n_head=2, d_model=32)
    base.update(kw)
    return GPTConfig(**base)


def batch(b: int = 4, t: int = 32, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    data = torch.tensor(list(TEXT), dtype=torch.long)
    starts = [(offset + 7 * i) % (len(data) - t - 1) for i in range(b)]
    x = torch.stack([data[s : s + t] for s in starts])
    y = torch.stack([data[s + 1 : s + t + 1] for s in starts])
    return x, y


def train(model: GPT, steps: int, lr: float = 3e-3) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = batch(offset=step)
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_forward_backward_bf16():
    torch.manual_seed(0)
    model = GPT(tiny())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    x, y = batch()
    logits, loss = model(x, y)
    assert logits.shape == (4, 32, 256) and logits.dtype == torch.float32
    assert loss.dtype == torch.float32 and loss.dim() == 0
    # Uniform-ish predictions at init: loss near ln(256).
    assert abs(loss.item() - math.log(256)) < 0.5
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(p.grad).all(), name
    logits2, none = model(x)
    assert none is None and torch.equal(logits, logits2)


def test_loss_falls_on_repeating_text():
    torch.manual_seed(0)
    losses = train(GPT(tiny()), steps=50)
    assert losses[-1] < 0.5 * losses[0], losses[::10]


@pytest.mark.parametrize(
    "option",
    [
        dict(untied_head=True),
        dict(untied_head=True, zero_init_head=True),
        dict(logit_softcap=5.0),
        dict(value_residual=True),
        dict(qk_layernorm=True),
        dict(z_loss=1e-2),
        dict(dtype="float32"),
        dict(norm="rmsnorm"),
        dict(norm="rmsnorm", qk_layernorm=True),
        dict(activation="relu2"),
        dict(norm="rmsnorm", activation="relu2"),
    ],
    ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()),
)
def test_each_option_builds_and_trains(option):
    torch.manual_seed(0)
    model = GPT(tiny(**option))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = train(model, steps=8)
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0], losses
    # Every parameter takes part: a non-zero gradient (pure-bf16 AdamW cannot move a gain of
    # 1.0 by lr=3e-3, so "changed" would be the wrong check; DeepSpeed keeps fp32 masters).
    model(*batch())[1].backward()
    silent = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.any()]
    assert not silent
    assert any(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())


def test_option_effects():
    torch.manual_seed(0)
    x, y = batch()
    untied = GPT(tiny(untied_head=True, zero_init_head=True))
    assert untied.head.weight is not untied.embed.weight and not untied.head.weight.any()
    logits, loss = untied(x, y)
    assert torch.all(logits == 0) and loss.item() == pytest.approx(math.log(256), abs=1e-5)

    capped = GPT(tiny(logit_softcap=0.5))
    assert capped(x)[0].abs().max() <= 0.5

    torch.manual_seed(0)
    plain = GPT(tiny(dtype="float32"))
    torch.manual_seed(0)
    zl = GPT(tiny(dtype="float32", z_loss=0.1))
    logits, ce = plain(x, y)
    _, total = zl(x, y)
    z = torch.logsumexp(logits.view(-1, 256), -1)
    assert total.item() == pytest.approx(ce.item() + 0.1 * z.square().mean().item(), rel=1e-6)

    vr = GPT(tiny(value_residual=True))
    vr(x, y)[1].backward()
    assert vr.blocks[0].attn.v_mix is None  # block 0 only hands its values on
    assert vr.blocks[1].attn.v_mix.grad.abs().sum() > 0  # block 1 really mixes block 0's values

    assert GPT(tiny(qk_layernorm=True)).blocks[0].attn.q_norm is not None


def test_norm_and_activation_choices():
    """rmsnorm / relu2 compute what their papers define; the defaults keep LayerNorm + GELU."""
    from thermowatch.trainer.model import FP32LayerNorm, FP32RMSNorm

    torch.manual_seed(0)
    default = GPT(tiny(qk_layernorm=True))
    norms = [m for m in default.modules() if isinstance(m, (FP32LayerNorm, FP32RMSNorm))]
    assert norms and all(type(m) is FP32LayerNorm for m in norms)
    torch.manual_seed(0)
    rms = GPT(tiny(norm="rmsnorm", activation="relu2", qk_layernorm=True, dtype="float32"))
    kinds = {n: type(m) for n, m in rms.named_modules() if isinstance(m, (FP32LayerNorm, FP32RMSNorm))}
    assert set(kinds.values()) == {FP32RMSNorm} and len(kinds) == len(norms)  # same names, other kind
    assert "blocks.0.attn.q_norm" in kinds and "final_norm" in kinds
    # RMSNorm: x / sqrt(mean(x^2) + eps) * g, no mean subtraction, no bias.
    ln = rms.blocks[0].ln1
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 32) + 2.0
    ref = x / torch.sqrt(x.square().mean(-1, keepdim=True) + ln.eps) * ln.weight
    torch.testing.assert_close(ln(x), ref)
    assert not hasattr(ln, "bias")
    # relu2: proj(relu(fc(x))^2).
    mlp = rms.blocks[0].mlp
    torch.testing.assert_close(mlp(x), mlp.proj(torch.relu(mlp.fc(x)) ** 2))
    gelu = GPT(tiny(dtype="float32")).blocks[0].mlp
    torch.testing.assert_close(gelu(x), gelu.proj(torch.nn.functional.gelu(gelu.fc(x))))


class _OpDtypes(TorchDispatchMode):
    """Records the input dtype of every aten op of interest (real dispatch, nothing replaced)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("native_layer_norm", "_log_softmax", "_softmax", "logsumexp"):
            self.seen.setdefault(name, set()).add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def test_precision_critical_ops_run_in_fp32():
    torch.manual_seed(0)
    model = GPT(tiny(z_loss=1e-4, qk_layernorm=True))
    out_dtypes: dict[str, torch.dtype] = {}
    for name, mod in model.named_modules():
        if name in ("embed_norm", "final_norm", "head") or name.startswith("blocks.") and name.count(".") <= 2:
            mod.register_forward_hook(lambda m, a, o, name=name: out_dtypes.__setitem__(name, o.dtype))
    x, y = batch()
    with _OpDtypes() as ops:
        model(x, y)[1].backward()
    assert ops.seen["native_layer_norm"] == {torch.float32}  # every LayerNorm (incl. q/k norms)
    assert ops.seen["_log_softmax"] == {torch.float32}  # the cross-entropy
    assert ops.seen["logsumexp"] == {torch.float32}  # the z-loss
    assert out_dtypes["embed_norm"] == torch.float32  # the residual stream starts fp32 ...
    assert out_dtypes["blocks.0"] == out_dtypes["blocks.1"] == torch.float32  # ... and stays fp32
    assert out_dtypes["blocks.0.attn"] == out_dtypes["blocks.0.mlp"] == torch.bfloat16  # branches bf16
    assert out_dtypes["final_norm"] == out_dtypes["head"] == torch.bfloat16


def test_counts_and_flops():
    tied, untied = GPT(tiny()), GPT(tiny(untied_head=True))
    assert untied.num_params() - tied.num_params() == 256 * 32
    c = tied.cfg
    n_matmul = tied.num_params() - c.seq_len * c.d_model
    assert tied.flops_per_token() == 6 * n_matmul + 12 * c.n_layer * c.d_model * c.seq_len
    # Untied: the token table is a lookup; the head does the same matmul work as the tied one.
    assert untied.flops_per_token() == tied.flops_per_token()


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(d_model=30, n_head=4), "d_model=30"),
        (dict(n_layer=0), "n_layer"),
        (dict(zero_init_head=True), "untied_head"),
        (dict(logit_softcap=0.0), "logit_softcap"),
        (dict(dtype="fp8"), "fp8"),
        (dict(dropout=1.0), "dropout"),
        (dict(norm="batchnorm"), "batchnorm"),
        (dict(activation="swiglu"), "swiglu"),
    ],
)
def test_config_rejects_bad_values(bad, match):
    with pytest.raises(ValueError, match=match):
        tiny(**bad)


def test_too_long_sequence_is_rejected():
    with pytest.raises(ValueError, match="seq_len=32"):
        GPT(tiny())(torch.zeros(1, 33, dtype=torch.long))
