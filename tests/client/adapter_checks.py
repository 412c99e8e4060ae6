"""What a finished adapter test run must show whatever trainer carried it out, beyond the commands
(tests/client/adapter_run.py's check_rollback_and_skip): the LR schedule rolled back with the rest,
and the last checkpoint holding the weights the trainer ended with."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.client.adapter_run import STEPS, check_rollback_and_skip
from thermowatch.checkpoint_io import load_as_data


def check_rolled_back_run(db, run_id: str, tw, rec, trained, model: torch.nn.Module, ckpt_dir: Path) -> None:
    """`tw` (an adapter's callback) ran STEPS steps under the operator's skip and rollback, which
    `rec` (the test's recorder: its `op`, and `lr` after each (attempt, step)) and `trained` saw."""
    assert tw.step == STEPS and tw.watch.attempt == 2
    check_rollback_and_skip(db, run_id, rec.op, trained, STEPS)
    # the scheduler was rolled back with the rest: the re-trained steps follow the first pass's schedule
    assert [rec.lr[2, s] for s in (11, 12)] == [rec.lr[1, s] for s in (11, 12)] and rec.lr[1, 12] < rec.lr[1, 11]
    ckpt = load_as_data(ckpt_dir / f"step_{STEPS:08d}.pt")  # as the loop reads it: as data (issue 33)
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=0, atol=0)
