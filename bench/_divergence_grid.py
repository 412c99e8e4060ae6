"""The run list of bench/divergence.py (issue 8's harder grid), per architecture and seed.

What each run stands for is in its tag; whether it diverged is NOT taken from the tag but from
its loss curve (bench/divergence.py, GROUND TRUTH). LRs are for the grid's model (3 layers,
d_model 64, 4 heads, 64-token windows, batch 16, AdamW, clip 1.0).
"""

from __future__ import annotations

from _divergence_runs import RunSpec

ARCHS = {"ln-gelu": ("layernorm", "gelu"), "rms-relu2": ("rmsnorm", "relu2")}

# (tag, RunSpec keyword arguments). Steps are kept small where the phenomenon allows, so the
# whole grid (2 architectures x 3 seeds) records in under 15 minutes on 2 cores.
RUNS: tuple[tuple[str, dict], ...] = (
    ("healthy-long", dict(peak_lr=1e-3, steps=1500)),  # slow healthy logit drift (4 -> ~20)
    ("healthy", dict(peak_lr=3e-3, steps=400)),
    ("healthy-cosine", dict(peak_lr=1e-2, steps=600, decay="cosine")),
    # Logits rise to ~300 and fall back below 50 while the loss keeps improving (issue 8's
    # "healthy rise-and-fall"), as the cosine schedule lowers the LR.
    ("rise-and-fall", dict(peak_lr=3e-2, steps=1000, decay="cosine")),
    ("logit-growth", dict(peak_lr=3e-2, steps=300)),
    ("late", dict(peak_lr=1e-1, warmup_steps=400, steps=700)),  # long warm-up to a high LR
    ("jump", dict(peak_lr=1e-3, steps=500, jump_at=250, jump_factor=30.0)),  # mid-run LR jump
    ("jump-qkln", dict(peak_lr=1e-3, steps=500, jump_at=250, jump_factor=100.0, qk_layernorm=True)),
    ("qkln-high-lr", dict(peak_lr=1e-1, steps=400, qk_layernorm=True)),  # degrades, no logit growth
)


def grid(seeds: int, archs: list[str]) -> list[RunSpec]:
    out = []
    for arch in archs:
        norm, act = ARCHS[arch]
        for seed in range(seeds):
            for tag, kw in RUNS:
                out.append(RunSpec(seed=seed, norm=norm, activation=act, tag=tag, **kw))
    return out
