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

from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.errors import UserError


def train(config_file: str, *, supervisor_url: str | None, sup_config: SupervisorConfig,
          verbose: bool = False, progress_every: int = 10, detach: bool = False, restarts: int = 10) -> int:
    import ray

    from thermowatch.train_output import announced_commands, Progress, quiet_http_logs
    from thermowatch.trainer.config import ConfigError, TrainConfig
    from thermowatch.trainer.controller import RunController

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
        from thermowatch.supervisor.operate.servers import joined, parse_servers
        from thermowatch.transport import HttpCommandChannel, HttpSink

        try:  # one URL, or several replicas' comma-separated (issue 40): the sink fails over between them
            supervisor_url = joined(parse_servers(supervisor_url, "--supervisor"))
        except ValueError as exc:
            raise UserError(str(exc)) from None

        # The daemon's auth is on by default: the trainer needs a token with the `ingest` scope
        # (`thermowatch token create trainer --scope ingest`), from THERMOWATCH_TOKEN, else the
        # admin token of THERMOWATCH_API_TOKEN / api_token_file.
        token = os.environ.get("THERMOWATCH_TOKEN") or sup_config.api_token
        if not token:
            raise UserError(f"--supervisor {supervisor_url}: no token to send; set THERMOWATCH_TOKEN to a token with "
                            f"the `ingest` scope (thermowatch token create trainer --scope ingest)")
        if detach:
            return _train_detached(tcfg, supervisor_url, token, restarts=restarts, progress_every=progress_every)
        sink = HttpSink(supervisor_url, sup_config.data_dir / "spool" / tcfg.run_id, token=token,
                        batch_s=tcfg.flush_every_s, batch_steps=tcfg.flush_every_steps, close_timeout=tcfg.close_timeout_s)
        commands = HttpCommandChannel(supervisor_url, token=token)
        closer = sink.close
    elif detach:
        raise UserError("--detach needs --supervisor URL: a detached controller outlives this process, and an "
                        "embedded supervisor would not")
    else:
        from thermowatch.supervisor.app.service import Supervisor

        sup = Supervisor(sup_config)
        sink = commands = sup
        closer = sup.close
    if not ray.is_initialized():
        ray.init(include_dashboard=False)  # joins the cluster named by RAY_ADDRESS (KubeRay), else local
    try:
        if tcfg.use_gpu:
            require_gpus(config_file, tcfg.world_size, int(ray.cluster_resources().get("GPU", 0)), "Ray reports")
        progress = Progress(tcfg.run_id, tcfg.steps, every=progress_every)
        result = RunController(tcfg, sink=sink, commands=announced_commands(commands), progress=progress).run()
    finally:
        closer()
    # The result on stdout, what scripts grep; progress and logs stay on stderr (issue 23).
    print(f"run {result.run_id}: step {result.final_step}, final loss {result.final_loss:.4f}, "
          f"attempts {result.attempts}, restarts {result.restarts}", flush=True)
    _nothing_trained(result.run_id, result.final_step, result.steps_recorded, tcfg)
    return 0 if result.final_step >= tcfg.steps or result.stopped else 1


def _train_detached(tcfg, supervisor_url: str, token: str, *, restarts: int, progress_every: int) -> int:
    """`train --detach`: the controller as a detached Ray actor that Ray restarts when its process
    dies (trainer/detached.py); this process only follows it and may die without harm. Launching
    the same run again attaches to its controller instead of starting a second one."""
    import ray

    from thermowatch.trainer import detached

    address = os.environ.get("RAY_ADDRESS")
    if not address and not ray.is_initialized():
        raise UserError("--detach needs a Ray cluster that outlives this process: start one (ray start --head "
                        "--port 6380 ...) or use KubeRay, and set RAY_ADDRESS to it")
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False)
    spool = Path(tcfg.checkpoint.dir) / tcfg.run_id / "spool"  # on the shared volume: any node may relaunch it
    actor, created = detached.start(tcfg.to_dict(), supervisor_url, str(spool), restarts=restarts,
                                    env={"THERMOWATCH_TOKEN": token})
    print(f"run {tcfg.run_id}: {'started' if created else 'attached to'} its controller, Ray actor "
          f"{detached.actor_name(tcfg.run_id)!r} in namespace {detached.NAMESPACE!r} (restarted up to {restarts} "
          f"times if its process dies); stopping this command leaves the run training", file=sys.stderr, flush=True)
    return follow(actor, tcfg.run_id, tcfg.steps, progress_every=progress_every)


def follow(actor, run_id: str, total_steps: int, *, progress_every: int = 10, poll_s: float = 1.0,
           out=None) -> int:
    """Print a detached controller's progress until its run ends; then collect it (the actor is
    killed once its result is read). Exit code as `train`'s."""
    import time

    import ray

    from thermowatch.monitors.contract import Ack, StepRecord
    from thermowatch.train_output import Progress, ack_line
    from thermowatch.trainer import detached

    out = out or sys.stderr
    progress = Progress(run_id, total_steps, every=progress_every, out=out)
    seq, pid = 0, None
    while True:
        try:
            st = ray.get(actor.status.remote(seq), timeout=60)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            try:  # restarting (its process died; Ray brings it back), or gone for good
                actor = ray.get_actor(detached.actor_name(run_id), namespace=detached.NAMESPACE)
            except ValueError:
                print(f"run {run_id}: its controller is gone (restarts exhausted or killed): {exc}", file=out)
                return 1
            time.sleep(poll_s)
            continue
        if pid is not None and st["pid"] != pid:
            seq = 0  # a new incarnation numbers its events afresh
            print(f"{run_id}: controller restarted by Ray (pid {pid} -> {st['pid']}, node {st['node_id'][:12]}), "
                  f"resuming from its newest checkpoint", file=out, flush=True)
            pid = st["pid"]
            continue
        pid = st["pid"]
        for _, kind, a, b in st["events"]:
            if kind == "step":
                progress(StepRecord.from_json(b), a)
            else:
                print(ack_line(run_id, a, Ack.from_json(b)), file=out, flush=True)
        seq = st["seq"]
        if st["done"]:
            break
        time.sleep(poll_s)
    ray.kill(actor, no_restart=True)  # collected: a finished run needs no controller
    if st["error"]:
        print(f"run {run_id}: failed: {st['error']}", file=out)
        return 1
    r = st["result"]
    print(f"run {r['run_id']}: step {r['final_step']}, final loss {r['final_loss']:.4f}, "
          f"attempts {r['attempts']}, restarts {r['restarts']}", file=sys.stdout if out is sys.stderr else out,
          flush=True)
    _nothing_trained(r["run_id"], r["final_step"], r.get("steps_recorded", 1), None, out)
    return 0 if r["final_step"] >= total_steps or r["stopped"] else 1


def _nothing_trained(run_id: str, final_step: int, recorded: int, tcfg, out=None) -> None:
    """A relaunch of a run that had already trained all its steps resumes at its last checkpoint
    and trains nothing: say so, instead of a bare "final loss nan" (issue 23)."""
    if recorded == 0 and final_step > 0:
        where = f" ({tcfg.checkpoint.dir})" if tcfg is not None else ""
        print(f"run {run_id}: nothing trained: it resumed at step {final_step}, its last, from its own checkpoints"
              f"{where}. To train again, give the config another run_id or an empty checkpoint dir.",
              file=out or sys.stderr, flush=True)


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


def validate_config(path: str, kind: str = "auto") -> list[str]:
    """`thermowatch validate-config FILE`: load a supervisor or a training config the way `serve`
    and `train` do (the config tree check, then each class's own range checks) and describe what
    was checked. Starts nothing, needs no GPU, reads no environment: it judges the file alone.
    Lives here because a training config is the trainer's class (DESIGN.md's import rule)."""
    from thermowatch.supervisor.app.config import read_mapping
    from thermowatch.trainer.config import ConfigError as TrainConfigError
    from thermowatch.trainer.config import TrainConfig

    values = read_mapping(Path(path))  # names the path when it is missing or not a YAML mapping
    if kind == "auto":
        kind = _config_kind(path, values, TrainConfig)
    if kind == "supervisor":
        cfg = SupervisorConfig.load(path, env={})
        return [f"{path}: supervisor config OK ({len(values)} keys set, checked as one tree against "
                f"SupervisorConfig, environment ignored)", *_describe_supervisor(cfg)]
    try:
        tcfg = TrainConfig.from_dict(values)  # the config tree walk (monitors.config_tree), then __post_init__
    except (TrainConfigError, ValueError) as exc:
        raise UserError(f"{path}: {exc}") from None
    return [f"{path}: training config OK ({len(values)} keys set, checked as one tree against TrainConfig)",
            *_describe_train(tcfg)]


def _config_kind(path: str, values: dict, train_cls: type) -> str:
    import dataclasses

    train_keys = {f.name for f in dataclasses.fields(train_cls)}
    sup_keys = {f.name for f in dataclasses.fields(SupervisorConfig)}
    in_train, in_sup = len(set(values) & train_keys), len(set(values) & sup_keys)
    if in_train == in_sup:
        raise UserError(f"{path}: cannot tell a supervisor config from a training config by its keys "
                        f"({sorted(values) or 'none'}); pass --kind supervisor or --kind train")
    return "train" if in_train > in_sup else "supervisor"


def _describe_supervisor(cfg: SupervisorConfig) -> list[str]:
    from thermowatch.monitors.config_tree import changed
    from thermowatch.supervisor import db

    return [
        f"  database: {db.redact(cfg.db_url) if cfg.db_url else f'SQLite in {cfg.data_dir}'}",
        f"  listens on {cfg.host}:{cfg.port}, auth {'on' if cfg.auth else 'OFF'}, public_url {cfg.public_url or '-'}",
        f"  Slack: {cfg.slack.channel or 'off (console alerts)'}; advise_only {cfg.advise_only}",
        f"  policy overrides: {changed(cfg.policy) or 'none'}; detector overrides: {changed(cfg.detectors) or 'none'}",
    ]


def _count(n: float) -> str:
    """2.1B, 350M, 0.8M: a tiny test model is not "~0.0B" (issue 23)."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit}"
    return f"{n:.0f}"


def _describe_train(c) -> list[str]:
    m, d, k = c.model, c.data, c.checkpoint
    params = 12 * m.n_layer * m.d_model**2 + m.vocab_size * m.d_model * (2 if m.untied_head else 1)
    ramp = (f"curriculum from batch {d.start_batch or d.global_batch} x seq {d.start_seq_len or d.seq_len} over "
            f"{d.ramp_tokens / 1e9:g}B tokens" if d.ramp_tokens else "no curriculum")
    return [
        f"  run {c.run_id}: {c.world_size} ranks ({'GPU, NCCL' if c.use_gpu else 'CPU, gloo'}), ZeRO stage "
        f"{c.zero_stage}, placement {c.placement}, {c.steps} steps",
        f"  model: {m.n_layer} layers, d_model {m.d_model}, {m.n_head} heads, seq {m.seq_len}, vocab "
        f"{m.vocab_size}: ~{_count(params)} parameters",
        f"  data: {d.source}{' ' + d.path if d.path else ''}, global batch {d.global_batch} x seq {d.seq_len}; {ramp}",
        f"  optim: lr {c.optim.lr:g}, warmup {c.optim.warmup_steps}, {c.optim.schedule}, clip {c.optim.grad_clip:g}",
        f"  checkpoints: every {k.every} steps to {k.dir}, keep last {k.keep_last} + one per {k.keep_every} steps",
    ]
