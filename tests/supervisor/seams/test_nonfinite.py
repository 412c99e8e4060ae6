"""Non-finite values from real training (a tiny GPT whose LR jumps to 1e20 at step 21, as a
misconfigured resume would; Composer's NaN test uses the same LR): stored as NaN, never an
ingest error; the non-finite detector fires at once; the policy rolls back immediately to a
healthy checkpoint before the onset and skips the offending samples. SQLite and PostgreSQL."""

from __future__ import annotations

import io
import math

from thermowatch.monitors.contract import Ack, RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import thermometers as thermo_store
from tests.fixtures.diverging import DETECTORS, NAN, POLICY, feed, nan_records, samples_of

RUN = "nan"


def test_nan_from_real_training_is_stored_and_rolled_back_at_once(db, tmp_path):
    recs = nan_records()
    first_bad = next(r.step for r in recs if not math.isfinite(r.values["loss"]))
    assert first_bad == NAN.jump_step + 1  # the update at the jump makes the next forward overflow
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "d", db_url=db.url, policy=dict(POLICY),
                                      detectors=dict(DETECTORS)), notifier=ConsoleNotifier(io.StringIO()))
    try:
        sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
        feed(sup, RUN, 0, recs, ckpt_root=tmp_path / "ckpt", batch=2)

        # NaN is data: every step stored, the loss history carries the NaNs as NaN.
        with sup.sessions() as s:
            steps, loss = thermo_store.history(s, RUN, "loss")
            incs = incidents_store.incidents(s, RUN)
            acts = actions_store.open_actions(s, RUN)
        assert list(steps) == [r.step for r in recs]
        assert all(math.isnan(v) for v in loss[first_bad - 1:]) and all(map(math.isfinite, loss[:first_bad - 1]))

        # Detected at the first bad step, with the onset there, and acted on by the first incident.
        first = incs[0]
        assert first.signal == "non_finite" and first.severity == "critical"
        assert first.onset_step == first.detect_step == first_bad
        (act,) = [a for a in acts if a.kind == "rollback"]
        assert act.incident_id == first.id and act.origin == "auto"
        # The newest checkpoint at or before onset - margin, all of them saved healthy before it.
        margin = POLICY["rollback_margin_steps"]
        expected = max(s for s in range(5, first_bad, 5) if s <= first_bad - margin)
        assert act.args["to_step"] == expected
        lo, hi = act.args["skip_ranges"][0]
        assert [lo, hi] == samples_of(recs, max(first_bad - margin, expected + 1), first_bad)

        # The trainer takes it; the incident closes; the NaN steps' checkpoints are never targets.
        assert [c.id for c in sup.poll(RUN)] == [act.id]
        sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=expected + 1))
        with sup.sessions() as s:
            assert incidents_store.get_incident(s, first.id).state == "resolved"
            assert actions_store.get_action(s, act.id).state == "done"
    finally:
        sup.close()
