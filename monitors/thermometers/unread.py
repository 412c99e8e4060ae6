"""Figures a budget left unread are absent from the record, never NaN (issue 36).

Under `ThermometerConfig(budget=...)`, or fixed cadences above 1 without one, the act, attn and
grad groups are read every n-th step (`thermometer_every/<group>` in the step's vector: read where
step % n == 0), and their slots hold NaN in between. A NaN act_max is a non-finite finding (monitors.detectors.
non_finite), so what leaves for the supervisor must not carry them: `Unread(names).keep(values,
step)` is the mask of the figures that were read, NaN of a group read this step included (that
NaN is real); the budget's own figures go once they are measured. Vectorised over the slots: one comparison per group, then one mask."""

from __future__ import annotations

import numpy as np

from thermowatch.monitors.contract import (ACT_MAX, ACT_MIN, ATTN_ENTROPY_MIN, ATTN_LOGIT_LSE, ATTN_LOGIT_MAX,
                                           GRAD_NORM, THERMOMETER_COST, THERMOMETER_EVERY, Z, metric_key, split_key)

_GROUP_METRICS = {"act": (ACT_MAX, ACT_MIN, Z), "attn": (ATTN_LOGIT_MAX, ATTN_LOGIT_LSE, ATTN_ENTROPY_MIN),
                  "grad": (GRAD_NORM,)}


class Unread:
    """Which slots of a step's vector were read (see the module docstring)."""

    def __init__(self, names: list[str]) -> None:
        self.names = list(names)
        index = {n: i for i, n in enumerate(names)}
        self.groups: list[tuple[int, np.ndarray]] = []  # (slot of the group's cadence, its figures' slots)
        for group, metrics in _GROUP_METRICS.items():
            every = index.get(metric_key(THERMOMETER_EVERY, group))
            if every is None:
                continue
            slots = []
            for i, name in enumerate(names):
                metric, module = split_key(name)
                # a module's figure (the bare global grad_norm is read every step)
                if metric in metrics and module:
                    slots.append(i)
            self.groups.append((every, np.asarray(slots, dtype=np.int64)))
        # the budget's own figures: NaN until its first measurement (the first steps), then sent
        self.own = np.asarray([i for i, n in enumerate(names) if split_key(n)[0] in (THERMOMETER_COST, THERMOMETER_EVERY)],
                              dtype=np.int64)
        self.active = bool(self.groups) or bool(self.own.size)

    def keep(self, values: np.ndarray, step: int) -> np.ndarray:
        """Mask over `values`: False where a budgeted group was not read at `step` (its NaN)."""
        mask = np.ones(len(values), dtype=bool)
        mask[self.own] = np.isfinite(values[self.own])
        for every_slot, slots in self.groups:
            every = values[every_slot]
            if np.isfinite(every) and every > 1 and step % int(every):
                mask[slots] = np.isfinite(values[slots])  # not read: its NaN goes; a finite value was read
        return mask

    def as_dict(self, values: np.ndarray, step: int, norm_read: bool = True) -> dict[str, float]:
        """The step's figures by name, those not read left out (all of them without a budget).
        `norm_read=False`: the global grad_norm was not read either (Thermometers.last_norm_unread),
        with or without a budget."""
        if not self.active:
            out = dict(zip(self.names, values.tolist()))
        else:
            out = {n: v for n, v, k in zip(self.names, values.tolist(), self.keep(values, step).tolist()) if k}
        if not norm_read and GRAD_NORM in out and not np.isfinite(out[GRAD_NORM]):
            del out[GRAD_NORM]  # its NaN says "not read", not a non-finite gradient
        return out
