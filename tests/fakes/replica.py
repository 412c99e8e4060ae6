"""A second daemon replica in front of a real one (issue 40), for the clients' failover tests:
two `thermowatch serve` processes on one PostgreSQL schema are heavy, and what a client meets at
a standby's address is its answers, which this gives.

`Replica(upstream, mode)`, a ServedFake with `.url`:
- "standby": what a standby answers: reads and ingest (registration, steps, checkpoint deletions)
  reach the real daemon, as a standby stores them in the shared database; what only the leader
  does (command polls, acks, checkpoint reports, a finish, manual commands) gets 503 with
  Retry-After and the standby's `detail`, as supervisor.app.service._leader_only answers;
- "unavailable": 503 with Retry-After to everything (a takeover under way, a replica starting);
- "leader": everything reaches the real daemon.
`mode` may change while it serves. Every request is recorded as (method, path, status), and the
client's port in `ports` (one per connection: a kept-alive connection repeats it).
"""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler

import httpx

from tests.fakes.served import ServedFake

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}
# What a standby stores itself (POST); every other POST is the leader's.
_STANDBY_POSTS = re.compile(r"^/api/runs(/[^/]+/attempts/\d+/(steps|checkpoints/deleted))?$")
_COMMAND_POLL = re.compile(r"^/api/runs/[^/]+/commands$")
STANDBY_DETAIL = "this replica is a standby: {what} is the leader's; send it there, or retry"


class Replica(ServedFake):
    thread_name = "fake-replica"

    def __init__(self, upstream: str, mode: str = "standby", retry_after_s: int = 1) -> None:
        assert mode in ("standby", "unavailable", "leader")
        self.upstream, self.mode, self.retry_after_s = upstream.rstrip("/"), mode, retry_after_s
        self._http = httpx.Client(base_url=self.upstream, timeout=60)
        self._lock = threading.Lock()
        self.requests: list[tuple[str, str, int]] = []
        self.ports: list[int] = []

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def refused(self, method: str | None = None) -> list[str]:
        """Paths answered 503 (of `method`)."""
        return [p for m, p, s in self.requests if s == 503 and method in (None, m)]

    def forwarded(self, method: str | None = None) -> list[str]:
        return [p for m, p, s in self.requests if s != 503 and method in (None, m)]

    def _stands_by(self, method: str, path: str) -> bool:
        if self.mode == "leader":
            return False
        if self.mode == "unavailable":
            return True
        if method == "GET":
            return bool(_COMMAND_POLL.match(path))
        return not _STANDBY_POSTS.match(path)

    def stop(self) -> None:
        super().stop()
        self._http.close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:  # quiet
                pass

            def _answer(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                path = self.path.split("?", 1)[0]
                if fake._stands_by(self.command, path):
                    status, headers = 503, {"retry-after": str(fake.retry_after_s), "content-type": "application/json"}
                    content = httpx.Response(503, json={"detail": STANDBY_DETAIL.format(what=path)}).content
                else:
                    fwd = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    r = fake._http.request(self.command, self.path, content=body, headers=fwd)
                    status, content = r.status_code, r.content
                    headers = {k: v for k, v in r.headers.items() if k.lower() not in _HOP}
                with fake._lock:
                    fake.requests.append((self.command, path, status))
                    fake.ports.append(self.client_address[1])
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("content-length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = _answer

        return Handler
