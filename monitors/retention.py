"""Which checkpoints retention keeps: one rule for the bundled trainer's CheckpointStore and
thermowatch.watch's checkpoint directory.

A rollback goes to the newest healthy checkpoint at or before the divergence's onset minus the
policy's margin (100 steps by default: PaLM restarted ~100 steps back; YaLM-100B "rolled back to
13k", thousands of steps). So retention keeps:

- the newest `keep_last` checkpoints;
- one per `keep_every`-step span (the first in it), forever: a target behind a slow drift or an
  onset found late (0 = none);
- with `now` and `behind`, a rule in steps back from the newest, whatever the counts, so that a
  small `checkpoint_every x keep_last` cannot delete the checkpoint a rollback needs (issue 35):
  - the newest checkpoint at or before `now - behind`: the target the policy picks for a
    divergence found now (onset - margin) is there while its command is on the way, however
    many checkpoints the run saves meanwhile;
  - a checkpoint `age` steps old is kept when it is the first in its aligned block, a power of
    two of steps: at most a tenth of `behind` within the last `behind` steps, then 0.2-0.4 x the
    age. A rollback lands on the newest kept checkpoint at or before the step it asks for: within
    the last `behind` steps at most a tenth of `behind` before it, further back at most
    1/(1 - 0.4) = 1.67 x as far back from now as the nearest checkpoint that was saved. About
    10 + 4 log2(run length / behind) checkpoints.
  Blocks are aligned powers of two, so the first of a block is the first of its first half: a
  checkpoint kept as the first of a larger block as it ages was kept all along. Nothing a later
  prune needs is ever deleted by an earlier one.
"""

from __future__ import annotations

import bisect
from typing import Sequence

# The policy's default margin (rollback_margin_steps, 100) + the steps between a divergence's
# detection and its command's arrival: how far back from the newest checkpoint `behind` reaches.
BEHIND = 110


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
    if now is not None and behind > 0 and steps:
        at = bisect.bisect_right(steps, now - behind)
        if at:
            keep.add(steps[at - 1])
        for i, s in enumerate(steps):  # one per checkpoint
            size = _block(now - s, behind)
            if i == 0 or steps[i - 1] < s - s % size:  # the first checkpoint of its block
                keep.add(s)
    return keep


def _block(age: int, behind: int) -> int:
    """The largest power of two at most behind / 10 (within the last `behind` steps), else at most
    0.4 x age: never smaller as a checkpoint ages, each block the first or second half of the next."""
    span = behind // 10 if age < behind else 2 * age // 5
    return 1 << max(0, span.bit_length() - 1)
