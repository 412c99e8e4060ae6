"""How the run controller carries out the typed commands (monitors.commands): the shared
executor (thermowatch/obey.py: one handler per command type, each returning a `Transition`,
applied by `RunController.transition` alone, and `outcome`, the words of what was done, the same
for thermowatch.watch's loop), with what only this trainer does: `profile`, and a rollback that
restarts without a rank's node.

Commands are applied at most once: the ack of every applied command id is kept, and a command
delivered again (a lost ack, a supervisor restart) is answered with the same ack, unchanged.
That memory, the LR changes and the skip ledger are written to `commands.json` in the run's
checkpoint root before the ack leaves, so a relaunched controller keeps what it acknowledged
even when no checkpoint was saved since (the manifest alone would forget it). The book, the
Outcome and the ack are thermowatch.protocol's: the same code as thermowatch.watch's.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Protocol

from thermowatch import obey
from thermowatch.monitors.contract import Ack, CheckpointInfo, Command, Profile, Rollback
from thermowatch.obey import Applied, Refused, Transition, outcome  # noqa: F401 - the trainer's names for them
from thermowatch.protocol import CommandBook, Directive, Outcome, ack_for
from thermowatch.trainer.checkpoint import CheckpointStorage
from thermowatch.trainer.config import TrainConfig
from thermowatch.trainer.data import SkipLedger
from thermowatch.trainer.lifecycle import GangLike

log = logging.getLogger(__name__)

ABANDONED = "abandoned"  # prefix of the unhealthy_reason of checkpoints a rollback left behind


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

    probes: Any  # trainer.probes.Probes: a rollback's precise skip, run once its Outcome is known

    def rollback_target(self, max_step: int) -> CheckpointInfo | None: ...

    def transition(self, t: Transition) -> Applied: ...

    def bisect(self, out: Outcome) -> Outcome: ...


class Obey(obey.Obey):
    """The shared handler table (thermowatch/obey.py) with what only the bundled trainer does:
    `profile`, and a rollback that restarts without a rank's node (trainer.exclude)."""

    name = "the bundled trainer"

    def __init__(self, ctl: Controlled) -> None:
        super().__init__(ctl)
        self.ctl = ctl
        self.handlers[Profile] = self._profile

    def apply(self, cmd: Command, on_gang_failure: Callable[[BaseException], None],
              gang_failures: tuple[type[BaseException], ...]) -> Ack:
        """Plan, apply through the controller, answer: the command's ack (the same one again for a
        command answered before, which changes nothing)."""
        ctl = self.ctl
        done = ctl.commands_state.answered(cmd)
        if done is not None:
            return done

        def restarted(exc: BaseException) -> str:
            on_gang_failure(exc)
            return f"the gang failed while applying it ({exc!r}); restarted"

        out, error = self.answer(cmd, gang_failures, restarted)
        if ctl.probes is not None and out is None:  # the rollback failed once begun: the blunt skip
            ctl.probes = None
            ctl.ledger.add_many([r.to_json() for r in cmd.body.skip])
        elif ctl.probes is not None:  # a rollback's precise skip: its probes, before the ack leaves
            try:
                out = ctl.bisect(out)
            except Exception as exc:  # noqa: BLE001 - cut short: every suspect skipped, as the policy asked
                if not isinstance(exc, gang_failures):  # a bug or a refused file: the ranks start again clean
                    log.exception("precise skip for command %s failed", cmd)
                ctl.probes = None
                ctl.ledger.add_many([r.to_json() for r in cmd.body.skip])
                reason = restarted(exc)
                out = replace(out, detail=f"{out.detail}; precise skip cut short ({reason}): skipping "
                                          f"{', '.join(map(str, cmd.body.skip))}", skip_ranges=cmd.body.skip)
        ack = ack_for(cmd, out, error, first_step=ctl.step + 1, lr_changes=ctl.lr_changes,
                      skip_ranges=ctl.ledger.ranges)
        ctl.commands_state.record(ack, cmd, lr_changes=ctl.lr_changes, skip_ranges=ctl.ledger.ranges)
        return ack

    def _profile(self, cmd: Profile) -> Transition:
        ctl = self.ctl
        out = cmd.out_dir or str(ctl.store.root / "profiles" / f"step_{ctl.step + 1:08d}")
        return Transition(f"tracing steps {ctl.step + 1}..{ctl.step + cmd.steps} into {out}", profile=(cmd.steps, out))

    def exclude(self, cmd: Rollback) -> tuple[str, ...]:
        """Restart without the node: same world size on spare capacity (the data split and the
        global batch stay as they are); refused, before anything changes, when the cluster has no
        such capacity (trainer.exclude)."""
        from thermowatch.trainer.exclude import nodes_to_exclude

        try:
            return tuple(nodes_to_exclude(self.ctl, cmd.exclude_rank, cmd.exclude_node))
        except ValueError as exc:
            raise Refused(f"restarting without rank {cmd.exclude_rank} / node {cmd.exclude_node!r}: {exc}") from None

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
