"""How the run controller carries out the typed commands (monitors.commands): a handler table,
one function per command type, each returning a `Transition`, the run's next state as data.

A handler only reads the controller. What a command changes (the loop's Directive, the skip
ledger, the LR changes, the excluded nodes, a new attempt from a checkpoint, a trace) is the
Transition it returns, and `RunController.transition` applies it, the one place commands change
the run. What applying did (the LR change's place in the list, the checkpoint really loaded, the
attempt numbers) comes back as `Applied`, and `outcome` turns both into the `Outcome` whose ack
the supervisor books, so what is recorded is what the trainer did (DESIGN.md, "Trust").

Commands are applied at most once: the ack of every applied command id is kept, and a command
delivered again (a lost ack, a supervisor restart) is answered with the same ack, unchanged.
That memory, the LR changes and the skip ledger are written to `commands.json` in the run's
checkpoint root before the ack leaves, so a relaunched controller keeps what it acknowledged
even when no checkpoint was saved since (the manifest alone would forget it). The book, the
Outcome and the ack are thermowatch.protocol's: the same code as thermowatch.watch's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from thermowatch.monitors.contract import (
    Ack,
    CheckpointInfo,
    Command,
    ContractError,
    LRChange,
    Pause,
    Profile,
    Resume,
    Rollback,
    SampleRange,
    SetLR,
    Skip,
    Stop,
)
from thermowatch.protocol import CheckpointRef, CommandBook, Directive, Outcome, ack_for, directed, resumed_by_rollback
from thermowatch.trainer.checkpoint import CheckpointStorage
from thermowatch.trainer.config import TrainConfig
from thermowatch.trainer.data import SkipLedger
from thermowatch.trainer.lifecycle import GangLike

log = logging.getLogger(__name__)

ABANDONED = "abandoned"  # prefix of the unhealthy_reason of checkpoints a rollback left behind


@dataclass(frozen=True)
class Transition:
    """What one command changes on the run, returned by its handler; applied by
    RunController.transition alone, in this order: the checkpoints after `restart_from` marked
    abandoned, `skip` into the ledger, `lr` appended, `exclude` added, `directive` set, then either
    a new attempt from `restart_from` or the live gang told (skip, LR changes, `profile`)."""

    words: str  # the ack's detail (a rollback's is finished by `outcome`, once the load is done)
    directive: Directive | None = None  # pause / resume / stop: what the loop does next
    skip: tuple[SampleRange, ...] = ()
    lr: SetLR | None = None  # an LR change ...
    lr_from: int = 0  # ... from this step on
    profile: tuple[int, str] | None = None  # (steps, output dir): trace the next steps
    restart_from: CheckpointInfo | None = None  # a rollback: a new attempt from this checkpoint
    exclude: tuple[str, ...] = ()  # Ray node ids no gang may use again (the restart leaves them out)
    rollback: Rollback | None = None  # the command a restart answers (its ack's words)
    why: str = ""  # why the checkpoint asked for is not `restart_from` ("" when it is)


@dataclass(frozen=True)
class Applied:
    """What RunController.transition did: the LR change made and its place in the list, and for a
    restart the checkpoint really loaded (an unreadable one falls back to an older one) and the
    attempt numbers before and after."""

    lr_change: LRChange | None = None
    lr_seq: int | None = None
    loaded: CheckpointInfo | None = None
    attempts: tuple[int, int] = (0, 0)
    passed_over: tuple[str, ...] = ()  # the checkpoints that failed to load before `loaded`, and why


class Controlled(Protocol):
    """What the handlers read on the run controller (trainer.controller.RunController), and the
    one method that changes it; typed here so this module never imports the controller back."""

    cfg: TrainConfig
    store: CheckpointStorage
    commands_state: CommandBook
    ledger: SkipLedger
    lr_changes: list
    excluded_nodes: list[str]
    deleted_steps: set[int]
    gang: GangLike | None
    step: int
    directive: Directive

    def rollback_target(self, max_step: int) -> CheckpointInfo | None: ...

    def transition(self, t: Transition) -> Applied: ...


class Refused(Exception):
    """A command that cannot be carried out as asked; the message says why and what to do."""


class Obey:
    """The handler table: command type -> handler(body) -> Transition (reads the controller only)."""

    def __init__(self, ctl: Controlled) -> None:
        self.ctl = ctl
        self.handlers: dict[type, Callable[[Any], Transition]] = {
            Pause: self._direct, Resume: self._direct, Stop: self._direct, Skip: self._skip,
            SetLR: self._set_lr, Profile: self._profile, Rollback: self._rollback,
        }

    def apply(self, cmd: Command, on_gang_failure: Callable[[BaseException], None],
              gang_failures: tuple[type[BaseException], ...]) -> Ack:
        """Plan, apply through the controller, answer: the command's ack (the same one again for a
        command answered before, which changes nothing)."""
        ctl = self.ctl
        done = ctl.commands_state.answered(cmd)
        if done is not None:
            return done
        out: Outcome | None = None
        error: str | None = None
        try:
            t = self.handlers[type(cmd.body)](cmd.body)
            out = outcome(t, ctl.transition(t))
        except gang_failures as exc:
            on_gang_failure(exc)
            error = f"the gang failed while applying it ({exc!r}); restarted"
        except (Refused, ContractError) as exc:  # cannot be done as asked: refuse, keep training
            log.warning("command %s refused: %s", cmd, exc)
            error = str(exc)
        except Exception as exc:  # noqa: BLE001 - a bug or a bad file: refuse, keep training
            log.exception("command %s failed", cmd)
            error = f"{type(exc).__name__}: {exc}"
        ack = ack_for(cmd, out, error, first_step=ctl.step + 1, lr_changes=ctl.lr_changes,
                      skip_ranges=ctl.ledger.ranges)
        ctl.commands_state.record(ack, cmd, lr_changes=ctl.lr_changes, skip_ranges=ctl.ledger.ranges)
        return ack

    # --- handlers: read the controller, return the Transition -----------------------------------

    def _direct(self, cmd: Pause | Resume | Stop) -> Transition:
        """Pause, resume, stop: one pure transition (thermowatch.protocol.directed)."""
        out = directed(self.ctl.directive, cmd, self.ctl.step)
        return Transition(out.detail, directive=out.directive)

    def _skip(self, cmd: Skip) -> Transition:
        return Transition(f"skipping {', '.join(map(str, cmd.ranges))}", skip=cmd.ranges)

    def _set_lr(self, cmd: SetLR) -> Transition:
        start = self.ctl.step + 1
        return Transition(f"{cmd.describe()} from step {start}", lr=cmd, lr_from=start)

    def _profile(self, cmd: Profile) -> Transition:
        ctl = self.ctl
        out = cmd.out_dir or str(ctl.store.root / "profiles" / f"step_{ctl.step + 1:08d}")
        return Transition(f"tracing steps {ctl.step + 1}..{ctl.step + cmd.steps} into {out}", profile=(cmd.steps, out))

    def _rollback(self, cmd: Rollback) -> Transition:
        """One command = one restart: load, skip, LR change, new attempt, all before the next step."""
        ctl = self.ctl
        exclude: list[str] = []
        if cmd.exclude_rank is not None or cmd.exclude_node:
            # Restart without the node: same world size on spare capacity (the data split and
            # the global batch stay as they are); refused, before anything changes, when the
            # cluster has no such capacity (trainer.exclude).
            from thermowatch.trainer.exclude import nodes_to_exclude

            try:
                exclude = nodes_to_exclude(ctl, cmd.exclude_rank, cmd.exclude_node)
            except ValueError as exc:
                raise Refused(f"restarting without rank {cmd.exclude_rank} / node {cmd.exclude_node!r}: {exc}") from None
        ckpt = ctl.rollback_target(min(cmd.to_step, ctl.step))
        why = "" if ckpt is not None and ckpt.step == cmd.to_step else self.why_not(cmd.to_step)
        if cmd.exact and (ckpt is None or ckpt.step != cmd.to_step):
            raise Refused(f"--exact: checkpoint {cmd.to_step} cannot be loaded ({why}); "
                          f"{'the newest usable one at or before it is ' + str(ckpt.step) if ckpt else 'none is usable'}")
        if ckpt is None:
            raise Refused(f"no valid healthy checkpoint at or before step {cmd.to_step} ({why}); nothing to roll back to")
        return Transition(f"rollback to step {ckpt.step}{_without(exclude, cmd)} (command)", skip=cmd.skip,
                          lr=cmd.lr, lr_from=ckpt.step + 1, restart_from=ckpt, exclude=tuple(exclude),
                          rollback=cmd, why=why, directive=resumed_by_rollback(ctl.directive))  # ends a pause

    def why_not(self, step: int) -> str:
        """Why checkpoint `step` is not the one loaded, in words for the ack."""
        ctl = self.ctl
        if step > ctl.step:
            return f"is in the future (the run is at step {ctl.step})"
        if step in ctl.deleted_steps:
            return "was removed by retention"
        if step not in ctl.store.steps():
            return "was never saved"
        problem = ctl.store.problem(step)
        if problem:
            return f"is not intact ({problem})"
        reason = ctl.store.load_manifest(step).get("unhealthy_reason", "")
        return f"is marked unhealthy ({reason or 'non-finite loss or gradient before it was saved'})"


def _without(exclude: list[str] | tuple[str, ...], cmd: Rollback) -> str:
    if not exclude:
        return ""
    return f" without node {', '.join(exclude)}" + (f" (rank {cmd.exclude_rank}'s)" if cmd.exclude_rank is not None else "")


def outcome(t: Transition, done: Applied) -> Outcome:
    """The Outcome (the ack's words and fields) of a Transition the controller applied."""
    cmd = t.rollback
    if cmd is None:
        return Outcome(t.words, lr_change=done.lr_change, lr_seq=done.lr_seq, skipped=t.skip, directive=t.directive)
    loaded = done.loaded or t.restart_from
    why = t.why or "could not be loaded (the log says why)"
    asked = f"asked <= {cmd.to_step}" + (f"; {cmd.to_step} {why}" if loaded.step != cmd.to_step else "")
    detail = (f"rolled back to checkpoint {loaded.step}{_without(t.exclude, cmd)}; {asked}; "
              f"attempt {done.attempts[0]} -> {done.attempts[1]}"
              + (f", skipping {', '.join(map(str, cmd.skip))}" if cmd.skip else "")
              + (f", {cmd.lr.describe()} from step {done.lr_change.start_step}" if done.lr_change else "")
              + (f"; passed over {'; '.join(done.passed_over)}" if done.passed_over else ""))
    return Outcome(detail, checkpoint=CheckpointRef(loaded.step, loaded.path), lr_change=done.lr_change,
                   lr_seq=done.lr_seq, skipped=cmd.skip)
