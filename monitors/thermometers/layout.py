"""Which modules each thermometer group reads, and where each key sits in the step's vector."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from thermowatch.monitors.contract import (
    ACT_MAX,
    ACT_MIN,
    ATTN_ENTROPY_MIN,
    ATTN_LOGIT_LSE,
    ATTN_LOGIT_MAX,
    GRAD_NORM,
    LOSS,
    LR,
    THERMOMETER_COST,
    THERMOMETER_EVERY,
    UPDATE_RATIO,
    Z,
    metric_key,
)
from thermowatch.monitors.thermometers.budget import BUDGETED
from thermowatch.monitors.thermometers.config import ThermometerConfig
from thermowatch.monitors.thermometers.intercept import find

_SCALARS = (LOSS, LR, GRAD_NORM)  # slots 0, 1, 2: given by the caller in end_step


@dataclass
class Layout:
    names: list[str]  # the fixed order of collect()
    act: dict[str, int]  # module -> its act_max slot (act_min follows)
    z: dict[str, int]  # module -> its z slot
    attn: list[tuple]  # (name, module, slot, n_head, kind, mode, entropy slot or None)
    grad: slice  # grad_norm/<group>
    update: int  # update_ratio (the groups' ratios follow)
    extras: slice  # the budget's figures (thermometer_cost, thermometer_every/<group>)


def _n_head(mod: nn.Module) -> int | None:
    """Heads of an attention module, by the names nanoGPT, torch and Hugging Face use."""
    for obj, attr in ((mod, "num_heads"), (mod, "n_head"), (mod, "num_attention_heads"),
                      (getattr(mod, "config", None), "num_attention_heads")):
        val = getattr(obj, attr, None)
        if isinstance(val, int) and val > 0:
            return val
    return None


def _attn_kind(name: str, mod: nn.Module, cfg: ThermometerConfig) -> str | None:
    """How this module's attention logits are read, or None when it is not attention. Raises
    AttentionNotProbed (intercept.py) now, naming the module, for one that cannot be read."""
    if hasattr(mod, "thermo_probe"):
        return "probe"
    if isinstance(mod, nn.MultiheadAttention):
        return "mha" if isinstance(mod, cfg.attn_types) else None
    return "found" if find(name, mod, isinstance(mod, cfg.attn_types), cfg.attn_find) else None


def select(model: nn.Module, cfg: ThermometerConfig):
    """The modules each group instruments, by the config's patterns and types: (act, z, attention
    with its kind, grad-norm groups), in the model's module order."""
    act, z, attn, groups = [], [], [], []
    for name, mod in model.named_modules():
        if not name:
            continue
        if cfg.matches(cfg.act_patterns, name) or isinstance(mod, cfg.act_types):
            act.append((name, mod))
        if cfg.matches(cfg.z_patterns, name):
            z.append((name, mod))
        kind = _attn_kind(name, mod, cfg)
        if kind is not None:
            attn.append((name, mod, kind))
        if cfg.matches(cfg.grad_patterns, name):
            groups.append((name, mod))
    return act, z, attn, groups


def layout(cfg: ThermometerConfig, act, z, attn, groups) -> Layout:
    """Every key's slot in the step's vector: the scalars, act max/min per module, z, the
    attention figures (and per head, entropy), grad norms, update ratios, the budget's figures."""
    names: list[str] = list(_SCALARS)
    act_slots = {}
    for name, _ in act:
        act_slots[name] = len(names)
        names += [metric_key(ACT_MAX, name), metric_key(ACT_MIN, name)]
    z_slots = {}
    for name, _ in z:
        z_slots[name] = len(names)
        names.append(metric_key(Z, name))
    attn_slots = []
    for name, mod, kind in attn:
        # A found module's figure under "lse" (the default) is its SDPA kernel's log-sum-exp, as a
        # probe's is (intercept.py: the call runs through the op that hands it out); under "exact"
        # an explicit max over every sequence; under "flex" (probes only) an explicit max of the
        # first attn_entropy_batch sequences ("sample").
        found = {"lse": "lse", "exact": "exact"}.get(cfg.attn_mode, "sample")
        mode = {"probe": cfg.attn_mode, "mha": "exact", "found": found}[kind]
        metric = ATTN_LOGIT_LSE if mode == "lse" else ATTN_LOGIT_MAX
        n_head = _n_head(mod)
        if (cfg.per_head or cfg.attn_heads is not None) and not n_head:
            raise ValueError(
                f"attention module {name!r} ({type(mod).__name__}) has no `n_head`/`num_heads`/`num_attention_heads`; "
                "per_head and attn_heads need it: set ThermometerConfig(per_head=False, attn_heads=None)"
            )
        slot = len(names)
        names.append(metric_key(metric, name))
        if cfg.per_head:
            names += [metric_key(metric, f"{name}.heads.{h}") for h in range(n_head)]
        ent_slot = None
        if cfg.attn_entropy:
            ent_slot = len(names)
            names.append(metric_key(ATTN_ENTROPY_MIN, name))
        attn_slots.append((name, mod, slot, n_head or 0, kind, mode, ent_slot))
    grad_start = len(names)
    names += [metric_key(GRAD_NORM, name) for name, _ in groups]
    grad = slice(grad_start, len(names))
    update_start = len(names)
    if cfg.update_ratio:
        names.append(UPDATE_RATIO)
        names += [metric_key(UPDATE_RATIO, name) for name, _ in groups]
    # The budget's own figures, last (slots 0, 1, 2 stay loss, lr, grad_norm): filled on the host
    # in collect(), or under a finish (the cross-rank reduction) into their device slots when
    # they change, every DECIDE_EVERY steps at most (Slots keeps them across resets).
    # Fixed cadences above 1 (no budget) carry their `thermometer_every/<group>` too, constant: a
    # group's figures between its reads are then absent from the record (unread.py), not NaN.
    extras_start = len(names)
    if cfg.budget is not None:
        names += [THERMOMETER_COST] + [metric_key(THERMOMETER_EVERY, g) for g in BUDGETED]
    elif max(cfg.act_every, cfg.attn_every, cfg.grad_every) > 1:
        names += [metric_key(THERMOMETER_EVERY, g) for g in BUDGETED]
    return Layout(names, act_slots, z_slots, attn_slots, grad, update_start, slice(extras_start, len(names)))
