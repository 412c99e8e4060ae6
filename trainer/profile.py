"""Throughput arithmetic for bench/trainer_throughput.py (the controller reports tokens/s, not MFU).

MFU = model FLOPs per token x tokens/s / peak FLOP/s (PaLM, appendix B). On a GPU the peak is
the datasheet's bf16 dense figure; a CPU has no such number worth trusting (it depends on the
ISA, the thread count and the clock under load), so `matmul_peak` measures one: the best
sustained FLOP/s of a square bf16 matmul with the threads a rank gets. That is the ceiling the
trainer's own GEMMs could reach on this machine, right now, which is what MFU should divide by.
"""

from __future__ import annotations

import time


def matmul_peak(n: int = 1024, dtype: str = "bfloat16", threads: int = 1, seconds: float = 1.0) -> float:
    """Best FLOP/s of an n x n x n matmul over ~`seconds` (2 n^3 FLOPs each)."""
    import torch

    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n).to(dt), torch.randn(n, n).to(dt)
    for _ in range(2):  # warm the kernel choice and the caches
        a @ b
    best, t_end = 0.0, time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
    return best


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float) -> float:
    return flops_per_token * tokens_per_s / peak_flops if peak_flops > 0 else float("nan")
