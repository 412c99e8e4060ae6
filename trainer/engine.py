"""The DeepSpeed ZeRO engine around the GPT: its config, one training step, checkpoints.

Precision (YaLM-100B): bf16 weights and activations, fp32 master weights and optimizer state
inside ZeRO, and gradients *reduced in fp32*: DeepSpeed's top-level
`"communication_data_type": "fp32"` (deepspeed/runtime/constants.py, COMMUNICATION_DATA_TYPE)
makes ZeRO 1/2 upcast each bf16 gradient bucket before its all-reduce / reduce-scatter
(runtime/zero/stage_1_and_2.py, `gradient_reduction_w_predivide`) and ZeRO 3 reduce-scatter in
that dtype (runtime/zero/stage3.py, `__avg_scatter_grads`). The other knob, `data_types.
grad_accum_dtype: "fp32"`, only matters with gradient accumulation (we run one micro-batch per
step) and under ZeRO 1 swaps in the BF16_Optimizer, so it is left to the user's override.

The LR is set on the optimizer's param groups before every step from trainer.lr (a pure
function of the step), so DeepSpeed runs without a scheduler of its own.
"""

from __future__ import annotations

import contextlib
import copy
import os
from typing import Any, Callable, ContextManager, Mapping

import torch

from trainer.config import TrainConfig

DS_TAG = "zero"  # the one tag inside each checkpoint directory the CheckpointStore hands us


def deep_merge(base: Mapping[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """`over` wins key by key; nested dicts merge (a user overrides one ZeRO knob, not all)."""
    out = copy.deepcopy(dict(base))
    for key, val in over.items():
        if isinstance(val, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = deep_merge(out[key], val)
        else:
            out[key] = copy.deepcopy(val)
    return out


def build_deepspeed_config(cfg: TrainConfig, on_gpu: bool = False) -> dict[str, Any]:
    """The DeepSpeed JSON for `cfg`, with the user's `deepspeed_config_override` merged last."""
    micro = cfg.data.global_batch // cfg.world_size
    zero: dict[str, Any] = {
        "stage": cfg.zero_stage,
        # Overlap the gradient reduction with the backward pass (DeepSpeed defaults it on only
        # for stage 3); contiguous buckets avoid fragmentation.
        "overlap_comm": True,
        "contiguous_gradients": True,
        "reduce_scatter": True,
        "reduce_bucket_size": int(5e7),
        "allgather_bucket_size": int(5e7),
    }
    if cfg.zero_stage == 3:
        # YaLM: prefetch the next layers' all-gathers while computing the current one.
        zero.update(
            {
                "stage3_prefetch_bucket_size": int(5e7),
                "stage3_max_live_parameters": int(1e9),
                "stage3_max_reuse_distance": int(1e9),
                # Tiny params (norms, biases) stay resident: gathering them costs more than it saves.
                "stage3_param_persistence_threshold": int(1e4),
            }
        )
    o = cfg.optim
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": cfg.gpt_config().dtype == "bfloat16"},
        "zero_optimization": zero,
        "communication_data_type": "fp32",  # fp32 gradient reduction (see module docstring)
        "gradient_clipping": o.grad_clip,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": o.lr,
                "betas": list(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
                # DeepSpeed's fused Adam is a CUDA kernel; torch's AdamW runs anywhere.
                "torch_adam": not on_gpu,
                "adam_w_mode": True,
            },
        },
        # The run controller reports progress; DeepSpeed's own prints and timers would only add
        # host syncs (wall_clock_breakdown synchronises the device every step).
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    return deep_merge(ds, cfg.deepspeed_config_override)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices only; norms, biases and mixing scalars are not decayed (nanoGPT, GPT-3)."""
    decay, no_decay = [], []
    for p in model.parameters():  # parameters() yields a tied weight once
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]



def decline_shm_comm_op() -> None:
    """On CPU, tell DeepSpeed its shared-memory comm op is unavailable, before init_distributed.

    DeepSpeed 0.19 JIT-builds that op (~30 s) in every CPU rank and maps a 66 MB /dev/shm file
    per rank that it never unlinks; yet it only serves `inference_all_reduce`
    (deepspeed/comm/torch.py), never a training collective, which all go through
    torch.distributed (gloo here). Measured here: killed gangs left 18 GB in /dev/shm, and a
    build killed mid-way left torch's extension lock behind, so every later rank waited on it
    forever. Declining it costs training nothing.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


class Engine:
    """One rank's DeepSpeed engine. Build after torch.distributed is initialised."""

    def __init__(self, cfg: TrainConfig, model: torch.nn.Module, on_gpu: bool = False) -> None:
        import deepspeed

        self.cfg = cfg
        self.ds_config = build_deepspeed_config(cfg, on_gpu)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model,
            model_parameters=param_groups(model, cfg.optim.weight_decay),
            config=self.ds_config,
        )
        self.device = self.engine.device

    @property
    def module(self) -> torch.nn.Module:
        """The model DeepSpeed wraps (attach thermometers here)."""
        return self.engine.module

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def train_step(
        self, inputs: torch.Tensor, targets: torch.Tensor, around_update: Callable[[], ContextManager] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward, backward, clip, update. Returns (loss, grad norm before clipping) as
        0-d tensors on the device: nothing here waits for the device. `around_update` (e.g.
        Thermometers.measure_update) wraps the optimizer step alone."""
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        _, loss = self.engine(inputs, targets)
        self.engine.backward(loss)
        with around_update() if around_update is not None else contextlib.nullcontext():
            self.engine.step()
        norm = self.engine.get_global_grad_norm()  # cached by step(): global over ranks
        if norm is None:  # ZeRO 1/2 with compute_grad_norm disabled by the user
            norm = torch.tensor(float("nan"))
        elif not isinstance(norm, torch.Tensor):
            norm = torch.tensor(float(norm))
        return loss.detach(), norm.detach()

    def save(self, directory: str | os.PathLike, client_state: dict[str, Any] | None = None) -> None:
        """ZeRO checkpoints are per rank: every rank must call this with the same directory."""
        self.engine.save_checkpoint(str(directory), tag=DS_TAG, client_state=client_state or {}, save_latest=False)

    def load(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Restore model, fp32 masters and optimizer state; returns the client state.
        Raises CheckpointLoadError when the files are missing or unreadable."""
        try:
            path, client = self.engine.load_checkpoint(
                str(directory), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        except Exception as exc:  # torch.load / zipfile / pickle errors on a damaged file
            raise CheckpointLoadError(f"cannot load the DeepSpeed checkpoint in {directory}: {exc!r}") from exc
        if path is None:
            raise CheckpointLoadError(f"no DeepSpeed checkpoint (tag {DS_TAG!r}) in {directory}")
        return client or {}


class CheckpointLoadError(RuntimeError):
    """A checkpoint directory that DeepSpeed cannot load; the controller falls back to an older one."""
