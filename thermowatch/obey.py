"""One command executor (issue 38 item 3) for thermowatch.watch's loop (thermowatch/loop.py) and
the bundled trainer's run controller (trainer/controller.py): a handler table, one function per
command type, each returning a `Transition`, the run's next state as data.

A handler only reads its host. What a command changes (the loop's Directive, the skip ledger,
the LR changes, the excluded nodes, a new attempt from a checkpoint) is the Transition it
returns, and the host's `transition` applies it, the one place commands change the run: each
host supplies how it loads a checkpoint and applies a skip and an LR change. What applying did
(the LR change's place in the list, the checkpoint really loaded, the attempt numbers, what was
really skipped) comes back as `Applied`, and `outcome` turns both into the `Outcome` whose ack the
supervisor books: the words of what was done are written once, here, for every trainer.

    obey = Obey(host)
    out, error = obey.answer(cmd)     # planned, applied, said; or refused with the reason
    ack = ack_for(cmd, out, error, first_step=host.step + 1, ...)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from thermowatch.monitors.contract import (
    CheckpointInfo, Command, ContractError, LRChange, Pause, Resume, Rollback, SampleRange, SetLR, Skip, Stop,
)
from thermowatch.protocol import CheckpointRef, Directive, Outcome, directed, resumed_by_rollback

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transition:
    """What one command changes on the run, returned by its handler; applied by the host's
    `transition` alone, in this order: `skip` into the ledger, `lr` appended, `exclude` added,
    `directive` set, then either a new attempt from `restart_from` (a rollback; the checkpoints
    after it abandoned) or the live run told (skip, LR changes, `profile`)."""

    words: str  # the ack's detail (a rollback's is finished by `outcome`, once the load is done)
    directive: Directive | None = None  # pause / resume / stop: what the loop does next
    skip: tuple[SampleRange, ...] = ()
    lr: SetLR | None = None  # an LR change ...
    lr_from: int = 0  # ... from this step on
    profile: tuple[int, str] | None = None  # (steps, output dir): trace the next steps (bundled trainer)
    restart_from: CheckpointInfo | None = None  # a rollback: a new attempt from this checkpoint
    exclude: tuple[str, ...] = ()  # Ray node ids no gang may use again (the restart leaves them out)
    rollback: Rollback | None = None  # the command a restart answers (its ack's words)
    why: str = ""  # why the checkpoint asked for is not `restart_from` ("" when it is)


@dataclass(frozen=True)
class Applied:
    """What the host's `transition` did: the LR change made and its place in the list, and for a
    restart the checkpoint really loaded (an unreadable one falls back to an older one), the
    attempt numbers before and after, and what was really skipped (None: the rollback's ranges
    as asked; a precise skip skips nothing yet and says so when its search ends)."""

    lr_change: LRChange | None = None
    lr_seq: int | None = None
    loaded: CheckpointInfo | None = None
    attempts: tuple[int, int] = (0, 0)
    passed_over: tuple[str, ...] = ()  # the checkpoints that failed to load before `loaded`, and why
    skip_ranges: tuple[SampleRange, ...] | None = None


class Host(Protocol):
    """What the handlers read on a loop, and the one method that changes it."""

    step: int  # the last step trained
    directive: Directive

    def rollback_target(self, max_step: int) -> CheckpointInfo | None: ...

    def why_not(self, step: int) -> str: ...

    def transition(self, t: Transition) -> Applied: ...


class Refused(Exception):
    """A command that cannot be carried out as asked; the message says why and what to do."""


class Obey:
    """The handler table: command type -> handler(body) -> Transition (reads the host only).
    The bundled trainer's subclass (trainer/obey.py) adds `profile` and restarting without a node."""

    name = "thermowatch.watch"  # who refuses what it cannot do

    def __init__(self, host: Host) -> None:
        self.host = host
        self.handlers: dict[type, Callable[[Any], Transition]] = {
            Pause: self._direct, Resume: self._direct, Stop: self._direct, Skip: self._skip,
            SetLR: self._set_lr, Rollback: self._rollback,
        }

    def plan(self, body: Any) -> Transition:
        handler = self.handlers.get(type(body))
        if handler is None:
            raise Refused(f"{body.kind.value} is not supported by {self.name}; the bundled trainer supports it")
        return handler(body)

    def carry_out(self, cmd: Command) -> Outcome:
        """Plan, apply through the host, say what was done. Raises Refused (or ContractError)."""
        t = self.plan(cmd.body)
        return outcome(t, self.host.transition(t))

    def answer(self, cmd: Command, failures: tuple[type[BaseException], ...] = (),
               on_failure: Callable[[BaseException], str] | None = None) -> tuple[Outcome | None, str | None]:
        """carry_out, or why not: (outcome, None) or (None, the reason). `failures`: exceptions
        the host recovers from itself (the bundled trainer's gang); `on_failure` does it and
        returns the reason the ack gives."""
        try:
            return self.carry_out(cmd), None
        except failures as exc:
            return None, on_failure(exc) if on_failure is not None else repr(exc)
        except (Refused, ContractError) as exc:  # cannot be done as asked: refuse, keep training
            log.warning("command %s refused: %s", cmd, exc)
            return None, str(exc)
        except Exception as exc:  # noqa: BLE001 - a bug or a bad file: refuse, keep training
            log.exception("command %s failed", cmd)
            return None, f"{type(exc).__name__}: {exc}"

    # --- handlers: read the host, return the Transition ---------------------------------------

    def _direct(self, cmd: Pause | Resume | Stop) -> Transition:
        """Pause, resume, stop: one pure transition (thermowatch.protocol.directed)."""
        out = directed(self.host.directive, cmd, self.host.step)
        return Transition(out.detail, directive=out.directive)

    def _skip(self, cmd: Skip) -> Transition:
        return Transition(f"skipping {', '.join(map(str, cmd.ranges))}", skip=cmd.ranges)

    def _set_lr(self, cmd: SetLR) -> Transition:
        start = self.host.step + 1
        return Transition(f"{cmd.describe()} from step {start}", lr=cmd, lr_from=start)

    def why_not(self, step: int) -> str:
        """Why checkpoint `step` is not the one a rollback loads, in words for the ack."""
        return self.host.why_not(step)

    def exclude(self, cmd: Rollback) -> tuple[str, ...]:
        """The nodes a rollback restarts without (the bundled trainer's); here: refused."""
        raise Refused(f"restarting without a rank or node is up to your launcher; {self.name} cannot do it")

    def _rollback(self, cmd: Rollback) -> Transition:
        """One command = one restart: load, skip, LR change, new attempt, all before the next step."""
        host = self.host
        exclude = self.exclude(cmd) if cmd.exclude_rank is not None or cmd.exclude_node else ()
        ckpt = host.rollback_target(min(cmd.to_step, host.step))
        why = "" if ckpt is not None and ckpt.step == cmd.to_step else self.why_not(cmd.to_step)
        if cmd.exact and (ckpt is None or ckpt.step != cmd.to_step):
            raise Refused(f"--exact: checkpoint {cmd.to_step} cannot be loaded ({why}); "
                          f"{'the newest usable one at or before it is ' + str(ckpt.step) if ckpt else 'none is usable'}")
        if ckpt is None:
            raise Refused(f"no valid healthy checkpoint at or before step {cmd.to_step} ({why}); nothing to roll back to")
        return Transition(f"rollback to step {ckpt.step}{without(exclude, cmd)} (command)", skip=cmd.skip,
                          lr=cmd.lr, lr_from=ckpt.step + 1, restart_from=ckpt, exclude=tuple(exclude),
                          rollback=cmd, why=why, directive=resumed_by_rollback(host.directive))  # ends a pause


def without(exclude: list[str] | tuple[str, ...], cmd: Rollback) -> str:
    if not exclude:
        return ""
    return f" without node {', '.join(exclude)}" + (f" (rank {cmd.exclude_rank}'s)" if cmd.exclude_rank is not None else "")


def outcome(t: Transition, done: Applied) -> Outcome:
    """The Outcome (the ack's words and fields) of a Transition the host applied."""
    cmd = t.rollback
    if cmd is None:
        return Outcome(t.words, lr_change=done.lr_change, lr_seq=done.lr_seq, skip_ranges=t.skip, directive=t.directive)
    loaded = done.loaded or t.restart_from
    skipped = cmd.skip if done.skip_ranges is None else done.skip_ranges
    why = t.why or "could not be loaded (the log says why)"
    asked = f"asked <= {cmd.to_step}" + (f"; {cmd.to_step} {why}" if loaded.step != cmd.to_step else "")
    detail = (f"rolled back to checkpoint {loaded.step}{without(t.exclude, cmd)}; {asked}; "
              f"attempt {done.attempts[0]} -> {done.attempts[1]}"
              + (f", skipping {', '.join(map(str, skipped))}" if skipped else "")
              + (f", {cmd.lr.describe()} from step {done.lr_change.start_step}" if done.lr_change else "")
              + (f"; passed over {'; '.join(done.passed_over)}" if done.passed_over else ""))
    return Outcome(detail, checkpoint=CheckpointRef(loaded.step, loaded.path), lr_change=done.lr_change,
                   lr_seq=done.lr_seq, skip_ranges=skipped, directive=t.directive)
