"""Cross-rank reduction of the thermometer vector on the device, with torch.distributed
collectives (issue 13, item 5): the driver then receives ONE vector per step from rank 0,
whatever the world size, instead of gathering W vectors and reducing them in Python.

Per step, two all-reduces run in the step's stream (NCCL orders them on the device; no host
sync), on every rank, right before the thermometers' one host copy:

- MAX over int64 keys that pack (value, rank): the high 32 bits are the float32 value mapped to
  an int32 that sorts like the float (`_orderable`), the low 32 bits are W-1-rank, so the
  maximum names the value and the *lowest* rank that holds it, as numpy's argmax does. Each
  max- or min-reduced metric contributes two keys, its maximum and (negated) its minimum: the
  pair tells whether the ranks disagree at all (monitors.reduce.Reducer names an extreme's rank
  only then). NaN is data and must win the metric's own side, as numpy's max/argmax let it (the
  first NaN rank): the largest key for a max metric, the smallest for a min one, on both sides,
  so on the other side it loses and reads NaN only when every rank is NaN (no rank named then:
  a sampled thermometer's off-steps, issue 35).
- SUM, in float64, of the mean- and sum-reduced metrics (and of this rank's tokens/s, a host
  float that never was float32), divided by W for the mean ones.

The result, decoded on the device, is one float64 vector: the M reduced values aligned with
the worker's `names`, then one rank per max/min metric (-1 where every rank agreed), in
`Reducer.extreme_names` order; `Reducer.unpack` turns it into (values, ranks).

Identical to `Reducer.__call__` on the W vectors, bit for bit, with two documented exceptions:
a NaN's payload is canonical (the record holds NaN either way), and float64 sums over more than
two ranks may round differently in the last bit when the ranks' float32 values span more than
~2^(29 - log2 W) in magnitude (gloo/NCCL add in ring order, numpy row by row; below that the
float64 sum of float32 values is exact in any order, which is why the worker rounds its
tokens/s to float32 too). -0.0 is counted as +0.0.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from thermowatch.monitors.contract import Reduce, reduction

_I32_MAX = 2**31 - 1
_I32_MIN = -(2**31)
_MAG = 0x7FFFFFFF  # the magnitude bits of a float32


def _orderable(v: torch.Tensor) -> torch.Tensor:
    """float32 -> int32 that sorts as the floats do (sign-magnitude -> two's complement)."""
    b = (v + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into +0.0: equal floats, equal keys
    return torch.where(b < 0, b ^ _MAG, b)


def _from_orderable(k: torch.Tensor) -> torch.Tensor:
    return torch.where(k < 0, k ^ _MAG, k).view(torch.float32)


class CollectiveReducer:
    """`names`: the worker's per-rank names (thermometer slots, then host-side extras such as
    tokens_per_s, which must reduce by SUM or MEAN). Call with the step's float32 slot buffer
    (the first `n_device` names) and the host extras; returns the packed float64 vector."""

    def __init__(self, names: list[str], n_device: int, device: torch.device,
                 rank: int | None = None, world: int | None = None,
                 all_reduce: Callable[[torch.Tensor, dist.ReduceOp], None] | None = None) -> None:
        # all_reduce(tensor, op), in place: the default process group's; bench/reduction.py
        # passes its own gloo groups (64 ranks as threads of one process).
        kinds = [reduction(n) for n in names]
        if any(kinds[i] in (Reduce.MAX, Reduce.MIN) for i in range(n_device, len(names))):
            raise ValueError(f"host-side extras {names[n_device:]} must reduce by SUM or MEAN")
        initialized = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else dist.get_rank() if initialized else 0
        self.world = world if world is not None else dist.get_world_size() if initialized else 1
        self.n, self.n_device = len(names), n_device
        self._all_reduce = all_reduce or (lambda t, op: dist.all_reduce(t, op=op))

        def idx(*ks: Reduce) -> list[int]:
            return [i for i, k in enumerate(kinds) if k in ks]

        mm, sm = idx(Reduce.MAX, Reduce.MIN), idx(Reduce.MEAN, Reduce.SUM)
        self.extreme_names = [names[i] for i in mm]
        t = lambda ix: torch.tensor(ix, dtype=torch.long, device=device)  # noqa: E731 - built once
        self._mm, self._sm = t(mm), t(sm)
        self._is_max = torch.tensor([kinds[i] is Reduce.MAX for i in mm], dtype=torch.bool, device=device)
        self._sm_dev = t([i for i in sm if i < n_device])  # where the device slots go in the sum vector
        self._sm_dev_pos = t([j for j, i in enumerate(sm) if i < n_device])
        self._sm_host_pos = [j for j, i in enumerate(sm) if i >= n_device]
        self._sm_host_src = [i - n_device for i in sm if i >= n_device]
        mean = [kinds[i] is Reduce.MEAN for i in sm]
        self._scale = torch.tensor([float(self.world) if m else 1.0 for m in mean], dtype=torch.float64, device=device)
        self._low = self.world - 1 - self.rank  # the lowest rank wins a tie of MAX keys

    def __call__(self, buf: torch.Tensor, extras: tuple[float, ...] = ()) -> torch.Tensor:
        """Tensor ops and two collectives; nothing here reads a device value on the host."""
        v = buf.index_select(0, self._mm)
        # NaN wins the metric's own side (a max metric's max, a min metric's min) and loses the other
        hi = torch.where(torch.isnan(v), torch.where(self._is_max, _I32_MAX, _I32_MIN), _orderable(v)).to(torch.int64)
        # max(-1 - k) = -1 - min(k): one MAX collective carries both sides.
        keys = torch.cat((hi * 2**32 + self._low, (-1 - hi) * 2**32 + self._low))
        sums = torch.empty(self._sm.numel(), dtype=torch.float64, device=buf.device)
        sums[self._sm_dev_pos] = buf.index_select(0, self._sm_dev).to(torch.float64)
        for j, src in zip(self._sm_host_pos, self._sm_host_src):  # a host float: a fill, not a copy
            sums[j] = extras[src]
        if self.world > 1:
            self._all_reduce(keys, dist.ReduceOp.MAX)
            self._all_reduce(sums, dist.ReduceOp.SUM)
        m = self._mm.numel()
        kmax, kmin = keys[:m], keys[m:]
        vmax = _from_orderable(torch.div(kmax, 2**32, rounding_mode="floor").to(torch.int32))
        vmin = _from_orderable((-1 - torch.div(kmin, 2**32, rounding_mode="floor")).to(torch.int32))
        rmax = self.world - 1 - torch.remainder(kmax, 2**32)
        rmin = self.world - 1 - torch.remainder(kmin, 2**32)
        value = torch.where(self._is_max, vmax, vmin)
        other = torch.where(self._is_max, vmin, vmax)  # NaN only when every rank is NaN: they agree
        differ = (vmax != vmin) & ~torch.isnan(other)
        ranks = torch.where(differ, torch.where(self._is_max, rmax, rmin), -1)
        out = torch.empty(self.n + m, dtype=torch.float64, device=buf.device)
        out[self._mm] = value.to(torch.float64)
        out[self._sm] = sums / self._scale
        out[self.n:] = ranks.to(torch.float64)
        return out

