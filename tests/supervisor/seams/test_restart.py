"""A supervisor restart resumes from the DB (DESIGN.md): the real daemon (`thermowatch serve`) in
a subprocess ingests a real diverging run over HTTP until it queues a rollback, is SIGKILLed
before anyone polls, and a new daemon on the same database delivers the pending command, still
has the incident open, and judges the next records with the detector state it had before."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.live_server import wait_healthy
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import incidents as incidents_store
from tests.fixtures.diverging import (
    DETECTORS,
    POLICY,
    checkpoint_for,
    diverging_records,
)
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH

RUN = "restart"
THERMOWATCH = str(Path(sys.executable).with_name("thermowatch"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Daemon:
    def __init__(self, db_url: str, config: Path, data_dir: Path, log: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._fh = log.open("ab")
        self.proc = subprocess.Popen(
            [THERMOWATCH, "serve", "--config", str(config), "--db", db_url, "--data-dir", str(data_dir),
             "--port", str(self.port)],
            stdout=self._fh, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1",
                                                                   "THERMOWATCH_API_TOKEN": ADMIN_TOKEN})
        wait_healthy(self.url, self.proc, log, timeout_s=45)
        self.http = httpx.Client(base_url=self.url, timeout=30, headers=AUTH)

    def post(self, path: str, body) -> httpx.Response:
        r = self.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
        assert r.status_code in (200, 201), (path, r.status_code, r.text)
        return r

    def settle(self, timeout: float = 60.0) -> None:
        """Wait until the daemon has judged what it acknowledged (it answers, then judges)."""
        deadline = time.monotonic() + timeout
        while self.get("/healthz")["judge_backlog"]:
            assert time.monotonic() < deadline, "the daemon's judge did not catch up"
            time.sleep(0.05)

    def get(self, path: str):
        r = self.http.get(path)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        self.http.close()
        self._fh.close()


def _send_batch(d: Daemon, recs, ckpt_root: Path) -> None:
    d.post(f"/api/runs/{RUN}/attempts/0/steps", {"records": [r.to_json() for r in recs]})
    for r in recs:
        if r.step % 5 == 0:
            c = checkpoint_for(r, ckpt_root)
            d.post(f"/api/runs/{RUN}/attempts/0/checkpoints",
                   {"step": c.step, "path": c.path, "sample_cursor": c.sample_cursor, "healthy": c.healthy,
                    "manifest": c.manifest})


def test_restart_resumes_pending_action_incident_and_detector_state(db, tmp_path):
    recs = diverging_records()
    config = tmp_path / "supervisor.yaml"
    config.write_text(yaml.safe_dump({"policy": POLICY, "detectors": DETECTORS}))
    data_dir, log, ckpt_root = tmp_path / "data", tmp_path / "daemon.log", tmp_path / "ckpt"
    batches = [recs[i:i + 10] for i in range(0, len(recs), 10)]

    d = Daemon(db.url, config, data_dir, log)
    try:
        d.post("/api/runs", {"run_id": RUN, "attempt": 0, "world_size": 1})
        sent = 0
        for batch in batches:
            _send_batch(d, batch, ckpt_root)
            sent += 1
            d.settle()
            acts = d.get(f"/api/runs/{RUN}/actions")["actions"]
            if acts:
                break
        assert sent < len(batches), "the daemon never acted on the divergence"
        (act,) = acts
        assert act["kind"] == "rollback" and act["state"] == "pending"
    finally:
        d.kill()  # SIGKILL: no shutdown hook runs, nobody polled
    assert d.proc.returncode == -signal.SIGKILL

    with db.sessions() as s:
        before_findings = [(f.finding.signal.value, f.finding.module, f.finding.detect_step)
                           for f in findings_store.findings(s, RUN)]
    assert before_findings

    d2 = Daemon(db.url, config, data_dir, log)
    try:
        incs = d2.get(f"/api/runs/{RUN}/incidents")["incidents"]
        # Alert-only incidents (an attention ceiling crossed before a witness of harm) close at once.
        assert [(i["id"], i["state"]) for i in incs if i["state"] == "open"] == [(act["incident_id"], "open")]
        cmds = d2.get(f"/api/runs/{RUN}/commands")["commands"]
        assert cmds == [{"id": act["id"], "kind": "rollback", "args": act["args"]}]
        assert d2.get(f"/api/runs/{RUN}/commands")["commands"] == []
        # The run kept training while the daemon was down: its next steps arrive. The attention
        # logits are still past the ceiling; a restored detector knows it already reported that
        # excursion, a fresh one would report it again as soon as it saw it.
        _send_batch(d2, batches[sent], ckpt_root)
        d2.settle()
        with db.sessions() as s:
            after_findings = [(f.finding.signal.value, f.finding.module, f.finding.detect_step)
                              for f in findings_store.findings(s, RUN)]
            open_incs = incidents_store.open_incidents(s, RUN)
        # Nothing about the series already reported; another layer may cross its ceiling now.
        new = after_findings[len(before_findings):]
        assert after_findings[:len(before_findings)] == before_findings
        assert not {f[:2] for f in new} & {f[:2] for f in before_findings}, \
            "a duplicate finding for the same event after the restart"
        assert [i.id for i in open_incs] == [act["incident_id"]]
        d2.post(f"/api/runs/{RUN}/acks", {"command_id": act["id"], "ok": True, "step": act["args"]["to_step"] + 1})
        (done,) = d2.get(f"/api/runs/{RUN}/actions")["actions"]
        assert done["state"] == "done"
    finally:
        d2.kill()
    text = log.read_text()
    assert "Traceback" not in text, text[-3000:]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    # httpx honours HTTP(S)_PROXY; the daemon is on loopback.
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
