"""Which checkpoints retention keeps: one rule for the bundled trainer's CheckpointStore and
thermowatch.watch's checkpoint directory.

A rollback goes to the newest healthy checkpoint at or before the divergence's onset minus the
policy's margin (100 steps by default: PaLM restarted ~100 steps back; YaLM-100B "rolled back to
13k", thousands of steps). So retention keeps:

- the newest `keep_last` checkpoints;
- one per `keep_every`-step span (the first in it), forever: a target behind a slow drift or an
  onset found late (0 = none);
- with `now` and `behind`, the newest checkpoint at or before step `now - behind`: a rollback the
  policy asks for while this one is being pruned still has its target. Without it a run that
  checkpointed every 25 steps and kept 5 had deleted the step-50 checkpoint the policy chose at
  step 171 by the time the command arrived (bench/precise_skip.py found it): the rollback failed.
"""

from __future__ import annotations

from typing import Sequence


def retained(steps: Sequence[int], keep_last: int, keep_every: int = 0, *, now: int | None = None,
             behind: int = 0) -> set[int]:
    """The steps of `steps` (ascending) that retention keeps."""
    steps = list(steps)
    keep = set(steps[-keep_last:]) if keep_last > 0 else set()
    if keep_every:
        first_in_span: dict[int, int] = {}
        for s in steps:  # one per checkpoint, not per element of anything large
            first_in_span.setdefault(s // keep_every, s)
        keep |= set(first_in_span.values())
    if now is not None and behind > 0:
        old = [s for s in steps if s <= now - behind]
        if old:
            keep.add(old[-1])
    return keep
