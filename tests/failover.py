"""Two `thermowatch serve` replicas on one PostgreSQL schema, for the failover test and
bench/failover.py (issue 40): start, SIGKILL, restart, ask who leads, and cut one replica's
database connection (a TCP relay in front of PostgreSQL that can black-hole its traffic: packets
go nowhere, nothing is refused, as when a network between two machines is cut).

Each replica has its own THERMOWATCH_REPLICA_NAME, so the two behave as on two machines: a
standby takes over only once the leader's lease has run out (never at once because the
leader's process is gone from "this host").
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx

from tests.live_server import free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "tw_failover-admin-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Relay:
    """127.0.0.1:<port> -> the database. `cut()` black-holes every connection, open and new (the
    bytes are read and dropped); `mend()` lets new connections through again."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.cut_ = False
        self._sock = socket.create_server(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            threading.Thread(target=self._pipe, args=(client,), daemon=True).start()

    def _pipe(self, client: socket.socket) -> None:
        try:
            up = socket.create_connection(self.upstream, timeout=5)
        except OSError:
            client.close()
            return
        socks = [client, up]
        try:
            while not self._stop:
                ready, _, _ = select.select(socks, [], [], 0.2)
                for s in ready:
                    data = s.recv(65536)
                    if not data:
                        return
                    if not self.cut_:
                        (up if s is client else client).sendall(data)
        except OSError:
            return
        finally:
            for s in socks:
                s.close()

    def cut(self) -> None:
        self.cut_ = True

    def close(self) -> None:
        self._stop = True
        self._sock.close()


def via(db_url: str, port: int) -> str:
    """`db_url` reaching the database through 127.0.0.1:port."""
    parts = urlsplit(db_url)
    user = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return urlunsplit(parts._replace(netloc=f"{user}127.0.0.1:{port}"))


@dataclass
class Replica:
    name: str
    db_url: str
    root: Path
    ttl_s: float
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None
    relay: Relay | None = None
    starts: int = 0
    extra_yaml: str = ""  # more of the supervisor config (policy, detectors)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *, cut_able: bool = False) -> "Replica":
        self.starts += 1
        data = self.root / self.name
        data.mkdir(parents=True, exist_ok=True)
        cfg = data / "sup.yaml"
        cfg.write_text(f"lease_ttl_s: {self.ttl_s}\njudge_process: false\n"
                       "limits:\n  max_reads_per_client_per_minute: 100000000\n" + self.extra_yaml)
        db_url = self.db_url
        if cut_able:
            parts = urlsplit(self.db_url)
            self.relay = Relay((parts.hostname or "127.0.0.1", parts.port or 5432))
            db_url = via(self.db_url, self.relay.port)
        env = dict(os.environ, THERMOWATCH_API_TOKEN=TOKEN, THERMOWATCH_REPLICA_NAME=self.name,
                   PYTHONPATH=str(ROOT))
        log = open(data / f"serve-{self.starts}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "thermowatch.cli", "serve", "--data-dir", str(data),
                                      "--db", db_url, "--port", str(self.port), "--config", str(cfg)],
                                     env=env, stdout=log, stderr=subprocess.STDOUT)
        wait_healthy(self.url, self.proc, data / f"serve-{self.starts}.log")
        return self

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        if self.relay is not None:
            self.relay.close()
            self.relay = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.relay is not None:
            self.relay.close()
            self.relay = None

    def role(self) -> str | None:
        try:
            return httpx.get(self.url + "/readyz", timeout=2).json().get("role")
        except (httpx.HTTPError, ValueError):
            return None

    def log_text(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted((self.root / self.name).glob("serve-*.log")))


def leader(replicas: list[Replica], timeout_s: float, exclude: Replica | None = None) -> tuple[Replica, float]:
    """The replica that leads, and how long it took to find one (a takeover's time)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        for r in replicas:
            if r is not exclude and r.proc is not None and r.proc.poll() is None and r.role() == "leader":
                return r, time.monotonic() - t0
        time.sleep(0.05)
    raise AssertionError(f"no replica led within {timeout_s} s: " + "; ".join(
        f"{r.name}: {r.role()} (exit {r.proc.poll() if r.proc else None})" for r in replicas))


class Client:
    """A trainer's calls over HTTP to whichever replica answers (a connection refused or a 503
    moves on to the next one), retried until `timeout_s`: what the client's failover does."""

    def __init__(self, replicas: list[Replica], timeout_s: float = 30.0) -> None:
        self.replicas, self.timeout_s = replicas, timeout_s
        self.http = httpx.Client(headers=AUTH, timeout=10)
        self.failovers = 0

    def call(self, method: str, path: str, **kw) -> httpx.Response:
        deadline = time.monotonic() + self.timeout_s
        last = ""
        while time.monotonic() < deadline:
            for r in self.replicas:
                try:
                    resp = self.http.request(method, r.url + path, **kw)
                except httpx.HTTPError as exc:
                    last = f"{r.name}: {exc}"
                    self.failovers += 1
                    continue
                if resp.status_code == 503:
                    last = f"{r.name}: 503 {resp.text[:200]}"
                    self.failovers += 1
                    continue
                return resp
            time.sleep(0.1)
        raise AssertionError(f"{method} {path}: no replica answered within {self.timeout_s} s ({last})")

    def close(self) -> None:
        self.http.close()
