"""The run controller (the Ray driver): owns the gang, steps it, reports, obeys commands.

    start:   attempt = last + 1; resume from the newest valid checkpoint (if any)
    loop:    poll commands (apply them between steps; block while paused)
             step every rank -> reduce across ranks -> StepRecord -> batch to sink.write
             every N steps: checkpoint (all ranks write, manifest last) -> sink.checkpoint_saved
    failure: a rank dies or hangs -> kill the gang, new attempt, new gang from the newest valid
             checkpoint at or before the current step -> sink.open_run -> go on

Every rollback and every gang restart starts a new attempt; the supervisor stores "later
attempts win" for the steps they re-train. The skip ledger and the LR changes are controller
state, written into every checkpoint manifest and re-applied on every start and rollback
(DESIGN.md, "Rollback semantics"), so a command never has to be repeated after a relaunch.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from thermowatch.monitors.contract import (
    CHECKPOINT_FAILURES,
    GRAD_NORM,
    LOSS,
    LR_MULTIPLIER,
    LR_PEAK_AHEAD,
    Ack,
    CheckpointInfo,
    Command,
    CommandChannel,
    RecordSink,
    FinishReason,
    RunFinished,
    RunInfo,
    StepRecord,
    multiplier_at,
)
from thermowatch.trainer.checkpoint import CheckpointError, CheckpointStorage, CheckpointStore, Retention, make_manifest
from thermowatch.trainer.config import TrainConfig
from thermowatch.trainer.data import SkipLedger
from thermowatch.trainer.lifecycle import (
    ControllerState,
    Errored,
    FailureDecision,
    FailureStatus,
    Finished,
    GangFactory,
    GangLike,
    Initializing,
    Paused,
    Restarting,
    Running,
    make_decision,
)
from thermowatch.trainer.lr import LRChange, changes_to_json
from thermowatch.trainer.seam import TrainedStep
from thermowatch.monitors.reduce import Reducer
from thermowatch.monitors.thermometers.unread import Unread
from thermowatch.paused import PauseNotice
from thermowatch.protocol import CommandBook, Directed, Directive, Outcome, next_attempt
from thermowatch.trainer.obey import ABANDONED as _ABANDONED
from thermowatch.trainer.obey import Applied, Obey, Transition
from thermowatch.probing import LossTrail, suspects_of
from thermowatch.trainer.probes import Probes

__all__ = ["RunController", "RunFailed", "RunResult", "Reducer"]

log = logging.getLogger(__name__)

class RunFailed(RuntimeError):
    """The run cannot go on (restarts exhausted, no way to build a gang). Says why."""


@dataclass
class RunResult:
    run_id: str
    final_step: int
    final_loss: float
    attempt: int  # the last attempt number
    attempts: list[int]  # every attempt this controller ran, in order
    restarts: int  # gang restarts after a failure (rollbacks not counted)
    stopped: bool  # ended by a STOP command
    acks: list[Ack] = field(default_factory=list)
    checkpoints: list[CheckpointInfo] = field(default_factory=list)
    wall_s: float = 0.0
    steps_recorded: int = 0  # steps this controller trained and recorded (0: a relaunch found the run done)


class RunController(Directed):
    def __init__(
        self,
        config: TrainConfig,
        sink: RecordSink,
        commands: CommandChannel,
        progress: Callable[[StepRecord, int], None] | None = None,
        store: CheckpointStorage | None = None,
        gang_factory: GangFactory | None = None,
    ) -> None:
        self.cfg = config
        # Each step goes to the sink as it is trained; records wait in one place, the sink's:
        # HttpSink's queue over HTTP, a Batched in front of an in-process one (thermowatch.transport).
        if not getattr(sink, "batches_records", False):
            from thermowatch.transport import Batched

            sink = Batched(sink, config.flush_every_steps, config.flush_every_s)
        self.sink, self.commands, self.progress = sink, commands, progress
        # Builds a gang: (config, attempt, data_state, lr_changes) -> Gang-like. Default: Ray
        # actors (trainer.worker.Gang); trainer.local.InProcessGang runs one rank in-process.
        self._gang_factory = gang_factory
        root = Path(config.checkpoint.dir) / config.run_id
        c = config.checkpoint
        retention = Retention(keep_last=c.keep_last, keep_every=c.keep_every, keep_behind=c.keep_behind)
        self.store: CheckpointStorage = store or CheckpointStore(root, retention)
        self.deleted_steps: set[int] = set()  # what retention removed, reported as it happens
        self.store.on_deleted = self._deleted
        self.commands_state = CommandBook(self.store.root)
        self.obey = Obey(self)
        self.loaded_checkpoint: CheckpointInfo | None = None
        self.passed_over: list[str] = []  # the checkpoints the last start_attempt could not load, and why
        self.schedule = config.lr_schedule()
        self.ledger = SkipLedger()
        self.lr_changes: list[LRChange] = []
        self.step = 0
        self.attempt = -1
        self.gang: GangLike | None = None
        # Ray node ids no gang may use again (a rollback that excludes an outlier's node); in
        # every attempt's RunInfo.config, so the supervisor records them.
        self.excluded_nodes: list[str] = []
        # What the operator's commands ask (run, pause, stop): set only in transition(), from
        # the Transition a handler returns; `paused` and `stopped` read it.
        self.directive = Directive.RUN
        self.pause_notice = PauseNotice(config.run_id)  # a pause says why and what ends it (issue 35)
        self.state: ControllerState = Initializing()
        self.states: list[ControllerState] = [self.state]  # every state entered, in order
        self.result = RunResult(config.run_id, 0, math.nan, -1, [], 0, False)
        self._healthy = True  # finite loss and grad norm since the previous checkpoint
        self._last_ckpt_step = -1
        self._ckpt_failures = 0  # consecutive failed checkpoint saves (reported in every record)
        self._ckpt_recovered = False
        self.last_checkpoint_error: str | None = None
        # Precise skip (trainer/probes.py): the path's (step, loss), a non-finite gradient as NaN
        # (the spike replay triage replays; a checkpoint keeps its newest as the probes' trail),
        # the steps where one rank alone broke (hardware's evidence), the abandoned path's end.
        self.precise = config.precise()
        self.probes: Probes | None = None  # a search the executor's Outcome hands the rollback to
        self._trail = LossTrail()  # the path's newest losses, the steps a rank broke alone (precise skip)
        self._trained_to = 0  # the abandoned path trained every sample id below this

    # --- the loop -------------------------------------------------------------------------------

    def run(self) -> RunResult:
        t0 = time.monotonic()
        self.store.clean_staging()
        resume = self._resume_point(None)
        if resume is not None:
            self.ledger = SkipLedger.from_json(resume.manifest["data"].get("skip_ranges"))
            self.lr_changes = [LRChange.from_json(c) for c in resume.manifest.get("lr", {}).get("changes", [])]
        if self.commands_state.loaded:
            # Commands acknowledged after the newest checkpoint live in commands.json, not in
            # its manifest: the supervisor booked them, so the relaunch keeps them too.
            self.lr_changes = list(self.commands_state.lr_changes)
            self.ledger.add_many([r.to_json() for r in self.commands_state.skip_ranges])
        self.step = 0 if resume is None else resume.step  # where a failed bring-up restarts from
        try:
            self.start_attempt(resume, reason="start" if resume is None else f"resume from step {resume.step}")
        except _GANG_FAILURES as exc:
            self._restart(exc)
        try:
            while self.step < self.cfg.steps and not self.stopped:
                self._apply_commands()
                if self.stopped or self.step >= self.cfg.steps:
                    break
                try:
                    self._train_step()
                    if self.cfg.checkpoint.every and self.step % self.cfg.checkpoint.every == 0:
                        self._checkpoint()
                except _GANG_FAILURES as exc:
                    self._restart(exc)
            self._drain()
            self._send_now()
            if self.cfg.checkpoint.every and self._last_ckpt_step != self.step and self.step > 0:
                try:
                    self._checkpoint()  # the end of the run (or a STOP) is a resume point too
                except _GANG_FAILURES as exc:  # the steps are done; the periodic checkpoints remain
                    log.error("final checkpoint at step %d failed: %r", self.step, exc)
        finally:
            self._send_now()
            if self.gang is not None:
                try:
                    self.gang.call("flush_profile", timeout_s=60)
                except Exception:
                    pass
                self.gang.kill()
                self.gang = None
        self._enter(Finished(self.step, self.stopped))
        # The same finish report as thermowatch.watch's close(): the run reads "finished", what
        # is still open for it expires, and the daemon tells its story (issue 23). A crash never
        # gets here: a crash is not a finish.
        reason = (FinishReason.STOPPED if self.stopped else
                  FinishReason.COMPLETED if self.step >= self.cfg.steps else FinishReason.CLOSED)
        self._tell(self.sink.finish_run, self.cfg.run_id, self.attempt,
                   RunFinished(step=self.step, reason=reason,
                               final_loss=self.result.final_loss if self.result.steps_recorded else None))
        r = self.result
        r.final_step, r.attempt, r.stopped, r.wall_s = self.step, self.attempt, self.stopped, time.monotonic() - t0
        return r

    def _train_step(self) -> None:
        step = self.step + 1
        outs = self.gang.call("step", step, timeout_s=self.cfg.step_timeout_s)
        self.step = step
        self._record(outs)  # the step before: the ranks hand their values out a step late

    def _drain(self) -> None:
        """Take the step the ranks still hold back (before a checkpoint, a command, a new
        attempt, the end): the supervisor must see every trained step first."""
        if self.gang is None or self.step == 0:
            return
        try:
            outs = self.gang.call("drain", timeout_s=self.cfg.step_timeout_s)
        except _GANG_FAILURES as exc:  # the step's values died with a rank; the next call restarts the gang
            log.error("could not collect step %d's thermometers: %r", self.step, exc)
            return
        self._record(outs)

    def _reduced(self, outs: list[TrainedStep | None]) -> tuple[np.ndarray, dict[str, int]]:
        if self.cfg.reduction == "collective":  # the ranks reduced on the device; rank 0 sent it
            return self.reducer.unpack(outs[0].values)
        return self.reducer(np.stack([o.values for o in outs]))

    def reduce(self, outs: list[TrainedStep | None]) -> dict[str, float]:
        """A step's reduced figures by name (a precise skip's probe: trainer/probes.py)."""
        values, _ = self._reduced(outs)
        return self._unread.as_dict(values, outs[0].step)

    def _record(self, outs: list[TrainedStep | None]) -> None:
        first = outs[0]
        if first is None:
            return
        values, ranks = self._reduced(outs)
        extra = {LR_MULTIPLIER: first.lr_multiplier, LR_PEAK_AHEAD: first.lr_peak_ahead}
        if self._ckpt_failures or self._ckpt_recovered:
            extra[CHECKPOINT_FAILURES] = float(self._ckpt_failures)
            self._ckpt_recovered = False
        read = self._unread.as_dict(values, first.step)  # a budget's unread figures are absent, not NaN
        rec = StepRecord(
            step=first.step,
            values={**read, **extra},
            sample_lo=first.sample_lo,
            sample_hi=first.sample_hi,
            tokens=first.tokens,
            wall_time=time.time(),
            ranks=ranks,
            ledger_digest=first.ledger_digest,
        )
        loss, norm = rec.values.get(LOSS, math.nan), rec.values.get(GRAD_NORM, math.nan)
        self._healthy &= math.isfinite(loss) and math.isfinite(norm)
        self._trained_to = max(self._trained_to, first.sample_hi)
        if self.precise is not None:  # a step with no grad_norm is a broken one here (norm NaN)
            self._trail.add(first.step, loss, norm, rec.values, ranks)
        self.result.final_loss = loss
        self.result.steps_recorded += 1
        self._tell(self.sink.write, self.cfg.run_id, self.attempt, [rec])
        if self.progress is not None:
            self.progress(rec, self.attempt)

    # --- attempts -------------------------------------------------------------------------------

    def start_attempt(self, ckpt: CheckpointInfo | None, reason: str, reuse_gang: bool = False) -> None:
        """New attempt number; state from `ckpt` (None = step 0) loaded into a new gang, or into
        the live one (`reuse_gang`, a rollback: saves the ~10 s of a gang bring-up; load_checkpoint
        restores weights, fp32 masters and optimizer state, and the data state and LR changes
        are set explicitly, so nothing of the abandoned trajectory survives); then open_run."""
        import ray

        self._drain()  # a live gang's held-back step belongs to the old attempt (sent under its number)
        self.attempt = next_attempt(self.store.root, self.attempt)  # never repeats across relaunches
        self.result.attempts.append(self.attempt)
        self.passed_over = []
        # A rollback's target is healthy: what it falls back to must be too (a resume takes any)
        healthy_only = ckpt is not None and ckpt.healthy
        while True:
            state = self._data_state(ckpt)
            if self.gang is not None and (not reuse_gang or ckpt is None):
                self.gang.kill()  # step 0 has no checkpoint to load in place: rebuild
                self.gang = None
            if self.gang is None:
                self.gang = self._build_gang(state)
            if ckpt is None:
                break
            try:
                t = self.cfg.step_timeout_s
                self.gang.call("load", ckpt.path, timeout_s=t)
                self.gang.call("set_data_state", state, self.attempt, timeout_s=t)
                self.gang.call("set_lr_changes", list(self.lr_changes), timeout_s=t)
                break
            except ray.exceptions.RayTaskError as exc:  # a file the store's checksums missed
                # the worker's own error (a refused file says so), not the actor's traceback
                cause = getattr(exc, "cause", None) or exc
                log.error("checkpoint step %d failed to load (%s); trying an older one", ckpt.step, cause)
                self.passed_over.append(f"{ckpt.step} (failed to load: {type(cause).__name__})")
                self.gang.kill()  # a half-loaded engine is not trusted; the next try starts clean
                self.gang = None
                ckpt = self._resume_point(ckpt.step - 1, healthy_only=healthy_only)
        self.step = 0 if ckpt is None else ckpt.step
        self.loaded_checkpoint = ckpt
        self._healthy = True
        self._trained_to = 0 if ckpt is None else int(ckpt.manifest["data"]["cursor"])
        self._trail.keep_to(self.step)
        self._last_ckpt_step = self.step if ckpt is not None else -1
        self.reducer = Reducer(self.gang.names)
        self._unread = Unread(list(self.gang.names))  # a thermometer budget's figures (issue 36)
        log.info("run %s attempt %d from step %d (%s)", self.cfg.run_id, self.attempt, self.step, reason)
        self._enter(Running(self.attempt, self.step))
        self._tell(
            self.sink.open_run,
            RunInfo(
                run_id=self.cfg.run_id,
                attempt=self.attempt,
                world_size=self.cfg.world_size,
                config={**self.cfg.to_dict(), "reason": reason, "excluded_nodes": list(self.excluded_nodes)},
                start_step=self.step,
                hosts=dict(self.gang.hosts),
            ),
        )

    def _enter(self, state: ControllerState) -> None:
        self.state = state
        self.states.append(state)
        log.debug("controller state %s", state)

    def _tell(self, fn: Callable[..., None], *args: Any) -> None:
        """Report to the sink; a sink failure is logged, never fatal (the run keeps training
        while the supervisor is down, DESIGN.md; HttpSink spools to disk on its own)."""
        try:
            fn(*args)
        except Exception as exc:
            log.error("%s failed: %r", getattr(fn, "__name__", fn), exc)

    def _build_gang(self, data_state: dict[str, Any]) -> GangLike:
        if self._gang_factory is not None:
            return self._gang_factory(self.cfg, self.attempt, data_state, list(self.lr_changes))
        from thermowatch.trainer.worker import Gang

        return Gang(self.cfg, self.attempt, data_state, list(self.lr_changes), exclude_nodes=self.excluded_nodes)

    def _restart(self, exc: BaseException) -> None:
        """A rank died or hung: the whole gang goes, a new one resumes from a checkpoint. A
        bring-up that fails too (the node is still down) counts as one more restart."""
        while True:
            self.result.restarts += 1
            log.error("gang failed at step %d (attempt %d): %r", self.step + 1, self.attempt, exc)
            self._enter(Restarting(self.attempt, self.step, repr(exc), self.result.restarts))
            if self.gang is not None:
                self.gang.kill()
                self.gang = None
            decision = make_decision(FailureStatus(self.result.restarts, self.cfg.max_restarts, exc))
            if decision is FailureDecision.RAISE:
                self._enter(Errored(f"{self.result.restarts} gang failures; last {exc!r}"))
                raise RunFailed(
                    f"run {self.cfg.run_id}: {self.result.restarts} gang failures exceed max_restarts="
                    f"{self.cfg.max_restarts}; last error {exc!r}. Check the failing node, then relaunch "
                    "(the run resumes from its newest valid checkpoint)"
                ) from exc
            ckpt = self._resume_point(self.step)
            try:
                self.start_attempt(ckpt, reason=f"restart after {type(exc).__name__} at step {self.step + 1}")
                return
            except _GANG_FAILURES as again:
                exc = again

    def _resume_point(self, max_step: int | None, healthy_only: bool = False) -> CheckpointInfo | None:
        """Newest intact checkpoint <= max_step that no rollback abandoned (and healthy when
        saved, if asked)."""
        while True:
            info = self.store.latest_valid(max_step=max_step, healthy_only=healthy_only)
            if info is None or not str(info.manifest.get("unhealthy_reason", "")).startswith(_ABANDONED):
                return info
            max_step = info.step - 1

    def rollback_target(self, max_step: int) -> CheckpointInfo | None:
        """A rollback's checkpoint: the newest valid, healthy one at or before max_step."""
        return self._resume_point(max_step, healthy_only=True)

    def _deleted(self, steps: list[int]) -> None:
        self.deleted_steps.update(steps)
        self._tell(self.sink.checkpoints_deleted, self.cfg.run_id, self.attempt, list(steps), "retention")

    def _data_state(self, ckpt: CheckpointInfo | None) -> dict[str, Any]:
        """The checkpoint's data state (or a fresh one) with the controller's whole ledger."""
        state = dict(ckpt.manifest["data"]) if ckpt is not None else {"cursor": 0, "tokens_consumed": 0, "step": 0}
        ledger = SkipLedger.from_json(state.get("skip_ranges"))
        ledger.add_many(self.ledger.ranges)
        self.ledger = ledger
        state["skip_ranges"] = ledger.to_json()
        return state

    # --- checkpoints ----------------------------------------------------------------------------

    def _checkpoint(self) -> CheckpointInfo | None:
        """Save a checkpoint. A write that fails (the volume full or read-only, a rank's save
        raising) does not end the run: the partial save is removed, the run trains on from the
        checkpoints it has, and every following record carries `checkpoint_failures` (the
        consecutive failures) until a save succeeds, which the supervisor pages on
        (supervisor/judge/checkpoint_health.py). A rank that dies or hangs in the save is a gang
        failure as anywhere else. Returns None when the save failed."""
        import ray

        try:
            return self._save_checkpoint()
        except (ray.exceptions.RayTaskError, OSError, CheckpointError) as exc:
            self._ckpt_failures += 1
            cause = getattr(exc, "cause", None) or exc
            self.last_checkpoint_error = f"{type(cause).__name__}: {cause}"
            log.error("checkpoint at step %d failed (%d in a row): %s; training on from checkpoint %s", self.step,
                      self._ckpt_failures, self.last_checkpoint_error, self._last_ckpt_step)
            try:
                self.store.discard(self.step)  # a half-written save only takes the space a retry needs
            except OSError as again:
                log.error("could not remove the failed save's staging dir: %r", again)
            return None

    def _save_checkpoint(self) -> CheckpointInfo:
        self._drain()  # `healthy` covers every step the checkpoint holds
        staging = self.store.begin(self.step)
        states = self.gang.call("save", str(staging), timeout_s=self.cfg.step_timeout_s)
        manifest = make_manifest(
            states[0],
            lr_multiplier=multiplier_at(self.step + 1, self.lr_changes),
            lr_changes=changes_to_json(self.lr_changes),
            attempt=self.attempt,
            healthy=self._healthy,
            run_id=self.cfg.run_id,
            world_size=self.cfg.world_size,
            zero_stage=self.cfg.zero_stage,
            # a precise skip's spike bar starts from them, should a rollback come back here
            **({"losses": self._trail.newest(self.precise.window)} if self.precise else {}),
        )
        # Durability barrier: every step this checkpoint covers is posted or spooled before the
        # checkpoint exists. A controller that dies right after the commit is relaunched from
        # this checkpoint and never trains those steps again: they must not die with it in the
        # sink's memory (trainer/detached.py). HttpSink.drain waits on its sender thread; the
        # embedded supervisor and the in-memory sinks store when their Batched writes.
        if not self.sink.drain(self.cfg.step_timeout_s):
            log.warning("sink still sending after %.0f s at checkpoint %d: a controller lost now may lose "
                        "the steps still queued", self.cfg.step_timeout_s, self.step)
        info = self.store.commit(self.step, manifest)
        self._tell(self.sink.checkpoint_saved, self.cfg.run_id, self.attempt, info)
        self.result.checkpoints.append(info)
        self._healthy, self._last_ckpt_step = True, self.step
        if self._ckpt_failures:
            self._ckpt_failures = 0
            self._ckpt_recovered = True  # the next record says 0 once: the supervisor sees it resolved
        return info

    # --- records --------------------------------------------------------------------------------

    def _send_now(self) -> None:
        """Hand the sink's waiting steps on now, without waiting for them to arrive."""
        self._tell(self.sink.drain, 0.0)

    # --- commands -------------------------------------------------------------------------------

    def _apply_commands(self) -> None:
        while True:
            cmds = self.commands.poll(self.cfg.run_id)
            if cmds:
                # The supervisor judges what happened before a command took effect: send it
                # everything the current attempt trained before a rollback starts the next one.
                self._drain()
                self._send_now()
            for cmd in cmds:
                self._apply(cmd)
            if not self.paused or self.stopped:
                if isinstance(self.state, Paused):
                    self._enter(Running(self.attempt, self.step))
                return
            if not isinstance(self.state, Paused):
                self._enter(Paused(self.attempt, self.step))
            self.pause_notice.tick()
            self._send_now()
            time.sleep(self.cfg.poll_every_s)

    def transition(self, t: Transition) -> Applied:
        """Apply a command's Transition (trainer.obey): the one place a command changes the run.
        The checkpoints a rollback walks away from are marked first: a crash from here on must not
        let a relaunch resume from one of them."""
        ckpt = t.restart_from
        suspects = None
        if ckpt is not None:
            self.store.abandon_after(ckpt.step, f"{_ABANDONED} by rollback to step {ckpt.step} from attempt {self.attempt}")
            if self.precise is not None and t.skip:  # a data rollback: which samples did it, first
                self._drain()  # the abandoned path's newest loss may be the spike triage replays
                suspects = suspects_of(t.skip, self._trained_to, self.ledger)
                left, lone = self._trail.abandon(ckpt.step)
                lone |= self._broke_alone(ckpt.step)
                suspects = suspects if len(suspects) else None
        ranges = [r.to_json() for r in t.skip] if suspects is None else []
        self.ledger.add_many(ranges)
        change = seq = None
        if t.lr is not None:
            change = t.lr.change(t.lr_from)
            self.lr_changes.append(change)
            seq = len(self.lr_changes) - 1
        self.excluded_nodes.extend(n for n in t.exclude if n not in self.excluded_nodes)
        if t.directive is not None:
            self.directive = t.directive
        if ckpt is not None:  # the new attempt's gang gets the ledger and the LR changes above
            before = self.attempt
            self.start_attempt(ckpt, reason=t.words, reuse_gang=not t.exclude)
            loaded = self.loaded_checkpoint or ckpt
            if suspects is not None and loaded.step < self.cfg.steps:
                # the probes run once the executor has said what the rollback did (trainer/obey.py)
                self.probes = Probes.begin(self, self.precise, suspects, loaded, left, self.cfg.steps,
                                           self.cfg.data.global_batch, self.cfg.step_timeout_s,
                                           lone.pop() if len(lone) == 1 else None)
            elif suspects is not None:
                self.ledger.add_many([r.to_json() for r in t.skip])
                self.gang.call("skip", [r.to_json() for r in t.skip], timeout_s=self.cfg.step_timeout_s)
            return Applied(change, seq, loaded, (before, self.attempt), tuple(self.passed_over),
                           skip_ranges=() if self.probes is not None else None)
        timeout = self.cfg.step_timeout_s
        if ranges:
            self.gang.call("skip", ranges, timeout_s=timeout)
        if change is not None:
            self.gang.call("set_lr_changes", list(self.lr_changes), timeout_s=timeout)
        if t.profile is not None:
            self.gang.call("profile", *t.profile, timeout_s=timeout)
        return Applied(change, seq)

    def _broke_alone(self, after_step: int) -> set[int]:
        """The ranks whose own loss went non-finite alone at a step after `after_step` on the path
        a rollback abandons: each rank's losses before the reduction (a mean: NaN on one rank is
        NaN for all, with no rank named), read once, from the device."""
        if self.cfg.world_size == 1 or self.gang is None:
            return set()
        per_rank = [dict(own) for own in self.gang.call("own_losses", after_step, timeout_s=self.cfg.step_timeout_s)]
        alone = set()
        for step in sorted(set().union(*per_rank)):
            broke = [r for r, own in enumerate(per_rank) if not math.isfinite(own.get(step, 0.0))]
            if len(broke) == 1:
                alone.add(broke[0])
        return alone

    def bisect(self, out: Outcome) -> Outcome:
        """A rollback's precise skip (trainer/probes.py), after the executor said what the rollback
        did: the probes from its checkpoint, then the offenders skipped and the ranks given the
        final data state. Its Outcome carries the search."""
        probes, self.probes = self.probes, None
        out = probes.run(out)  # ends with the checkpoint loaded again
        self.ledger.add_many([r.to_json() for r in out.skip_ranges])
        t = self.cfg.step_timeout_s
        self.gang.call("set_data_state", self._data_state(probes.ckpt), self.attempt, timeout_s=t)
        self.gang.call("set_lr_changes", list(self.lr_changes), timeout_s=t)
        log.info("run %s: %s", self.cfg.run_id, out.detail)
        return out

    def _apply(self, cmd: Command) -> None:
        was = self.directive
        ack = self.obey.apply(cmd, self._restart, _GANG_FAILURES)
        self.result.acks.append(ack)
        if was is not Directive.PAUSE and self.paused:  # says why and what ends it (thermowatch/paused.py)
            self.pause_notice.paused(self.step + 1, getattr(cmd.body, "reason", ""), self.store.steps())
        elif was is Directive.PAUSE and not self.paused:
            self.pause_notice.ended(ack.detail)
        try:
            self.commands.ack(self.cfg.run_id, ack)
        except Exception as exc:  # the supervisor re-sends it after its ack timeout; we answer again
            log.error("could not ack command %d: %r", cmd.id, exc)


def _gang_failures() -> tuple[type[BaseException], ...]:
    import ray.exceptions

    from thermowatch.trainer.worker import GangTimeout, PeerLost

    return (ray.exceptions.RayActorError, GangTimeout, PeerLost)


_GANG_FAILURES = _gang_failures()
