"""thermowatch.supervisor.serve.body: every route bounds the body it reads before it reads it (issue 21).

Against the daemon's app served by a real uvicorn on a real port, on both databases: the client
streams its body from a generator that counts what the server pulled, so "refused before it was
read" is measured, not assumed. Before issue 21, POST /login and Slack's callback read a whole
400 MB body before checking its size.
"""

from __future__ import annotations

import io
import threading
import time

import httpx
import pytest

from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.serve.body import InFlight
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import thermometers
from tests.live_server import running
from tests.supervisor.auth_helpers import AUTH, ADMIN_TOKEN

MB = 1 << 20


@pytest.fixture
def daemon(db, tmp_path):
    secret = tmp_path / "signing-secret"
    secret.write_text("s" * 32)
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN, max_body_bytes=2 * MB,
                           slack={"signing_secret_env": "", "signing_secret_file": str(secret)},
                           limits={"max_body_bytes_in_flight": 3 * MB})
    sup = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    sup.open_run(RunInfo("r", 0, world_size=1))
    with running(build_app(sup)) as url:
        yield sup, url
    sup.close()


class Feed:
    """A request body streamed in 64 KB pieces; `sent` is how much the server pulled."""

    def __init__(self, total: int, pause_after: int | None = None, gate: threading.Event | None = None) -> None:
        self.total, self.sent = total, 0
        self.pause_after, self.gate = pause_after, gate

    def __iter__(self):
        piece = b"a" * (64 << 10)
        while self.sent < self.total:
            if self.pause_after is not None and self.sent >= self.pause_after:
                self.gate.wait(30)
                self.pause_after = None
            n = min(len(piece), self.total - self.sent)
            self.sent += n
            yield piece[:n]


def _post(url: str, feed: Feed, headers: dict | None = None) -> httpx.Response | Exception:
    try:
        return httpx.post(url, content=feed, headers=headers or {}, timeout=60)
    except httpx.HTTPError as exc:  # the server may close the connection once it has answered
        return exc


@pytest.mark.parametrize("path", ["/login", "/api/slack/interactions"])
def test_unauthenticated_routes_refuse_a_big_body_after_reading_at_most_their_budget(daemon, path):
    _, url = daemon
    same_site = {"origin": url, "content-type": "application/x-www-form-urlencoded"}
    # Declared up front: refused when the route starts reading, before a byte of the body.
    r = httpx.post(url + path, content=b"a" * (2 * MB), headers=same_site, timeout=60)
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"], r.text
    assert r.headers["connection"] == "close"
    # Chunked (no length): counted as it streams, refused past the budget (4 KB / 64 KB).
    feed = Feed(200 * MB)
    r = _post(url + path, feed, same_site)
    assert isinstance(r, Exception) or r.status_code == 413
    assert feed.sent < 4 * MB, f"the server pulled {feed.sent} bytes of a body it refuses past 64 KB"
    assert httpx.get(url + "/healthz").status_code == 200


def test_a_batch_over_max_body_bytes_is_413_naming_the_setting_and_stores_nothing(daemon):
    sup, url = daemon
    r = httpx.post(f"{url}/api/runs/r/attempts/0/steps", content=b"x" * (3 * MB),
                   headers={**AUTH, "content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["detail"]
    assert "/api/runs/{run_id}/attempts/{attempt}/steps" in r.json()["detail"]
    ok = httpx.post(f"{url}/api/runs/r/attempts/0/steps", json={"records": [{"step": 0, "loss": 1.5}]}, headers=AUTH)
    assert ok.status_code == 200
    with sup.sessions() as s:
        assert thermometers.history(s, "r", "loss")[0].tolist() == [0]


def test_without_a_token_the_body_of_a_protected_route_is_never_read(daemon):
    _, url = daemon
    feed = Feed(100 * MB)
    r = _post(f"{url}/api/runs/r/attempts/0/steps", feed, {"content-type": "application/json"})
    assert isinstance(r, Exception) or r.status_code == 401
    assert feed.sent < 4 * MB


def test_bodies_in_flight_share_one_budget_and_the_overflow_is_503_with_retry_after(daemon):
    """Two authorised 1.5 MB batches fit the 3 MB budget one at a time; the third, sent while two
    are still being read, gets 503 + Retry-After; once they finish the same body is accepted."""
    _, url = daemon
    gate = threading.Event()
    hdr = {**AUTH, "content-type": "application/json", "content-length": str(int(1.5 * MB))}
    held = [Feed(int(1.5 * MB), pause_after=64 << 10, gate=gate) for _ in range(2)]
    answers: list = []
    threads = [threading.Thread(target=lambda f=f: answers.append(_post(f"{url}/api/runs/r/attempts/0/steps", f, hdr)))
               for f in held]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while not all(f.sent > 0 for f in held):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)  # both requests are inside their routes, reading
    third = httpx.post(f"{url}/api/runs/r/attempts/0/steps", content=b"a" * int(1.5 * MB), headers=hdr, timeout=60)
    assert third.status_code == 503 and third.headers["retry-after"], third.text
    assert "max_body_bytes_in_flight" in third.json()["detail"]
    gate.set()
    for t in threads:
        t.join(60)
    assert [a.status_code for a in answers] == [400, 400]  # read whole, then refused as not JSON
    again = httpx.post(f"{url}/api/runs/r/attempts/0/steps", json={"records": [{"step": 1, "loss": 1.0}]},
                       headers=AUTH)
    assert again.status_code == 200


def test_in_flight_lets_one_body_through_whatever_its_size():
    budget = InFlight(100)
    assert budget.take(500)  # one body alone: its route's own limit bounds it
    assert not budget.take(1) and budget.refused == 1
    budget.give(500)
    assert budget.take(60) and budget.take(40) and not budget.take(1)
    assert budget.peak == 500 and budget.held == 100


@pytest.mark.parametrize("query", ["a=%1C0", "a=%1F12", "limit=%1E5"])
def test_a_control_byte_before_digits_in_a_query_is_not_a_500(daemon, query):
    _, url = daemon
    for headers in ({"Cookie": "x=y"}, AUTH):
        r = httpx.get(f"{url}/api/runs/r/actions?{query}", headers=headers)
        assert r.status_code < 500, r.text
        assert httpx.get(f"{url}/healthz?{query}", headers=headers).status_code == 200
