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

from thermowatch.trainer.config import TrainConfig

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
    bf16 = cfg.model.dtype == "bfloat16"
    ds: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": 1,
        # check_grad_overflow off: bf16 has fp32's exponent range, so the fp16 overflow check
        # (four blocking host syncs per step on ZeRO 1/2, measured) guards against nothing it
        # cannot see anyway; a non-finite gradient shows up in the grad_norm/loss thermometers,
        # and the supervisor's non_finite detector rolls back to a healthy checkpoint instead of
        # DeepSpeed silently skipping the step (which would also hide the bad data).
        "bf16": {"enabled": bf16, **({"check_grad_overflow": False} if bf16 else {})},
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
        """ZeRO checkpoints are per rank: every rank must call this with the same directory.

        A write that fails on one rank (the volume full, a read-only file) must not leave the
        ranks in different places: DeepSpeed's save runs barriers and collectives between its
        writes, and a rank that raised out of it would leave the others waiting in a barrier
        that the next training step's collectives then meet. So a failed write is recorded and
        the rest of the save goes on (skipping the writes), every rank passes every collective,
        and then the ranks agree on the outcome: if any rank failed, every rank raises
        CheckpointSaveError, and the gang is as it was before the save."""
        import torch.distributed as dist

        failed: list[str] = []

        def guard(write):
            def guarded(*args, **kwargs):
                if failed:
                    return  # the save is lost already; do not fill what space is left
                try:
                    write(*args, **kwargs)
                except (OSError, RuntimeError) as exc:  # torch.save raises RuntimeError("... file write failed")
                    failed.append(f"{type(exc).__name__}: {exc}")
            return guarded

        # Every file DeepSpeed 0.19 writes in a save: the state files (its checkpoint engine) and,
        # on rank 0, the copied recovery scripts.
        ce, ds = self.engine.checkpoint_engine, self.engine
        writers = [(ce, "save"), (ds, "_copy_recovery_script")]
        own = {(id(obj), name): vars(obj).get(name) for obj, name in writers}  # instance attributes, if any
        for obj, name in writers:
            setattr(obj, name, guard(getattr(obj, name)))
        try:
            self.engine.save_checkpoint(str(directory), tag=DS_TAG, client_state=client_state or {},
                                        save_latest=False)
        finally:
            for obj, name in writers:
                before = own[(id(obj), name)]
                if before is None:
                    delattr(obj, name)  # back to the class's method
                else:
                    setattr(obj, name, before)
        device = next(self.engine.module.parameters()).device
        flag = torch.tensor([1.0 if failed else 0.0], device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:  # once per checkpoint, not a per-step host sync
            raise CheckpointSaveError(failed[0] if failed else "another rank's checkpoint write failed")

    def load(self, directory: str | os.PathLike) -> dict[str, Any]:
        """Restore model, fp32 masters and optimizer state; returns the client state.
        Raises CheckpointLoadError when the files are missing or unreadable, or refused.

        Every file is read as data (thermowatch/checkpoint_io.py, issue 33): DeepSpeed's own
        checkpoint engine reads with torch.load(weights_only=False), so for this load its `load`
        is ours, torch.load(weights_only=True) with deepspeed_globals() allow-listed. Every ZeRO
        1/2/3 file DeepSpeed 0.19 reads for load_checkpoint goes through the checkpoint engine;
        only its universal-checkpoint loading (`checkpoint.load_universal`, which this trainer
        never sets) calls torch.load(weights_only=False) itself."""
        from thermowatch.checkpoint_io import CheckpointRefused, load_as_data

        allowed = deepspeed_globals()
        ce = self.engine.checkpoint_engine
        own = vars(ce).get("load")
        ce.load = lambda path, map_location=None: load_as_data(path, allowed, map_location=map_location)
        try:
            path, client = self.engine.load_checkpoint(
                str(directory), tag=DS_TAG, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        except CheckpointRefused as exc:
            raise CheckpointLoadError(f"refused the DeepSpeed checkpoint in {directory}: {exc}") from exc
        except Exception as exc:  # torch.load / zipfile / pickle errors on a damaged file
            raise CheckpointLoadError(f"cannot load the DeepSpeed checkpoint in {directory}: {exc!r}") from exc
        finally:
            if own is None:
                del ce.load  # back to the class's method
            else:
                ce.load = own
        if path is None:
            raise CheckpointLoadError(f"no DeepSpeed checkpoint (tag {DS_TAG!r}) in {directory}")
        return client or {}


def deepspeed_globals() -> list[Any]:
    """What DeepSpeed 0.19's ZeRO checkpoints hold besides tensors and plain values, allow-listed
    for Engine.load. Found by torch.serialization.get_unsafe_globals_in_checkpoint on real ZeRO 1,
    2 and 3 checkpoints (bf16 and fp32, CPU): the optimizer state's ZeRO stage enum, its loss
    scaler, and (ZeRO 1/2) each fp32 partition's address; the model states file holds none.
    DynamicLossScaler is what the same field holds under fp16 (a user's deepspeed_config_override;
    fp16 does not run on CPU, so it is allow-listed from DeepSpeed's source, not seen in a file)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address]


class CheckpointSaveError(OSError):
    """A checkpoint write failed on at least one rank; every rank raises it, in step."""


class CheckpointLoadError(RuntimeError):
    """A checkpoint directory that DeepSpeed cannot load; the controller falls back to an older one."""
