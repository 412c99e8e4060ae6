"""Every command reaches a final state on its own, and one bad command never blocks the next
(issue 9): over real HTTP (uvicorn on a free port, the trainer's HttpCommandChannel), on
SQLite and PostgreSQL."""

from __future__ import annotations

import io
import socket
from urllib.parse import urlsplit

import httpx
import pytest

from thermowatch.monitors.contract import Ack, RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.transport import HttpCommandChannel
from tests.live_server import running
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH

RUN = "fin"


@pytest.fixture
def served(db, tmp_path):
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN),
                     notifier=ConsoleNotifier(io.StringIO()))
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1, config={"steps": 100, "data": {"global_batch": 8}}))
    app = build_app(sup)

    @app.get("/test-boom")
    def boom() -> dict:
        raise RuntimeError("a bug in a route")

    try:
        with running(app) as url:
            yield sup, url, urlsplit(url).port
    finally:
        sup.close()


def _row(sup, aid):
    with sup.sessions() as s:
        return actions_store.get_action(s, aid)


def test_unstorable_commands_are_refused_at_submit(served):
    sup, url, _ = served
    with httpx.Client(base_url=url, headers=AUTH) as c:
        # 422: the contract refuses it; 409: what is stored rules it out (the run's data size)
        for args, kind, words, status in (({"skip_ranges": [[0, 2**63]]}, "skip", "2**63-1", 422),
                                          ({"lr_multiplier": 0.5, "lr_steps": 2**63}, "set_lr", "lr_steps", 422),
                                          ({"skip_ranges": [[5_200_000, 5_400_000]]}, "skip", "ids stop at 800", 409)):
            r = c.post(f"/api/runs/{RUN}/actions", json={"kind": kind, "args": args, "who": "bob"})
            assert r.status_code == status, r.text
            assert words in r.json()["detail"]
    with sup.sessions() as s:
        assert actions_store.actions(s, RUN) == []


def test_a_bad_command_and_a_bad_ack_do_not_block_a_pause(served):
    sup, url, _ = served
    # A row no valid command can be built from (written by an older version, before the
    # contract bounded its fields): it must fail, loudly, not block the queue or the channel.
    with sup.sessions.begin() as s:
        bad = actions_store.enqueue_action(s, RUN, "skip", {"skip_ranges": [[0, 2**63]]}, "legacy", "manual", "old")
    with httpx.Client(base_url=url, headers=AUTH) as c:
        pause = c.post(f"/api/runs/{RUN}/actions", json={"kind": "pause", "who": "bob"}).json()["action_id"]
    ch = HttpCommandChannel(url, ADMIN_TOKEN)
    try:
        ch.ack(RUN, Ack(command_id=123456, ok=True, first_step=3))  # an ack the supervisor refuses (404)
        cmds = ch.poll(RUN)
        assert [c.id for c in cmds] == [pause]  # the pause arrives
        ch.ack(RUN, Ack(command_id=pause, ok=True, first_step=4, detail="paused before step 4"))
        assert not ch._unsent, "an ack stayed behind a refused one"
        assert [a.command_id for a, _ in ch.refused] == [123456]
    finally:
        ch.close()
    assert _row(sup, pause).state == "done"
    row = _row(sup, bad)
    assert row.state == "failed" and "2**63-1" in row.error
    with sup.sessions() as s:
        assert any("FAILED" in a.text and f"action {bad}" in a.text for a in alerts_store.alerts(s, RUN))


def test_an_ack_that_cannot_be_booked_fails_its_command_with_a_4xx(served):
    sup, url, _ = served
    with httpx.Client(base_url=url, headers=AUTH) as c:
        aid = c.post(f"/api/runs/{RUN}/actions", json={"kind": "set_lr", "args": {"lr_multiplier": 0.5},
                                                        "who": "bob"}).json()["action_id"]
        c.get(f"/api/runs/{RUN}/commands")
        # The trainer claims an LR change the contract does not allow: refused, and the action fails.
        bad = {**Ack(aid, True, 7).to_json(), "lr_change": {"start_step": 7, "multiplier": 50.0}, "lr_seq": 0}
        r = c.post(f"/api/runs/{RUN}/acks", json=bad)
        assert r.status_code == 422 and "multiplier" in r.json()["detail"], r.text
    row = _row(sup, aid)
    assert row.state == "failed" and "multiplier" in row.error


def test_a_500_keeps_the_keep_alive_connection(served):
    """uvicorn closed the connection after Starlette re-raised a route's error; the command
    channel's next request on it then failed too."""
    _, _, port = served
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        req = "GET {} HTTP/1.1\r\nHost: x\r\n\r\n"
        sock.sendall(req.format("/test-boom").encode())
        first = _read_response(sock)
        assert first.startswith(b"HTTP/1.1 500"), first[:100]
        sock.sendall(req.format("/healthz").encode())  # same connection
        second = _read_response(sock)
        assert second.startswith(b"HTTP/1.1 200") and b'"ok":true' in second, second[:200]


def _read_response(sock) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(l.split(b":")[1] for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")))
    while len(body) < length:
        chunk = sock.recv(4096)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_precise_skips_ack_travels_and_a_bad_one_is_refused(served):
    """Ack.bisected over HTTP (AckBody): stored with the action and shown by its outcome; a search
    the contract does not allow (an unknown outcome) is a 422 that names it."""
    from thermowatch.monitors.contract import Bisected, SampleRange
    from thermowatch.supervisor.act.outcome import details, outcome

    sup, url, _ = served
    b = Bisected((SampleRange(0, 64),), probes=4, steps=20, seconds=1.5, outcome="narrowed")
    with httpx.Client(base_url=url, headers=AUTH) as c:
        aid, other = (c.post(f"/api/runs/{RUN}/actions", json={"kind": "skip", "args": {"skip_ranges": [[0, 64]]},
                                                                "who": "bob"}).json()["action_id"] for _ in range(2))
        c.get(f"/api/runs/{RUN}/commands")
        good = Ack(aid, True, 7, skip_ranges=(SampleRange(8, 16),), bisected=b).to_json()
        assert c.post(f"/api/runs/{RUN}/acks", json=good).status_code < 300
        bad = {**Ack(other, True, 7).to_json(), "bisected": {**b.to_json(), "outcome": "x"}}
        r = c.post(f"/api/runs/{RUN}/acks", json=bad)
        assert r.status_code == 422 and "outcome" in r.text, r.text
    o = outcome(_row(sup, aid))
    assert o["bisected"] == b.to_json() and o["skip_ranges"] == [[8, 16]]
    assert "precise skip (narrowed): 4 probes, 20 steps re-trained, 1.5 s, over 64 suspect samples" in details(o)
    assert _row(sup, other).state == "failed"  # the trainer will not send it differently
