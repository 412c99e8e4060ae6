"""The grid as a thermometer budget reads it (issue 36): each group's keys only on the steps its
cadence reads, ABSENT on the others (the client omits a figure it did not read: never a zero,
never the last value). `--thin attn=4,act=16,grad=16,update=10` in bench/divergence.py.

Groups, by metric name (monitors/contract.py), as monitors/thermometers reads them:

    attn    attn_logit_max/*, attn_logit_lse/*, attn_entropy_min/*  (the attention figure)
    act     act_max/*, act_min/*, z/*                               (activations and output logits)
    grad    grad_norm/<module>: per-layer norms; the bare global `grad_norm` is read every step
    update  update_ratio/*

A group read every k-th step is read on the steps with step % k == 0 (powers of two, so a step
a slow group reads is read by the faster ones too). Loss, LR and the global gradient norm stay.
"""

from __future__ import annotations

from thermowatch.monitors.contract import (ACT_MAX, ACT_MIN, ATTN_ENTROPY_MIN, ATTN_LOGIT_LSE, ATTN_LOGIT_MAX,
                                           GRAD_NORM, UPDATE_RATIO, Z, StepRecord, split_key)

GROUPS: dict[str, frozenset[str]] = {
    "attn": frozenset({ATTN_LOGIT_MAX, ATTN_LOGIT_LSE, ATTN_ENTROPY_MIN}),
    "act": frozenset({ACT_MAX, ACT_MIN, Z}),
    "grad": frozenset({GRAD_NORM}),  # per-module keys only: group_of() leaves the global norm out
    "update": frozenset({UPDATE_RATIO}),
}


def parse_thin(text: str) -> dict[str, int]:
    """"attn=4,act=16" -> {"attn": 4, "act": 16}; a bad group or cadence names the fix."""
    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, sep, every = part.partition("=")
        if name not in GROUPS or not sep:
            raise ValueError(f"--thin {part!r}: write GROUP=EVERY with GROUP one of {sorted(GROUPS)}, e.g. attn=4")
        try:
            k = int(every)
        except ValueError:
            k = 0
        if k < 1:
            raise ValueError(f"--thin {part!r}: the cadence must be a whole number of steps >= 1, e.g. {name}=4")
        out[name] = k
    return out


def group_of(key: str) -> str | None:
    metric, module = split_key(key)
    if metric == GRAD_NORM and not module:
        return None  # the global norm: every step, whatever the budget
    return next((g for g, names in GROUPS.items() if metric in names), None)


def thin(records: list[StepRecord], every: dict[str, int]) -> int:
    """Remove, in place, each group's keys from the records whose step its cadence does not read.
    Returns how many values were removed."""
    removed = 0
    groups: dict[str, str | None] = {}
    for rec in records:
        for key in list(rec.values):
            g = groups[key] if key in groups else groups.setdefault(key, group_of(key))
            if g is not None and g in every and rec.step % every[g] != 0:
                del rec.values[key]
                rec.ranks.pop(key, None)
                removed += 1
    return removed


def describe(every: dict[str, int]) -> str:
    return ",".join(f"{g}={k}" for g, k in every.items()) or "every step"
