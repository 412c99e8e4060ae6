"""thermowatch.watch against `thermowatch serve` as deployed (a process of its own, auth on, both
databases): the client's records, checkpoints, acks and finish report cross real HTTP with an
`ingest` token, and an operator's commands, posted to the API while the loop trains, come back
through the client's poller and are carried out between two steps."""

from __future__ import annotations

import pytest
import torch

import thermowatch
from tests.client.http_loop import operator, train_operated
from tests.client.user_loop import user_model
from tests.live_server import served

ADMIN = "tw_client-http-admin-0123456789abcdef"


def test_a_loop_over_http_obeys_the_operator_and_reads_finished(db, tmp_path):
    with served(db.url, tmp_path / "srv", ADMIN) as (url, _):
        started = (tmp_path / "serve.log").read_text()  # a fresh database: every migration ran
        assert "Running upgrade" not in started and "Added job" not in started, started  # issue 23: 41 lines
        api, secret = operator(url, ADMIN)
        torch.manual_seed(0)
        model = user_model()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        tw = thermowatch.watch(model, opt, run="wire", steps=200, global_batch=4, server=url, token=secret,
                               checkpoint_dir=tmp_path / "ckpt", checkpoint_every=10, poll_interval_s=0.1)
        trained = train_operated(tw, model, opt, api, "wire", {
            5: {"kind": "skip", "args": {"skip_ranges": [[200, 240]]}, "who": "ana", "reason": "bad shard"},
            30: {"kind": "stop", "who": "ana", "reason": "enough"}})
        tw.close()

        acts = {a["kind"]: a for a in api.get("/api/runs/wire/actions").json()["actions"]}
        assert acts["skip"]["state"] == "done" and acts["skip"]["result"]["skip_ranges"] == [[200, 240]]
        assert not any(200 <= i < 240 for s, ids in trained if s >= acts["skip"]["result"]["first_step"] for i in ids)
        assert acts["stop"]["state"] == "done" and acts["stop"]["result"]["first_step"] == tw.step + 1 < 200
        status = api.get("/api/runs/wire/status").json()
        assert status["state"] == "finished" and status["finish_reason"] == "stopped", status
        assert status["final_step"] == tw.step == status["last_step"]
        assert status["final_loss"] == pytest.approx(tw.final_loss)
        # a finished run takes no command: refused at submit, naming the state (issue 23)
        late = api.post("/api/runs/wire/actions", json={"kind": "rollback", "args": {"to_step": 10}, "who": "ana",
                                                        "reason": "too late"})
        assert late.status_code == 409, late.text
        assert f"has finished (stopped at step {tw.step}" in late.json()["detail"]
        assert len(api.get("/api/runs/wire/actions").json()["actions"]) == 2
