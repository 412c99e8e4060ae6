"""Rank values -> one step record row, by the contract's per-metric reduction.

`Reducer.__call__` reduces W rank vectors on the driver (TrainConfig.reduction = "driver");
`Reducer.unpack` reads the one vector the ranks reduced among themselves on the device
("collective", monitors.collective), which must give the same row and ranks."""

from __future__ import annotations

import numpy as np

from thermowatch.monitors.contract import Reduce, reduction


class Reducer:
    """Rank values (W, M) -> one row (M,) by contract.reduction, plus the extreme's rank."""

    def __init__(self, names: list[str]) -> None:
        self.names = names
        kinds = [reduction(n) for n in names]
        self.idx = {k: np.array([i for i, r in enumerate(kinds) if r is k], dtype=np.int64) for k in Reduce}
        self.max_names = [names[i] for i in self.idx[Reduce.MAX]]
        self.min_names = [names[i] for i in self.idx[Reduce.MIN]]
        # The order of the collective vector's rank part (monitors.collective.CollectiveReducer).
        self.extreme_names = [n for n, k in zip(names, kinds) if k in (Reduce.MAX, Reduce.MIN)]

    def unpack(self, packed: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        """The collective path's one vector -> the same (row, ranks) as __call__ gives."""
        n = len(self.names)
        ranks = packed[n:]
        hit = np.flatnonzero(ranks >= 0)
        return packed[:n], dict(zip([self.extreme_names[i] for i in hit], ranks[hit].astype(np.int64).tolist()))

    def __call__(self, values: np.ndarray) -> tuple[np.ndarray, dict[str, int]]:
        out = np.empty(values.shape[1], dtype=np.float64)
        mx, mn = values[:, self.idx[Reduce.MAX]], values[:, self.idx[Reduce.MIN]]
        with np.errstate(invalid="ignore"):  # NaN and Inf are data: max/min propagate NaN
            out[self.idx[Reduce.MAX]] = mx.max(axis=0) if mx.size else mx.sum(axis=0)
            out[self.idx[Reduce.MIN]] = mn.min(axis=0) if mn.size else mn.sum(axis=0)
            out[self.idx[Reduce.MEAN]] = values[:, self.idx[Reduce.MEAN]].mean(axis=0)
            out[self.idx[Reduce.SUM]] = values[:, self.idx[Reduce.SUM]].sum(axis=0)
        # Name the rank that held an extreme only where the ranks disagree: a value every rank
        # shares (the global grad norm, the LR) has no outlier, and argmax would always say 0.
        # NaN on every rank is shared too: a sampled thermometer's off-steps (attn_entropy_min is
        # read every 10th step) named rank 0 on 9 steps of 10, and outlier_rank paged a healthy
        # 2-rank FSDP2 run at step 30 (issue 35). NaN on some ranks only is a disagreement.
        ranks: dict[str, int] = {}
        for names, vals, pick in ((self.max_names, mx, np.argmax), (self.min_names, mn, np.argmin)):
            if vals.size:
                differ = (vals != vals[:1]).any(axis=0) & ~np.isnan(vals).all(axis=0)
                ranks.update((names[i], int(r)) for i, r in enumerate(pick(vals, axis=0).tolist()) if differ[i])
        return out, ranks
