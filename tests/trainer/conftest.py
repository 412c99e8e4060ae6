"""Shared fixtures for the trainer tests: one local Ray instance for the whole session.

DeepSpeed's CPU accelerator JIT-builds its shared-memory comm op on first use (~30 s, cached
under ~/.cache/torch_extensions afterwards); the first gang of a fresh machine pays for it.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a throwaway local instance
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="session")
def ray_session():
    import ray

    init_local_ray()
    yield ray
    ray.shutdown()


def init_local_ray() -> None:
    import ray

    if not ray.is_initialized():
        # 4 logical CPUs: a 2-rank gang plus room for a second gang while the first is torn down.
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, logging_level="WARNING")


# The brief's name for the fixture.
ray = ray_session


def tiny_config(tmp_path, **over):
    """2 ranks, a 2-layer d_model 64 GPT on stdlib bytes, 64-token windows, batch 8."""
    from thermowatch.trainer.config import TrainConfig

    base = {
        "run_id": "t",
        "steps": 20,
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 0},
        "data": {"max_bytes": 1 << 20, "seq_len": 64, "global_batch": 8},
        "optim": {"lr": 3e-3, "warmup_steps": 5},
    }
    for key, val in over.items():
        if isinstance(val, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **val}
        else:
            base[key] = val
    return TrainConfig.from_dict(base)
