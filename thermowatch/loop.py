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

import collections
import copy
import logging
import math
import time
import warnings
from typing import Any, Iterator

import numpy as np
import torch

from thermowatch import checkpoint_trust
from thermowatch.checkpoint_dir import KEEP_BEHIND, KEEP_EVERY, CheckpointDir
from thermowatch.monitors.collective import CollectiveReducer
from thermowatch.monitors.contract import (
    LR_MULTIPLIER, LR_PEAK_AHEAD, CheckpointInfo, Command, LRChange, StepRecord, ledger_digest, multiplier_at,
)
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.monitors.reduce import Reducer
from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from thermowatch.monitors.thermometers.unread import Unread
from thermowatch.probing import Probing, lone_rank, suspects_of
from thermowatch.paused import PauseNotice
from thermowatch.obey import Applied, Obey, Refused, Transition
from thermowatch.protocol import Directed, Directive, Outcome, ack_for
from thermowatch.ranks import Ranks, rng_state
from thermowatch.run import Run
from thermowatch.watch_config import WatchConfig

log = logging.getLogger(__name__)

FORECAST_HORIZON = 200_000  # steps of the schedule dry-run for lr_peak_ahead (one pass, at start)


class Watch(Directed):
    """One protected training loop. Build it with `thermowatch.watch(...)`.

    Read during or after the loop: `step` (the last step trained), `attempt`, `final_loss` (the
    loss of the last step recorded: one step's, not a mean, as the run's finish report and
    `thermowatch status` carry it for every client, the bundled trainer's included; NaN before the
    first step and when the run ended diverged), `lr_multiplier`, `probing`, `serving`."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, cfg: WatchConfig | None = None, *,
                 scheduler: Any = None, lr_schedule: Any = None, data_index: Any = None, supervisor_config: Any = None,
                 **settings: Any) -> None:
        """`cfg`, or its fields as keyword arguments (`settings`): thermowatch/watch_config.py."""
        if cfg is None:
            cfg = WatchConfig(**settings)
        elif settings:
            raise TypeError(f"Watch takes a WatchConfig or its settings as keyword arguments, not both: {sorted(settings)}")
        self.cfg = cfg
        run, steps, global_batch, dataset_size = cfg.run, cfg.steps, cfg.global_batch, cfg.dataset_size
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        if lr_schedule is not None and not callable(lr_schedule):
            raise ValueError(f"lr_schedule must be a function of the step (1-based) giving its LR, got {lr_schedule!r}")
        self.lr_schedule = lr_schedule  # a loop that sets its LR by hand: the forecast from it
        self.dist = Ranks.detect(model)
        if global_batch % self.dist.world:
            raise ValueError(f"global_batch ({global_batch}) must divide among the {self.dist.world} ranks")
        # A loop that indexes `data[ids % dataset_size]` passes over its data more than once: a skip
        # then stands for the data it skipped, in every pass (monitors.ledger, issue 35).
        self.dataset_size = None if dataset_size is None else int(dataset_size)
        # A loop that shuffles each pass: its map from ids to data indices (vectorised), the
        # integrations' WatchedDataset.data_index; None = `id % dataset_size`.
        self.data_index = data_index
        self.total, self.global_batch = int(steps), int(global_batch)
        self.checkpoint_every, self.keep_checkpoints = cfg.checkpoint_every, cfg.keep_checkpoints
        self.dir = cfg.dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ckpts = CheckpointDir(self.dir, self.dist, model, optimizer, scheduler, self.keep_checkpoints)
        # `model`: what makes runs comparable for the peer envelope (supervisor/store/peers.py);
        # a config that names its own model section keeps it
        info = {"client": "thermowatch.watch", "checkpoint": {"every": self.checkpoint_every},
               "model": model_fingerprint(model), **(cfg.config or {})}
        if data_index is not None:  # the quarantine's data indices are the loader's to map (quarantine API)
            info["data"] = {**info.get("data", {}), "shuffled": True}
        # Rank 0 talks to the supervisor; the others hear its commands through _agree().
        self.run: Run | _Quiet = Run(
            run, steps=steps, global_batch=global_batch, config=info, server=cfg.server, token=cfg.token,
            state_dir=self.dir, world_size=self.dist.world, poll_interval_s=cfg.poll_interval_s,
            supervisor_config=supervisor_config,
            close_timeout_s=cfg.close_timeout_s,  # close() waits at most this for the daemon (thermowatch.run)
            dataset_size=self.dataset_size,
        ) if self.dist.rank == 0 else _Quiet(cfg.poll_interval_s)
        self.step = 0  # the last step trained
        self.cursor = 0  # the next absolute sample id to consider
        self.ledger = SkipLedger(period=self.dataset_size, index=data_index)
        self.lr_changes: list[LRChange] = []
        self.directive = Directive.RUN  # set only in transition, from the command's Transition
        self.pause_notice = PauseNotice(run)  # a pause says why and what ends it (rank 0; issue 35)
        self._executor = Obey(self)  # thermowatch/obey.py: the commands' handlers, shared with the bundled trainer
        self.final_loss = math.nan
        self._ids: np.ndarray | None = None
        self._ids_step = 0
        self._recorded = True
        self._meta: dict[int, tuple[int, int, float, float, float]] = {}  # step -> ids lo, hi, lr x, peak, lr
        self._healthy = True  # every loss since the last checkpoint was finite
        self._started = False
        self._closed = False
        self.th = None
        self._reducer: Reducer | None = None
        if cfg.thermometers is not False:
            # gradient norms read from .grad in the optimizer post-hook (_after_optimizer_step)
            self.th = instrument(model, cfg.thermometers if isinstance(cfg.thermometers, ThermometerConfig) else None,
                                 grad_hooks=False)
            self._unread = Unread(self.th.names)
            if self.dist.world > 1:  # reduced on the device, in the step's stream, before the one host copy
                self.th.finish = CollectiveReducer(self.th.names, len(self.th.names), self.th.device)
                self._reducer = Reducer(self.th.names)
        self._peak, self._peak_base = np.zeros(0), 0  # the schedule's forecast, made when steps() starts
        self.precise = cfg.precise
        self._losses: collections.deque[tuple[int, float]] = collections.deque(maxlen=256)  # (step, loss) sent
        # (step, rank): under torchrun, steps whose non-finite figures the reduction pinned on one rank
        self._lone: collections.deque[tuple[int, int]] = collections.deque(maxlen=64)
        self._ckpt_losses: list[float] = []  # the newest losses before the checkpoint loaded last (precise skip)
        self._probing: Probing | None = None
        self._probe_grad_finite = True  # the probe step's gradient was finite (_before_optimizer_step)
        self._waiting: list[Command] = []  # commands that came with a rollback that is still probing
        self._saved_lrs: list[Any] | None = None
        self._hooks = [optimizer.register_step_pre_hook(self._before_optimizer_step),
                       optimizer.register_step_post_hook(self._after_optimizer_step)]

    # --- the loop -----------------------------------------------------------------------------

    def steps(self) -> Iterator[int]:
        """The steps to train, 1-based. Resumes from the newest checkpoint; after a rollback it
        yields the checkpoint's step + 1 again; blocks while paused; ends at `steps` or on stop."""
        if not self._started:
            self._resume()
        while True:
            if self._started and not self._recorded:
                raise RuntimeError(f"step {self._ids_step}: call record(loss) once per step before the next one")
            if self._probing is not None:
                nxt = self._probe_next()
                if nxt is not None:
                    self._prepare(nxt)
                    yield nxt
                    continue
            self._after_step()
            self._obey()
            if self._probing is not None:  # a rollback that bisects before it resumes: probes first
                continue
            while self.paused and not self.stopped:
                self.pause_notice.tick()
                time.sleep(min(self.run.poll_interval_s, 0.2))
                self._obey()
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
        lo, hi, mult, peak, lr = self._meta[step]
        if self._probing is not None:  # a precise skip's probe: judged here, never sent
            self._meta.pop(step)
            ok, self._probe_grad_finite = self._probe_grad_finite, True
            # Every rank's verdict at once (issue 39 item 3): one rank's non-finite gradient or loss
            # makes the mean NaN on every rank, so every rank's search takes the same turn.
            self._probing.observe(step, self._ids, self.dist.mean(loss if ok else math.nan))
            self.cursor, self.step, self._recorded = hi, step, True
            return
        if self.th is not None:
            self.th.end_step(loss=loss, lr=lr, grad_norm=grad_norm)
            self._drain(False, values)
        else:
            scalars = {"loss": self.dist.mean(loss), "lr": lr}
            if grad_norm is not None:
                scalars["grad_norm"] = float(grad_norm)
            self._emit(step, scalars, values)
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
        self._collect_all()
        for h in self._hooks:
            h.remove()
        if self.th is not None:
            self.th.detach()
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
    def probing(self) -> bool:
        """True while the steps being trained are a precise skip's probes (`precise_skip`): they
        are re-trained from a checkpoint and thrown away, so a loop's own logging may leave them out."""
        return self._probing is not None

    @property
    def serving(self) -> SkipLedger:
        """The ledger the step being trained was taken through: a probe's while probing (the other
        suspects skipped), else the run's own. What a framework's data iterator must follow."""
        return self._probing.ledger if self._probing is not None else self.ledger

    @property
    def lr_multiplier(self) -> float:
        return multiplier_at(self.step + 1, self.lr_changes)

    # --- per step -----------------------------------------------------------------------------

    def _prepare(self, step: int) -> None:
        probe = self._probing
        if probe is not None and probe.clean is not None and self.cursor >= probe.clean[1]:
            self.cursor = probe.clean[0]  # replay triage's known-clean samples, round again
        ids = (probe.ledger if probe is not None else self.ledger).take(self.cursor, self.global_batch)
        self._ids, self._ids_step, self._recorded = ids, step, False
        mult = multiplier_at(step, self.lr_changes)
        k = step - 1 - self._peak_base
        peak = float(self._peak[k]) if 0 <= k < len(self._peak) else math.nan
        # the LR this step trains at: the schedule's now (the user's scheduler.step() comes after)
        self._meta[step] = (int(ids[0]), int(ids[-1]) + 1, mult, peak * mult, self._schedule_lr() * mult)
        if self.th is not None and probe is None:
            self.th.begin_step(step)

    def _drain(self, block: bool, extra: dict[str, float]) -> None:
        vals = self.th.collect(block=block)
        while vals is not None:
            ranks: dict[str, int] = {}
            if self._reducer is not None:
                vals, ranks = self._reducer.unpack(vals)
            # a budget's unread figures are absent, not NaN (issue 36)
            self._emit(self.th.last_step, self._unread.as_dict(vals, self.th.last_step), extra, ranks)
            vals = self.th.collect(block=block)

    def _emit(self, step: int, vals: dict[str, float], extra: dict[str, float],
              ranks: dict[str, int] | None = None) -> None:
        lo, hi, mult, peak, _ = self._meta.pop(step, (-1, -1, 1.0, math.nan, math.nan))
        vals = {**vals, LR_MULTIPLIER: mult, **{k: float(v) for k, v in extra.items()}}
        if math.isfinite(peak):
            vals[LR_PEAK_AHEAD] = peak
        loss = vals.get("loss", math.nan)
        self._healthy &= math.isfinite(loss)
        self.final_loss = loss
        # precise skip's view of the path: a non-finite gradient is a spike at its step, as in its
        # probes (a flipped bit shows in grad_norm a step before the loss)
        grad = vals.get("grad_norm", 0.0)
        self._losses.append((step, loss if grad is None or math.isfinite(grad) else math.nan))
        if ranks and not (math.isfinite(loss) and (grad is None or math.isfinite(grad))):
            # rare (a broken step): the one rank that held the non-finite extremes, if one did
            lone = lone_rank(vals, ranks)
            if lone is not None:
                self._lone.append((step, lone))
        self.run.send(StepRecord(step=step, values=vals, sample_lo=lo, sample_hi=hi, wall_time=time.time(),
                                 ranks=ranks or {}, ledger_digest=ledger_digest(self.ledger.ranges)))

    def _collect_all(self) -> None:
        if self.th is not None:
            self._drain(True, {})

    def _after_step(self) -> None:
        if self._started and self.step and self.step % self.checkpoint_every == 0 and self._ids_step == self.step:
            if not self.ckpts.exists(self.step):
                self._save(self.step)

    # --- the LR multiplier, around optimizer.step() --------------------------------------------

    def _schedule_lr(self) -> float:
        lr = self.optimizer.param_groups[0]["lr"]
        return float(lr) if not isinstance(lr, torch.Tensor) else float(lr.detach().cpu())

    def _before_optimizer_step(self, opt, args, kwargs) -> None:
        if self._probing is not None:
            # A probe's spike is a non-finite gradient too (a flipped bit shows there a step before
            # the loss does; replay triage compares with the abandoned path's grad_norm). Probes only:
            # one reduction and one host read a probe step, never on a training step.
            # (FSDP2: this rank's shards; the ranks' verdicts meet in record's mean)
            grads = [q.grad.to_local() if hasattr(q.grad, "to_local") else q.grad
                     for g in opt.param_groups for q in g["params"] if q.grad is not None]
            self._probe_grad_finite = bool(torch.isfinite(torch.stack([x.norm() for x in grads]).sum())) if grads else True
        mult = multiplier_at(self._ids_step, self.lr_changes)
        meta = self._meta.get(self._ids_step)
        if meta is not None:  # the LR the step really trains at: a loop that sets it by hand has by now
            self._meta[self._ids_step] = (*meta[:4], self._schedule_lr() * mult)
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
        if self.th is not None:
            self.th.grads_from_params(self.dist.sum_on_device)
        if self._saved_lrs is not None:
            for g, lr in zip(opt.param_groups, self._saved_lrs):
                g["lr"] = lr
            self._saved_lrs = None

    def _forecast(self) -> np.ndarray:
        """lr_peak_ahead on the schedule alone: peak[k] = the largest LR from step base+k+1 on,
        from `lr_schedule(step)` when given (a loop that sets its LR by hand, as nanoGPT's
        get_lr does), else a dry run of a copy of the user's scheduler on a stand-in optimizer
        (never theirs). Once at the start and after each rollback, not per step."""
        self._peak_base = self.step
        n = min(self.total - self.step, FORECAST_HORIZON)
        if self.lr_schedule is not None and n > 0:
            try:
                lrs = np.array([float(self.lr_schedule(self.step + 1 + i)) for i in range(n)])
            except Exception as exc:  # noqa: BLE001 - the user's function: no forecast, say so once
                log.warning("thermowatch: lr_schedule failed (%s); the LR forecast is off", exc)
                return np.zeros(0)
            return np.maximum.accumulate(lrs[::-1])[::-1]
        now = self._schedule_lr()
        if self.scheduler is None or n <= 0:
            return np.full(max(n, 0), now)
        try:
            stand_in = torch.optim.SGD([torch.zeros(1)], lr=now)
            stand_in.param_groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
                                      "params": [torch.zeros(1)]} for g in self.optimizer.param_groups]
            # Every reference to the user's optimizer (SequentialLR's children too) becomes the stand-in.
            sched = copy.deepcopy(self.scheduler, memo={id(self.optimizer): stand_in})
            lrs = np.empty(n)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for i in range(n):
                    lrs[i] = float(stand_in.param_groups[0]["lr"])
                    sched.step()
        except Exception as exc:  # noqa: BLE001 - a scheduler we cannot copy: no forecast, say so once
            log.warning("thermowatch: cannot dry-run %s for lr_peak_ahead (%s); the LR forecast is off",
                        type(self.scheduler).__name__, exc)
            return np.zeros(0)
        return np.maximum.accumulate(lrs[::-1])[::-1]

    # --- commands -----------------------------------------------------------------------------

    def _obey(self) -> None:
        cmds = self._waiting + self.dist.agree(self.run.commands)
        self._waiting = []
        for i, cmd in enumerate(cmds):
            was = self.directive
            out, error = self._executor.answer(cmd)  # thermowatch/obey.py: the bundled trainer's too
            self._said(cmd, was, out)
            if self._probing is not None:  # answered when its search ends; the rest wait for it
                if self._probing.out is None:
                    self._probing.cmd, self._probing.out = cmd, out
                self._waiting = cmds[i + 1:]
                return
            self._answer(cmd, out, error)

    def _said(self, cmd: Command, was: Directive, out: Outcome | None) -> None:
        """A pause that began or ended says so on rank 0, with the reason it was given and the
        commands that end it (thermowatch/paused.py)."""
        if self.dist.rank != 0 or (was is Directive.PAUSE) == (self.directive is Directive.PAUSE):
            return
        if self.paused:
            self.pause_notice.paused(self.step + 1, getattr(cmd.body, "reason", ""), self._checkpoints())
        else:
            self.pause_notice.ended(out.detail if out is not None else "")

    def _answer(self, cmd: Command, out: Outcome | None, error: str | None) -> None:
        ack = ack_for(cmd, out, error, first_step=self.step + 1, lr_changes=self.lr_changes,
                      skip_ranges=self.ledger.ranges)
        # remembered with the ledger and the LR changes before it leaves (thermowatch.protocol)
        self.run.ack(ack, cmd, lr_changes=self.lr_changes, skip_ranges=self.ledger.ranges)

    # --- the shared executor's host (thermowatch/obey.py) --------------------------------------

    def rollback_target(self, max_step: int) -> CheckpointInfo | None:
        """The newest checkpoint at or before `max_step` (rank 0's listing); its load may still
        fall back to an older healthy one (transition)."""
        usable = self.dist.from_rank0(lambda: [s for s in self._checkpoints() if s <= max_step])
        if not usable:
            return None
        path = self.ckpts.path(usable[-1])
        # the cursor is read from the file when it loads: unknown (0) until then
        return CheckpointInfo(usable[-1], str(path), 0, self.ckpts.healthy(usable[-1]))

    def why_not(self, step: int) -> str:
        if step > self.step:
            return f"is in the future (the run is at step {self.step})"
        if step not in self.dist.from_rank0(self._checkpoints):
            return f"is not in {self.dir} (never saved, or removed by retention)"
        problem = checkpoint_trust.problem(self.ckpts.path(step))
        if problem:
            return f"is not intact ({problem})"
        return "is marked unhealthy (saved after a non-finite loss)"

    def transition(self, t: Transition) -> Applied:
        """Apply a command's Transition: the one place a command changes this loop."""
        if t.restart_from is not None:
            return self._rollback(t)
        self.ledger.add_many([r.to_json() for r in t.skip])
        change = seq = None
        if t.lr is not None:
            change = t.lr.change(t.lr_from)
            self.lr_changes.append(change)
            seq = len(self.lr_changes) - 1
        if t.directive is not None:
            self.directive = t.directive
        return Applied(change, seq)

    def _rollback(self, t: Transition) -> Applied:
        """Load the checkpoint (or an older healthy one), abandon the path after it, and open the
        next attempt; with precise skip, the probes start before the skip is decided."""
        cmd = t.rollback
        trained_to = self.cursor  # the abandoned path trained every id below this
        steps = [t.restart_from.step] if cmd.exact else [s for s in self.dist.from_rank0(self._checkpoints)
                                                         if s <= t.restart_from.step]
        loaded = self._load_newest(steps, healthy_fallback=True)
        if loaded is None:
            why = "; ".join(self.ckpts.passed_over) or "the log says why"
            if cmd.exact:
                raise Refused(f"--exact: checkpoint {cmd.to_step} in {self.dir} is unreadable ({why})")
            raise Refused(f"checkpoint {t.restart_from.step} in {self.dir} and every older healthy one are "
                          f"unreadable ({why}); nothing to roll back to")
        # a blunt skip never lists its ids
        suspects = suspects_of(cmd.skip, trained_to, self.ledger) if self.precise is not None else np.zeros(0, np.int64)
        precise = len(suspects) > 0
        if not precise:
            self.ledger.add_many([r.to_json() for r in t.skip])
        change = seq = None
        if t.lr is not None:
            change = t.lr.change(loaded + 1)
            self.lr_changes.append(change)
            seq = len(self.lr_changes) - 1
        abandoned = [s for s in self._checkpoints() if s > loaded]
        if precise:  # its newest losses first: the spike replay triage compares with may be in them
            self._collect_all()
        left = [(s, v) for s, v in self._losses if s > loaded]  # the abandoned path's losses (replay triage)
        lone = {r for s, r in self._lone if s > loaded}  # one rank broke alone on it: hardware's evidence
        self._lone.clear()
        self.dist.barrier()  # every rank has loaded before rank 0 deletes anything
        if self.dist.rank == 0:
            for s in abandoned:
                self.ckpts.remove(s)
        prev = self.run.attempt
        self.run.checkpoints_deleted(abandoned, f"abandoned by the rollback to step {loaded}")
        if self.th is not None:
            self.th.discard_pending()
        self._meta.clear()
        self._losses = collections.deque(((s, v) for s, v in self._losses if s <= loaded), maxlen=256)  # the path's
        self._healthy = True
        self.run.start(start_step=loaded)
        self.run.attempt = self.dist.from_rank0(lambda: self.run.attempt)
        self._peak = self._forecast()
        if t.directive is not None:  # it ends a pause (issue 35)
            self.directive = t.directive
        if precise:  # its command and Outcome are handed over by _obey once the executor has said it
            healthy = self._ckpt_losses or [v for s, v in self._losses if s <= loaded]
            self._probing = Probing.begin(self.precise, suspects, loaded, self.ledger.copy(), healthy, left,
                                          self.global_batch, lone.pop() if len(lone) == 1 else None)
        ckpt = t.restart_from if loaded == t.restart_from.step else CheckpointInfo(
            loaded, str(self.ckpts.path(loaded)), self.cursor, self.ckpts.healthy(loaded))
        return Applied(change, seq, ckpt, (prev, self.run.attempt), tuple(self.ckpts.passed_over),
                       skip_ranges=() if precise else None)

    # --- precise skip: probes from the rollback's checkpoint (thermowatch/probing.py) ----------

    def _probe_next(self) -> int | None:
        """The next probe step to train, or None once the search has ended (the checkpoint
        loaded again, the offenders skipped, the rollback answered)."""
        p = self._probing
        if p.advance(self):
            return self.step + 1
        self._probing = None
        out = p.result()
        self.ledger.add_many([r.to_json() for r in out.skip_ranges])
        self._save_state()
        log.info("thermowatch: %s", out.detail)
        self._answer(p.cmd, out, None)
        return None

    # --- checkpoints (thermowatch/checkpoint_dir.py does the files) ---------------------------

    def _checkpoints(self) -> list[int]:
        return self.ckpts.steps()

    def _save(self, step: int) -> None:
        self._collect_all()  # the health of the steps before it is known before it is registered
        extra = {"step": step, "cursor": self.cursor,
                 "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                 "rng": rng_state()}
        if self.precise is not None:  # a precise skip's healthy trail, should a rollback come back here
            extra["losses"] = [v for _, v in list(self._losses)[-self.precise.window:]]
        path = self.ckpts.save(step, extra, self.cursor, self._healthy)
        if path is not None:  # rank 0: registered, the book kept, retention, then the others go on
            self._save_state()
            self.run.checkpoint_saved(step, path.resolve(), self.cursor, healthy=self._healthy,
                                      manifest={"attempt": self.run.attempt, "client": "thermowatch.watch"})
            old = self.ckpts.prune(step)
            self.run.checkpoints_deleted(old, f"retention: keep_checkpoints={self.ckpts.keep}, one per "
                                              f"{KEEP_EVERY} steps, the newest {KEEP_BEHIND}+ steps old")
            self.ckpts.released()
        self._healthy = True

    def _adopt(self, state: dict[str, Any]) -> int:
        """A loaded checkpoint's own state: the step, the cursor and the precise skip's trail."""
        self._ckpt_losses = [float(v) for v in state.get("losses") or []]
        self.step, self.cursor = int(state["step"]), int(state["cursor"])
        self._ids_step = self.step
        return self.step

    def _load(self, step: int) -> int:
        return self._adopt(self.ckpts.load(step))

    def _load_newest(self, steps: list[int], healthy_fallback: bool = False) -> int | None:
        """The step of the newest of `steps` that loaded (CheckpointDir.load_newest), or None."""
        state = self.ckpts.load_newest(steps, healthy_fallback)
        return self._adopt(state) if state is not None else None

    def _save_state(self) -> None:
        """The ledger and the LR changes are absolute and outlive every rollback: kept in the run's
        command book (thermowatch.protocol, `checkpoint_dir/commands.json`) beside the
        checkpoints, not in them, so a relaunch has the newest. Rank 0 keeps them."""
        if self.dist.rank == 0:
            self.run.book.save(self.lr_changes, self.ledger.ranges)

    def _resume(self) -> None:
        book = self.dist.from_rank0(lambda: {"skip_ranges": [r.to_json() for r in self.run.book.skip_ranges],
                                             "lr_changes": [c.to_json() for c in self.run.book.lr_changes]})
        self.ledger = SkipLedger(book["skip_ranges"], period=self.dataset_size, index=self.data_index)
        self.lr_changes = [LRChange.from_json(c) for c in book["lr_changes"]]
        start = self._load_newest(self.dist.from_rank0(self._checkpoints)) or 0
        self.run.start(start_step=start)
        self.run.attempt = self.dist.from_rank0(lambda: self.run.attempt)
        self._peak = self._forecast()
        self._started = True
        self._ids_step = self.step


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
