"""Local stand-ins for two receivers outside the machine (STYLE.md 12): PagerDuty's Events API v2
and a generic signed-webhook receiver. Real HTTP on 127.0.0.1; every request is recorded.

FakePagerDuty speaks the Events API v2 wire format
(developer.pagerduty.com/docs/events-api-v2/overview): `POST /v2/enqueue`, JSON with
`routing_key`, `event_action` (trigger, acknowledge, resolve), `dedup_key` (at most 255
characters), and for a trigger `payload.summary`, `payload.source` and `payload.severity`
(critical, error, warning, info). A valid event is answered 202 `{"status": "success",
"message": "Event processed", "dedup_key": ...}`, an invalid one 400 `{"status": "invalid
event", "message": "Event object is invalid", "errors": [...]}`, a routing key it does not know
400 too (as PagerDuty does). It keeps PagerDuty's incident rule: a trigger whose dedup key has an
open (triggered or acknowledged) incident joins it; otherwise it opens one; acknowledge and
resolve change an open incident and are accepted without effect otherwise.

FakeWebhook records each POST's raw body and headers and checks the signature the way a
receiver would, with the standard library only (not thermowatch's own `verify`): HMAC-SHA256
over "<timestamp>." + body under its secret, the timestamp within 300 s; a bad one is a 401.

Failure switches on both: `fail_next(status, calls)` answers the next calls with that status.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from tests.fakes.served import ServedFake

ROUTING_KEY = "R0UTINGKEY0123456789ABCDEFGHIJKL"  # 32 characters, as PagerDuty's integration keys
_SEVERITIES = {"critical", "error", "warning", "info"}


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    raw: bytes
    status: int  # what the fake answered

    @property
    def body(self) -> Any:
        try:
            return json.loads(self.raw)
        except ValueError:
            return None


@dataclass
class Incident:
    dedup_key: str
    state: str  # triggered, acknowledged, resolved
    events: list[dict[str, Any]] = field(default_factory=list)


class _Server(ServedFake):
    path = "/"

    def __init__(self) -> None:
        self.requests: list[Received] = []
        self._lock = threading.Lock()
        self._failures: list[int] = []

    def fail_next(self, status: int, calls: int = 1) -> None:
        with self._lock:
            self._failures += [status] * calls

    @property
    def url(self) -> str:
        assert self._server is not None, "not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with fake._lock:
                    forced = fake._failures.pop(0) if fake._failures else None
                    if forced is not None:
                        status, answer = forced, {"status": "error", "message": f"forced {forced}"}
                    elif self.path != fake.path:
                        status, answer = 404, {"message": "not found"}
                    else:
                        status, answer = fake._answer(dict(self.headers), raw)
                    fake.requests.append(Received(self.path, dict(self.headers), raw, status))
                out = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, fmt: str, *args: Any) -> None:
                pass

        return Handler

    def _answer(self, headers: dict[str, str], raw: bytes) -> tuple[int, dict[str, Any]]:
        raise NotImplementedError


class FakePagerDuty(_Server):
    path = "/v2/enqueue"

    def __init__(self, routing_key: str = ROUTING_KEY) -> None:
        super().__init__()
        self.routing_key = routing_key
        self.incidents: list[Incident] = []  # in the order they were opened

    def events(self, action: str | None = None) -> list[dict[str, Any]]:
        """The accepted events (202), oldest first; `action`: only those."""
        return [r.body for r in self.requests
                if r.status == 202 and (action is None or r.body["event_action"] == action)]

    def _answer(self, headers: dict[str, str], raw: bytes) -> tuple[int, dict[str, Any]]:
        try:
            ev = json.loads(raw)
        except ValueError:
            return 400, {"status": "invalid event", "message": "Event object is invalid", "errors": ["not JSON"]}
        errors = []
        if not isinstance(ev, dict):
            return 400, {"status": "invalid event", "message": "Event object is invalid", "errors": ["not an object"]}
        if ev.get("routing_key") != self.routing_key:
            errors.append("Invalid Routing Key")
        action, key = ev.get("event_action"), ev.get("dedup_key")
        if action not in ("trigger", "acknowledge", "resolve"):
            errors.append("'event_action' is invalid")
        if action in ("acknowledge", "resolve") and not key:
            errors.append("'dedup_key' is required for acknowledge and resolve")
        if key is not None and (not isinstance(key, str) or len(key) > 255):
            errors.append("'dedup_key' must be a string of at most 255 characters")
        if action == "trigger":
            p = ev.get("payload")
            if not isinstance(p, dict):
                errors.append("'payload' is missing")
            else:
                for k in ("summary", "source", "severity"):
                    if not isinstance(p.get(k), str) or not p[k]:
                        errors.append(f"'payload.{k}' is missing or blank")
                if p.get("severity") not in _SEVERITIES:
                    errors.append("'payload.severity' is invalid")
                if not isinstance(p.get("custom_details", {}), dict):
                    errors.append("'payload.custom_details' must be an object")
            for link in ev.get("links", []):
                if not isinstance(link, dict) or not isinstance(link.get("href"), str):
                    errors.append("'links' entries need an href")
        if errors:
            return 400, {"status": "invalid event", "message": "Event object is invalid", "errors": errors}
        open_ = next((i for i in self.incidents if i.dedup_key == key and i.state != "resolved"), None)
        if action == "trigger":
            if open_ is None:
                open_ = Incident(key, "triggered")
                self.incidents.append(open_)
            open_.events.append(ev)
        elif open_ is not None:
            open_.state = "acknowledged" if action == "acknowledge" else "resolved"
            open_.events.append(ev)
        return 202, {"status": "success", "message": "Event processed", "dedup_key": key}


class FakeWebhook(_Server):
    path = "/hook"
    TOLERANCE_S = 300

    def __init__(self, secret: str = "whsec-test-secret") -> None:
        super().__init__()
        self.secret = secret

    @property
    def hook_url(self) -> str:
        return self.url + self.path

    def accepted(self) -> list[dict[str, Any]]:
        return [r.body for r in self.requests if r.status == 200]

    def _answer(self, headers: dict[str, str], raw: bytes) -> tuple[int, dict[str, Any]]:
        h = {k.lower(): v for k, v in headers.items()}
        ts, sig = h.get("x-thermowatch-timestamp", ""), h.get("x-thermowatch-signature", "")
        want = "sha256=" + hmac.new(self.secret.encode(), ts.encode() + b"." + raw, hashlib.sha256).hexdigest()
        if not ts.isdigit() or abs(time.time() - int(ts)) > self.TOLERANCE_S:
            return 401, {"message": "stale or missing timestamp"}
        if not hmac.compare_digest(want, sig):
            return 401, {"message": "bad signature"}
        return 200, {"message": "ok"}
