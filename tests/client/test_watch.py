"""thermowatch.watch around a user's own loop (issue 22), against a real supervisor on both
databases: every command is carried out between two steps and its ack says what was done.

The loop below is written as docs/any-trainer.md shows it; commands are the operator's manual
ones (the same action rows and executor as the automatic policy), submitted while it trains.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import thermowatch
from tests.client.user_loop import B, DATA, diverging, train_step, user_batch, user_model
from tests.waits import action_final
from thermowatch.checkpoint_io import load_as_data
from thermowatch.supervisor.store.views import run_status
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import runs as runs_store



def test_a_plain_loop_obeys_skip_lr_rollback_pause_and_stop(db, tmp_path):
    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url)
    tw = thermowatch.watch(model, opt, run="mine", steps=80, global_batch=B, checkpoint_dir=tmp_path / "ckpt",
                           checkpoint_every=10, scheduler=sched, supervisor_config=cfg, poll_interval_s=0.05)
    sup = tw.run.supervisor
    trained: list[tuple[int, int, list[int], float, float]] = []  # attempt, step, ids, lr used, noise
    lr_used: list[float] = []
    opt.register_step_pre_hook(lambda o, a, k: lr_used.append(float(o.param_groups[0]["lr"])))
    weights_at_30 = None
    submitted: dict[str, int] = {}
    ends: list[float] = []

    for step in tw.steps():
        ids = tw.batch_ids(step)
        noise = float(torch.rand(()))  # the RNG state a rollback must restore
        loss = train_step(model, opt, *user_batch(DATA, ids))
        sched.step()
        tw.record(loss)
        trained.append((tw.attempt, step, ids.tolist(), lr_used[-1], noise))
        if step == 30 and tw.attempt == 1:
            weights_at_30 = {k: v.clone() for k, v in model.state_dict().items()}
        ends.append(time.monotonic())
        # Submitted as an operator would, while it trains: each is carried out at a later step
        # boundary (the poll runs on the client's own thread), never inside this step.
        if step == 5 and "skip" not in submitted:
            tw.run.flush()  # registered (the background thread's first call): a loaded machine lags it
            submitted["skip"] = sup.executor.submit("mine", "skip", {"skip_ranges": [[120, 140]]}, "ana", "bad shard")
        if step == 25 and "set_lr" not in submitted:
            submitted["set_lr"] = sup.executor.submit("mine", "set_lr", {"lr_multiplier": 0.5}, "ana", "too hot")
        if step == 38 and "rollback" not in submitted:
            submitted["rollback"] = sup.executor.submit("mine", "rollback", {"to_step": 35}, "ana", "spike")
        if step == 45 and tw.attempt == 2 and "pause" not in submitted:
            submitted["pause"] = sup.executor.submit("mine", "pause", {}, "ana", "look")

            def resume_later() -> None:  # 1.5 s after the pause was carried out, however late it arrived
                action_final(sup, submitted["pause"])
                time.sleep(1.5)
                submitted.setdefault("resume", sup.executor.submit("mine", "resume", {}, "ana", "fine"))

            threading.Thread(target=resume_later, daemon=True).start()
        if "resume" in submitted and "stop" not in submitted:  # after the pause has been lifted
            submitted["stop"] = sup.executor.submit("mine", "stop", {}, "ana", "enough")
    last = tw.step
    tw.close()
    for i in submitted.values():
        action_final(sup, i)

    with db.sessions() as s:
        rows = {kind: actions_store.get_action(s, i) for kind, i in submitted.items()}
        attempts = [a.attempt for a in runs_store.attempts(s, "mine")]
    assert {k: r.state for k, r in rows.items()} == dict.fromkeys(submitted, "done"), {k: r.error for k, r in rows.items()}

    # skip: from its ack's step on, no step trains an id in [120, 140)
    skip = rows["skip"].result
    assert skip["skip_ranges"] == [[120, 140]] and skip["ok"] and skip["first_step"] < 30
    after = [ids for a, s, ids, _, _ in trained if s >= skip["first_step"]]
    assert not any(120 <= i < 140 for ids in after for i in ids)
    assert any(i >= 140 for ids in after for i in ids)

    # set_lr: the optimizer stepped at 0.5x the schedule from the ack's step, 1x before it;
    # the scheduler itself never saw the multiplier (it would have compounded in a chainable one)
    lr = rows["set_lr"].result
    assert lr["lr_multiplier"] == 0.5 and lr["lr_change"]["start_step"] == lr["first_step"]
    first_attempt = [(s, used) for a, s, _, used, _ in trained if a == 1]
    schedule = {s: 1e-3 * min(1.0, s / 20) for s in range(1, 81)}  # LambdaLR at step s: (s-1+1)/20
    for s, used in first_attempt:
        want = schedule[s] * (0.5 if s >= lr["first_step"] else 1.0)
        assert used == pytest.approx(want, rel=1e-6), (s, used, want)

    # rollback: checkpoint 30 (the newest at or before 35 that exists: every 10), attempt 2,
    # steps 31.. trained again on the same ids, with the weights and RNG of step 30
    rb = rows["rollback"].result
    assert rb["checkpoint_step"] == 30 and rb["first_step"] == 31 and attempts == [1, 2]
    # one name per concept (issue 22): the page and the events say the checkpoint loaded, 30,
    # not the first step re-trained, 31 (a rollback to checkpoint 1000 was labelled "-> 1001")
    from thermowatch.monitors.detectors import BankConfig
    from thermowatch.supervisor.serve.api.events import run_events
    from thermowatch.supervisor.charts.png import marks_for

    with db.sessions() as s:
        ev = next(a for a in run_events(s, "mine", BankConfig())["actions"] if a["kind"] == "rollback")
        marks = marks_for(s, "mine", None)
    assert (ev["to_step"], ev["ack_step"]) == (30, 31)
    assert [(m.label, m.to_step) for m in marks.rollbacks] == [(f"rollback #{submitted['rollback']} to checkpoint 30", 30)]
    first = {s: (ids, noise) for a, s, ids, _, noise in trained if a == 1}
    again = {s: (ids, noise) for a, s, ids, _, noise in trained if a == 2}
    assert min(again) == 31 and again[31] == first[31]
    ckpt = load_as_data(Path(rb["checkpoint_path"]))  # as the loop reads it: as data (issue 33)
    for k, v in weights_at_30.items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=0, atol=0)
    # the LR change survives the rollback: it is absolute on the schedule from its start step
    for s, used in [(s, used) for a, s, _, used, _ in trained if a == 2]:
        assert used == pytest.approx(schedule[s] * (0.5 if s >= lr["first_step"] else 1.0), rel=1e-6), (s, used)

    # pause/resume: steps() blocked between two steps until the resume; stop: it ended where
    # the stop's ack says, before the planned 80 steps
    assert rows["pause"].result["detail"].startswith("paused before step")
    assert max(np.diff(ends)) >= 1.0, "steps() must block while paused"
    assert rows["stop"].result["first_step"] == last + 1 and 45 <= last < 80
    with db.sessions() as s:
        stored = runs_store.attempts(s, "mine")
    assert stored[-1].start_step == 30


def test_a_rerun_resumes_from_its_newest_checkpoint_as_a_new_attempt(db, tmp_path):
    """Re-running the script with the same run id and checkpoint dir resumes from the newest
    checkpoint as the run's next attempt (issue 22, item 2)."""
    torch.manual_seed(0)
    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url)
    kw = dict(run="again", steps=30, global_batch=B, checkpoint_dir=tmp_path / "ckpt", checkpoint_every=10,
              supervisor_config=cfg, poll_interval_s=0.05)
    model = user_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    tw = thermowatch.watch(model, opt, **kw)
    for step in tw.steps():
        loss = train_step(model, opt, *user_batch(DATA, tw.batch_ids(step)))
        tw.record(loss)
        if step == 20:
            break  # the script dies after step 20 (checkpoint 20 saved at the top of the next step: not yet)
    tw.close()
    # The loop ended early: the run reads finished with the loss it ended on (issue 22, item 9).
    with db.sessions() as s:
        st = run_status(s, "again", stall_after_s=600)
    assert (st["state"], st["finish_reason"], st["final_step"]) == ("finished", "closed", 20), st
    assert st["final_loss"] == tw.final_loss and 0 < tw.final_loss < 10
    model2 = user_model()
    opt2 = torch.optim.SGD(model2.parameters(), lr=1e-2)
    tw2 = thermowatch.watch(model2, opt2, **kw)
    steps = []
    for step in tw2.steps():
        steps.append(step)
        loss = train_step(model2, opt2, *user_batch(DATA, tw2.batch_ids(step)))
        tw2.record(loss)
    tw2.close()
    assert steps[0] == 11 and steps[-1] == 30 and tw2.attempt == 2  # resumed from checkpoint 10
    with db.sessions() as s:
        assert [a.attempt for a in runs_store.attempts(s, "again")] == [1, 2]
        assert [a.start_step for a in runs_store.attempts(s, "again")] == [0, 10]
        assert [a.finished.reason.value for a in runs_store.attempts(s, "again")] == ["closed", "completed"]
        st = run_status(s, "again", stall_after_s=600)
    assert (st["state"], st["finish_reason"], st["final_step"], st["final_loss"]) == (
        "finished", "completed", 30, tw2.final_loss)


def test_a_real_divergence_in_a_users_sdpa_model_is_rolled_back_then_the_lr_lowered(db, tmp_path):
    """Issue 22 end to end: a user's nanoGPT-style model (F.scaled_dot_product_attention, nothing
    of thermowatch inside) trained at a learning rate that really diverges; the daemon reads its
    attention logits, rolls the loop back (rung 1), and when it diverges again climbs to rung 2
    (roll back and lower the LR) within seconds, not after a wall-clock cooldown."""
    model, opt, data, tw = diverging(db, tmp_path, "hot", checkpoint_every=2, keep_checkpoints=200, poll_interval_s=0.1)
    human = threading.Event()

    def on_call():  # rung 3 pauses for a human: this one looks and stops the run
        while not human.wait(0.1):
            if tw.paused:
                tw.run.supervisor.executor.submit("hot", "stop", {}, "ana", "paused by the ladder; stopping")
                return

    threading.Thread(target=on_call, daemon=True).start()

    def rollbacks_done() -> int:
        with db.sessions() as s:
            return sum(a.kind == "rollback" and a.origin == "auto" and a.state == "done"
                       for a in actions_store.actions(s, "hot"))

    for step in tw.steps():  # until rung 2 is carried out (or a human stops it): not a race with the clock
        loss = train_step(model, opt, *user_batch(data, tw.batch_ids(step), 32))
        tw.record(loss)
        if step % 5 == 0 and tw.attempt >= 3 and rollbacks_done() >= 2:
            break
    human.set()
    tw.close()
    with db.sessions() as s:
        acts = sorted(actions_store.actions(s, "hot"), key=lambda a: a.id)
        attempts = [a.attempt for a in runs_store.attempts(s, "hot")]
    rollbacks = [a for a in acts if a.kind == "rollback" and a.origin == "auto"]
    assert len(rollbacks) >= 2 and all(a.state == "done" for a in rollbacks), [(a.kind, a.state, a.reason) for a in acts]
    first, second = rollbacks[0].result, rollbacks[1].result
    assert first["ok"] and first["skip_ranges"] and first["lr_change"] is None  # rung 1: roll back, skip
    assert second["ok"] and second["lr_change"]["multiplier"] < 1.0  # rung 2: and lower the LR
    assert len(attempts) >= 3 and tw.lr_multiplier < 1.0


def test_a_divergence_that_recurs_inside_a_step_cooldown_is_judged_again_when_the_cooldown_ends(db, tmp_path):
    """Issue 22, item 9: a recurrence inside `cooldown_steps` is held back (the rollback is given
    time to take effect), but a latched detector would then stay silent for the rest of the
    excursion: before the fix this run trained 90 diverged steps with nothing done. Now the
    detectors' latches are released when the cooldown ends and the ladder climbs (rung 2)."""
    cooldown = 25
    model, opt, data, tw = diverging(db, tmp_path, "recur", policy={"cooldown_steps": cooldown}, checkpoint_every=2,
                                     keep_checkpoints=200, poll_interval_s=0.1)

    def rollbacks_done() -> int:
        with db.sessions() as s:
            return sum(a.kind == "rollback" and a.origin == "auto" and a.state == "done"
                       for a in actions_store.actions(s, "recur"))

    # This toy's steps take milliseconds, the supervisor's round trip (records batched for up to
    # 0.5 s, judged, polled) longer: train until the second rollback is carried out, not a fixed
    # number of steps that a fast machine finishes before the supervisor answers.
    for step in tw.steps():
        tw.record(train_step(model, opt, *user_batch(data, tw.batch_ids(step), 32)))
        if tw.paused or (step % 5 == 0 and tw.attempt >= 3 and rollbacks_done() >= 2):
            break
    tw.close()
    from sqlalchemy import text

    with db.sessions() as s:
        rollbacks = [a for a in sorted(actions_store.actions(s, "recur"), key=lambda a: a.id)
                     if a.kind == "rollback" and a.origin == "auto"]
        incidents = s.execute(text("SELECT detect_step, resolution FROM incidents WHERE run_id = 'recur' "
                                   "ORDER BY id")).all()
    assert len(rollbacks) >= 2 and all(a.state == "done" for a in rollbacks), [(a.state, a.reason) for a in rollbacks]
    first_step = rollbacks[0].result["first_step"]  # where the first rollback took effect
    held = [d for d, r in incidents if r.startswith("noop")]
    assert held and all(first_step <= d < first_step + cooldown for d in held), incidents  # inside the cooldown
    # ... and acted on once it ended: rung 2, the LR lowered
    second = rollbacks[1]
    assert second.result["lr_change"]["multiplier"] < 1.0
    acted = [d for d, r in incidents if r.startswith("rollback done")]
    assert len(acted) >= 2 and acted[1] >= first_step + cooldown, incidents


def test_the_grad_norm_is_the_steps_own_when_the_step_takes_a_closure(db, tmp_path):
    """`optimizer.step(closure)` (Lightning's automatic optimization, LBFGS) runs forward and
    backward inside step(), after its pre-hooks: reading .grad there gave no grad on step 1 (a NaN
    grad_norm, a non-finite finding that paused a healthy Lightning run in CI) and the previous
    step's grads on every later step. Each recorded grad_norm must be the norm the closure made."""
    from thermowatch.supervisor.store import thermometers

    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url)
    tw = thermowatch.watch(model, opt, run="closure", steps=6, global_batch=B, checkpoint_dir=tmp_path / "ckpt",
                           checkpoint_every=100, supervisor_config=cfg, poll_interval_s=0.05)
    made: dict[int, float] = {}
    for step in tw.steps():
        x, y = user_batch(DATA, tw.batch_ids(step))

        def closure():
            opt.zero_grad(set_to_none=True)
            _, loss = model(x, y)
            loss.backward()
            made[step] = float(torch.stack([p.grad.norm() for p in model.parameters()]).norm())
            return loss

        tw.record(opt.step(closure))
    tw.close()
    with db.sessions() as s:
        steps, norms = thermometers.history(s, "closure", "grad_norm")
    assert steps.tolist() == [1, 2, 3, 4, 5, 6]
    assert norms.tolist() == pytest.approx([made[s] for s in range(1, 7)], rel=1e-5)
