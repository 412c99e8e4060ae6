"""Update-to-weight ratio: ||W_after - W_before|| / ||W_before|| per module for one optimizer step,
the figure behind the `update_growth` witness of harm (monitors/detectors/witness.py).

Exact, from a copy of the weights taken just before the step (no optimizer internals, so it
works for any optimizer, the plain torch loop and DeepSpeed alike). The copy is what costs:
one more copy of the parameters this rank holds, alive across the step, so it is taken on
sampled steps only (ThermometerConfig.update_every).

Which part of the weights a rank copies and measures:
- ZeRO-3: `p.ds_tensor`, this rank's shard (`p` itself is empty outside forward).
- `split` (the trainer sets it for ZeRO 1/2, whose ranks all hold the same full bf16 weights:
  each optimizer step all-gathers the updated partitions into them): the rank's 1/world
  contiguous slice of every flattened tensor, so the copy shrinks by the world size. Only
  correct when the ranks' weights are identical (data parallel); off by default.
- otherwise (plain torch, one process): the whole tensor.
In the first two cases the sums of squares are all-reduced (SUM over the default process
group, the data-parallel group of our trainer) before the ratio, so every rank holds the
exact, identical figure; ZeRO-3's zero padding adds nothing. On NCCL the all-reduce is
stream-ordered: no host sync. Every rank must then measure on the same steps.

Because every rank ends with the same value, the run controller's cross-rank reduction of
`update_ratio` (the contract's default, MEAN) returns it unchanged.

Precision: the difference is taken in the weights' dtype (bf16 under ZeRO); W_after - W_before
is exact whenever the two are within a factor 2 of each other (Sterbenz), i.e. for any step
that is not itself a blow-up; the norms accumulate in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class UpdateRatio:
    """Writes `update_ratio` (whole model) at `slot` and one ratio per group after it.

    `src[i]` -> `dst[i]`: parameter index -> group index, as for the gradient-norm groups."""

    def __init__(self, params: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, n_groups: int,
                 buf: torch.Tensor, slot: int, split: bool = False) -> None:
        self.params, self.src, self.dst, self.n_groups = params, src, dst, n_groups
        self.buf, self.slot = buf, slot
        self.sharded = any(getattr(p, "ds_tensor", None) is not None for p in params)
        self.split = split and not self.sharded
        self._old: list[torch.Tensor] | None = None

    def _parts(self) -> list[torch.Tensor]:
        """What this rank measures of each parameter (see the module docstring)."""
        if self.sharded:
            return [(p.ds_tensor if getattr(p, "ds_tensor", None) is not None else p).detach() for p in self.params]
        rank, world = _world()
        if self.split and world > 1:
            return [p.detach().reshape(-1).tensor_split(world)[rank] for p in self.params]
        return [p.detach() for p in self.params]

    def before(self) -> None:
        """Copy this rank's part of the weights (call right before the optimizer step)."""
        self._old = [t.clone() for t in self._parts()] if self.params else None

    def after(self) -> None:
        """Ratios into the slots (call right after the optimizer step); tensor ops only."""
        old, self._old = self._old, None
        if old is None:
            return
        w = torch.stack(torch._foreach_norm(old, 2, dtype=torch.float32))
        torch._foreach_sub_(old, self._parts())  # old := W_before - W_after
        d = torch.stack(torch._foreach_norm(old, 2, dtype=torch.float32))
        del old
        sq = torch.stack((d, w)).square()  # [2, params]
        sums = torch.zeros(2, 1 + self.n_groups, dtype=torch.float32, device=sq.device)
        sums[:, 0] = sq.sum(dim=1)
        sums[:, 1:].index_add_(1, self.dst, sq.index_select(1, self.src))
        if (self.sharded or self.split) and _world()[1] > 1:
            dist.all_reduce(sums)  # disjoint parts: the sum over ranks is the whole weight
        self.buf[self.slot : self.slot + 1 + self.n_groups].copy_((sums[0] / sums[1]).sqrt())
