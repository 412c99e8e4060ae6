"""Update-to-weight ratio: ||W_after - W_before|| / ||W_before|| per module for one optimizer step.

Exact, from a copy of the weights taken just before the step (no optimizer internals, so it
works for any optimizer, the plain torch loop and DeepSpeed alike). The copy is what costs:
one more copy of the parameters this rank holds, alive across the step, so it is taken on
sampled steps only (ThermometerConfig.update_every).

Which tensor is "the weight" on a rank:
- plain torch, DDP, ZeRO 1/2: `p` itself. ZeRO 1/2 keep the full bf16 weights on every rank
  (each optimizer step all-gathers the updated partitions into them), so every rank computes
  the exact figure alone and no collective is needed.
- ZeRO-3: `p.ds_tensor`, this rank's shard (`p` itself is empty outside forward). The sums of
  squares are then all-reduced (SUM over the default process group, the data-parallel group of
  our trainer) before the ratio, so every rank again holds the exact, identical figure; the
  shards' zero padding adds nothing. On NCCL the all-reduce is stream-ordered: no host sync.

Because every rank ends with the same value, the run controller's cross-rank reduction of
`update_ratio` (the contract's default, MEAN) returns it unchanged.

Precision: the difference is taken in the weights' dtype (bf16 under ZeRO); W_after - W_before
is exact whenever the two are within a factor 2 of each other (Sterbenz), i.e. for any step
that is not itself a blow-up; the norms accumulate in fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _local(p: torch.Tensor) -> torch.Tensor:
    """The part of `p` this rank owns: the ZeRO-3 shard, else the tensor itself."""
    shard = getattr(p, "ds_tensor", None)
    return (shard if shard is not None else p).detach()


class UpdateRatio:
    """Writes `update_ratio` (whole model) at `slot` and one ratio per group after it.

    `src[i]` -> `dst[i]`: parameter index -> group index, as for the gradient-norm groups."""

    def __init__(self, params: list[torch.Tensor], src: torch.Tensor, dst: torch.Tensor, n_groups: int,
                 buf: torch.Tensor, slot: int) -> None:
        self.params, self.src, self.dst, self.n_groups = params, src, dst, n_groups
        self.buf, self.slot = buf, slot
        self.sharded = any(getattr(p, "ds_tensor", None) is not None for p in params)
        self._old: list[torch.Tensor] | None = None

    def before(self) -> None:
        """Copy this rank's weights (call right before the optimizer step)."""
        self._old = [t.clone() for t in map(_local, self.params)] if self.params else None

    def after(self) -> None:
        """Ratios into the slots (call right after the optimizer step); tensor ops only."""
        old, self._old = self._old, None
        if old is None:
            return
        w = torch.stack(torch._foreach_norm(old, 2, dtype=torch.float32))
        torch._foreach_sub_(old, [_local(p) for p in self.params])  # old := W_before - W_after
        d = torch.stack(torch._foreach_norm(old, 2, dtype=torch.float32))
        del old
        sq = torch.stack((d, w)).square()  # [2, params]
        sums = torch.zeros(2, 1 + self.n_groups, dtype=torch.float32, device=sq.device)
        sums[:, 0] = sq.sum(dim=1)
        sums[:, 1:].index_add_(1, self.dst, sq.index_select(1, self.src))
        if self.sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(sums)  # disjoint ZeRO-3 shards: the sum over ranks is the whole weight
        self.buf[self.slot : self.slot + 1 + self.n_groups].copy_((sums[0] / sums[1]).sqrt())
