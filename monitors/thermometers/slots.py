"""One preallocated device tensor that every thermometer writes into.

Hooks write 0-d/1-d device tensors into fixed slots with tensor ops only: no `.item()`, no
host sync. A slot written several times in one step (gradient accumulation runs several
forwards) keeps the max (or, for put_min, the min) of the writes; a slot nobody wrote stays NaN.
"""

from __future__ import annotations

import torch


class Slots:
    def __init__(self, size: int, device: torch.device, keep: int = 0) -> None:
        self.buf = torch.full((size,), float("nan"), dtype=torch.float32, device=device)
        self.seen = [False] * size  # host-side flags: first write copies, later ones combine
        self._reset = self.buf[: size - keep]  # the last `keep` slots are written when they change

    def reset(self) -> None:
        self._reset.fill_(float("nan"))
        self.seen = [False] * len(self.seen)

    def put(self, start: int, values: torch.Tensor) -> None:
        """Write a 1-d tensor into buf[start : start + len]; max-combine with earlier writes."""
        view = self.buf[start : start + values.numel()]
        if not self.seen[start]:
            view.copy_(values)
            self.seen[start] = True
        else:
            torch.maximum(view, values.float(), out=view)

    def put_min(self, start: int, values: torch.Tensor) -> None:
        """Like put, but min-combines with earlier writes (a minimum over micro-batches)."""
        view = self.buf[start : start + values.numel()]
        if not self.seen[start]:
            view.copy_(values)
            self.seen[start] = True
        else:
            torch.minimum(view, values.float(), out=view)

    def put_minmax(self, start: int, mn: torch.Tensor, mx: torch.Tensor) -> None:
        """buf[start] = max, buf[start + 1] = min (one copy on the first write)."""
        if not self.seen[start]:
            self.buf[start : start + 2].copy_(torch.stack((mx, mn)))
            self.seen[start] = True
        else:
            hi, lo = self.buf[start : start + 1], self.buf[start + 1 : start + 2]
            torch.maximum(hi, mx.float().reshape(1), out=hi)
            torch.minimum(lo, mn.float().reshape(1), out=lo)

    def put_aminmax(self, start: int, t: torch.Tensor) -> None:
        """buf[start] = max(t), buf[start + 1] = min(t), max/min-combined like put_minmax. The
        first fp32 write reduces straight into the slots (aminmax's out=): no stack, no copy,
        two ops fewer per module and step on the activation hooks' hot path."""
        if not self.seen[start] and t.dtype == self.buf.dtype:
            torch.aminmax(t, out=(self.buf[start + 1], self.buf[start]))
            self.seen[start] = True
        else:
            mn, mx = torch.aminmax(t)
            self.put_minmax(start, mn, mx)

    def put_indexed(self, start: int, length: int, index: torch.Tensor, values: torch.Tensor) -> None:
        """buf[start + index] = values for an index into a block of `length` slots, max-combined
        with earlier writes this step; the block's first slot carries the seen flag."""
        view = self.buf[start : start + length]
        values = values.float()
        if self.seen[start]:
            values = torch.maximum(view.index_select(0, index), values)
        view.index_copy_(0, index, values)
        self.seen[start] = True
