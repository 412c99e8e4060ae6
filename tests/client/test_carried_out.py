"""A connected trainer says what the supervisor did (issue 35: a trainer connected to a daemon
printed nothing on a rollback or an LR change). A plain loop under thermowatch.watch, against a
real supervisor on both databases, is sent a skip, an LR change, a rollback, a rollback it must
refuse and a stop: each, once carried out, is one line on its stderr and one WARNING record of
the `thermowatch` logger, with what was done and from which step."""

from __future__ import annotations

import logging
import time


from tests.client.user_loop import DATA, calm, train_step, user_batch
from thermowatch.supervisor.store import actions as actions_store


def _carried_out(sup, action_id: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        with sup.sessions() as s:
            if actions_store.get_action(s, action_id).state in ("done", "failed"):
                return
        assert time.monotonic() < deadline
        time.sleep(0.02)


def test_each_command_carried_out_is_one_line_on_stderr_and_the_log(db, tmp_path, capsys, caplog):
    tw, model, opt = calm(db, tmp_path, "told", 60, poll_interval_s=0.02)
    sup = tw.run.supervisor
    plan = {(1, 4): ("skip", {"skip_ranges": [[40, 44]]}), (1, 8): ("set_lr", {"lr_multiplier": 0.5}),
            (1, 13): ("rollback", {"to_step": 10, "skip_ranges": [[48, 52]]}),
            (2, 12): ("rollback", {"to_step": 10, "exclude_rank": 1}),  # up to the launcher: refused
            (2, 14): ("stop", {})}
    ids = {}
    caplog.set_level(logging.WARNING, logger="thermowatch")
    for step in tw.steps():
        loss = train_step(model, opt, *user_batch(DATA, tw.batch_ids(step)))
        tw.record(loss)
        if (tw.attempt, step) in plan:
            kind, args = plan.pop((tw.attempt, step))
            tw.run.flush()  # the supervisor has the steps a skip names
            ids[kind, step] = sup.executor.submit("told", kind, args, "ana", "test")
            while not any(c.id == ids[kind, step] for c in list(tw.run._inbox)):
                time.sleep(0.01)  # carried out at the next boundary
    tw.close()
    for i in ids.values():
        _carried_out(sup, i)
    assert not plan and tw.step == 14

    want = [f"thermowatch: run told skipping samples [40, 44) from step 5 (action {ids['skip', 4]})",
            f"thermowatch: run told LR x0.5 of the schedule from step 9 (action {ids['set_lr', 8]})",
            f"thermowatch: run told rolled back to checkpoint 10 (action {ids['rollback', 13]}); re-training from "
            f"step 11, skipping samples [48, 52)",
            f"thermowatch: run told refused action {ids['rollback', 12]} (rollback): restarting without a rank or "
            "node is up to your launcher; thermowatch.watch cannot do it",
            f"thermowatch: run told stopping after step 14 (action {ids['stop', 14]}): the loop ends here"]
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("thermowatch: run told")]
    assert err == want, err
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("thermowatch")
              and r.getMessage().startswith("thermowatch: run told") and r.levelno == logging.WARNING]
    assert logged == want, logged
