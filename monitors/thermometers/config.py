"""What the thermometers measure, and how often."""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch.nn as nn

# A transformer block in our GPT (`blocks.3`), torch.nn.TransformerEncoder (`layers.3`),
# HF GPT-2 (`transformer.h.3`) and Llama-style models (`model.layers.3`).
BLOCK_PATTERN = r"(^|\.)(blocks|layers|h)\.\d+$"

ATTN_MODES = ("lse", "exact", "flex")


@dataclass
class ThermometerConfig:
    """What the thermometers measure and how often: each field, its default and what it does are
    in docs/any-trainer.md ("What the thermometers measure"), and in the comment above it here."""

    # Modules whose output gets act_max/act_min, by qualified-name regex (re.search) ...
    act_patterns: tuple[str, ...] = (
        r"(^|\.)embed_norm$",  # YaLM's LayerNorm after the embeddings
        BLOCK_PATTERN,  # residual stream after each block
        r"\.(attn|self_attn|attention)$",  # attention outputs
        r"\.(mlp|ffn|feed_forward)$",  # MLP outputs
        r"(^|\.)(final_norm|ln_f|norm)$",  # the last norm before the head
        r"(^|\.)(head|lm_head)$",  # the logits
    )
    # ... or by type: foreign models name their attention freely, the class is stable.
    act_types: tuple[type, ...] = (nn.MultiheadAttention,)
    # Modules whose output is logits: z/<module> = max over tokens of logsumexp over the vocab.
    z_patterns: tuple[str, ...] = (r"(^|\.)(head|lm_head)$",)
    # Sequences of the logits z covers (the first n of a [B, T, V] output; None = all, exact).
    # A sample, like the attention figure's: the logit scale that z witnesses rises everywhere,
    # while one fp32 logsumexp over B x T x V was the largest thermometer on a GPU (+20% of a
    # GPT-2-small step on an H100 for B 16 T 1024, bench/thermometer_overhead_any.py).
    z_batch: int | None = 1
    # Attention modules: every module exposing a `thermo_probe` slot (trainer.model's attention),
    # these types (nn.MultiheadAttention: explicit QK^T recomputed from its inputs; any other
    # class: its SDPA or softmax calls intercepted, or an error at instrument() if it makes none),
    # and with attn_find every module whose forward calls F.scaled_dot_product_attention or
    # Hugging Face's attention functions (intercept.py). A found module's figure follows
    # attn_mode: "lse", attn_logit_lse, its SDPA kernel's own log-sum-exp (the call runs through
    # the private op that hands it out; a call with a mask, dropout or GQA gets it from an
    # explicit q k^T of the first attn_entropy_batch sequences); "exact", attn_logit_max, an
    # explicit fp32 max of q k^T over attn_heads heads of every sequence; under an eager softmax,
    # the rows' lse (or max) of its input over the whole batch.
    attn_types: tuple[type, ...] = (nn.MultiheadAttention,)
    attn_find: bool = True
    # How probe and found modules measure: "lse" = the fused kernel's log-sum-exp, a bound
    # max <= lse <= max + ln(keys), free (no T x T); "exact" = explicit QK^T (T x T per head);
    # "flex" = FlexAttention max_scores, exact and fused, CUDA only (a found module: an
    # explicit max of the first attn_entropy_batch sequences).
    attn_mode: str = "lse"
    # Heads per attention module the explicit QK^T path computes each sampled step, rotating
    # through all heads step by step; None = every head (then the max is exact, not a sample).
    attn_heads: int | None = None
    per_head: bool = False  # also one key per head: `<metric>/<module>.heads.<h>`
    # attn_entropy_min/<module>: min over heads of the mean (over batch and query positions)
    # attention entropy in nats (ViT-22B: entropy collapse witnesses harmful logit growth).
    # Sampled with the attention group. "lse"/"flex" probes: one extra fused forward attention
    # pass without gradient (trainer.model.attention_entropy), exact for the sequences it sees;
    # "exact" mode and nn.MultiheadAttention: from the explicit softmax of the heads computed
    # that step, over the whole batch (no extra cost: the T x T scores exist already).
    attn_entropy: bool = True
    # Sampled every attn_entropy_every steps (on attention steps: step % it == 0 and
    # step % attn_every == 0); NaN in between, which the witness skips as it does the update
    # ratio's. Entropy collapse is a slow witness, read as a median of its last points against
    # a baseline: one step in 10 keeps its trend, where every step was the largest single cost
    # of a found attention's figure on CPU (~1.5% of a 4L d128 step, bench/thermometer_overhead_any.py).
    attn_entropy_every: int = 10
    # Sequences of each micro-batch the extra pass covers (the first n); None = all (exact).
    # Also the sequences a found module's q k^T covers outside attn_mode "exact".
    # 1: the pass costs 1/B of an attention forward, and the mean over one sequence's T query
    # positions is a sample that still shows a collapse (measured: bench/thermometer_overhead.py,
    # +9% of a CPU step for the whole batch of 8 at T 128).
    attn_entropy_batch: int | None = 1
    # Modules whose parameters get grad_norm/<module> (a parameter counts in every match).
    grad_patterns: tuple[str, ...] = (BLOCK_PATTERN, r"(^|\.)(embed|head|lm_head)$")
    # Sampling intervals per group, in steps (step % every == 0 is sampled). 1 = every step:
    # a divergence can take off within tens of steps (PaLM restarts ~100 steps before a spike).
    # Under a budget, a group left at 1 is the budget's to thin; one set above 1 stays there.
    # Without one, a cadence above 1 puts `thermometer_every/<group>` in the vector, so what a
    # step did not read is absent from the record (unread.py), not NaN. Either way the global
    # grad_norm is read on every step whose end_step was not handed the loop's own before.
    act_every: int = 1
    attn_every: int = 1
    grad_every: int = 1
    # The fraction of the step's time the thermometers may take (issue 36: at ~11% of a GPT-2
    # small step on an H100 they cost what the supervisor saves). Each group's cost is measured
    # on the device (budget.py) and every 32 steps the act, attn and grad cadences double until
    # they fit, within floors: the attention figure at least every 4th step, loss, lr and the
    # global gradient norm every step (the grad group too, unless end_step is handed grad_norm),
    # activations and per-layer gradient norms at least every budget_max_every-th step. Where
    # the floors exceed it they win, and a warning says so. None: the fixed cadences, unmeasured.
    # On by default (issue 36): a thinned group's figures are absent from the record, not NaN
    # (unread.py), and the detectors know the cadence; on the divergence grid replayed at the
    # floors' cadence every damaged run is still acted on and no healthy one (BENCHMARKS.md).
    budget: float | None = 0.01
    # The slowest activations and per-layer gradient norms are read under a budget (a power of two).
    budget_max_every: int = 16
    # update_ratio/<module> = ||W_after - W_before|| / ||W_before|| over the module's parameters
    # (same modules as grad_patterns; plain `update_ratio` = the whole model), measured around
    # the optimizer step by Thermometers.measure_update(). Exact, from a copy of the weights
    # held across the step (update.py): this rank's ZeRO-3 shard, or with update_split its
    # 1/world slice, so 2 bytes per parameter / world in bf16. Sampled every `update_every`
    # steps (k-th step only; unmeasured steps carry NaN, which no detector reads as a finding:
    # the witness skips non-finite points). Every step cost +2% of a CPU step at vocab 256 and
    # +8% at 32k (bench/thermometer_overhead.py), the largest of the new thermometers; a
    # ratio of update to weight moves with the LR schedule over hundreds of steps, so one
    # sample in 10 keeps its trend for a tenth of the cost.
    update_ratio: bool = True
    update_every: int = 10
    # Ranks hold identical weights (DDP, ZeRO 1/2): each copies 1/world of every tensor and the
    # sums are all-reduced. The trainer's worker sets it for ZeRO 1/2; wrong for tensor parallel.
    update_split: bool = False

    def __post_init__(self) -> None:
        for name in ("act_patterns", "z_patterns", "grad_patterns"):
            for pat in getattr(self, name):
                try:
                    re.compile(pat)
                except re.error as exc:
                    raise ValueError(f"ThermometerConfig.{name}: bad regex {pat!r}: {exc}") from exc
        for name in ("act_types", "attn_types"):
            for t in getattr(self, name):
                if not (isinstance(t, type) and issubclass(t, nn.Module)):
                    raise ValueError(f"ThermometerConfig.{name} must hold nn.Module classes, got {t!r}")
        if self.attn_mode not in ATTN_MODES:
            raise ValueError(f"ThermometerConfig.attn_mode={self.attn_mode!r} is not one of {ATTN_MODES}")
        for name in ("attn_heads", "attn_entropy_batch", "z_batch"):
            val = getattr(self, name)
            if val is not None and (isinstance(val, bool) or not isinstance(val, int) or val < 1):
                raise ValueError(f"ThermometerConfig.{name} must be an integer >= 1 or None, got {val!r}")
        for name in ("act_every", "attn_every", "attn_entropy_every", "grad_every", "update_every", "budget_max_every"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val < 1:
                raise ValueError(f"ThermometerConfig.{name} must be an integer >= 1, got {val!r}")
        b = self.budget
        if b is not None:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 1:
                raise ValueError(f"ThermometerConfig.budget must be a fraction of the step in (0, 1] (0.01 = 1%), "
                                 f"or None for the fixed *_every cadences; got {b!r}")
        val = self.budget_max_every
        if val & (val - 1):
            raise ValueError(f"ThermometerConfig.budget_max_every must be a power of two (the groups' reads then "
                             f"align), got {val}: use {1 << (val.bit_length() - 1)} or {1 << val.bit_length()}")

    def matches(self, patterns: tuple[str, ...], name: str) -> bool:
        return any(re.search(p, name) for p in patterns)
