"""Two daemons on one PostgreSQL (issue 40): the leader is SIGKILLed three times during a real
divergence; a standby leads within the lease's time each time, judges what either replica
stored, and the rollback is decided, handed to the trainer and booked exactly once. A second
daemon on one SQLite file refuses to start, saying why."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from thermowatch.supervisor.store import actions as actions_store
import httpx

from tests.failover import AUTH, ROOT, TOKEN, Client, Replica, leader
from tests.live_server import free_port
from tests.fixtures.diverging import DETECTORS, POLICY, checkpoint_for, diverging_records

pytestmark = pytest.mark.timeout(300)
RUN = "failover"
TTL_S = 2.0


def _config() -> str:
    """Both replicas' policy and detectors: the fixture's, so its divergence is acted on."""
    import yaml

    return yaml.safe_dump({"policy": dict(POLICY), "detectors": dict(DETECTORS)})


@pytest.mark.parametrize("db", ["postgres"], indirect=True)  # SQLite is single-replica: the test below
def test_the_leader_killed_three_times_mid_divergence_rolls_back_once(db, tmp_path):
    a, b = (Replica(name, db.url, tmp_path, TTL_S, extra_yaml=_config()) for name in ("replica-a", "replica-b"))
    replicas = [a, b]
    a.start()
    b.start()
    client = Client(replicas, timeout_s=4 * TTL_S + 20)
    takeovers: list[float] = []
    try:
        first, _ = leader(replicas, 10)
        other = b if first is a else a
        assert (first.role(), other.role()) == ("leader", "standby")
        # A Service that routes to the leader only reads /readyz/leader; /metrics says the same.
        assert httpx.get(first.url + "/readyz/leader").status_code == 200
        assert httpx.get(other.url + "/readyz/leader").status_code == 503
        ready = httpx.get(first.url + "/readyz").json()
        assert ready["lease"]["holder"].startswith(first.name + ":") and ready["lease"]["age_s"] < TTL_S
        for r, up in ((first, 1), (other, 0)):
            text = httpx.get(r.url + "/metrics", headers=AUTH).text
            assert f"thermowatch_leader {up}.0" in text, text[-500:]

        def kill_leader() -> None:
            old, _ = leader(replicas, 10)
            old.kill()
            new, took = leader(replicas, 4 * TTL_S + 10, exclude=old)
            takeovers.append(took)
            old.start()  # back as a standby
            assert old.role() == "standby" and new.role() == "leader"

        recs = diverging_records()
        assert client.call("POST", "/api/runs", json={"run_id": RUN, "attempt": 0, "world_size": 1}).status_code in (
            200, 201)
        got: list[dict] = []
        kills_at = {2, 5}  # batches before the detection; the third kill waits for the command
        for i in range(0, len(recs), 10):
            if i // 10 in kills_at:
                kill_leader()
            chunk = recs[i:i + 10]
            body = json.dumps({"records": [x.to_json() for x in chunk]})  # NaN and Infinity as JSON literals
            r = client.call("POST", f"/api/runs/{RUN}/attempts/0/steps", content=body,
                            headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            for x in chunk:
                if x.step % 5 == 0:
                    ck = checkpoint_for(x, tmp_path / "ckpt")
                    r = client.call("POST", f"/api/runs/{RUN}/attempts/0/checkpoints",
                                    json={"step": ck.step, "path": ck.path, "sample_cursor": ck.sample_cursor,
                                          "healthy": True})
                    assert r.status_code in (200, 201), r.text
            got = _poll(client, 3.0)
            if got:
                break
        assert [c["kind"] for c in got] == ["rollback"], got
        kill_leader()  # the command handed out, not acknowledged yet: the new leader re-delivers it
        cmd = got[0]
        again = _poll(client, 3 * 5.0)  # a sent, unacknowledged command goes out again (redeliver_s)
        assert [c["id"] for c in again] == [cmd["id"]], again
        to = cmd["args"]["to_step"]
        r = client.call("POST", f"/api/runs/{RUN}/acks", json={"command_id": cmd["id"], "ok": True, "step": to + 1,
                                                              "detail": "rolled back", "checkpoint_step": to})
        assert r.status_code == 200, r.text
        with db.sessions() as s:
            rows = actions_store.actions(s, RUN)
        assert [(x.kind, x.state) for x in rows] == [("rollback", "done")], rows
        assert len(takeovers) == 3 and max(takeovers) < 4 * TTL_S + 5, takeovers
        assert _poll(client, 1.0) == []  # nothing more to do, on whichever replica answers
    finally:
        client.close()
        for r in replicas:
            r.stop()


def _poll(client: Client, for_s: float) -> list[dict]:
    """Commands from the leader (a standby answers 503 and the client tries the other)."""
    deadline = time.monotonic() + for_s
    while True:
        r = client.call("GET", f"/api/runs/{RUN}/commands")
        assert r.status_code == 200, r.text
        cmds = r.json()["commands"]
        if cmds or time.monotonic() > deadline:
            return cmds
        time.sleep(0.2)


def test_a_second_daemon_on_one_sqlite_file_refuses_to_start(tmp_path):
    one = Replica("one", f"sqlite:///{tmp_path / 'tw.db'}", tmp_path, 6.0).start()
    try:
        env = {"THERMOWATCH_API_TOKEN": TOKEN, "THERMOWATCH_REPLICA_NAME": "two", "PYTHONPATH": str(ROOT),
               "PATH": "/usr/bin:/bin"}
        proc = subprocess.run([sys.executable, "-m", "thermowatch.cli", "serve", "--data-dir", str(tmp_path / "two"),
                               "--db", f"sqlite:///{tmp_path / 'tw.db'}", "--port", str(free_port())],
                              capture_output=True, text=True, timeout=120, env=env)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert "SQLite is single-replica" in proc.stderr and "Traceback" not in proc.stderr
        assert one.role() == "leader"
    finally:
        one.stop()
