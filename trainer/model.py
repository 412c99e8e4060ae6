"""A nanoGPT-style GPT decoder with the YaLM / modded-nanogpt stabilizations, in one file.

Precision (YaLM-100B: bf16 weights, precision-critical ops in fp32):
- weights and matmuls in `GPTConfig.dtype` (bf16 by default);
- every LayerNorm / RMSNorm (`GPTConfig.norm`) computes in fp32 and casts back to the matmul dtype;
- the residual stream is fp32: `blocks.{i}` outputs fp32 and each block adds its branch in fp32;
- the attention softmax is fp32: the fused SDPA kernels accumulate in fp32 for bf16 inputs
  (`opmath_type`, aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), the explicit path casts;
- the cross-entropy (log-softmax) and the z-loss run on fp32 logits.

Positions: a learned `pos_embed` table (nanoGPT), not rotary: simpler, and it keeps every
module a plain nn.Module the thermometers can hook.

Stable module names (thermometers and the supervisor rely on them): `embed`, `pos_embed`,
`embed_norm`, `blocks.{i}` (output = fp32 residual stream after block i), `blocks.{i}.attn`,
`blocks.{i}.mlp`, `final_norm`, `head` (pre-softcap logits).

Attention probe: each `CausalSelfAttention` carries `thermo_probe` (None by default). A
thermometer (monitors.thermometers) puts an object there; on a sampled step its `mode` says
what to measure and the module calls it back with detached tensors, never a host sync:
- "lse":   the same fused kernel SDPA dispatches to, called through its private aten op so it
           also returns the row log-sum-exp (public ops if that op is gone: attention_with_lse);
           `probe.put_lse(lse[B, H, T])`.
- "exact": plain SDPA plus an explicit fp32 QK^T/sqrt(d) for `probe.heads` (None = all);
           `probe.put_scores_max(max[H_sampled])` (the last resort: materialises T x T).
- "flex":  FlexAttention with AuxRequest(max_scores=True), exact, CUDA only;
           `probe.put_scores_max(max[H])`.
With `probe.entropy` the module also calls `probe.put_entropy(mean_entropy[H])`
(`attention_entropy` over the first `probe.entropy_batch` sequences, None = all: one more fused
forward pass; in "exact" mode from the explicit softmax, all sequences).

z probe: `head.thermo_z_probe` (None by default). When set and `on`, the model hands it the
per-token log-sum-exp of the head's logits, `probe.put_lse(lse[...])`: from the loss's own
log-softmax when there is no soft-cap (no pass over the vocabulary), else a logsumexp over the
fp32 logits the model holds anyway (no copy of its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

# The fused kernel's attention with its lse, and the entropy from one more fused pass, are the
# thermometers' (any model's SDPA calls are read the same way: intercept.py); re-exported here.
from thermowatch.monitors.thermometers.attention import attention_entropy, attention_with_lse

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
_NORMS = ("layernorm", "rmsnorm")
_ACTIVATIONS = ("gelu", "relu2")


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens: no tokenizer to ship or version
    seq_len: int = 256  # context length; the learned pos_embed table has this many rows
    n_layer: int = 6  # small enough to train on a CPU in tests, deep enough for per-layer plots
    n_head: int = 6
    d_model: int = 384  # nanoGPT's "baby GPT" width
    mlp_ratio: int = 4  # GPT-2 / nanoGPT hidden width = 4 * d_model
    dropout: float = 0.0  # YaLM: turning dropout off gave +15% speed, no quality loss at scale
    untied_head: bool = False  # modded-nanogpt unties embed/head (+quality, same active params)
    zero_init_head: bool = False  # modded-nanogpt: start from uniform predictions; needs untied_head
    logit_softcap: float | None = None  # Gemma 2 / modded-nanogpt: cap * tanh(logits / cap)
    value_residual: bool = False  # modded-nanogpt: mix block 0's values into every later block
    qk_layernorm: bool = False  # LayerNorm on q and k bounds the attention logits (ViT-22B)
    z_loss: float = 0.0  # PaLM uses 1e-4 * log(Z)^2 to keep the softmax normaliser near 0
    dtype: str = "bfloat16"  # weight dtype; YaLM trains bf16 with fp32 critical ops
    # Every norm layer (embed_norm, ln1/ln2, final_norm, the q/k norms): "layernorm" (nanoGPT,
    # YaLM) or "rmsnorm" (LLaMA, modded-nanogpt: no mean, no bias). Both compute in fp32.
    norm: str = "layernorm"
    # MLP nonlinearity: "gelu" (GPT-2, nanoGPT) or "relu2" = relu(x)^2 (Primer; modded-nanogpt).
    activation: str = "gelu"

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "mlp_ratio"):
            val = getattr(self, name)
            if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {val!r}")
        if self.d_model % self.n_head:
            raise ValueError(
                f"GPTConfig.d_model={self.d_model} is not divisible by n_head={self.n_head}; "
                "pick d_model a multiple of n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if self.zero_init_head and not self.untied_head:
            raise ValueError(
                "GPTConfig.zero_init_head=True needs untied_head=True (a tied head would zero "
                "the token embedding too)"
            )
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise ValueError(f"GPTConfig.logit_softcap must be > 0 or None, got {self.logit_softcap!r}")
        if not self.z_loss >= 0.0:
            raise ValueError(f"GPTConfig.z_loss must be >= 0, got {self.z_loss!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"GPTConfig.dtype={self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.norm not in _NORMS:
            raise ValueError(f"GPTConfig.norm={self.norm!r} is not one of {list(_NORMS)}")
        if self.activation not in _ACTIVATIONS:
            raise ValueError(f"GPTConfig.activation={self.activation!r} is not one of {list(_ACTIVATIONS)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]


class FP32LayerNorm(nn.LayerNorm):
    """LayerNorm computed in fp32 whatever the weight/input dtype (YaLM), output in `out_dtype`
    (None = the input's dtype). `embed_norm` keeps fp32: it starts the fp32 residual stream."""

    def __init__(self, dim: int, out_dtype: torch.dtype | None = None) -> None:
        super().__init__(dim)
        self.out_dtype = out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.float() if self.weight is not None else None
        b = self.bias.float() if self.bias is not None else None
        y = F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps)
        return y.to(self.out_dtype or x.dtype)


class FP32RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019; LLaMA, modded-nanogpt) with a learned gain, computed in
    fp32 like FP32LayerNorm, output in `out_dtype` (None = the input's dtype)."""

    def __init__(self, dim: int, out_dtype: torch.dtype | None = None, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.out_dtype = eps, out_dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps)
        return y.to(self.out_dtype or x.dtype)


def make_norm(cfg: GPTConfig, dim: int, out_dtype: torch.dtype | None = None) -> nn.Module:
    """The norm layer `cfg.norm` names; the module names stay the same for either kind."""
    if cfg.norm == "rmsnorm":
        return FP32RMSNorm(dim, out_dtype)
    return FP32LayerNorm(dim, out_dtype)


def causal_scores_stats(
    q: torch.Tensor, k: torch.Tensor, scale: float, entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Exact per-head max of the causal pre-softmax logits QK^T * scale, and (with `entropy`) the
    mean over batch and query positions of the softmax entropy in nats: [B, H, T, D] -> ([H], [H])
    fp32. Materialises [B, H, T, T]: only for the few heads a thermometer samples, and for tests."""
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    t_q, t_k = s.shape[-2], s.shape[-1]
    future = torch.ones(t_q, t_k, dtype=torch.bool, device=s.device).triu(1 + t_k - t_q)
    s = s.masked_fill(future, float("-inf"))
    ent = torch.special.entr(torch.softmax(s, dim=-1)).sum(-1).mean(dim=(0, 2)) if entropy else None
    return s.amax(dim=(0, 2, 3)), ent


def causal_scores_max(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Exact max of the causal pre-softmax logits per head: [B, H, T, D] -> [H] (fp32)."""
    return causal_scores_stats(q, k, scale)[0]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_head, self.head_dim = cfg.n_head, cfg.d_model // cfg.n_head
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        # qk-norm (ViT-22B); of the kind `cfg.norm` names, so "rmsnorm" means QK-RMSNorm.
        self.q_norm = make_norm(cfg, self.head_dim) if cfg.qk_layernorm else None
        self.k_norm = make_norm(cfg, self.head_dim) if cfg.qk_layernorm else None
        # Learned mix of this block's values with block 0's (modded-nanogpt value residual).
        # Block 0 only hands its values on: no parameter there, since an unused one breaks
        # DDP / ZeRO gradient bookkeeping.
        self.v_mix = nn.Parameter(torch.tensor([0.5, 0.5])) if cfg.value_residual and layer > 0 else None
        self.dropout = cfg.dropout
        self.thermo_probe = None  # set by monitors.thermometers; see the module docstring
        self._flex_mask = None  # (key, BlockMask) for the "flex" probe mode

    def forward(self, x: torch.Tensor, values: list[torch.Tensor] | None = None) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if values is not None:  # value residual: block 0 appends its v, later blocks mix it in
            if self.v_mix is not None:
                v = self.v_mix[0] * v + self.v_mix[1] * values[0]
            else:
                values.append(v)
        y = self._attend(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        probe = self.thermo_probe
        mode = None if probe is None else probe.mode
        drop = self.dropout if self.training else 0.0
        if mode == "lse" and drop == 0.0:
            y, lse = attention_with_lse(q, k, v, self.scale)
            probe.put_lse(lse.detach())
            if probe.entropy:  # over the first entropy_batch sequences (None = all)
                n = probe.entropy_batch
                probe.put_entropy(attention_entropy(q[:n].detach(), k[:n].detach(), self.scale))
            return y
        if mode == "flex":  # untested here (CPU only); compile the model for a fused kernel
            from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

            t = q.shape[-2]
            if self._flex_mask is None or self._flex_mask[0] != (t, q.device):  # built once per shape
                mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, t, t, device=q.device)
                self._flex_mask = ((t, q.device), mask)
            y, aux = flex_attention(
                q, k, v, block_mask=self._flex_mask[1], scale=self.scale, return_aux=AuxRequest(max_scores=True)
            )
            probe.put_scores_max(aux.max_scores.detach().amax(dim=(0, 2)))
            if probe.entropy:
                n = probe.entropy_batch
                probe.put_entropy(attention_entropy(q[:n].detach(), k[:n].detach(), self.scale))
            return y
        if mode == "exact" or mode == "lse":  # "lse" with dropout: the exact max (within the bound)
            heads = probe.heads
            with torch.no_grad():
                qs, ks = (q, k) if heads is None else (q[:, heads], k[:, heads])
                mx, ent = causal_scores_stats(qs, ks, self.scale, probe.entropy)
                probe.put_scores_max(mx)
                if ent is not None:  # the sampled heads' entropy (pre-dropout distribution)
                    probe.put_entropy(ent)
        return F.scaled_dot_product_attention(q, k, v, dropout_p=drop, is_causal=True, scale=self.scale)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)
        self.relu2 = cfg.activation == "relu2"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        # relu(x)^2: Primer (So et al. 2021), modded-nanogpt's MLP.
        return self.proj(F.relu(h).square() if self.relu2 else F.gelu(h))


class Block(nn.Module):
    """Pre-LN block; the residual stream `x` stays fp32, the branches run in the weight dtype."""

    def __init__(self, cfg: GPTConfig, layer: int = 0) -> None:
        super().__init__()
        wdt = cfg.torch_dtype
        self.ln1, self.ln2 = make_norm(cfg, cfg.d_model, wdt), make_norm(cfg, cfg.d_model, wdt)
        self.attn, self.mlp = CausalSelfAttention(cfg, layer), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, values: list[torch.Tensor] | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), values)).float()
        return x + self.drop(self.mlp(self.ln2(x))).float()


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.embed_norm = make_norm(cfg, cfg.d_model, torch.float32)  # YaLM: LN after embeddings
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.final_norm = make_norm(cfg, cfg.d_model, cfg.torch_dtype)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.head.thermo_z_probe = None  # set by monitors.thermometers; see the module docstring
        if not cfg.untied_head:
            self.head.weight = self.embed.weight
        self._init_weights()
        self.to(cfg.torch_dtype)

    def _init_weights(self) -> None:
        # nanoGPT: N(0, 0.02); residual projections scaled by 1/sqrt(2 * n_layer) (GPT-2 paper).
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * self.cfg.n_layer) if name.endswith(".proj.weight") else 0.02
                nn.init.normal_(p, mean=0.0, std=std)
        if self.cfg.zero_init_head:
            nn.init.zeros_(self.head.weight)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        """idx, targets: LongTensor [B, T]. Returns (logits [B, T, V] fp32, loss fp32 scalar | None)."""
        b, t = idx.shape
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence length {t} exceeds GPTConfig.seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.embed_norm(self.embed(idx) + self.pos_embed(pos)))
        values: list[torch.Tensor] | None = [] if self.cfg.value_residual else None
        for block in self.blocks:
            x = block(x, values)
        logits = self.head(self.final_norm(x)).float()  # fp32 softmax / cross-entropy (YaLM)
        zp = getattr(self.head, "thermo_z_probe", None)  # a head without the slot: no probe
        z_from_loss = targets is not None and self.cfg.logit_softcap is None
        if zp is not None and zp.on and not z_from_loss:  # on the fp32 logits we hold anyway
            zp.put_lse(torch.logsumexp(logits.detach(), dim=-1))
        if self.cfg.logit_softcap is not None:
            cap = self.cfg.logit_softcap
            logits = cap * torch.tanh(logits / cap)
        if targets is None:
            return logits, None
        flat = logits.view(-1, logits.size(-1))
        # = F.cross_entropy (aten computes exactly these two ops), with log p kept in hand so
        # the z thermometer reads the loss's own log-normaliser: lse = x_0 - log p_0.
        logp = F.log_softmax(flat, dim=-1)
        loss = F.nll_loss(logp, targets.reshape(-1))
        if zp is not None and zp.on and z_from_loss:
            zp.put_lse((flat[:, 0] - logp[:, 0]).detach())
        if self.cfg.z_loss:
            loss = loss + self.cfg.z_loss * torch.logsumexp(flat, dim=-1).square().mean()
        return logits, loss

    def num_params(self) -> int:
        """Unique parameters (a tied embed/head weight counts once)."""
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self) -> int:
        """Training FLOPs per token for MFU: 6N + 12 * n_layer * d_model * seq_len (PaLM, App. B).
        N counts the parameters that do matmul work: the pos_embed table never does, the token
        table only when it doubles as the head (tied)."""
        n = self.num_params() - self.pos_embed.weight.numel()
        if self.cfg.untied_head:
            n -= self.embed.weight.numel()
        c = self.cfg
        return 6 * n + 12 * c.n_layer * c.d_model * c.seq_len
