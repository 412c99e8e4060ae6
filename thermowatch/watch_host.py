"""How thermowatch.watch carries out the supervisor's commands: the host of the shared executor
(thermowatch/obey.py, the bundled trainer's too) for one Watch.

Commands are taken between two steps, on the training thread, on every rank at once (rank 0's are
broadcast: Ranks.agree). `transition` is the one place a command changes the loop: the skip
ledger, the LR changes, the Directive, or a rollback (load a checkpoint, abandon the path after it,
open the next attempt). A rollback that skips samples under precise skip first probes from its
checkpoint (thermowatch/probing.py); its ack leaves when the search ends, and the commands that
came after it wait for that. Each ack is remembered with the ledger and the LR changes before it
leaves (thermowatch.protocol's command book)."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from thermowatch import checkpoint_trust
from thermowatch.monitors.contract import CheckpointInfo, Command
from thermowatch.obey import Applied, Obey, Refused, Transition
from thermowatch.probing import Probing, suspects_of
from thermowatch.protocol import Directive, Outcome, ack_for

log = logging.getLogger(__name__)


class WatchHost:
    """The executor's host for `w`, the Watch (thermowatch/loop.py; not imported here: the loop
    imports this module): `step` and `directive` are the loop's."""

    def __init__(self, w: Any) -> None:
        self.w = w
        self.probing: Probing | None = None  # a precise skip's search in progress
        self._waiting: list[Command] = []  # commands that came with a rollback that is still probing
        self._executor = Obey(self)

    @property
    def step(self) -> int:
        return self.w.step

    @property
    def directive(self) -> Directive:
        return self.w.directive

    # --- between two steps --------------------------------------------------------------------

    def obey(self) -> None:
        """Carry out every command that came, in order (a probing rollback holds the rest back)."""
        w = self.w
        cmds = self._waiting + w.dist.agree(w.run.commands)
        self._waiting = []
        for i, cmd in enumerate(cmds):
            was = w.directive
            out, error = self._executor.answer(cmd)
            self._said(cmd, was, out)
            if self.probing is not None:  # answered when its search ends; the rest wait for it
                if self.probing.out is None:
                    self.probing.cmd, self.probing.out = cmd, out
                self._waiting = cmds[i + 1:]
                return
            self.answer(cmd, out, error)

    def _said(self, cmd: Command, was: Directive, out: Outcome | None) -> None:
        """A pause that began or ended says so on rank 0, with the reason it was given and the
        commands that end it (thermowatch/paused.py)."""
        w = self.w
        if w.dist.rank != 0 or (was is Directive.PAUSE) == (w.directive is Directive.PAUSE):
            return
        if w.paused:
            w.pause_notice.paused(w.step + 1, getattr(cmd.body, "reason", ""), w.ckpts.steps())
        else:
            w.pause_notice.ended(out.detail if out is not None else "")

    def answer(self, cmd: Command, out: Outcome | None, error: str | None) -> None:
        w = self.w
        ack = ack_for(cmd, out, error, first_step=w.step + 1, lr_changes=w.lr_changes, skip_ranges=w.ledger.ranges)
        # remembered with the ledger and the LR changes before it leaves (thermowatch.protocol)
        w.run.ack(ack, cmd, lr_changes=w.lr_changes, skip_ranges=w.ledger.ranges)

    def probe_next(self) -> int | None:
        """The next probe step to train, or None once the search has ended (the checkpoint
        loaded again, the offenders skipped, the rollback answered)."""
        p, w = self.probing, self.w
        if p.advance(w):
            return w.step + 1
        self.probing = None
        out = p.result()
        w.ledger.add_many([r.to_json() for r in out.skip_ranges])
        w.saved.save_book()
        log.info("thermowatch: %s", out.detail)
        self.answer(p.cmd, out, None)
        return None

    # --- the host protocol (thermowatch/obey.py) ----------------------------------------------

    def rollback_target(self, max_step: int) -> CheckpointInfo | None:
        """The newest checkpoint at or before `max_step` (rank 0's listing); its load may still
        fall back to an older healthy one (transition)."""
        w = self.w
        usable = w.dist.from_rank0(lambda: [s for s in w.ckpts.steps() if s <= max_step])
        if not usable:
            return None
        # the cursor is read from the file when it loads: unknown (0) until then
        return CheckpointInfo(usable[-1], str(w.ckpts.path(usable[-1])), 0, w.ckpts.healthy(usable[-1]))

    def why_not(self, step: int) -> str:
        w = self.w
        if step > w.step:
            return f"is in the future (the run is at step {w.step})"
        if step not in w.dist.from_rank0(w.ckpts.steps):
            return f"is not in {w.dir} (never saved, or removed by retention)"
        problem = checkpoint_trust.problem(w.ckpts.path(step))
        if problem:
            return f"is not intact ({problem})"
        return "is marked unhealthy (saved after a non-finite loss)"

    def transition(self, t: Transition) -> Applied:
        """Apply a command's Transition: the one place a command changes this loop."""
        w = self.w
        if t.restart_from is not None:
            return self._rollback(t)
        w.ledger.add_many([r.to_json() for r in t.skip])
        change, seq = w.change_lr(t.lr, t.lr_from)
        if t.directive is not None:
            w.directive = t.directive
        return Applied(change, seq)

    def _rollback(self, t: Transition) -> Applied:
        """Load the checkpoint (or an older healthy one), abandon the path after it, and open the
        next attempt; with precise skip, the probes start before the skip is decided."""
        w, cmd = self.w, t.rollback
        trained_to = w.cursor  # the abandoned path trained every id below this
        steps = [t.restart_from.step] if cmd.exact else [s for s in w.dist.from_rank0(w.ckpts.steps)
                                                         if s <= t.restart_from.step]
        loaded = w.saved.load_newest(steps, healthy_fallback=True)
        if loaded is None:
            why = "; ".join(w.ckpts.passed_over) or "the log says why"
            if cmd.exact:
                raise Refused(f"--exact: checkpoint {cmd.to_step} in {w.dir} is unreadable ({why})")
            raise Refused(f"checkpoint {t.restart_from.step} in {w.dir} and every older healthy one are "
                          f"unreadable ({why}); nothing to roll back to")
        # a blunt skip never lists its ids
        suspects = suspects_of(cmd.skip, trained_to, w.ledger) if w.precise is not None else np.zeros(0, np.int64)
        precise = len(suspects) > 0
        if not precise:
            w.ledger.add_many([r.to_json() for r in t.skip])
        change, seq = w.change_lr(t.lr, loaded + 1)
        abandoned = [s for s in w.ckpts.steps() if s > loaded]
        if precise:  # its newest losses first: the spike replay triage compares with may be in them
            w.recorder.drain(True)
        # the abandoned path's losses (replay triage), and a rank that broke alone on it (hardware's evidence)
        left, lone = w.recorder.rewind(loaded)
        w.dist.barrier()  # every rank has loaded before rank 0 deletes anything
        if w.dist.rank == 0:
            for s in abandoned:
                w.ckpts.remove(s)
        prev = w.run.attempt
        w.run.checkpoints_deleted(abandoned, f"abandoned by the rollback to step {loaded}")
        w.saved.open_attempt(loaded)
        if t.directive is not None:  # it ends a pause (issue 35)
            w.directive = t.directive
        if precise:  # its command and Outcome are handed over by obey() once the executor has said it
            healthy = w.saved.losses or w.recorder.trail.newest()
            self.probing = Probing.begin(w.precise, suspects, loaded, w.ledger.copy(), healthy, left,
                                         w.global_batch, lone.pop() if len(lone) == 1 else None)
        ckpt = t.restart_from if loaded == t.restart_from.step else CheckpointInfo(
            loaded, str(w.ckpts.path(loaded)), w.cursor, w.ckpts.healthy(loaded))
        return Applied(change, seq, ckpt, (prev, w.run.attempt), tuple(w.ckpts.passed_over),
                       skip_ranges=() if precise else None)
