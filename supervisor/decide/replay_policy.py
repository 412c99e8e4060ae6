"""What the policy would have done, for `thermowatch replay`.

A recorded run has no checkpoint list and no wall clock, so the replay assumes a checkpoint
every `checkpoint_every` steps, all healthy until a finding's onset, and one simulated second
per step (so `cooldown_s`, when set, and the intervention window behave as they would at ~1 step/s).
The recorded run never rolled back, so an action's step cooldown counts from its decision step.
Each decision joins the history the next finding is judged against, so the ladder (rollback,
then rollback + lower LR, then pause) shows up in a replay exactly as it would live. As live,
findings that arrive while an action is still on its way (within `in_flight_steps` of the
decision; one divergence trips several layers' detectors within a few steps) join that action's
incident instead of being decided again.
"""

from __future__ import annotations

from typing import Any, Callable

from thermowatch.monitors.contract import CheckpointInfo, Finding
from thermowatch.monitors.commands import Rollback
from thermowatch.supervisor.decide.policy import Intervention, PolicyConfig, PolicyInput, make_decision


# The replay's own settings, beside PolicyConfig's fields in its --policy file.
REPLAY_KEYS = ("checkpoint_every", "seconds_per_step", "in_flight_steps")


def replay_decider(settings: dict[str, Any] | None = None) -> Callable[[Finding], dict[str, Any]]:
    settings = dict(settings or {})
    every = int(settings.pop("checkpoint_every", 100))
    seconds_per_step = float(settings.pop("seconds_per_step", 1.0))
    in_flight_steps = int(settings.pop("in_flight_steps", 10))
    cfg = PolicyConfig(**settings)
    history: list[Intervention] = []
    unhealthy_from: list[int] = []
    lr = [1.0]

    def decide(f: Finding) -> dict[str, Any]:
        if history and f.detect_step < history[-1].step + in_flight_steps:
            return {"kind": "joins", "reasons": [f"joins the incident acted on at step {history[-1].step}"]}
        unhealthy_from.append(f.onset_step)
        cutoff = min(unhealthy_from)
        cks = [CheckpointInfo(step=s, path=f"step_{s}", sample_cursor=0, healthy=s < cutoff)
               for s in range(0, f.detect_step + 1, every)]
        d = make_decision(PolicyInput(finding=f, now=f.detect_step * seconds_per_step, checkpoints=cks,
                                      history=list(history), current_lr_multiplier=lr[0]), cfg)
        if d.acts:
            history.append(Intervention(kind=d.kind, signal=f.signal, module=f.module, step=f.detect_step,
                                        time=f.detect_step * seconds_per_step, ok=True,
                                        to_step=d.command.to_step if isinstance(d.command, Rollback) else None,
                                        lowered_lr=d.lr is not None,
                                        seq=len(history)))
            if d.lr is not None:
                lr[0] = d.lr.multiplier
            if isinstance(d.command, Rollback):
                unhealthy_from.clear()  # the re-trained steps after the target start healthy again
        return d.to_json()

    return decide
