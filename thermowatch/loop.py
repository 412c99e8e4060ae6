"""`thermowatch.watch`: protection for any PyTorch training loop (docs/any-trainer.md).

    tw = thermowatch.watch(model, optimizer, run="my-run", steps=N, global_batch=B,
                           checkpoint_dir="ckpt", checkpoint_every=50, scheduler=sched)
    for step in tw.steps():        # resumes; re-trains from a checkpoint after a rollback;
        ids = tw.batch_ids(step)   #   blocks while paused; ends on stop
        ...forward, backward, optimizer.step(), scheduler.step()...
        tw.record(loss)            # thermometers + loss, sent in the background; checkpoints
    tw.close()                     # the run is finished

Every command is carried out here, on the training thread, between two steps:

- rollback: loads model, optimizer, scheduler and RNG state from the newest intact checkpoint at
  or before the step asked (exactly it with `exact`; one whose files no longer match their
  checksums, or that does not read, is passed over for the next older healthy one, and the ack
  says which and why: thermowatch/checkpoint_trust.py), deletes the checkpoints after it (that
  trajectory is abandoned), adds the skip ranges, applies the LR change from the step after the
  checkpoint, and opens the next attempt; `steps()` then yields the checkpoint's step + 1 again.
- skip: the ranges join the skip ledger; `batch_ids` passes over them from then on.
- set_lr: an absolute multiplier on the user's schedule from the next step: applied around
  `optimizer.step()` (a pre- and post-hook), so the scheduler itself never sees it and a
  chainable scheduler (ExponentialLR) does not compound it.
- pause / resume / stop: `steps()` blocks while paused and ends on stop; a rollback ends a pause.
  A pause says so on stderr and the `thermowatch` logger, with the reason it was given and the
  commands that end it, and repeats a short line every few minutes while it waits
  (thermowatch/paused.py).
- precise skip (opt-in, `precise_skip=True`, thermowatch/precise_skip.py): a rollback that skips
  samples first re-trains from its checkpoint in halves to find the offending ones; `steps()`
  yields the probes' steps (the user's loop trains them as any step; nothing of them is sent or
  checkpointed), then the checkpoint is loaded again and only the offenders are skipped. The
  rollback's ack leaves when the search ends, with what it cost.

The ack says what was really done (the checkpoint loaded, the change applied, the ledger's
digest). Sends and polls run on a background thread (thermowatch.run.Run).

Under torchrun (a default process group of more than one rank, DDP or FSDP) every rank makes
the same calls. Rank 0 alone talks to the supervisor; the commands it receives are broadcast at
the step boundary, so every rank carries out each one before the same step. The thermometers
are reduced across ranks on the device before their one host copy (monitors/collective.py:
max, min, mean or sum as each metric's meaning needs). `batch_ids` is this rank's share of the
step's global batch. Checkpoints are torch.distributed.checkpoint directories (every rank writes
its shards; the scheduler and each rank's RNG beside them) in a `checkpoint_dir` every rank sees.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

import numpy as np
import torch

from thermowatch.checkpoint_dir import CheckpointDir
from thermowatch.checkpointing import Checkpointing
from thermowatch.lr_forecast import Forecast, schedule_lr
from thermowatch.monitors.contract import Command, LRChange, ledger_digest, multiplier_at
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.paused import PauseNotice
from thermowatch.protocol import Directed, Directive
from thermowatch.ranks import Ranks
from thermowatch.recorder import Recorder
from thermowatch.run import Run
from thermowatch.watch_config import WatchConfig
from thermowatch.watch_host import WatchHost


class Watch(Directed):
    """One protected training loop. Build it with `thermowatch.watch(...)`.

    Read during or after the loop: `step` (the last step trained), `attempt`, `final_loss` (the
    loss of the last step recorded: one step's, not a mean, as the run's finish report and
    `thermowatch status` carry it for every client, the bundled trainer's included; NaN before the
    first step and when the run ended diverged), `lr_multiplier`, `probing`, `serving`.

    The loop's parts: its settings (WatchConfig), the checkpoint files (CheckpointDir), what each
    step sends (Recorder), the commands (WatchHost, the shared executor's host), the run's
    conversation with the supervisor (Run; rank 0 only)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: WatchConfig | None = None, *,
                 scheduler: Any = None, lr_schedule: Any = None, data_index: Any = None, supervisor_config: Any = None,
                 **settings: Any) -> None:
        """`cfg`, or its fields as keyword arguments (`settings`): thermowatch/watch_config.py."""
        if cfg is None:
            cfg = WatchConfig(**settings)
        elif settings:
            raise TypeError(f"Watch takes a WatchConfig or its settings as keyword arguments, not both: {sorted(settings)}")
        if lr_schedule is not None and not callable(lr_schedule):
            raise ValueError(f"lr_schedule must be a function of the step (1-based) giving its LR, got {lr_schedule!r}")
        self.cfg, self.model, self.optimizer, self.scheduler = cfg, model, optimizer, scheduler
        self.lr_schedule = lr_schedule  # a loop that sets its LR by hand: the forecast from it
        self.dist = Ranks.detect(model)
        if cfg.global_batch % self.dist.world:
            raise ValueError(f"global_batch ({cfg.global_batch}) must divide among the {self.dist.world} ranks")
        # A loop that indexes `data[ids % dataset_size]` passes over its data more than once: a skip
        # then stands for the data it skipped, in every pass (monitors.ledger, issue 35). A loop that
        # shuffles each pass: its map from ids to data indices (vectorised), the integrations'
        # WatchedDataset.data_index; None = `id % dataset_size`.
        self.dataset_size = None if cfg.dataset_size is None else int(cfg.dataset_size)
        self.data_index = data_index
        self.total, self.global_batch, self.precise = int(cfg.steps), int(cfg.global_batch), cfg.precise
        self.checkpoint_every, self.keep_checkpoints, self.dir = cfg.checkpoint_every, cfg.keep_checkpoints, cfg.dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpts = CheckpointDir(self.dir, self.dist, model, optimizer, scheduler, self.keep_checkpoints)
        # Rank 0 talks to the supervisor; the others hear its commands through Ranks.agree.
        self.run: Run | _Quiet = _open_run(cfg, model, self.dist, data_index, supervisor_config)
        self.step = 0  # the last step trained
        self.cursor = 0  # the next absolute sample id to consider
        self.ledger = SkipLedger(period=self.dataset_size, index=data_index)
        self.lr_changes: list[LRChange] = []
        self.directive = Directive.RUN  # set only by the host's transition, from the command's Transition
        self.pause_notice = PauseNotice(cfg.run)  # a pause says why and what ends it (rank 0; issue 35)
        self.recorder = Recorder(model, cfg.thermometers, self.dist, lambda r: self.run.send(r),
                                 lambda: ledger_digest(self.ledger.ranges))
        self.host = WatchHost(self)  # the commands: thermowatch/obey.py's handlers, shared with the bundled trainer
        self.saved = Checkpointing(self)  # what a checkpoint holds, and what a load or a resume puts back
        self._ids: np.ndarray | None = None
        self._ids_step = 0
        self._recorded = True
        self._started = self._closed = False
        self.forecast = Forecast()  # the schedule's peak LR ahead, made when an attempt opens
        self._probe_grad_finite = True  # the probe step's gradient was finite (_before_optimizer_step)
        self._saved_lrs: list[Any] | None = None
        self._hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step),
                       optimizer.register_step_post_hook(self._after_optimizer_step)]

    # --- the loop -----------------------------------------------------------------------------

    def steps(self) -> Iterator[int]:
        """The steps to train, 1-based. Resumes from the newest checkpoint; after a rollback it
        yields the checkpoint's step + 1 again; blocks while paused; ends at `steps` or on stop."""
        if not self._started:
            self.saved.resume()
            self._started = True
        while True:
            if self._started and not self._recorded:
                raise RuntimeError(f"step {self._ids_step}: call record(loss) once per step before the next one")
            if self.host.probing is not None:
                nxt = self.host.probe_next()
                if nxt is not None:
                    self._prepare(nxt)
                    yield nxt
                    continue
            self.saved.due()
            self.host.obey()
            if self.host.probing is not None:  # a rollback that bisects before it resumes: probes first
                continue
            while self.paused and not self.stopped:
                self.pause_notice.tick()
                time.sleep(min(self.run.poll_interval_s, 0.2))
                self.host.obey()
            if self.stopped or self.step >= self.total:
                return
            nxt = self.step + 1
            self._prepare(nxt)
            yield nxt

    def batch_ids(self, step: int) -> np.ndarray:
        """The absolute sample ids step `step` trains on (int64, `global_batch` of them), the skip
        ledger applied: index your data with them (`data[ids % len(data)]`) so a skip is real.
        Under torchrun: this rank's share, `global_batch / world` of them, rank 0's first."""
        if step != self._ids_step or self._ids is None:
            raise ValueError(f"batch_ids({step}): the step being trained is {self._ids_step}")
        if self.dist.world > 1:  # this rank's contiguous share of the global batch
            k = self.global_batch // self.dist.world
            return self._ids[self.dist.rank * k:(self.dist.rank + 1) * k]
        return self._ids

    def record(self, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None = None,
               **values: float) -> None:
        """Close the step: the loss (a tensor stays on its device), the thermometers, and any
        extra scalars (`values`, floats). Sent in the background. `grad_norm`: the global
        gradient norm the loop has already (what `clip_grad_norm_` returns; a tensor stays on its
        device): the thermometers then take it as `grad_norm` instead of reducing every gradient
        again each step, and under a budget the per-layer norms may thin (issue 36)."""
        step = self._ids_step
        if self._recorded:
            raise RuntimeError(f"record() called twice for step {step}, or before steps() yielded one")
        lo, hi = self.recorder.samples(step)
        if self.host.probing is not None:  # a precise skip's probe: judged here, never sent
            self.recorder.drop(step)
            ok, self._probe_grad_finite = self._probe_grad_finite, True
            # Every rank's verdict at once (issue 39 item 3): one rank's non-finite gradient or loss
            # makes the mean NaN on every rank, so every rank's search takes the same turn.
            self.host.probing.observe(step, self._ids, self.dist.mean(loss if ok else math.nan))
            self.cursor, self.step, self._recorded = hi, step, True
            return
        self.recorder.end(step, loss, grad_norm, values)
        self.cursor = hi if hi > lo else self.cursor
        self.step = step
        self._recorded = True

    def close(self, *, finished: bool = True) -> None:
        """Send what is left and end the run's session (the daemon keeps everything). The run
        then reads "finished" with the last step trained and its loss (`final_loss`, NaN or Inf
        included): "stopped" when a stop command ended it, "completed" when the steps were
        trained, else "closed" (the loop ended early). `finished=False` says nothing of the sort
        (a `with` block left by an exception: a crash is not a finish)."""
        if self._closed:
            return
        self._closed = True
        self.recorder.drain(True)
        for h in self._hooks:
            h.remove()
        self.recorder.detach()
        if not finished or not self._started:
            self.run.finish()
            return
        reason = "stopped" if self.stopped else "completed" if self.step >= self.total else "closed"
        self.run.finish(final_step=self.step, final_loss=self.final_loss, reason=reason)

    def __enter__(self) -> "Watch":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(finished=exc_type is None)

    @property
    def attempt(self) -> int:
        return self.run.attempt

    @property
    def final_loss(self) -> float:
        return self.recorder.final_loss

    @property
    def th(self) -> Any:
        """The thermometers (monitors/thermometers), or None when they are off."""
        return self.recorder.th

    @property
    def probing(self) -> bool:
        """True while the steps being trained are a precise skip's probes (`precise_skip`): they
        are re-trained from a checkpoint and thrown away, so a loop's own logging may leave them out."""
        return self.host.probing is not None

    @property
    def serving(self) -> SkipLedger:
        """The ledger the step being trained was taken through: a probe's while probing (the other
        suspects skipped), else the run's own. What a framework's data iterator must follow."""
        return self.host.probing.ledger if self.host.probing is not None else self.ledger

    @property
    def lr_multiplier(self) -> float:
        return multiplier_at(self.step + 1, self.lr_changes)

    def _load(self, step: int) -> int:
        """Load checkpoint `step` into the loop (thermowatch/probing.py's ProbeHost)."""
        return self.saved.load(step)

    @property
    def batch_step(self) -> int:
        """The step whose batch steps() handed out last (batch_ids' step)."""
        return self._ids_step

    def move_to(self, step: int, cursor: int) -> None:
        """Where a loaded checkpoint puts the loop: its step, trained, and the next sample id."""
        self.step, self.cursor, self._ids_step = step, cursor, step

    # --- per step -----------------------------------------------------------------------------

    def _prepare(self, step: int) -> None:
        probe = self.host.probing
        if probe is not None and probe.clean is not None and self.cursor >= probe.clean[1]:
            self.cursor = probe.clean[0]  # replay triage's known-clean samples, round again
        ids = (probe.ledger if probe is not None else self.ledger).take(self.cursor, self.global_batch)
        self._ids, self._ids_step, self._recorded = ids, step, False
        mult = multiplier_at(step, self.lr_changes)
        peak = self.forecast.at(step)
        # the LR this step trains at: the schedule's now (the user's scheduler.step() comes after)
        self.recorder.begin(step, int(ids[0]), int(ids[-1]) + 1, mult, peak * mult,
                            schedule_lr(self.optimizer) * mult, probe=probe is not None)

    # --- the LR multiplier, around optimizer.step() --------------------------------------------

    def change_lr(self, lr: Any, start_step: int) -> tuple[LRChange | None, int | None]:
        """A command's SetLR from `start_step` on: the change and its place in the list (or none)."""
        if lr is None:
            return None, None
        self.lr_changes.append(lr.change(start_step))
        return self.lr_changes[-1], len(self.lr_changes) - 1

    def _before_optimizer_step(self, opt, args, kwargs) -> None:
        if self.host.probing is not None:
            # A probe's spike is a non-finite gradient too (a flipped bit shows there a step before
            # the loss does; replay triage compares with the abandoned path's grad_norm). Probes only:
            # one reduction and one host read a probe step, never on a training step.
            # (FSDP2: this rank's shards; the ranks' verdicts meet in record's mean)
            grads = [q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad
                     for g in opt.param_groups for q in g["params"] if q.grad is not None]
            self._probe_grad_finite = bool(torch.isfinite(torch.stack([x.norm() for x in grads]).sum())) if grads else True
        mult = multiplier_at(self._ids_step, self.lr_changes)
        # the LR the step really trains at: a loop that sets it by hand has by now
        self.recorder.trained_at(self._ids_step, schedule_lr(self.optimizer) * mult)
        if mult != 1.0:
            self._saved_lrs = [g["lr"] for g in opt.param_groups]
            for g in opt.param_groups:
                g["lr"] = g["lr"] * mult

    def _after_optimizer_step(self, opt, args, kwargs) -> None:
        # The grads the step used (FSDP2: local shards, summed), read after it: a step given a
        # closure (Lightning's automatic optimization, LBFGS) runs forward and backward inside
        # step(), after the pre-hooks, which saw no grads on the first step (a NaN grad_norm that
        # paused a healthy run) and the previous step's on every later one. A fused optimizer under
        # a GradScaler has also unscaled them by now. optimizer.step() leaves .grad as it was.
        self.recorder.grads_from_params()
        if self._saved_lrs is not None:
            for g, lr in zip(opt.param_groups, self._saved_lrs):
                g["lr"] = lr
            self._saved_lrs = None


def _open_run(cfg: WatchConfig, model: torch.nn.Module, dist: Ranks, data_index: Any,
              supervisor_config: Any) -> "Run | _Quiet":
    """Rank 0's Run (rank > 0: a stand-in that sends nothing), registered with what makes runs
    comparable (the model's fingerprint: the peer envelope, supervisor/store/peers.py); a config
    that names its own model section keeps it."""
    if dist.rank != 0:
        return _Quiet(cfg.poll_interval_s)
    info = {"client": "thermowatch.watch", "checkpoint": {"every": cfg.checkpoint_every},
            "model": model_fingerprint(model), **(cfg.config or {})}
    if data_index is not None:  # the quarantine's data indices are the loader's to map (quarantine API)
        info["data"] = {**info.get("data", {}), "shuffled": True}
    return Run(cfg.run, steps=cfg.steps, global_batch=cfg.global_batch, config=info, server=cfg.server,
               token=cfg.token, state_dir=cfg.dir, world_size=dist.world, poll_interval_s=cfg.poll_interval_s,
               supervisor_config=supervisor_config,
               close_timeout_s=cfg.close_timeout_s,  # close() waits at most this for the daemon (thermowatch.run)
               dataset_size=cfg.dataset_size)


def model_fingerprint(model: torch.nn.Module) -> dict[str, Any]:
    """The model's architecture as the supervisor compares runs by (the peer envelope): its class,
    parameter count and a digest of every parameter's name, shape and dtype. Two runs of the same
    architecture match whatever their weights, LR or data; another width or depth does not."""
    import hashlib

    h = hashlib.sha256(type(model).__qualname__.encode())
    n = 0
    for name, p in model.named_parameters():
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
        n += p.numel()
    return {"class": type(model).__qualname__, "parameters": n, "fingerprint": h.hexdigest()[:16]}


class _Quiet:
    """Rank > 0's stand-in for Run under torchrun: rank 0 alone talks to the supervisor."""

    supervisor = None

    def __init__(self, poll_interval_s: float) -> None:
        self.poll_interval_s = poll_interval_s
        self.attempt = 0

    def start(self, start_step: int = 0, hosts: Any = None) -> int:
        return self.attempt

    def commands(self) -> list[Command]:
        return []

    def send(self, *a: Any, **k: Any) -> None:
        pass

    ack = checkpoint_saved = checkpoints_deleted = finish = send


def watch(model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: WatchConfig | None = None,
          **kwargs: Any) -> Watch:
    """Protect a training loop: see Watch, WatchConfig and docs/any-trainer.md."""
    return Watch(model, optimizer, cfg, **kwargs)
