"""The process group as thermowatch.watch's loop sees it (thermowatch/loop.py): rank 0's choices
agreed on every rank over a host gloo group, the loss averaged, and the checkpoint each rank
writes and reads (torch.distributed.checkpoint: DDP's replicas once, FSDP's shards each), with
the RNG state every rank keeps beside it. World 1 (every call local) without torchrun."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from thermowatch.checkpoint_io import load_as_data
from thermowatch.monitors.contract import Command


def rng_state() -> dict[str, Any]:
    out = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def set_rng_state(st: dict[str, Any]) -> None:
    torch.set_rng_state(st["torch"])
    np.random.set_state(st["numpy"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


class Ranks:
    """The process group as the loop sees it; world 1 (every call local) without torchrun.

    The loop's own agreement (commands, checkpoint choices, "did every rank read it") travels
    on a gloo group on the host, whatever the training backend: it never waits on the device,
    so the per-step broadcast of "any commands?" adds no device sync to a CUDA loop."""

    def __init__(self, rank: int = 0, world: int = 1, group: Any = None) -> None:
        self.rank, self.world, self.group = rank, world, group

    @classmethod
    def detect(cls, model: torch.nn.Module) -> "Ranks":
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(dist.get_rank(), dist.get_world_size(), group)

    def from_rank0(self, fn: Any) -> Any:
        """fn() run on rank 0; its value on every rank."""
        if self.world == 1:
            return fn()
        import torch.distributed as dist

        box = [fn() if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def agree(self, fetch: Any) -> list[Command]:
        """Rank 0's commands, on every rank, at the same step boundary: one 8-byte broadcast a
        step, and the commands themselves only when there are some."""
        if self.world == 1:
            return fetch()
        import torch.distributed as dist

        cmds = fetch() if self.rank == 0 else []
        n = torch.tensor([len(cmds)], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group)
        if int(n[0]) == 0:
            return []
        box = [cmds]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def all_ok(self, ok: bool) -> bool:
        if self.world == 1:
            return ok
        import torch.distributed as dist

        t = torch.tensor([int(ok)], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return bool(t[0])

    def mean(self, loss: torch.Tensor | float) -> float:
        """The loss averaged over the ranks (thermometers off; with them the reducer does it)."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()
        if self.world == 1:
            return float(loss)
        import torch.distributed as dist

        t = torch.tensor([float(loss)], dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return float(t[0]) / self.world

    def sum_on_device(self, t: torch.Tensor) -> None:
        """In place, over the training group (the tensor's own device): sharded grads' squares."""
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)

    def barrier(self) -> None:
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier(group=self.group)

    def save(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict[str, Any], tmp: Path) -> None:
        """Every rank writes its shards (torch.distributed.checkpoint: DDP's replicas once, FSDP's
        shards each) and its own scheduler and RNG state beside them, into `tmp`."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.rank == 0 and tmp.exists():  # a partial left by a crash
            shutil.rmtree(tmp)
        self.barrier()
        msd, osd = get_state_dict(model, optimizer)
        dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(tmp))
        part = tmp / f"extra_rank{self.rank}.pt"
        torch.save(extra, part)
        with open(part, "rb+") as f:
            os.fsync(f.fileno())
        self.barrier()

    def load(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path) -> dict[str, Any]:
        """Every file read as data (thermowatch/checkpoint_io.py): a refused one raises CheckpointRefused."""
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        from thermowatch import checkpoint_dcp

        msd, osd = get_state_dict(model, optimizer)
        state = {"model": msd, "optimizer": osd}
        checkpoint_dcp.load(state, path)  # collective: every rank reaches it, whatever fails after
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        return load_as_data(path / f"extra_rank{self.rank}.pt")
