"""One leader per database (issue 40): the replica that judges, decides, acts and notifies.

Any number of `thermowatch serve` replicas may share one PostgreSQL database. They compete for
one row of `leader_lease`: the holder leads until `expires_at` and renews it every `renew_s`;
a standby takes it once it has expired, incrementing `token`, the fencing token. Times are the
database's clock (`now()` on PostgreSQL), never a replica's, so clock skew between machines
cannot make two leaders.

A leader that cannot renew (its network to the database is cut, the database restarts) can do
nothing that counts meanwhile: every leader-only write checks the token in its own transaction (`Lease.fence`: a shared lock on the row, so a takeover
waits for the write to commit, and a write after a takeover is refused), and the alert outbox
checks it before each delivery: a deposed leader's writes and messages are refused, never doubled.
Once the database answers again, a leader that was replaced learns it at its next renewal and
steps down (the daemon exits to restart as a standby); one whose lease merely ran out, nobody
having taken it (a single daemon through a PostgreSQL restart), takes it back with a new token.

SQLite is single-replica: a second daemon on the same file finds the lease held and stops with
a message saying so. A holder on this host whose process is gone (a SIGKILL, a crash) is taken
over at once: its machine did not die, and a restarted daemon need not wait out the lease.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable

from sqlalchemy import select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from thermowatch.supervisor.errors import NotLeader
from thermowatch.supervisor.store.orm import LeaderLease

log = logging.getLogger(__name__)

NAME = "daemon"
TTL_S = 6.0  # a standby leads within this (plus its own poll) after the leader's last renewal
RENEW_S = 1.5


class Deposed(NotLeader):
    """This replica no longer leads: the write that asked was refused (another replica took the
    lease, or this one could not renew it in time)."""


@dataclass(frozen=True)
class LeaseState:
    holder: str
    token: int
    acquired_at: dt.datetime
    expires_at: dt.datetime
    now: dt.datetime  # the database's clock when this was read

    @property
    def live(self) -> bool:
        return self.expires_at > self.now


def _host() -> str:
    """This replica's machine: THERMOWATCH_REPLICA_NAME when set (two replicas on one host that
    must behave as on two machines: tests, a benchmark of takeover), else the host name."""
    return os.environ.get("THERMOWATCH_REPLICA_NAME") or socket.gethostname()


def this_holder() -> str:
    """host:pid:nonce: unique per process, and says where it runs (for /readyz and the logs)."""
    return f"{_host()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _gone_from_this_host(holder: str) -> bool:
    """A holder on this host whose process no longer exists."""
    host, _, rest = holder.partition(":")
    pid_text = rest.partition(":")[0]
    if host != _host() or not pid_text.isdigit() or int(pid_text) == os.getpid():
        return False
    try:
        os.kill(int(pid_text), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


class Lease:
    def __init__(self, sessions: sessionmaker | None = None, holder: str | None = None, *, ttl_s: float = TTL_S,
                 name: str = NAME) -> None:
        self.holder = holder or this_holder()
        self.ttl = dt.timedelta(seconds=ttl_s)
        self.name = name
        self.token: int | None = None  # ours while we lead
        if sessions is not None:
            self.use(sessions)

    def use(self, sessions: sessionmaker) -> "Lease":
        """The database, once it is open and migrated (the Supervisor does this)."""
        self.sessions = sessions
        self._postgres = sessions.kw["bind"].dialect.name == "postgresql"
        return self

    @property
    def shared(self) -> bool:
        """Whether standbys can share this database (PostgreSQL); SQLite is one daemon's."""
        return self._postgres

    def _now(self, s: Session) -> dt.datetime:
        if self._postgres:
            return s.execute(text("SELECT now()")).scalar_one()
        return dt.datetime.now(dt.timezone.utc)

    def state(self) -> LeaseState | None:
        with self.sessions() as s:
            row = s.get(LeaderLease, self.name)
            if row is None:
                return None
            return LeaseState(row.holder, row.token, row.acquired_at, row.expires_at, self._now(s))

    def acquire(self) -> int | None:
        """Lead if nobody does (no lease, an expired one, ours, or a holder gone from this host):
        our fencing token. None: another replica leads."""
        try:
            with self.sessions.begin() as s:
                now = self._now(s)
                row = s.execute(select(LeaderLease).where(LeaderLease.name == self.name).with_for_update()
                                ).scalar_one_or_none()
                if row is None:
                    s.add(LeaderLease(name=self.name, holder=self.holder, token=1, acquired_at=now,
                                      expires_at=now + self.ttl))
                    self.token = 1
                    return 1
                if row.holder == self.holder and row.token == self.token and row.expires_at > now:
                    row.expires_at = now + self.ttl
                    return self.token
                if row.expires_at > now and not _gone_from_this_host(row.holder):
                    return None
                log.warning("taking the lease from %s (token %d, %s)", row.holder, row.token,
                            "expired" if row.expires_at <= now else "its process is gone from this host")
                row.token += 1
                row.holder, row.acquired_at, row.expires_at = self.holder, now, now + self.ttl
                self.token = row.token
                return row.token
        except IntegrityError:  # another replica inserted the first row at the same moment
            return None

    def renew(self) -> bool:
        """Extend our lease; False: it is no longer ours."""
        if self.token is None:
            return False
        with self.sessions.begin() as s:
            now = self._now(s)
            res = s.execute(update(LeaderLease).where(
                LeaderLease.name == self.name, LeaderLease.holder == self.holder, LeaderLease.token == self.token,
                LeaderLease.expires_at > now).values(expires_at=now + self.ttl))
            return res.rowcount == 1

    def fence(self, s: Session) -> None:
        """In a leader-only write's transaction: raise Deposed unless we still hold the lease. A
        shared lock on PostgreSQL: a takeover (an UPDATE of the row) waits until this commits."""
        if self.token is None:
            raise Deposed("this replica is a standby; only the leader writes this")
        q = select(LeaderLease.holder, LeaderLease.token, LeaderLease.expires_at).where(LeaderLease.name == self.name)
        row = s.execute(q.with_for_update(read=True) if self._postgres else q).first()
        if row is None or row.holder != self.holder or row.token != self.token or row.expires_at <= self._now(s):
            raise Deposed(f"this replica (token {self.token}) no longer leads: the lease is "
                          f"{'gone' if row is None else f'{row.holder} token {row.token}'}")

    def holds(self) -> bool:
        """Whether we still lead, read in a transaction of its own (the outbox's check)."""
        try:
            with self.sessions() as s:
                self.fence(s)
            return True
        except Deposed:
            return False

    def release(self) -> None:
        """Stepping down (a clean stop): the lease expires now, so a standby leads at its next poll."""
        if self.token is None:
            return
        try:
            with self.sessions.begin() as s:
                now = self._now(s)
                s.execute(update(LeaderLease).where(
                    LeaderLease.name == self.name, LeaderLease.holder == self.holder,
                    LeaderLease.token == self.token).values(expires_at=now))
        finally:
            self.token = None


class Coordinator:
    """Keeps this replica's role: a standby polls for the lease every `renew_s`; the leader renews
    it as often. `on_lead(token)` once it leads; `on_lost(why)` once another replica holds the
    lease (a renewal refused). After on_lost this replica must stop acting (the daemon exits: its
    service manager restarts it as a standby). `unsure`: no renewal for `ttl_s - renew_s` (a
    watchdog thread that never waits on the database says so; /readyz shows the lease's age)."""

    def __init__(self, lease: Lease, on_lead: Callable[[int], None], on_lost: Callable[[str], None], *,
                 renew_s: float = RENEW_S) -> None:
        self.lease, self.on_lead, self.on_lost, self.renew_s = lease, on_lead, on_lost, renew_s
        self.leading = False
        self._ok_at = 0.0  # monotonic time of the last successful acquire or renewal
        self._stop = threading.Event()
        self._lost = False
        self.unsure = False  # leading, but no renewal for ttl - renew (the database away)
        self._threads: list[threading.Thread] = []

    @property
    def deadline_s(self) -> float:
        return self.lease.ttl.total_seconds() - self.renew_s

    def lease_age_s(self) -> float | None:
        """Seconds since the last successful renewal (None as a standby)."""
        return time.monotonic() - self._ok_at if self.leading else None

    def start(self) -> "Coordinator":
        for target, name in ((self._run, "thermowatch-lease"), (self._watch, "thermowatch-lease-watchdog")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def step(self) -> None:
        """One poll or renewal (the thread's body; tests call it directly)."""
        if not self.leading:
            token = self.lease.acquire()
            if token is not None:
                self._ok_at = time.monotonic()
                self.leading = True
                log.info("this replica leads (lease token %d, holder %s)", token, self.lease.holder)
                self.on_lead(token)
            return
        if self.lease.renew():
            self._ok_at = time.monotonic()
            self.unsure = False
        elif self._taken():
            self._lose("another replica holds the lease now")
        else:  # our own lease ran out (the database was away longer than the ttl), nobody took it
            self.lease.token = None
            token = self.lease.acquire()
            if token is None:
                self._lose("another replica holds the lease now")
            else:
                log.warning("the lease had run out (the database was away); taken back (token %d)", token)
                self._ok_at = time.monotonic()
                self.unsure = False

    def _taken(self) -> bool:
        st = self.lease.state()
        return st is not None and st.holder != self.lease.holder and st.live

    def _run(self) -> None:
        while not self._stop.is_set() and not self._lost:
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - the database away: the watchdog decides
                log.warning("lease %s failed: %s", "renewal" if self.leading else "poll", exc)
            self._stop.wait(self.renew_s)

    def _watch(self) -> None:
        # No renewal for ttl - renew: this replica cannot be sure it still leads. It does not exit
        # (a single daemon must ride out a PostgreSQL restart, tests/faults/test_postgres_restart.py):
        # its writes and its outbox's sends all go through the database, each checking the token,
        # so while the database is away they fail, and once it is back a replica that was
        # replaced learns so at its next renewal and steps down (_lose).
        while not self._stop.is_set() and not self._lost:
            late = self.leading and time.monotonic() - self._ok_at > self.deadline_s
            if late and not self.unsure:
                log.warning("no renewal of the lease for %.1f s (it lasts %g s): the database is unreachable; "
                            "nothing is written or sent until it is back", time.monotonic() - self._ok_at,
                            self.lease.ttl.total_seconds())
            self.unsure = late
            self._stop.wait(min(0.25, self.renew_s / 4))

    def _lose(self, why: str) -> None:
        if self._lost:
            return
        self._lost = True
        self.leading = False
        self.lease.token = None
        log.critical("this replica no longer leads: %s", why)
        self.on_lost(why)

    def stop(self, release: bool = True) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(5)
        if release and self.leading and not self._lost:
            try:
                self.lease.release()
            except Exception:  # noqa: BLE001 - the lease then simply expires
                log.exception("releasing the lease failed; it expires by itself")
        self.leading = False
