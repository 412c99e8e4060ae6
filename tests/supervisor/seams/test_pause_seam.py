"""Never a silent hang (issue 35, item 3), across the bundled trainer's seam: a real RunController
(a tiny GPT, one rank in-process: trainer.local.InProcessGang, real DeepSpeed on gloo) paused
through the embedded Supervisor, on SQLite and PostgreSQL, says why on stderr with the commands
that end the pause, and a rollback ends it: training goes on from the rollback's checkpoint to
the last step (an acked rollback used to leave the loop paused until a resume)."""

from __future__ import annotations

import io
import os
import threading
import time

from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store

from tests.supervisor.seams.test_lr_seam import POLICY, RUN, tiny

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def test_the_bundled_trainer_says_why_it_paused_and_a_rollback_ends_the_pause(db, tmp_path, capsys):
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import InProcessGang

    cfg = tiny(tmp_path, steps=14)  # checkpoints every 4 steps
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY)),
                     notifier=ConsoleNotifier(io.StringIO()))

    def on_step(rec, attempt):
        if (attempt, rec.step) == (0, 9):  # a person pauses it, through the daemon's executor
            sup.executor.submit(RUN, "pause", {}, "ana", "the loss looks odd")

    ctl = RunController(cfg, sup, sup, progress=on_step, gang_factory=InProcessGang)
    asked: dict[str, object] = {}

    def on_call():  # waits for the pause, then rolls back to checkpoint 4
        try:
            deadline = time.monotonic() + 120
            while not ctl.paused and time.monotonic() < deadline:
                time.sleep(0.02)
            asked["paused_at"] = ctl.step + 1
            time.sleep(0.3)  # it waits: no step is trained meanwhile
            asked["steps_meanwhile"] = ctl.step + 1 - asked["paused_at"]
            asked["rollback"] = sup.executor.submit(RUN, "rollback", {"to_step": 4}, "ana", "from 4")
            deadline = time.monotonic() + 60
            while ctl.paused and time.monotonic() < deadline:
                time.sleep(0.02)
            if ctl.paused:  # the rollback did not end the pause: end the run, the test fails below
                asked["still_paused"] = True
                sup.executor.submit(RUN, "stop", {}, "ana", "still paused after the rollback")
        except BaseException as exc:  # noqa: BLE001 - end the run, then fail the test with it
            asked["error"] = exc
            sup.executor.submit(RUN, "stop", {}, "ana", "the test's on-call failed")

    human = threading.Thread(target=on_call, daemon=True)
    human.start()
    try:
        result = ctl.run()
        human.join(5)
        err = capsys.readouterr().err
        assert "error" not in asked and "still_paused" not in asked, asked
        with sup.sessions() as s:
            acts = sorted(actions_store.actions(s, RUN), key=lambda a: a.id)
        assert [(a.kind, a.state) for a in acts] == [("pause", "done"), ("rollback", "done")]
        rollback = acts[1]
        paused = next(ln for ln in err.splitlines() if "is PAUSED" in ln)
        assert f"run {RUN} is PAUSED before step {asked['paused_at']}: paused by ana: the loss looks odd." in paused
        assert f"`thermowatch resume {RUN}`" in paused and f"`thermowatch rollback {RUN} --to-step N`" in paused
        assert "on disk: 4, 8" in paused
        assert asked["steps_meanwhile"] == 0
        ended = next(ln for ln in err.splitlines() if "no longer paused" in ln)
        assert "rolled back to checkpoint 4" in ended
        # the rollback ended the pause: a new attempt from checkpoint 4, trained to the end
        assert (rollback.result["checkpoint_step"], rollback.result["first_step"]) == (4, 5)
        assert result.final_step == 14 and not result.stopped and not ctl.paused
        assert len(result.attempts) == 2
    finally:
        sup.close()
