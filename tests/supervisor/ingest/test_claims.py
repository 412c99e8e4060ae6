"""A trainer's claims about its data are bounded by what its run can have consumed (issue 34), on
real SQLite and PostgreSQL, in process and over HTTP.

The probe: steps claiming `sample_lo: 0, sample_hi: 1e15` made the policy order
`skip [[0, 1000000000000301]]`, the whole dataset.
"""

from __future__ import annotations

import io
import json
import math

import pytest
from fastapi.testclient import TestClient

from tests.supervisor.auth_helpers import ADMIN_TOKEN, bearer, make_token
from thermowatch.monitors.contract import ContractError, RunInfo, StepRecord
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import skips as skips_store
from thermowatch.supervisor.store import steps as steps_store

BATCH = 16
CONFIG = {"steps": 200, "data": {"global_batch": BATCH}}


@pytest.fixture
def sup(db, tmp_path):
    s = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN),
                   notifier=ConsoleNotifier(io.StringIO()))
    s.open_run(RunInfo("r", 0, world_size=1, config=CONFIG), "trainer")
    yield s
    s.close()


def _step(step: int, lo: int, hi: int, loss: float = 2.0) -> StepRecord:
    return StepRecord(step=step, values={"loss": loss}, sample_lo=lo, sample_hi=hi)


def _honest(steps) -> list[StepRecord]:
    return [_step(s, s * BATCH, (s + 1) * BATCH) for s in steps]


def _stored_steps(sup) -> list[int]:
    with sup.sessions() as s:
        return sorted(steps_store.stored(s, "r", 0, 0, 10**6))


def test_a_claim_of_the_whole_dataset_is_refused_naming_the_arithmetic_and_stores_nothing(sup):
    sup.write("r", 0, _honest(range(10)))
    with pytest.raises(ContractError) as exc:
        sup.write("r", 0, [_step(10, 0, 10**15, math.nan), _step(11, 0, 10**15 + 301, math.nan)])
    msg = str(exc.value)
    assert "step 10: claims samples [0, 1000000000000000)" in msg
    assert "by step 10 it has consumed at most 176 sample ids ((step + 1) x data.global_batch 16 + 0" in msg
    assert _stored_steps(sup) == list(range(10))
    with sup.sessions() as s:
        assert actions_store.actions(s, "r") == []  # the policy never saw it: no skip of the dataset


@pytest.mark.parametrize("lo, hi, why", [
    (100, 176, "one step consumes at most 16 ids .* this range spans 76"),  # within the run's end, too wide
    (170, 177, "by step 10 it has consumed at most 176 sample ids"),  # a step's width, past the end
    (170, 160, "ends before it starts"),
])
def test_each_rule(sup, lo, hi, why):
    sup.write("r", 0, _honest(range(10)))
    with pytest.raises(ContractError, match=why):
        sup.write("r", 0, [_step(10, lo, hi)])
    sup.write("r", 0, [_step(10, -1, -1)])  # an unknown range is still fine


def test_a_skip_widens_the_bound_by_what_the_ledger_passed_over(sup):
    """After the ledger skips [100, 500), the trainer's cursor is 400 ids further on: a step
    straddling the skipped ids is a true claim and is stored, though the bound read before the
    skip would refuse it (the kept ledger size is read again before refusing)."""
    sup.write("r", 0, _honest(range(6)))  # reads the ledger's size (0) and keeps it
    with sup.sessions.begin() as s:
        skips_store.add_skip_range(s, "r", 100, 500)
    sup.write("r", 0, [_step(6, 96, 100 + 400 + 12)])  # 4 ids before the skip, 12 after
    assert _stored_steps(sup) == list(range(7))
    with pytest.raises(ContractError, match=r"\+ 400 its skip ledger passed over"):
        sup.write("r", 0, [_step(7, 512, 512 + BATCH + 401)])


def test_a_checkpoint_cursor_past_the_run_is_refused(sup):
    from thermowatch.monitors.contract import CheckpointInfo

    sup.ingestor.checkpoint_saved("r", 0, CheckpointInfo(step=10, path="/ck/10", sample_cursor=11 * BATCH,
                                                          healthy=True))
    with pytest.raises(ContractError, match=r"checkpoint 20: sample_cursor 1000000000000000 is past"):
        sup.ingestor.checkpoint_saved("r", 0, CheckpointInfo(step=20, path="/ck/20", sample_cursor=10**15,
                                                              healthy=True))


def test_a_run_that_does_not_say_its_batch_gets_the_order_check_only(sup):
    sup.open_run(RunInfo("free", 0, world_size=1, config={}), "trainer")
    sup.write("free", 0, [_step(0, 0, 10**12)])
    with pytest.raises(ContractError, match="ends before it starts"):
        sup.write("free", 0, [_step(1, 5, 4)])


def test_over_http_the_probe_is_a_422_and_the_run_goes_on(sup):
    trainer = bearer(make_token(sup.sessions, "trainer", "ingest"))
    with TestClient(build_app(sup), headers={**trainer, "content-type": "application/json"}) as c:
        ok = c.post("/api/runs/r/attempts/0/steps",
                    content=json.dumps({"records": [r.to_json() for r in _honest(range(5))]}))
        assert ok.status_code == 200, ok.text
        bad = [{"step": 5 + i, "loss": float("nan"), "sample_lo": 0, "sample_hi": 10**15} for i in range(3)]
        r = c.post("/api/runs/r/attempts/0/steps", content=json.dumps({"records": bad}))
        assert r.status_code == 422 and "more than run 'r' can have consumed" in r.json()["detail"], r.text
        ok = c.post("/api/runs/r/attempts/0/steps",
                    content=json.dumps({"records": [r.to_json() for r in _honest(range(5, 8))]}))
        assert ok.status_code == 200, ok.text
    assert _stored_steps(sup) == list(range(8))
