"""Replay triage (issue 39 item 1), end to end: a user's loop under thermowatch.watch with
precise skip (the embedded supervisor, real nanoGPT on CPU) meets each of the three causes from
tests/client/faults.py. The policy rolls back and asks to skip the window; before bisecting, the
client replays from the checkpoint, with the same samples and then without the suspects, and
labels the cause: hardware (the replay ran clean: nothing skipped), data (the offenders skipped),
optimizer (it diverged without them too: nothing skipped, and the supervisor cuts the LR)."""

from __future__ import annotations

import pytest
import torch

import thermowatch
from thermowatch.precise_skip import PreciseSkip
from tests.client.faults import Faults
from tests.client.user_loop import train_step, user_model
from tests.supervisor.auth_helpers import ADMIN_TOKEN
from thermowatch.monitors.commands import ActionState, CommandKind
from thermowatch.monitors.contract import Ack
from thermowatch.supervisor.act.outcome import details, outcome, summary
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import skips as skips_store

B, STEPS, EVERY = 16, 190, 10
AT = 171  # the fault's step: past the detectors' warm-up (test_quarantine's poison), between checkpoints
# a short margin keeps the suspects (and the replays) to ~25 steps: each test stays well under 30 s
POLICY = {"rollback_margin_steps": 20, "cooldown_steps": 15, "skip_ahead_steps": 2}


def train(db, tmp_path, run: str, faults: Faults, policy: dict | None = None):
    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url, api_token=ADMIN_TOKEN,
                           policy={**POLICY, **(policy or {})})
    tw = thermowatch.watch(model, opt, run=run, steps=STEPS, global_batch=B, checkpoint_dir=tmp_path / "ckpt",
                           checkpoint_every=EVERY, scheduler=sched, supervisor_config=cfg, poll_interval_s=0.02,
                           precise_skip=PreciseSkip(triage=True))
    for step in tw.steps():
        faults.before_step(step, opt, sched)
        x, y = faults.batch(torch.as_tensor(tw.batch_ids(step)))
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        faults.after_backward(step, model)
        opt.step()
        tw.record(loss)
        sched.step()
    tw.close()
    sup = tw.run.supervisor
    with sup.sessions() as s:
        acts = sorted(actions_store.actions(s, run), key=lambda a: a.id)
        skips = skips_store.skip_ranges(s, run)
    return acts, skips, tw


def first_rollback(acts):
    rb = next(a for a in acts if a.kind is CommandKind.ROLLBACK)
    assert rb.state is ActionState.DONE, (rb.state, rb.error)
    return rb, Ack.from_json(rb.result).bisected


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_gradient_fault_is_hardware_and_skips_nothing(db, tmp_path):
    faults = Faults(grad_step=AT)
    acts, skips, tw = train(db, tmp_path, "hw", faults)
    assert faults.fired == [AT]
    rb, b = first_rollback(acts)
    assert b is not None and b.cause is not None, rb.result
    c = b.cause
    assert c.label == "hardware" and b.outcome == "cleared", rb.result
    assert c.recorded_step == AT and c.recorded_loss is None  # the NaN gradient (grad_norm) at the fault
    (replay,) = c.replays
    assert not replay.spiked and replay.step == AT and replay.loss is not None
    assert c.steps == replay.steps == AT - rb.result["checkpoint_step"] and c.seconds > 0
    assert b.probes == 1 and b.steps == c.steps
    assert rb.result["skip_ranges"] == [] and skips == []  # the window asked for is dropped
    o = outcome(rb)
    assert "cause: hardware (the replay of the same samples ran clean through step" in "\n".join(details(o))
    assert "skipped nothing, cause: hardware (the replay of the same samples ran clean)" in summary(o)
    assert not any(a.kind is CommandKind.SET_LR for a in acts)
    assert tw.step == STEPS and tw.final_loss == tw.final_loss  # trained on, finite


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_poisoned_samples_are_data_and_only_they_are_skipped(db, tmp_path):
    poison = range((AT - 1) * B, (AT + 1) * B)  # steps AT and AT + 1 on the first pass (test_quarantine's)
    acts, skips, tw = train(db, tmp_path, "data", Faults(poison=poison))
    rb, b = first_rollback(acts)
    c = b.cause
    assert c is not None and c.label == "data" and b.outcome == "narrowed", rb.result
    same, without = c.replays
    assert same.spiked and same.step in (AT, AT + 1) and not without.spiked and without.step == same.step
    assert c.recorded_step == same.step and c.steps == same.steps + without.steps and b.steps > c.steps
    skipped = {i for lo, hi in rb.result["skip_ranges"] for i in range(lo, hi)}
    assert set(poison) <= skipped and len(skipped) <= len(poison) + B, rb.result["skip_ranges"]
    assert [tuple(r) for r in skips] == [tuple(r) for r in rb.result["skip_ranges"]]
    assert "cause: data (the replay of the same samples spiked at step" in "\n".join(details(outcome(rb)))
    assert not any(a.kind is CommandKind.SET_LR for a in acts)


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_an_lr_blow_up_is_the_optimizer_skips_nothing_and_the_lr_is_cut(db, tmp_path):
    faults = Faults(lr_step=AT, lr_factor=300.0)  # 1e-3 -> 0.3, bench/any_loop_study.py's blow-up
    # the cut must bring x300 back near the LR this model trains at: x0.005 of it is x1.5
    acts, skips, tw = train(db, tmp_path, "lr", faults, policy={"lr_factor": 0.005, "min_lr_multiplier": 0.001})
    rb, b = first_rollback(acts)
    c = b.cause
    assert c is not None and c.label == "optimizer" and b.outcome == "cleared", rb.result
    same, without = c.replays
    assert same.spiked and without.spiked and without.suspects_skipped
    assert rb.result["skip_ranges"] == [] and skips == []
    assert "skipped nothing, cause: optimizer" in summary(outcome(rb))
    # the supervisor followed with the policy's LR cut, in the rollback's incident, carried out
    cut = next(a for a in acts if a.kind is CommandKind.SET_LR)
    assert cut.id > rb.id and cut.incident_id == rb.incident_id and cut.state is ActionState.DONE, cut
    assert cut.args["lr_multiplier"] == pytest.approx(0.005) and "replay triage" in cut.reason
