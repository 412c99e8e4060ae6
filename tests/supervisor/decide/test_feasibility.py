"""supervisor/decide/feasibility.py over HTTP: a manual command this run cannot carry out as
stored now is refused up front (409 naming the value and what the run has), never delivered,
and stores nothing; a relative LR request is made absolute against the multiplier in force."""

from __future__ import annotations

import io

import pytest
from fastapi.testclient import TestClient

from thermowatch.monitors.contract import CheckpointInfo, RunInfo, StepRecord
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import actions as actions_store
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH

RUN = "feasible"
BATCH, STEPS = 8, 100  # the run can ever consume 800 sample ids


@pytest.fixture
def client(db, tmp_path):
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN),
                     notifier=ConsoleNotifier(io.StringIO()))
    sup.open_run(RunInfo(RUN, 0, world_size=1, config={"steps": STEPS, "data": {"global_batch": BATCH}}))
    sup.write(RUN, 0, [StepRecord(step=k, values={"loss": 3.0}, sample_lo=BATCH * (k - 1), sample_hi=BATCH * k)
                       for k in range(1, 31)])  # consumed ids 0..240
    for step, healthy in ((10, True), (20, True), (25, False)):
        sup.checkpoint_saved(RUN, 0, CheckpointInfo(step, f"/ck/{step}", BATCH * step, healthy))
    with TestClient(build_app(sup), headers=AUTH) as c:
        c.sup = sup
        yield c
    sup.close()


def submit(client, kind: str, args: dict):
    return client.post(f"/api/runs/{RUN}/actions", json={"kind": kind, "args": args, "who": "bob"})


def actions(client) -> list:
    with client.sup.sessions() as s:
        return [(a.kind, a.args) for a in actions_store.actions(s, RUN)]


@pytest.mark.parametrize("kind, args, says", [
    ("skip", {"skip_ranges": [[900, 1000]]}, "beyond the samples run 'feasible' can consume: ids stop at 800 "
                                             "(100 steps x batch 8 + 0 skipped)"),
    ("rollback", {"to_step": 20, "skip_ranges": [[300, 320]]}, "wholly in the future: run 'feasible' has consumed "
                                                               "samples up to 240"),
    ("rollback", {"to_step": 25, "exact": True}, "--exact: checkpoint 25 of run 'feasible' is marked unhealthy"),
    ("rollback", {"to_step": 15, "exact": True}, "--exact: checkpoint 15 of run 'feasible' was never saved; "
                                                 "usable checkpoints: [10, 20]"),
    ("rollback", {"to_step": 5}, "no healthy checkpoint of run 'feasible' at or before step 5 (usable: [10, 20])"),
])
def test_what_the_run_cannot_do_is_a_409_that_stores_nothing(client, kind, args, says):
    r = submit(client, kind, args)
    assert r.status_code == 409 and says in r.json()["detail"], r.text
    assert actions(client) == []
    assert client.get(f"/api/runs/{RUN}/commands").json() == {"commands": []}


def test_what_it_can_do_is_queued(client):
    assert submit(client, "skip", {"skip_ranges": [[700, 720]]}).status_code == 201  # not reached yet: fine
    assert submit(client, "rollback", {"to_step": 25, "skip_ranges": [[100, 120]]}).status_code == 201
    assert sorted(k for k, _ in actions(client)) == ["rollback", "skip"]


def test_a_relative_lr_is_made_absolute_against_the_multiplier_in_force(client):
    r = submit(client, "set_lr", {"lr_factor": 0.5})
    assert r.status_code == 201, r.text
    ((kind, args),) = actions(client)
    assert kind == "set_lr" and args["lr_multiplier"] == 0.5 and args["lr_base"] == 1.0 and args["lr_factor"] == 0.5
    r = submit(client, "set_lr", {"lr_factor": 0.0})
    assert r.status_code == 422 and "lr_factor must be a number in (0," in r.json()["detail"]
