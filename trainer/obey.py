"""How the run controller carries out the typed commands (monitors.commands): a handler table,
one function per command type, and the state the commands leave behind.

Every handler returns an `Outcome` saying what really happened (the checkpoint loaded, the LR
change applied, the ranges skipped); `Obey.apply` turns it into the `Ack` the supervisor books,
so what is recorded is what the trainer did (DESIGN.md, "Trust").

Commands are applied at most once: the ack of every applied command id is kept, and a command
delivered again (a lost ack, a supervisor restart) is answered with the same ack, unchanged.
That memory, the LR changes and the skip ledger are written to `commands.json` in the run's
checkpoint root before the ack leaves, so a relaunched controller keeps what it acknowledged
even when no checkpoint was saved since (the manifest alone would forget it). The book, the
Outcome and the ack are thermowatch.protocol's: the same code as thermowatch.watch's.
"""

from __future__ import annotations

import logging
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
    SetLR,
    Skip,
    Stop,
)
from thermowatch.protocol import CheckpointRef, CommandBook, Directive, Outcome, ack_for, directed
from thermowatch.trainer.checkpoint import CheckpointStorage
from thermowatch.trainer.config import TrainConfig
from thermowatch.trainer.data import SkipLedger
from thermowatch.trainer.lifecycle import GangLike

log = logging.getLogger(__name__)

ABANDONED = "abandoned"  # prefix of the unhealthy_reason of checkpoints a rollback left behind


class Controlled(Protocol):
    """What the handlers read and change on the run controller (trainer.controller.RunController),
    typed here so this module never imports the controller back (no cycle)."""

    cfg: TrainConfig
    store: CheckpointStorage
    commands_state: CommandBook
    # read here; changed only through skip / add_lr_change / exclude_nodes below
    ledger: SkipLedger
    lr_changes: list
    excluded_nodes: list[str]
    deleted_steps: set[int]
    loaded_checkpoint: CheckpointInfo | None
    gang: GangLike | None
    step: int
    attempt: int
    directive: Directive  # read here; set by the controller from the Outcome a handler returns

    def start_attempt(self, ckpt: CheckpointInfo | None, reason: str, reuse_gang: bool = False) -> None: ...

    def skip(self, ranges: list) -> None: ...

    def add_lr_change(self, change: LRChange) -> int: ...

    def exclude_nodes(self, nodes: list[str]) -> None: ...

    def rollback_target(self, max_step: int) -> CheckpointInfo | None: ...


class Refused(Exception):
    """A command that cannot be carried out as asked; the message says why and what to do."""


class Obey:
    """The handler table: command type -> handler(controller, body) -> Outcome."""

    def __init__(self, ctl: Controlled) -> None:
        self.ctl = ctl
        self.handlers: dict[type, Callable[[Any], Outcome]] = {
            Pause: self._direct, Resume: self._direct, Stop: self._direct, Skip: self._skip,
            SetLR: self._set_lr, Profile: self._profile, Rollback: self._rollback,
        }

    def apply(self, cmd: Command, on_gang_failure: Callable[[BaseException], None],
              gang_failures: tuple[type[BaseException], ...]) -> tuple[Ack, Directive | None]:
        """The command's ack, and the loop's next Directive where the command changes it (pause,
        resume, stop; None otherwise, and for a command answered before)."""
        ctl = self.ctl
        done = ctl.commands_state.answered(cmd)
        if done is not None:
            return done, None
        out: Outcome | None = None
        error: str | None = None
        try:
            out = self.handlers[type(cmd.body)](cmd.body)
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
        return ack, (out.directive if out is not None else None)

    # --- handlers --------------------------------------------------------------------------

    def _direct(self, cmd: Pause | Resume | Stop) -> Outcome:
        """Pause, resume, stop: one pure transition (thermowatch.protocol.directed)."""
        return directed(self.ctl.directive, cmd, self.ctl.step)

    def _skip(self, cmd: Skip) -> Outcome:
        ctl = self.ctl
        ranges = [r.to_json() for r in cmd.ranges]
        ctl.skip(ranges)
        ctl.gang.call("skip", ranges, timeout_s=ctl.cfg.step_timeout_s)
        return Outcome(f"skipping {', '.join(map(str, cmd.ranges))}", skipped=cmd.ranges)

    def _add_lr(self, lr: SetLR, start: int) -> tuple[LRChange, int]:
        change = lr.change(start)
        return change, self.ctl.add_lr_change(change)

    def _set_lr(self, cmd: SetLR) -> Outcome:
        ctl = self.ctl
        change, seq = self._add_lr(cmd, ctl.step + 1)
        ctl.gang.call("set_lr_changes", [c.to_json() for c in ctl.lr_changes], timeout_s=ctl.cfg.step_timeout_s)
        return Outcome(f"{cmd.describe()} from step {change.start_step}", lr_change=change, lr_seq=seq)

    def _profile(self, cmd: Profile) -> Outcome:
        ctl = self.ctl
        out = cmd.out_dir or str(ctl.store.root / "profiles" / f"step_{ctl.step + 1:08d}")
        ctl.gang.call("profile", cmd.steps, out, timeout_s=ctl.cfg.step_timeout_s)
        return Outcome(f"tracing steps {ctl.step + 1}..{ctl.step + cmd.steps} into {out}")

    def _rollback(self, cmd: Rollback) -> Outcome:
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
        ctl.skip([r.to_json() for r in cmd.skip])
        change = seq = None
        if cmd.lr is not None:
            change, seq = self._add_lr(cmd.lr, ckpt.step + 1)
        prev_attempt = ctl.attempt
        # Mark the left trajectory before anything else: a crash from here on must not let a
        # relaunch resume from a checkpoint this rollback walked away from.
        ctl.store.abandon_after(ckpt.step, f"{ABANDONED} by rollback to step {ckpt.step} from attempt {prev_attempt}")
        without = ""
        if exclude:
            ctl.exclude_nodes(exclude)
            without = f" without node {', '.join(exclude)}" + (
                f" (rank {cmd.exclude_rank}'s)" if cmd.exclude_rank is not None else "")
        ctl.start_attempt(ckpt, reason=f"rollback to step {ckpt.step}{without} (command)", reuse_gang=not exclude)
        loaded = ctl.loaded_checkpoint or ckpt  # an unreadable one falls back to an older one
        asked = f"asked <= {cmd.to_step}" + (f"; {cmd.to_step} {why}" if loaded.step != cmd.to_step else "")
        detail = (f"rolled back to checkpoint {loaded.step}{without}; {asked}; attempt {prev_attempt} -> {ctl.attempt}"
                  + (f", skipping {', '.join(map(str, cmd.skip))}" if cmd.skip else "")
                  + (f", {cmd.lr.describe()} from step {change.start_step}" if change else ""))
        return Outcome(detail, checkpoint=CheckpointRef(loaded.step, loaded.path), lr_change=change, lr_seq=seq,
                       skipped=cmd.skip)

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
