"""What `thermowatch train` prints (issue 12.5); the real run's lines are asserted in test_launch."""

from __future__ import annotations

import io
import logging

from thermowatch.monitors.commands import Ack, Command, Rollback, SampleRange
from thermowatch.monitors.contract import StepRecord
from thermowatch.train_output import announced_commands, Progress, quiet_http_logs


def _rec(step: int, **values: float) -> StepRecord:
    return StepRecord(step=step, values={"loss": 2.5, **values})


def test_a_progress_line_every_n_steps_and_at_the_last():
    out, now = io.StringIO(), [100.0]
    p = Progress("r1", total_steps=25, every=10, out=out, clock=lambda: now[0])
    for step in range(1, 26):
        now[0] += 2.0
        p(_rec(step, tokens_per_s=1234.6, **{"attn_logit_max/blocks.0.attn": 12.34,
                                              "attn_logit_max/blocks.1.attn": 40.0}), 0)
    lines = out.getvalue().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["r1 step 10/25", "r1 step 20/25", "r1 step 25/25"]
    # 9 steps in 18 s since the first record: 2 s a step, 15 left
    assert lines[0] == "r1 step 10/25: loss 2.5000, 1,235 tok/s, max attn logit 40.0, ETA 0:00:30"
    assert lines[-1].endswith("ETA 0:00:00")
    assert not any(ln.startswith("run r1: step") for ln in lines)  # the final line's prefix, grepped by tests


def test_a_progress_line_leaves_out_what_the_record_lacks():
    out = io.StringIO()
    Progress("r1", total_steps=5, every=1, out=out)(_rec(1), 0)
    assert out.getvalue() == "r1 step 1/5: loss 2.5000\n"


class _Channel:
    def __init__(self, cmds):
        self.cmds, self.acks = cmds, []

    def poll(self, run_id):
        cmds, self.cmds = self.cmds, []
        return cmds

    def ack(self, run_id, ack):
        self.acks.append(ack)


def test_one_line_per_acknowledged_command_then_the_real_ack():
    inner = _Channel([Command(7, Rollback(to_step=20, skip=(SampleRange(100, 200),)))])
    out = io.StringIO()
    ch = announced_commands(inner, out=out)
    assert [c.id for c in ch.poll("r1")] == [7]
    ack = Ack(7, True, 21, detail="", checkpoint_step=20, lr_multiplier=1.0, skip_ranges=(SampleRange(100, 200),))
    ch.ack("r1", ack)
    ch.ack("r1", Ack(8, False, 30, detail="no checkpoint at or before step 3"))
    assert out.getvalue().splitlines() == [
        "r1 command 7 rollback: done at step 21 (checkpoint 20; skipped 1 range(s); lr x1)",
        "r1 command 8 command: FAILED at step 30 (no checkpoint at or before step 3)",
    ]
    assert [a.command_id for a in inner.acks] == [7, 8]


def test_http_client_logs_are_off_unless_verbose():
    quiet_http_logs(False)
    assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
    quiet_http_logs(True)
    assert logging.getLogger("httpx").isEnabledFor(logging.INFO)
    quiet_http_logs(False)


def test_max_attention_logit_skips_nan_layers():
    out = io.StringIO()
    p = Progress("r1", total_steps=5, every=1, out=out)
    p(_rec(1, **{"attn_logit_max/a": float("nan"), "attn_logit_max/b": 7.0}), 0)
    p(_rec(2, **{"attn_logit_max/a": float("nan")}), 0)
    lines = out.getvalue().splitlines()
    assert "max attn logit 7.0" in lines[0] and "max attn logit nan" in lines[1]


def test_the_lse_bound_stands_in_for_the_max_when_only_it_is_measured():
    out = io.StringIO()
    Progress("r1", total_steps=5, every=1, out=out)(_rec(1, **{"attn_logit_lse/blocks.0.attn": 9.25}), 0)
    assert out.getvalue() == "r1 step 1/5: loss 2.5000, max attn logit <= 9.2\n"
