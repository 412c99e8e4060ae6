"""PostgreSQL restarted during ingest (issue 13, the fault matrix): the daemon (`thermowatch serve`,
a subprocess) ingests a real diverging run from the trainer's own HttpSink while its PostgreSQL is
stopped for a few seconds and started again. The server is a private cluster of this test
(initdb into a temp dir, its own port and socket dir), so restarting it disturbs no other test.

What must survive: the daemon stays up and answers again once the database is back; the sink
spools what was refused and replays it; afterwards the database holds every step exactly once
(counted), the divergence was judged (an incident and a rollback decided), and every action has
a state."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.faults.cluster import free_port
from tests.fixtures.diverging import DETECTORS, POLICY, checkpoint_for, diverging_records
from tests.supervisor.auth_helpers import ADMIN_TOKEN
from tests.supervisor.seams.test_restart import Daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
RUN = "pgrestart"


class PrivatePostgres:
    """A PostgreSQL cluster of its own, run as the `postgres` user (initdb refuses root)."""

    def __init__(self) -> None:
        (bindir,) = sorted(glob.glob("/usr/lib/postgresql/*/bin"))[-1:]
        self.bin = Path(bindir)
        self.root = Path(tempfile.mkdtemp(prefix="twpg"))
        self.data, self.sock = self.root / "data", self.root / "sock"
        self.sock.mkdir()
        shutil.chown(self.root, "postgres")
        shutil.chown(self.sock, "postgres")
        self.port = free_port()
        self._as_postgres(self.bin / "initdb", "-D", self.data, "-A", "trust", "-U", "postgres", "--no-sync")
        self.start()
        self.url = f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _as_postgres(self, *cmd) -> None:
        line = " ".join(f"'{c}'" for c in cmd)
        done = subprocess.run(["su", "postgres", "-s", "/bin/sh", "-c", line], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"{line}: {done.stdout}\n{done.stderr}"

    def start(self) -> None:
        opts = f"-p {self.port} -k {self.sock} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_postgres(self.bin / "pg_ctl", "-D", self.data, "-o", opts, "-l", self.root / "log", "-w", "start")

    def stop(self) -> None:
        self._as_postgres(self.bin / "pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")

    def close(self) -> None:
        try:
            self.stop()
        except AssertionError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def pg():
    p = PrivatePostgres()
    try:
        yield p
    finally:
        p.close()


def test_postgres_restarted_during_ingest_loses_no_step_and_stores_none_twice(pg, tmp_path):
    from thermowatch.monitors.contract import RunInfo
    from thermowatch.supervisor import db
    from thermowatch.supervisor.store import actions as actions_store
    from thermowatch.supervisor.store import incidents as incidents_store
    from thermowatch.supervisor.store.orm import Step
    from thermowatch.transport import HttpSink

    recs = diverging_records()
    config = tmp_path / "supervisor.yaml"
    config.write_text(yaml.safe_dump({"policy": POLICY, "detectors": DETECTORS}))
    d = Daemon(pg.url, config, tmp_path / "data", tmp_path / "daemon.log")
    sink = HttpSink(d.url, tmp_path / "spool", token=ADMIN_TOKEN, timeout=5.0, retry_interval=0.2,
                    max_retry_interval=1.0)
    try:
        sink.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
        third = len(recs) // 3

        def send(lo: int, hi: int) -> None:  # as the controller does: steps, and a checkpoint every 5
            for i in range(lo, hi, 10):
                sink.write(RUN, 0, recs[i:i + 10])
                for r in recs[i:i + 10]:
                    if r.step % 5 == 0:
                        sink.checkpoint_saved(RUN, 0, checkpoint_for(r, tmp_path / "ckpt"))
                time.sleep(0.05)

        send(0, third)
        assert sink.drain(60)
        pg.stop()  # the database goes away mid-stream ...
        down_answers = set()
        send(third, 2 * third)
        assert sink.drain(60)
        refused = [ln for ln in (tmp_path / "daemon.log").read_text().splitlines() if "database unavailable" in ln]
        for _ in range(5):  # what the daemon says while its database is down: an error, not a crash
            try:
                down_answers.add(httpx.get(f"{d.url}/healthz", timeout=5).status_code)
            except httpx.HTTPError as exc:
                down_answers.add(type(exc).__name__)
        spooled_while_down = sink.spooled
        time.sleep(2)
        pg.start()  # ... and comes back
        send(2 * third, len(recs))
        deadline = time.monotonic() + 120
        while not (sink.drain(5) and sink.spooled == 0):
            assert time.monotonic() < deadline, f"the spool was never replayed ({sink.spooled} left)"
            time.sleep(0.2)
        assert d.proc.poll() is None, "the daemon died with its database"
        d.settle(120)
        health = httpx.get(f"{d.url}/healthz", timeout=10)
    finally:
        sink.close()
        d.kill()

    assert spooled_while_down > 0  # the refused batches went to the trainer's spool, not nowhere
    assert refused, "the daemon never said its database was unavailable"  # a 503, not a 500 (our bugs)
    assert down_answers == {503}, down_answers  # /healthz named the database as down; it never hung
    assert health.status_code == 200, health.text
    engine = db.make_engine(pg.url)
    try:
        with db.make_sessionmaker(engine)() as s:
            rows = s.query(Step.attempt, Step.step).filter(Step.run_id == RUN).all()
            acts = actions_store.actions(s, RUN)
            incidents = incidents_store.incidents(s, RUN)
    finally:
        engine.dispose()
    steps = sorted(st for _, st in rows)
    assert steps == sorted(r.step for r in recs), "a step was lost or stored twice"
    assert incidents and acts, "the divergence was not judged after the restart"
    assert all(a.state for a in acts) and {a.kind for a in acts} >= {"rollback"}
