"""One leader per database (issue 40, supervisor.app.lease), on SQLite and PostgreSQL: the lease
is taken once, renewed only by its holder, taken over only once it has expired (or its holder's
process is gone from this host), each takeover a higher fencing token; a deposed leader's
writes are refused in their own transaction, and its outbox sends nothing."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time

import pytest
from sqlalchemy import update

from thermowatch.monitors.contract import RunInfo, Severity
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.lease import Coordinator, Deposed, Lease
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.errors import NotLeader
from thermowatch.supervisor.notify.base import Alert
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store.orm import LeaderLease, utcnow


def _expire(db) -> None:
    """The holder's machine died: its lease runs out (the database's rows, as time would leave them)."""
    with db.sessions.begin() as s:
        s.execute(update(LeaderLease).values(expires_at=utcnow().replace(year=2000)))


def test_one_holder_renews_and_a_standby_takes_over_only_after_expiry(db):
    a, b = Lease(db.sessions, "host-a:1:x"), Lease(db.sessions, "host-b:2:y")
    assert a.acquire() == 1 and b.acquire() is None
    assert a.renew() and not b.renew()
    assert a.acquire() == 1  # its own lease again: the same token
    with db.sessions() as s:
        a.fence(s)
        with pytest.raises(Deposed):
            b.fence(s)
    _expire(db)
    assert b.acquire() == 2 and b.state().holder == "host-b:2:y"
    assert not a.renew()  # the old leader learns it is deposed at its next renewal
    with db.sessions() as s:
        with pytest.raises(Deposed, match="no longer leads"):
            a.fence(s)
        b.fence(s)
    assert not a.holds() and b.holds()
    b.release()
    assert a.acquire() == 3  # a clean stop hands over at once, not after the ttl


def test_a_holder_whose_process_is_gone_from_this_host_is_taken_over_at_once(db):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    gone = Lease(db.sessions, f"{socket.gethostname()}:{dead.pid}:z")
    assert gone.acquire() == 1
    me = Lease(db.sessions, f"{socket.gethostname()}:{os.getpid()}:w")
    assert me.acquire() == 2  # no ttl to wait out: the machine is this one and the process is gone
    alive = Lease(db.sessions, f"{socket.gethostname()}:{os.getppid()}:v")
    assert alive.acquire() is None  # a live process on this host keeps its lease


def test_a_deposed_leader_writes_nothing_and_sends_nothing(db, tmp_path):
    """Two Supervisors on one database, as two replicas: the standby refuses the leader's work
    (503), the leader's writes are fenced by the token in their own transaction, and once it is
    deposed its outbox leaves the rows for the new leader."""
    cfg = SupervisorConfig(data_dir=tmp_path / "d", db_url=db.url)
    lease_a, lease_b = Lease(holder="a:1:x"), Lease(holder="b:2:y")
    out_a, out_b = io.StringIO(), io.StringIO()
    a = Supervisor(cfg, notifier=ConsoleNotifier(out_a), judge_inline=False, lease=lease_a, standby=True)
    b = Supervisor(cfg, notifier=ConsoleNotifier(out_b), judge_inline=False, lease=lease_b, standby=True)
    try:
        assert lease_a.acquire() == 1
        a.lead()
        a.open_run(RunInfo(run_id="r", attempt=0, world_size=1))
        with pytest.raises(NotLeader, match="standby"):
            b.poll("r")
        with pytest.raises(NotLeader):
            b.executor.submit("r", "pause", {}, "bob", "from the standby")
        a.executor.notify(Alert("r", Severity.CRITICAL, "r: from the leader"))
        assert a.executor.outbox.drain(10) and "r: from the leader" in out_a.getvalue()
        _expire(db)
        assert lease_b.acquire() == 2
        with pytest.raises(Deposed):  # its next write, whatever it is
            a.executor.submit("r", "pause", {}, "alice", "after the takeover")
        with a.sessions() as s:
            assert [x.title for x in alerts_store.pending(s, "console")] == []
        # A row written before the takeover, not sent yet: the deposed sender leaves it.
        with db.sessions.begin() as s:
            a.executor.outbox.enqueue(s, Alert("r", Severity.CRITICAL, "r: written before the takeover"))
        a.executor.outbox.wake()
        time.sleep(0.5)
        assert "written before the takeover" not in out_a.getvalue()
        b.lead()
        assert b.executor.outbox.drain(10) and "written before the takeover" in out_b.getvalue()
        assert b.poll("r") == []
    finally:
        a.close()
        b.close()


def test_the_coordinator_steps_down_when_renewals_stop(db):
    """The watchdog never waits on the database: a leader whose renewals fail (here, another
    replica took the lease) is told it lost within its deadline."""
    lost: list[str] = []
    lease = Lease(db.sessions, "a:1:x", ttl_s=1.2)
    coord = Coordinator(lease, on_lead=lambda t: None, on_lost=lost.append, renew_s=0.3)
    coord.step()
    assert coord.leading and coord.lease_age_s() is not None
    coord.start()
    try:
        _expire(db)
        other = Lease(db.sessions, "b:2:y", ttl_s=1.2)
        assert other.acquire() == 2
        deadline = time.monotonic() + 5
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and not coord.leading and lease.token is None
    finally:
        coord.stop(release=False)
