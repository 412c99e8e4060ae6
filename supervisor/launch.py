"""`thermowatch train CONFIG`: one supervised run.

Against a running daemon (`--supervisor URL`) the controller talks HTTP with an `ingest` token
(THERMOWATCH_TOKEN), spooling to disk while the daemon is away; without one, an embedded supervisor runs in this process (the same code,
no HTTP) on the data dir's SQLite.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from supervisor.config import SupervisorConfig
from supervisor.errors import UserError


def train(config_file: str, *, supervisor_url: str | None, sup_config: SupervisorConfig,
          verbose: bool = False, progress_every: int = 10) -> int:
    import ray

    from supervisor.train_output import AnnouncedCommands, Progress, quiet_http_logs
    from trainer.config import ConfigError, TrainConfig
    from trainer.controller import RunController

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_http_logs(verbose)
    if not Path(config_file).exists():
        raise UserError(f"training config {config_file} does not exist")
    try:
        tcfg = TrainConfig.load(config_file)
    except (ConfigError, ValueError) as exc:
        raise UserError(f"{config_file}: {exc}") from None
    joining = bool(os.environ.get("RAY_ADDRESS")) or ray.is_initialized()
    if tcfg.use_gpu and not joining:
        # Locally Ray would wait forever to place a GPU actor this machine cannot hold. On a
        # cluster the driver may sit on a CPU-only head node: there Ray's count decides, below.
        import torch

        require_gpus(config_file, tcfg.world_size, torch.cuda.device_count() if torch.cuda.is_available() else 0,
                     "torch sees")
    if supervisor_url:
        from trainer.http_sink import HttpCommandChannel, HttpSink

        # The daemon's auth is on by default: the trainer needs a token with the `ingest` scope
        # (`thermowatch token create trainer --scope ingest`), from THERMOWATCH_TOKEN, else the
        # admin token of THERMOWATCH_API_TOKEN / api_token_file.
        token = os.environ.get("THERMOWATCH_TOKEN") or sup_config.api_token
        if not token:
            raise UserError(f"--supervisor {supervisor_url}: no token to send; set THERMOWATCH_TOKEN to a token with "
                            f"the `ingest` scope (thermowatch token create trainer --scope ingest)")
        sink = HttpSink(supervisor_url, sup_config.data_dir / "spool" / tcfg.run_id, token=token)
        commands = HttpCommandChannel(supervisor_url, token=token)
        closer = sink.close
    else:
        from supervisor.service import Supervisor

        sup = Supervisor(sup_config)
        sink = commands = sup
        closer = sup.close
    if not ray.is_initialized():
        ray.init(include_dashboard=False)  # joins the cluster named by RAY_ADDRESS (KubeRay), else local
    try:
        if tcfg.use_gpu:
            require_gpus(config_file, tcfg.world_size, int(ray.cluster_resources().get("GPU", 0)), "Ray reports")
        progress = Progress(tcfg.run_id, tcfg.steps, every=progress_every)
        result = RunController(tcfg, sink=sink, commands=AnnouncedCommands(commands), progress=progress).run()
    finally:
        closer()
    print(f"run {result.run_id}: step {result.final_step}, final loss {result.final_loss:.4f}, "
          f"attempts {result.attempts}, restarts {result.restarts}", file=sys.stderr)
    return 0 if result.final_step >= tcfg.steps or result.stopped else 1


def require_gpus(config_file: str, world_size: int, gpus: int, who: str) -> None:
    """`use_gpu: true` where there are no GPUs: refuse now (exit 2) instead of hanging on placement.
    Fewer GPUs than ranks is only a warning: an autoscaling cluster may still add nodes."""
    if gpus == 0:
        raise UserError(f"{config_file}: use_gpu is true but {who} no GPU on this machine or cluster; set "
                        f"`use_gpu: false` to train on CPU ranks (deploy/local/train.yaml), or run where GPUs are "
                        f"(RAY_ADDRESS=... for a Ray cluster)")
    if gpus < world_size:
        logging.getLogger(__name__).warning(
            "%s %d GPU(s) for world_size=%d: the run waits until the cluster has %d", who, gpus, world_size,
            world_size)
