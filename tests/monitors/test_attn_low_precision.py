"""The attention figure's scores in bf16 (issue 36: on a GPU under autocast the fp32 copies of q and
k were cast back to bf16 by autocast anyway, and an fp32 causal mask doubled the bytes of the T x T
passes): the bf16 product reads the max to 2^-8 of itself, the mask in the scores' dtype masks
exactly what SDPA masks, and only bf16 on a GPU takes that path (fp16 would overflow to inf)."""

from __future__ import annotations

import math

import torch

from thermowatch.monitors.thermometers import attention as A


def _causal_max_fp64(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    sc = torch.matmul(q.double() * scale, k.double().transpose(-1, -2))
    t = q.shape[-2]
    sc = sc.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), -math.inf)
    return sc.amax(dim=(0, 2, 3))


def test_bf16_scores_read_the_max_within_their_rounding_and_mask_the_future():
    torch.manual_seed(0)
    q = (torch.randn(1, 4, 64, 16) * 3).bfloat16()
    k = (torch.randn(1, 4, 64, 16) * 3).bfloat16()
    k[0, :, -1] *= 40  # the largest logits sit at the last key, in every query's future but the last's
    scale = 16 ** -0.5
    want = _causal_max_fp64(q, k, scale)
    fut = A._future(64, 64, q.device, torch.bfloat16)
    assert fut.dtype == torch.bfloat16 and fut[0, 1] == -math.inf and fut[1, 0] == 0
    got = A._masked_scores(q, k, scale, None, fut, low=True)
    assert got.dtype == torch.bfloat16
    mx = got.float().amax(dim=(0, 2, 3))
    assert torch.allclose(mx.double(), want, rtol=2 ** -7), (mx, want)
    # without the mask the future key would win: the masked figure is not the unmasked one
    assert (torch.matmul(q.float() * scale, k.float().transpose(-1, -2)).amax(dim=(0, 2, 3)) > 2 * want).all()


def test_only_bf16_on_a_gpu_is_read_in_low_precision():
    assert not A.low_precision_scores(torch.zeros(1, dtype=torch.bfloat16))  # CPU: fp32 as before
    assert not A.low_precision_scores(torch.zeros(1, dtype=torch.float16))
    assert not A.low_precision_scores(torch.zeros(1))


def test_the_cpu_figure_is_still_fp32_and_exact():
    torch.manual_seed(1)
    q, k = torch.randn(2, 3, 32, 8), torch.randn(2, 3, 32, 8)
    mx, ent = A.sdpa_scores_stats((q, k), {"is_causal": True}, None, 1, True)
    assert torch.allclose(mx.double(), _causal_max_fp64(q[:1], k[:1], 8 ** -0.5), rtol=1e-6)
    assert ent is not None and ent.shape == (3,) and torch.isfinite(ent).all()
