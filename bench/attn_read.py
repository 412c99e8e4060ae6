"""Where an attention read's time goes on a GPU (issue 36): one SDPA call's q and k at a given
shape, the pieces of monitors.thermometers.attention.sdpa_scores_stats timed with CUDA events
(median of --repeat), beside the SDPA forward itself. The read covers the first sequence
(ThermometerConfig.attn_entropy_batch 1): q, k [1, H, T, E].

    python bench/attn_read.py --heads 16 --seq-len 2048 --head-dim 128 --layers 24
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thermowatch.monitors.thermometers import attention as A  # noqa: E402


def timed(fn, repeat: int) -> float:
    out = []
    for _ in range(repeat + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out[3:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24, help="to scale a read of one layer to the model's")
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args()
    dev = torch.device("cuda")
    h, t, e = args.heads, args.seq_len, args.head_dim
    q, k, v = (torch.randn(args.batch, h, t, e, device=dev, dtype=torch.bfloat16) for _ in range(3))
    q1, k1 = q[:1], k[:1]
    scale = e ** -0.5
    fut32, fut16 = A._future(t, t, dev, torch.float32), A._future(t, t, dev, torch.bfloat16)
    sc16 = torch.matmul(q1 * scale, k1.transpose(-1, -2))
    sc32 = torch.matmul(q1.float() * scale, k1.float().transpose(-1, -2))
    rows = {
        "sdpa forward, whole batch (the model's own)": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        "q k^T fp32 (no autocast)": lambda: torch.matmul(q1.float() * scale, k1.float().transpose(-1, -2)),
        "q k^T fp32 copies under autocast (before)": lambda: _autocast(lambda: torch.matmul(q1.float() * scale, k1.float().transpose(-1, -2))),
        "q k^T bf16 (after)": lambda: torch.matmul(q1 * scale, k1.transpose(-1, -2)),
        "+ causal mask fp32 on bf16 scores (before)": lambda: sc16.clone().add_(fut32),
        "+ causal mask bf16 (after)": lambda: sc16.clone().add_(fut16),
        "  (the clone alone)": lambda: sc16.clone(),
        "amax bf16": lambda: sc16.amax(dim=(0, 2, 3)),
        "amax fp32": lambda: sc32.amax(dim=(0, 2, 3)),
        "entropy (softmax_entropy, every 10th read step)": lambda: A.softmax_entropy(sc16 + fut16),
        "whole read, before-like (fp32 copies, autocast)": lambda: _autocast(lambda: A.sdpa_scores_stats((q.float(), k.float()), {"is_causal": True}, None, 1, False)),
        "whole read, after": lambda: A.sdpa_scores_stats((q, k), {"is_causal": True}, None, 1, False),
        "whole read, after, with entropy": lambda: A.sdpa_scores_stats((q, k), {"is_causal": True}, None, 1, True),
        # the default since session 26: the call itself through the op that hands out its lse
        "sdpa forward through the lse op (the kernel path)": lambda: A.fused_attention_with_lse(q, k, v, None, True),
        "+ its figure: amax of the lse [B, H, T]": lambda: A.fused_attention_with_lse(q, k, v, None, True)[1].amax(),
        "entropy, one more fused pass over 1 sequence": lambda: A.attention_entropy(q1, k1, None, True),
        # as in training (inputs that need grad): the step's cost of a read step's kernel path
        "sdpa forward + backward, whole batch (the model's own)":
            lambda: F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(dy),
        "forward + backward through the lse op": lambda: A.fused_attention_with_lse(qg, kg, vg, None, True)[0].backward(dy),
    }
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dy = torch.randn_like(q)
    pick = torch._fused_sdp_choice(qg, kg, vg, None, 0.0, True)
    print(f"SDPA picks backend {pick} ({', '.join(f'{b.name}={int(b)}' for b in _BACKENDS)}) for these inputs with grad")
    print(f"q, k [1, {h}, {t}, {e}] bf16 on {torch.cuda.get_device_name()}, {args.layers} layers; ms per layer (x layers)")
    for name, fn in rows.items():
        ms = timed(fn, args.repeat)
        print(f"  {name:<52}{ms:8.3f}  ({ms * args.layers:7.2f})")


_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION)


def _autocast(fn):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return fn()


if __name__ == "__main__":
    main()
