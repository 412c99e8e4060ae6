"""The run list of bench/divergence.py (issue 8's harder grid), per architecture and seed.

What each run stands for is in its tag; whether it diverged is NOT taken from the tag but from
its loss curve (bench/divergence.py, GROUND TRUTH). LRs are for the grid's model (3 layers,
d_model 64, 4 heads, 64-token windows, batch 16, AdamW, clip 1.0).
"""

from __future__ import annotations

from _divergence_runs import RunSpec

ARCHS = {"ln-gelu": ("layernorm", "gelu"), "rms-relu2": ("rmsnorm", "relu2")}

# (tag, RunSpec keyword arguments, seeds it runs for: None = all). Steps are kept small where
# the phenomenon allows, so the whole grid (2 architectures x 3 seeds) records in about 15
# minutes on 2 idle cores (~0.05 s per step per core with every thermometer on).
RUNS: tuple[tuple[str, dict, tuple[int, ...] | None], ...] = (
    ("healthy-long", dict(peak_lr=1e-3, steps=1500), (0,)),  # slow healthy logit drift, 1,500 steps
    ("healthy", dict(peak_lr=3e-3, steps=400), None),
    # Logits rise to ~300 and fall back while the loss keeps improving (issue 8's "healthy
    # rise-and-fall"), as the cosine schedule lowers the LR.
    ("rise-and-fall", dict(peak_lr=3e-2, steps=700, decay="cosine"), None),
    ("logit-growth", dict(peak_lr=3e-2, steps=300), None),
    ("late", dict(peak_lr=1e-1, warmup_steps=300, steps=600), None),  # long warm-up to a high LR
    ("jump", dict(peak_lr=1e-3, steps=400, jump_at=200, jump_factor=30.0), None),  # mid-run LR jump
    ("jump-qkln", dict(peak_lr=1e-3, steps=400, jump_at=200, jump_factor=100.0, qk_layernorm=True), None),
    ("qkln-high-lr", dict(peak_lr=1e-1, steps=300, qk_layernorm=True), None),  # degrades, no logit growth
    # An operator's raise x4 at step 200 whose cost should be transient (issue 24, item 2): the
    # LR-jump detector must leave it alone unless the loss stays behind its pre-raise trend.
    ("jump-x4", dict(peak_lr=1e-3, steps=500, jump_at=200, jump_factor=4.0), None),
    # Issue 24, items 1 and 3. qk-LN models compare only with qk-LN models (another model
    # config), so the qk-LN family gets its own healthy run to be compared with; ...
    ("healthy-qkln", dict(peak_lr=3e-3, steps=400, qk_layernorm=True), None),
    # ... a qk-LN run at an LR that degrades it with no logit growth (ends >= 0.3 nats behind);
    ("qkln-degrade", dict(peak_lr=3e-1, steps=400, qk_layernorm=True), None),
    # ... and one that runs behind, then blows up over ~20-50 steps as its long warm-up takes the
    # LR past ~0.6 (loss and gradient norm rising together, logits bounded by qk-LN).
    ("qkln-blowup", dict(peak_lr=1.0, warmup_steps=300, steps=400, qk_layernorm=True), None),
)


def grid(seeds: int, archs: list[str]) -> list[RunSpec]:
    out = []
    for arch in archs:
        norm, act = ARCHS[arch]
        for seed in range(seeds):
            for tag, kw, only in RUNS:
                if only is None or seed in only:
                    out.append(RunSpec(seed=seed, norm=norm, activation=act, tag=tag, **kw))
    return out
