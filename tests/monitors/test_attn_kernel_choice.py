"""The attention figure's kernel path on a GPU runs the kernel SDPA itself picks (cuDNN, flash or
memory-efficient), so a read step's attention is the user's own call: the same output, the same
gradient, and the row log-sum-exp of the scaled, causally masked logits beside it."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from thermowatch.monitors.thermometers import attention as A

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the kernel choice is CUDA's")


def _inputs(seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    return tuple((torch.randn(2, 4, 256, 64, device="cuda", generator=g) * 2).bfloat16() for _ in range(4))


def _lse_fp32(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    sc = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    t = q.shape[-2]
    sc = sc.masked_fill(torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1), -math.inf)
    return torch.logsumexp(sc, dim=-1)


@pytest.mark.parametrize("backend", [None, SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                                     SDPBackend.EFFICIENT_ATTENTION])
def test_the_kernel_path_is_the_users_own_call_with_its_lse(backend):
    q0, k0, v0, dy = _inputs()
    ours = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    theirs = [t.clone().requires_grad_() for t in (q0, k0, v0)]
    ctx = sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext()  # None: SDPA's own pick
    with ctx:
        picked = torch._fused_sdp_choice(*theirs, None, 0.0, True)
        if backend is not None and picked != int(backend):
            pytest.skip(f"{backend.name} does not take this call on this GPU")
        try:
            want = F.scaled_dot_product_attention(*theirs, is_causal=True)
        except RuntimeError as exc:  # no kernel of that kind here
            pytest.skip(f"{backend}: {exc}")
        out, lse = A.fused_attention_with_lse(*ours, None, True)
    assert torch.equal(out, want)  # the same kernel: bit for bit
    assert lse.shape == q0.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(lse, _lse_fp32(q0, k0), atol=3e-2, rtol=0)
    out.backward(dy)
    want.backward(dy)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.grad, b.grad, atol=2e-2, rtol=2e-2)


def test_the_entropy_pass_of_its_own_matches_the_explicit_softmax():
    q, k, _, _ = _inputs(1)
    q, k = q[:1], k[:1]
    got = A.attention_entropy(q, k, None, True)  # its own pass: the flash kernel, not SDPA's pick
    sc = torch.matmul(q.float(), k.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    sc = sc.masked_fill(torch.ones(256, 256, dtype=torch.bool, device="cuda").triu(1), -math.inf)
    want = torch.special.entr(torch.softmax(sc, dim=-1)).sum(-1).mean(dim=(0, 2))
    torch.testing.assert_close(got, want, atol=5e-2, rtol=2e-2)
