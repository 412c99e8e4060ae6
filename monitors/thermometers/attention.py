"""Attention-logit thermometers: the probe slot, and explicit QK^T for torch.nn.MultiheadAttention.

The probe protocol (duck-typed, so `monitors` never imports `trainer`): an attention module
with a `thermo_probe` attribute reads `probe.mode` each forward (None = not sampled, or
"lse" / "exact" / "flex") and `probe.heads` (device index of the heads to compute
explicitly, None = all), then calls `probe.put_lse(lse[B, H, T])` or
`probe.put_scores_max(max[len(heads)])` with detached tensors; when `probe.entropy` is True it
also calls `probe.put_entropy(mean_entropy[heads])` (mean over batch and query positions, nats).
trainer.model implements it.

What the entropy figure is: attn_entropy_min = min over heads of that mean. Exact (to the
kernel's precision) when every head and sequence is computed. Samples otherwise: the
"lse"/"flex" probes cover the first `probe.entropy_batch` sequences of the micro-batch
(ThermometerConfig.attn_entropy_batch, 1 by default), so the mean is over those sequences;
with `attn_heads=k` the explicit path sees k heads a step, so the min over them is an upper
bound of the true min.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from thermowatch.monitors.thermometers.budget import ATTN, NullTimer
from thermowatch.monitors.thermometers.slots import Slots


class AttnProbe:
    """Writes one module's attention-logit figures into its slots: the max over batch, heads
    and query positions at `slot`, and with `per_head` one value per head after it."""

    def __init__(self, slots: Slots, slot: int, n_head: int, per_head: bool, entropy_slot: int | None = None) -> None:
        self.slots, self.slot, self.n_head, self.per_head = slots, slot, n_head, per_head
        self.entropy_slot = entropy_slot
        self.entropy = entropy_slot is not None  # the model computes the entropy when True
        self.entropy_batch: int | None = None  # sequences the extra entropy pass covers (None = all)
        self.mode: str | None = None  # set by Thermometers.begin_step on sampled steps
        self.heads: torch.Tensor | None = None
        # The budget's timer (budget.py). The puts time themselves; a model's own extra work for the
        # figure (an entropy pass, explicit scores) is counted where it wraps it in timer.start()
        # and timer.stop(ATTN) (regions nest: each counts once).
        self.timer = NullTimer()

    def put_entropy(self, ent: torch.Tensor) -> None:
        """ent: [heads computed] mean entropy per head; the slot keeps the min (over heads and
        over the step's micro-batches)."""
        if self.entropy_slot is not None:
            self.timer.start()
            self.slots.put_min(self.entropy_slot, ent.float().amin().reshape(1))
            self.timer.stop(ATTN)

    def put_lse(self, lse: torch.Tensor) -> None:
        self.timer.start()
        if self.per_head:
            per = lse.amax(dim=(0, 2))
            self.slots.put(self.slot + 1, per)
            self.slots.put(self.slot, per.amax().reshape(1))
        else:
            self.slots.put(self.slot, lse.amax().reshape(1))
        self.timer.stop(ATTN)

    def put_scores_max(self, m: torch.Tensor) -> None:
        self.put_head_max(m, self.heads)

    def put_head_max(self, m: torch.Tensor, heads: torch.Tensor | None) -> None:
        """m: max per head for `heads` (None = every head, in order). A figure that is not per
        head (m of one value where the module has several) fills only the module's slot."""
        self.timer.start()
        self.slots.put(self.slot, m.float().amax().reshape(1))
        if self.per_head:
            if heads is not None:
                self.slots.put_indexed(self.slot + 1, self.n_head, heads, m)
            elif m.numel() == self.n_head:
                self.slots.put(self.slot + 1, m)
        self.timer.stop(ATTN)


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default=None):
    if name in kwargs:
        return kwargs[name]
    return args[pos] if len(args) > pos else default


def mha_scores_max(mha: nn.MultiheadAttention, args: tuple, kwargs: dict, heads: torch.Tensor | None) -> torch.Tensor:
    """Exact max of the pre-softmax logits QK^T/sqrt(d) (+ an additive float mask; masked
    positions excluded) for `heads` of an nn.MultiheadAttention call, recomputed from its
    inputs: only the sampled heads' rows of the q/k projections. Returns [len(heads)] fp32.
    add_bias_kv's extra key is ignored."""
    return mha_scores_stats(mha, args, kwargs, heads, entropy=False)[0]


def softmax_entropy(scores: torch.Tensor) -> torch.Tensor:
    """Mean entropy (nats) per head of softmax(scores) over the last dim, [B, H, T, S] -> [H];
    -inf entries are masked keys (they add 0); a fully masked row (NaN) is left out.
    -sum(p log p) from one log_softmax: on CPU ~half the time of entr(softmax(.)), the cost of
    the found attention's figure on every sampled step (bench/thermometer_overhead_any.py)."""
    logp = torch.log_softmax(scores.float(), dim=-1)
    # exp of the clamped log-probabilities: exp(-inf) takes libm's slow path on CPU (x10 over the
    # 64K scores of a T 128 head group); a masked key's term is 0 either way (its log p -> 0).
    ent = -(logp.clamp(min=-80.0).exp() * logp.nan_to_num(nan=math.nan, neginf=0.0)).sum(-1)
    return ent.nanmean(dim=(0, 2))


@torch.no_grad()
def mha_scores_stats(
    mha: nn.MultiheadAttention, args: tuple, kwargs: dict, heads: torch.Tensor | None, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(mha_scores_max, mean softmax entropy per head or None) from one explicit QK^T."""
    query = _arg(args, kwargs, 0, "query")
    key = _arg(args, kwargs, 1, "key")
    key_padding_mask = _arg(args, kwargs, 3, "key_padding_mask")
    attn_mask = _arg(args, kwargs, 5, "attn_mask")
    is_causal = _arg(args, kwargs, 7, "is_causal", False)
    if query.dim() == 2:  # unbatched (T, E)
        query, key = query.unsqueeze(0), key.unsqueeze(0)
        key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
    elif not mha.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    e, n_head = mha.embed_dim, mha.num_heads
    hd = e // n_head
    heads = torch.arange(n_head, device=query.device) if heads is None else heads
    rows = (heads[:, None] * hd + torch.arange(hd, device=query.device)).reshape(-1)
    if mha._qkv_same_embed_dim:
        wq, wk = mha.in_proj_weight[:e], mha.in_proj_weight[e : 2 * e]
    else:
        wq, wk = mha.q_proj_weight, mha.k_proj_weight
    bias = mha.in_proj_bias
    bq, bk = (None, None) if bias is None else (bias[:e][rows], bias[e : 2 * e][rows])
    b, t, s = query.shape[0], query.shape[1], key.shape[1]
    k_sel = heads.numel()
    q = F.linear(query, wq[rows], bq).view(b, t, k_sel, hd).transpose(1, 2).float()
    k = F.linear(key, wk[rows], bk).view(b, s, k_sel, hd).transpose(1, 2).float()
    scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)  # [B, k, T, S]
    if attn_mask is not None:
        m = attn_mask if attn_mask.dim() == 2 else attn_mask.view(b, n_head, t, s)[:, heads]
        scores = scores.masked_fill(m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
    elif is_causal:
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    if key_padding_mask is not None:
        kpm = key_padding_mask[:, None, None, :]
        scores = scores.masked_fill(kpm, float("-inf")) if kpm.dtype == torch.bool else scores + kpm.float()
    return scores.amax(dim=(0, 2, 3)), softmax_entropy(scores) if entropy else None


# fp32 scores per chunk of heads (256 MB): bounds the explicit path's memory at long contexts.
_CHUNK_ELEMENTS = 1 << 26

_FUTURE: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _future(t: int, s: int, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """SDPA's top-left causal mask as an additive tensor (-inf = a key in the query's future, 0
    otherwise) in the scores' dtype, built once per shape: adding it costs a tenth of a broadcast
    masked_fill_ on CPU, and bf16 scores read a bf16 mask (half the bytes of an fp32 one)."""
    key = (t, s, device, dtype)
    m = _FUTURE.get(key)
    if m is None:
        if len(_FUTURE) > 64:  # many shapes (variable lengths): keep the newest only
            _FUTURE.clear()
        m = _FUTURE[key] = torch.full((t, s), float("-inf"), device=device, dtype=dtype).triu(1)
    return m


@torch.no_grad()
def sdpa_scores_stats(
    args: tuple, kwargs: dict, heads: torch.Tensor | None, n_seq: int | None, entropy: bool, lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Max per head of the pre-softmax logits of one `F.scaled_dot_product_attention` call,
    recomputed from its q and k with public ops: scale * q k^T (scale = 1/sqrt(E) unless given),
    plus its `attn_mask` (bool: False = masked; float: added) or, with `is_causal`, SDPA's
    top-left causal mask. For the query heads `heads` (None = all; under GQA each reads its key
    head) of the first `n_seq` sequences (None = all). Returns ([heads] fp32, mean softmax
    entropy per head or None). With `lse`, the max per head of each row's log-sum-exp instead
    (the fused path's figure, for calls it does not take: fused_call). Dropout is ignored: the
    logits are pre-dropout. Materialises the scores in chunks of heads of at most _CHUNK_ELEMENTS."""
    q, k = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key")
    mask = _arg(args, kwargs, 3, "attn_mask")
    is_causal = _arg(args, kwargs, 5, "is_causal", False)
    scale = _arg(args, kwargs, 6, "scale")
    t, s, e = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(e) if scale is None else scale
    if q.dim() < 4:  # (L, E) or (N, L, E): one head
        if mask is not None and mask.dim() == 3:
            mask = mask.unsqueeze(1)
        q, k = q.reshape(-1, 1, t, e), k.reshape(-1, 1, s, e)
    elif q.dim() > 4:  # (N, ..., H, L, E): the leading dims are all batch
        if mask is not None:
            mask = mask.expand(*q.shape[:-1], s).flatten(0, -4)
        q, k = q.flatten(0, -4), k.flatten(0, -4)
    if mask is not None:
        while mask.dim() < 4:
            mask = mask.unsqueeze(0)
    n = q.shape[0] if n_seq is None else min(n_seq, q.shape[0])
    q, k = q[:n], k[:n]
    if mask is not None and mask.shape[0] > 1:
        mask = mask[:n]
    group = q.shape[1] // k.shape[1]  # GQA: query heads per key head
    per_chunk = max(1, _CHUNK_ELEMENTS // max(1, n * t * s))
    whole = heads is None and group == 1 and q.shape[1] <= per_chunk  # no head to pick: no copies
    low = low_precision_scores(q)
    future = _future(t, s, q.device, torch.bfloat16 if low else torch.float32) if mask is None and is_causal else None
    if whole:  # the common case, one chunk: no head index, no concatenation
        sc = _masked_scores(q, k, scale, mask, future, low)
        return _row_max(sc, lse), softmax_entropy(sc) if entropy else None
    if heads is None:
        heads = torch.arange(q.shape[1], device=q.device)
    maxes, ents = [], []
    for hs in heads.split(per_chunk):  # one chunk unless the scores are very large
        m = mask if mask is None or mask.shape[1] == 1 else mask.index_select(1, hs)
        sc = _masked_scores(q.index_select(1, hs), k.index_select(1, hs // group if group > 1 else hs), scale, m, future,
                            low)
        maxes.append(_row_max(sc, lse))
        if entropy:
            ents.append(softmax_entropy(sc))
    return torch.cat(maxes), torch.cat(ents) if entropy else None


def _row_max(sc: torch.Tensor, lse: bool) -> torch.Tensor:
    """[n, h, L, S] scores -> [h]: the max, or with `lse` the max over rows of the row's fp32
    log-sum-exp (max <= lse <= max + ln(keys))."""
    return torch.logsumexp(sc.float(), dim=-1).amax(dim=(0, 2)) if lse else sc.amax(dim=(0, 2, 3))


def _masked_scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None,
                   future: torch.Tensor | None, low: bool = False) -> torch.Tensor:
    """scale * q k^T [n, h, L, S] (scaled on the smaller side), masked as SDPA masks: a bool
    `mask` (False = masked), a float one added, or the cached causal `future`. fp32, except bf16
    q and k on a GPU (`low`, low_precision_scores): there the product runs on the tensor cores in
    bf16, accumulated in fp32 as the attention kernel itself does, and is kept in bf16, so the
    max is read to 2^-8 of itself (0.4%: 50.0 +- 0.2), as autocast did to the fp32 copies' product
    anyway; the copies and an fp32 mask's bytes are saved (BENCHMARKS.md, issue 36 on a GPU)."""
    if low:
        return _mask(torch.matmul(q * scale, k.transpose(-1, -2)), mask, future)
    return _mask(torch.matmul(q.float() * scale, k.float().transpose(-1, -2)), mask, future)


def low_precision_scores(q: torch.Tensor) -> bool:
    """Whether the scores are taken in bf16 (see _masked_scores): bf16 inputs on a GPU. fp16 stays
    fp32: a blown-up logit past 65504 would read as inf, a false non-finite finding."""
    return q.dtype == torch.bfloat16 and q.is_cuda


def _mask(sc: torch.Tensor, mask: torch.Tensor | None, future: torch.Tensor | None) -> torch.Tensor:
    if mask is not None:
        return sc.masked_fill_(~mask, float("-inf")) if mask.dtype == torch.bool else sc.add_(mask.float())
    return sc if future is None else sc.add_(future)


@torch.no_grad()
def softmax_stats(
    logits: torch.Tensor, probs: torch.Tensor, n_seq: int | None, entropy: bool, lse: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An eager attention's own softmax (Hugging Face's eager_attention_forward, nanoGPT's
    non-flash path): its input is the scaled, masked logits, so their max is exact and costs one
    pass (an additive mask's large negatives never win over a key that takes part). Per head
    for [B, H, L, S], one value otherwise. The entropy comes from its output, over the first
    `n_seq` sequences (None = all). With `lse`, the rows' log-sum-exp in place of the max, as
    the fused path reads it (attention_with_lse)."""
    four = logits.dim() == 4
    if lse:
        row = torch.logsumexp(logits.float(), dim=-1)
        mx = row.amax(dim=(0, 2)) if four else row.amax().reshape(1)
    else:
        mx = logits.amax(dim=(0, 2, 3)) if four else logits.amax().reshape(1)
    if not entropy:
        return mx, None
    ent = torch.special.entr(probs[:n_seq].float()).sum(-1)
    return mx, ent.nanmean(dim=(0, 2)) if four else ent.nanmean().reshape(1)


# The fused kernel's log-sum-exp: the attention figure at the cost of the attention itself.

_FLASH, _EFFICIENT, _CUDNN = (int(b) for b in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                                                SDPBackend.CUDNN_ATTENTION))

# What a private op that is gone, renamed or refuses its arguments raises (a CUDA OutOfMemoryError,
# a RuntimeError too, is re-raised by the callers: the user's own call would have run out too).
OP_REFUSED = (AttributeError, NotImplementedError, RuntimeError, TypeError)


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                       is_causal: bool = True, own: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that also returns the row log-sum-exp [B, H, L] (fp32) of the scaled logits
    (top-left causally masked with `is_causal`): per row max <= lse <= max + ln(keys).

    Calls the fused kernel SDPA itself picks, through its private aten op, so the output (and
    its gradient) is the same as `F.scaled_dot_product_attention` (tested bit-exact on CPU) and
    the lse comes free. No public op returns it, so a torch whose op is gone or changed falls
    back to public ops (`public_attention_with_lse`: the same output, the lse from an explicit
    L x S pass), with a warning, rather than failing the step (issue 22). `own`: a pass of the
    thermometers' own, not the model's (fused_attention_with_lse).
    """
    try:
        return fused_attention_with_lse(q, k, v, scale, is_causal, own)
    except OP_REFUSED as exc:
        if isinstance(exc, torch.cuda.OutOfMemoryError):
            raise
        warnings.warn(f"thermowatch: torch's fused attention-with-lse op is unavailable here ({exc!r}); "
                      "the attention-logit LSE now costs an explicit T x T pass", stacklevel=2)
        return public_attention_with_lse(q, k, v, scale, is_causal)


def public_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                              is_causal: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """attention_with_lse from public ops only: SDPA for the output, an fp32 logsumexp over the
    (causal) scores, without gradient, for the lse."""
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    with torch.no_grad():
        future = _future(q.shape[-2], k.shape[-2], q.device) if is_causal else None
        lse = torch.logsumexp(_masked_scores(q, k, sc, None, future), dim=-1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale), lse


def fused_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                             is_causal: bool = True, own: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel SDPA dispatches to for a call without mask or dropout, called through its
    private aten op, which hands out the lse too. Raises when the op is gone or refuses the call.
    `own`: a pass of the thermometers' own (the entropy's, no grad, one sequence), not the model's
    call: on a GPU the flash kernel where it can, faster there than the cuDNN one SDPA picks
    (on an H200 0.31 vs 0.44 ms a layer at GPT-2 small, 0.24 vs 0.46 at 24L d2048 T2048)."""
    if q.device.type == "cpu":
        # aten::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal, *,
        #   attn_mask=None, scale=None) -> (output, logsumexp)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, is_causal, scale=scale)
    # The kernel SDPA picks for this call, as SDPA asks (its own flags, the sdpa_kernel context,
    # the device, the inputs' grad): on an H200 it picks cuDNN for bf16 where the flash op took
    # 1.5-1.8x its forward (BENCHMARKS.md), a cost on every read step the budget never saw.
    choice = -1 if own else torch._fused_sdp_choice(q, k, v, None, 0.0, is_causal, scale=scale)
    if choice == _CUDNN:
        # (output, logsumexp [B, H, L] or [B, H, L, 1], ...); compute_log_sumexp=True
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, is_causal, False,
                                                                 scale=scale)
        return out[0], out[1].reshape(q.shape[:3])
    if choice == _FLASH or (choice != _EFFICIENT and q.dtype in (torch.float16, torch.bfloat16)
                            and q.shape[-1] <= 256 and torch.backends.cuda.flash_sdp_enabled()):
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)
        return out[0], out[1]
    # Memory-efficient kernel: lse is padded to a multiple of 32 along L.
    out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, is_causal,
                                                                      scale=scale)[:2]
    return out, lse[..., : q.shape[-2]]


def fused_call(args: tuple, kwargs: dict) -> tuple | None:
    """An intercepted `F.scaled_dot_product_attention` call as (q, k, v, scale, is_causal) for
    fused_attention_with_lse, or None for a call that kernel path does not take the same way:
    a mask, dropout, GQA, not [B, H, L, E], a value width other than the key's, mixed dtypes,
    causal with L != S, the user's flash kernel switched off. Under autocast the inputs are cast
    as autocast casts SDPA's (it is on its lower-precision list), so the kernel and the output
    are the ones the user's call would get."""
    q, k, v = _arg(args, kwargs, 0, "query"), _arg(args, kwargs, 1, "key"), _arg(args, kwargs, 2, "value")
    if (_arg(args, kwargs, 3, "attn_mask") is not None or _arg(args, kwargs, 4, "dropout_p", 0.0) != 0.0
            or _arg(args, kwargs, 7, "enable_gqa", False)):
        return None
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 and not t.is_nested for t in (q, k, v)):
        return None
    is_causal = bool(_arg(args, kwargs, 5, "is_causal", False))
    if (q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]
            or v.shape[-1] != q.shape[-1] or (is_causal and q.shape[-2] != k.shape[-2])):
        return None
    dev = q.device.type
    flash, efficient = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled()
    if not (dev == "cpu" and flash or dev == "cuda" and (flash or efficient)):  # CPU's flash obeys the same switch
        return None
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        q, k, v = (t.to(dt) if t.is_floating_point() and t.dtype != torch.float64 else t for t in (q, k, v))
    if not (q.dtype == k.dtype == v.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16)):
        return None
    return q, k, v, _arg(args, kwargs, 6, "scale"), is_causal


@torch.no_grad()
def attention_entropy(q: torch.Tensor, k: torch.Tensor, scale: float | None = None,
                      is_causal: bool = True) -> torch.Tensor:
    """Mean (over batch and query positions) entropy of each head's (causal) attention
    distribution, in nats, [B, H, T, D] -> [H] fp32, without materialising T x T.

    Per row, H = lse - E_p[s] with s_j = scale * q.k_j, and E_p[s] = scale * q . (sum_j p_j k_j):
    the attention output with V = K. So one more fused forward pass (no gradient) gives it
    exactly, up to the kernel's precision. The keys are centred first (V = K - kbar, the
    q.kbar share added back in fp32): any constant shift is exact since sum_j p_j = 1, and the
    bf16 output then carries only the deviation, so lse - E_p[s] does not cancel large terms.
    """
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    kbar = k.mean(dim=-2, keepdim=True)
    out, lse = attention_with_lse(q, k, k - kbar, scale, is_causal, own=True)
    qf = q.float()
    mean_s = sc * ((qf * out.float()).sum(-1) + (qf * kbar.float()).sum(-1))
    return (lse.float() - mean_s).mean(dim=(0, 2))
