"""What a connected trainer says when it carries out the supervisor's command (issue 35: a
trainer connected to a daemon printed nothing on a rollback or an LR change; whoever watched its
output saw the loss jump back or the steps repeat and had to ask the daemon why).

`line(run_id, ack, command)` is the one line for a command answered by `ack`; thermowatch.Run's
`ack()` says it (thermowatch/paused.py's `say`: the `thermowatch` logger at WARNING, and stderr
once), so thermowatch.watch, the Hugging Face and Lightning callbacks and a loop of its own on
thermowatch.Run all print it, from the one process that talks to the supervisor (rank 0).

    thermowatch: run my-run rolled back to checkpoint 40 (action 7); re-training from step 41,
        skipping samples [640, 1136)
    thermowatch: run my-run skipping samples [1200, 1264) from step 76 (action 8)
    thermowatch: run my-run LR x0.5 of the schedule from step 80 (action 9)
    thermowatch: run my-run stopping after step 90 (action 10): the loop ends here
    thermowatch: run my-run refused action 11 (rollback): no readable checkpoint at or before ...

A pause and a resume are the pause notice's (thermowatch/paused.py: the reason, and the commands
that end it). The command's reason stays with the daemon: `thermowatch actions <run>` lists it.
"""

from __future__ import annotations

import logging

from thermowatch.monitors.contract import Ack, Command, Pause, Resume, Rollback, SetLR, Skip, Stop
from thermowatch.monitors.names import printable

log = logging.getLogger(__name__)


def line(run_id: str, ack: Ack, command: Command | None) -> str | None:
    """The line for `command` answered by `ack`, or None where another part says it (a pause
    and a resume). `command` None (a loop on thermowatch.Run that acks without it): the ack's words."""
    run = f"thermowatch: run {printable(run_id)}"
    body = command.body if command is not None else None
    if isinstance(body, (Pause, Resume)):
        return None
    act = f"action {ack.command_id}"
    if not ack.ok:
        kind = f" ({body.kind.value})" if body is not None else ""
        return f"{run} refused {act}{kind}: {printable(ack.detail)}"
    skipped = ", ".join(map(str, ack.skip_ranges))
    lr = (f"LR x{ack.lr_change.multiplier:g} of the schedule from step {ack.lr_change.start_step}"
          if ack.lr_change is not None else "")
    if isinstance(body, Rollback):
        return (f"{run} rolled back to checkpoint {ack.checkpoint_step} ({act}); re-training from step {ack.first_step}"
                + (f", skipping samples {skipped}" if skipped else "") + (f", {lr}" if lr else ""))
    if isinstance(body, Skip):
        return f"{run} skipping samples {skipped} from step {ack.first_step} ({act})"
    if isinstance(body, SetLR):
        return f"{run} {lr or f'LR x{ack.lr_multiplier:g} of the schedule from step {ack.first_step}'} ({act})"
    if isinstance(body, Stop):
        return f"{run} stopping after step {ack.first_step - 1} ({act}): the loop ends here"
    return f"{run} carried out {act}" + (f" ({body.kind.value})" if body is not None else "") + (
        f": {printable(ack.detail)}" if ack.detail else "")
