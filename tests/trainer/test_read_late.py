"""Thermometers read a step late (TrainConfig.read_late; the default on a GPU): the ranks hand
out step k-1's values while step k trains, and the controller drains the held-back step before a
checkpoint, a command and the end. On CPU the same code path runs when asked for, so CI tests it:
every trained step is recorded exactly once under the attempt that trained it, with values
bit-identical to the on-time path, across checkpoints, a rollback and the end of the run.

One rank in-process (trainer.local.InProcessGang, real DeepSpeed ZeRO on gloo)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from thermowatch.monitors.contract import TOKENS_PER_S, CommandKind
from tests.trainer.conftest import tiny_config

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _run(tmp_path, read_late: bool):
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import InProcessGang, ListSink, QueueCommands

    cfg = tiny_config(tmp_path / ("late" if read_late else "on-time"), run_id="rl", world_size=1, steps=12,
                      read_late=read_late, checkpoint={"every": 4, "keep_last": 3, "keep_every": 0},
                      model={"n_layer": 1, "d_model": 32, "n_head": 2},
                      data={"max_bytes": 1 << 18, "seq_len": 32, "global_batch": 4})
    sink, q, seen = ListSink(), QueueCommands(), {}

    def gang(*args):
        seen["gang"] = InProcessGang(*args)
        seen["worker"] = seen["gang"].worker  # kill() drops the gang's reference, not the object
        return seen["gang"]

    def on_step(rec, attempt):
        seen.setdefault("arrived", []).append((attempt, rec.step, seen["worker"].next_step - 1))
        if attempt == 0 and rec.step == 6:
            seen["rollback"] = q.push("rl", CommandKind.ROLLBACK, to_step=4)

    result = RunController(cfg, sink, q, progress=on_step, gang_factory=gang).run()
    trained = [(a, s) for a, s, _ in seen["worker"]._seen]
    return result, sink, q.ack_for(seen["rollback"]), trained, seen["arrived"]


def _values(rec) -> dict:
    return {k: v for k, v in rec.values.items() if k != TOKENS_PER_S}  # a wall-clock rate


@pytest.mark.slow
def test_late_reading_records_every_trained_step_once_with_the_on_time_values(tmp_path):
    late, sink_l, ack_l, trained_l, arrived_l = _run(tmp_path, read_late=True)
    on_time, sink_o, ack_o, trained_o, arrived_o = _run(tmp_path, read_late=False)

    # Late: the record of step k arrives once step k+1 has trained, except the held-back steps
    # drained before a checkpoint (4, 8, 12) and before the rollback (7); on time, right after k.
    drained = {(a, step) for a, step, trained in arrived_l if trained == step}
    assert drained == {(0, 4), (0, 7), (1, 8), (1, 12)}
    assert all(trained == step + 1 for a, step, trained in arrived_l if (a, step) not in drained)
    assert all(trained == step for _, step, trained in arrived_o)

    for result, sink, ack, trained in ((late, sink_l, ack_l, trained_l), (on_time, sink_o, ack_o, trained_o)):
        assert result.final_step == 12 and result.attempts == [0, 1] and ack.ok and ack.checkpoint_step == 4
        recorded = [(a, r.step) for a in sink.attempts("rl") for r in sink.attempt("rl", a)]
        # Every step trained is recorded once, under its own attempt, the held-back one included.
        assert sorted(recorded) == sorted(set(recorded)) == sorted(trained)
        assert [c.step for _, c in sink.checkpoints] == [4, 8, 12] and all(c.healthy for _, c in sink.checkpoints)

    # The command reaches the late controller a step later: it trained step 7 before rolling back.
    assert max(s for a, s in trained_l if a == 0) == 7 and max(s for a, s in trained_o if a == 0) == 6
    # The same steps carry bit-identical thermometers either way (training is deterministic).
    for a in (0, 1):
        late_recs = {r.step: r for r in sink_l.attempt("rl", a)}
        for r in sink_o.attempt("rl", a):
            lv, ov = _values(late_recs[r.step]), _values(r)
            # NaN-aware: update_ratio is measured every 10th step and NaN between (NaN != NaN in a dict ==)
            assert lv.keys() == ov.keys(), (a, r.step)
            np.testing.assert_array_equal([lv[k] for k in ov], list(ov.values()), err_msg=f"attempt {a} step {r.step}")
            assert (late_recs[r.step].sample_lo, late_recs[r.step].sample_hi) == (r.sample_lo, r.sample_hi)
    assert np.isfinite(late.final_loss) and late.final_loss == on_time.final_loss
