"""Several daemon addresses (issue 40, item 3): the client, its sink and its command channel move
to a replica that answers, losing no record and carrying out nothing twice.

A real daemon (`thermowatch serve` as deployed, or its app in this process) behind three kinds of
address: one that refuses connections (a free port, nothing listening), a standby (tests/fakes/
replica.py: reads and ingest reach the daemon's database, what only the leader does gets 503 with
Retry-After), and the live leader."""

from __future__ import annotations

import io
import time

import httpx
import pytest
import torch

import thermowatch
from tests.client.http_loop import operator, train_operated
from tests.client.user_loop import user_model
from tests.fakes.network import Silent
from tests.fakes.replica import Replica
from tests.live_server import free_port, running, served
from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.spool import Tail
from thermowatch.supervisor.operate.servers import RETRY_AFTER_CAP_S, Servers
from thermowatch.transport import HttpCommandChannel, HttpSink

ADMIN = "tw_client-failover-admin-0123456789abcdef"


def _dead() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: connection refused


def _stored_steps(api: httpx.Client, run: str) -> dict[str, list[int]]:
    r = api.get(f"/api/runs/{run}/history", params={"key": "loss", "attempts": "all"})
    assert r.status_code == 200, r.text
    return {a: p["steps"] for a, p in r.json()["attempts"].items()}


def test_a_loop_given_a_dead_address_a_standby_and_the_leader_loses_nothing(db, tmp_path):
    with served(db.url, tmp_path / "srv", ADMIN) as (leader, _):
        api, secret = operator(leader, ADMIN)
        with Replica(leader, "standby") as standby:
            torch.manual_seed(0)
            model = user_model()
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            # The order a trainer might list them in: the first is gone, the second a standby.
            tw = thermowatch.watch(model, opt, run="failover", steps=60, global_batch=4,
                                   server=[_dead(), standby.url, leader], token=secret,
                                   checkpoint_dir=tmp_path / "ckpt", checkpoint_every=10, poll_interval_s=0.1)
            trained = train_operated(tw, model, opt, api, "failover", {
                5: {"kind": "skip", "args": {"skip_ranges": [[100, 140]]}, "who": "ana", "reason": "bad shard"}})
            tw.close()

        # Every step once, in the order trained (one attempt: no rollback here).
        assert [s for s, _ in trained] == list(range(1, 61))
        assert _stored_steps(api, "failover") == {str(tw.attempt): list(range(1, 61))}
        status = api.get("/api/runs/failover/status").json()
        assert status["state"] == "finished" and status["final_step"] == 60 == status["last_step"], status
        # The operator's command came from the leader, was carried out once and acknowledged there.
        acts = api.get("/api/runs/failover/actions").json()["actions"]
        assert [(a["kind"], a["state"]) for a in acts] == [("skip", "done")], acts
        skipped_from = acts[0]["result"]["first_step"]
        assert not any(100 <= i < 140 for s, ids in trained if s >= skipped_from for i in ids)
        # The standby took what a standby stores and refused what only the leader does; a poll
        # never got a command from it.
        assert any(p.endswith("/steps") for p in standby.forwarded("POST")), standby.requests
        assert any(p.endswith("/commands") for p in standby.refused("GET")), standby.requests
        assert any(p.endswith("/checkpoints") for p in standby.refused("POST")), standby.requests
        assert not any(p.endswith("/commands") for p in standby.forwarded("GET"))
        # Nothing waits, nothing was set aside.
        assert not Tail.of(tmp_path / "ckpt" / "spool")
        assert not (tmp_path / "ckpt" / "spool" / "rejected.jsonl").exists()


@pytest.fixture
def daemon(db, tmp_path):
    """The daemon's app on the test database, over real HTTP in this process, leading, auth off."""
    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.app.service import Supervisor
    from thermowatch.supervisor.notify.console import ConsoleNotifier
    from thermowatch.supervisor.serve.server import build_app

    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "daemon", db_url=db.url, auth=False),
                     notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    try:
        with running(build_app(sup)) as url:
            yield url
    finally:
        sup.close()


def _records(lo: int, hi: int) -> list[StepRecord]:
    return [StepRecord(step=s, values={"loss": 2.0 - s / 1000}, sample_lo=4 * s, sample_hi=4 * s + 4)
            for s in range(lo, hi)]


def test_records_spooled_while_no_replica_answers_arrive_once_when_one_leads(daemon, tmp_path):
    """A takeover under way: the old leader's address refuses connections, the other replica
    answers 503 (Retry-After: 1) to everything. Records spool; the sink tries again after the
    Retry-After it was given (not its doubled backoff); once that replica leads, the spool
    drains there in order: every step once, nothing left."""
    spool = tmp_path / "spool"
    with Replica(daemon, "unavailable", retry_after_s=1) as next_leader:
        sink = HttpSink([_dead(), next_leader.url], spool, retry_interval=30.0, max_retry_interval=60.0)
        try:
            sink.open_run(RunInfo(run_id="takeover", attempt=0, world_size=1))
            for lo in range(0, 40, 10):
                sink.write("takeover", 0, _records(lo, lo + 10))
            assert sink.drain(30)
            assert sink.spooled >= 1 and sink.last_error.startswith("HTTP 503"), sink.last_error
            assert next_leader.refused("POST") and not next_leader.forwarded()
            next_leader.mode = "leader"  # it took the lease
            t0 = time.monotonic()
            deadline = t0 + 30
            while sink.spooled and time.monotonic() < deadline:
                time.sleep(0.05)
            # Retry-After (1 s) set the next try, not retry_interval (30 s).
            assert sink.spooled == 0 and time.monotonic() - t0 < RETRY_AFTER_CAP_S + 1
            sink.write("takeover", 0, _records(40, 50))
            assert sink.drain(30)
        finally:
            tail = sink.close()
    assert not tail and not Tail.of(spool)
    with httpx.Client(base_url=daemon, timeout=30) as api:
        assert _stored_steps(api, "takeover") == {"0": list(range(0, 50))}


def test_the_command_channel_polls_the_leader_and_waits_out_retry_after(daemon, tmp_path):
    sink = HttpSink(daemon, tmp_path / "spool")
    sink.open_run(RunInfo(run_id="polled", attempt=0, world_size=1))
    sink.write("polled", 0, _records(1, 11))
    assert sink.drain(30) and sink.spooled == 0
    sink.close()
    with httpx.Client(base_url=daemon, timeout=30) as api:
        r = api.post("/api/runs/polled/actions", json={"kind": "pause", "who": "ana", "reason": "look"})
        assert r.status_code == 201, r.text
    with Replica(daemon, "standby") as standby:
        channel = HttpCommandChannel([standby.url, daemon])
        try:
            cmds = channel.poll("polled")
            assert [c.id for c in cmds] == [r.json()["action_id"]]
            assert standby.refused("GET") == ["/api/runs/polled/commands"]
            # From now on the leader first: the standby is asked no more.
            channel.poll("polled")
            assert len(standby.requests) == 1
            # Every replica says "not now": no request until its Retry-After (1 s) has passed.
            standby.mode = "unavailable"
            gone = HttpCommandChannel([standby.url, _dead()])
            try:
                assert gone.poll("polled") == [] and len(standby.requests) == 2
                assert gone.poll("polled") == [] and len(standby.requests) == 2
                time.sleep(1.1)
                gone.poll("polled")
                assert len(standby.requests) == 3
            finally:
                gone.close()
        finally:
            channel.close()


def test_a_request_that_must_not_be_sent_twice_moves_on_only_when_nothing_was_sent(daemon):
    with Silent() as silent:  # takes the request, never answers: it may have acted on it
        servers = Servers([silent.url, daemon], timeout=httpx.Timeout(0.5, connect=0.5))
        try:
            with pytest.raises(httpx.ReadTimeout):
                servers.request("POST", "/api/runs", json={}, resend=False)
            assert servers.url == silent.url
            assert servers.request("GET", "/api/runs").status_code == 200  # a read may go on
            assert servers.url == daemon
        finally:
            servers.close()
    dead = _dead()
    servers = Servers([dead, daemon])
    try:
        assert servers.request("GET", "/api/runs", resend=False).status_code == 200  # refused: nothing was sent
        assert servers.url == daemon
    finally:
        servers.close()


def test_after_a_503_one_address_is_asked_on_a_new_connection(daemon):
    """Behind one address a load balancer (a Kubernetes Service over both replicas) picks a replica
    per connection: a kept-alive connection to the standby would reach it again and again."""
    with Replica(daemon, "leader") as one:
        servers = Servers(one.url)
        try:
            assert [servers.request("GET", "/api/runs").status_code for _ in range(2)] == [200, 200]
            assert one.ports[0] == one.ports[1]  # kept alive
            one.mode = "unavailable"
            r = servers.request("GET", "/api/runs")
            assert r.status_code == 503 and servers.retry_after_s == 1  # one address: its answer, as before
            one.mode = "leader"
            assert servers.request("GET", "/api/runs").status_code == 200
            assert one.ports[2] == one.ports[1] != one.ports[3]
        finally:
            servers.close()
