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
    app = build_app(sup)
    sup.body_in_flight = app.state.body_in_flight  # the daemon's one budget, for the tests to read
    with running(app) as url:
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
    """Two authorised 1.5 MB batches, each held after 1.4 MB has arrived, fill most of the 3 MB
    budget; a third, sent while they are still being read, passes it and gets 503 + Retry-After;
    once they finish the same body is accepted. The budget counts bytes received (issue 33)."""
    sup, url = daemon
    gate = threading.Event()
    hdr = {**AUTH, "content-type": "application/json", "content-length": str(int(1.5 * MB))}
    held = [Feed(int(1.5 * MB), pause_after=int(1.4 * MB), gate=gate) for _ in range(2)]
    answers: list = []
    threads = [threading.Thread(target=lambda f=f: answers.append(_post(f"{url}/api/runs/r/attempts/0/steps", f, hdr)))
               for f in held]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while sup.body_in_flight.held < int(2.8 * MB):  # both requests inside their routes, 1.4 MB each read
        assert time.monotonic() < deadline, sup.body_in_flight.held
        time.sleep(0.01)
    third = httpx.post(f"{url}/api/runs/r/attempts/0/steps", content=b"a" * int(1.5 * MB), headers=hdr, timeout=60)
    assert third.status_code == 503 and third.headers["retry-after"], third.text
    assert "max_body_bytes_in_flight" in third.json()["detail"]
    gate.set()
    for t in threads:
        t.join(60)
    assert [a.status_code for a in answers] == [400, 400]  # read whole, then refused as not JSON
    deadline = time.monotonic() + 10  # given back once each answer has left (the client may see it first)
    while sup.body_in_flight.held:
        assert time.monotonic() < deadline, sup.body_in_flight.held
        time.sleep(0.01)
    again = httpx.post(f"{url}/api/runs/r/attempts/0/steps", json={"records": [{"step": 1, "loss": 1.0}]},
                       headers=AUTH)
    assert again.status_code == 200


def test_a_declared_length_reserves_nothing_of_the_budget(daemon):
    """Headers declaring a body within the route's limit, and no body bytes: the budget holds only
    what has arrived (here 64 KB), so promises cannot crowd real batches out."""
    sup, url = daemon
    gate = threading.Event()
    hdr = {**AUTH, "content-type": "application/json", "content-length": str(2 * MB)}
    feeds = [Feed(2 * MB, pause_after=64 << 10, gate=gate) for _ in range(4)]  # 8 MB promised, 3 MB budget
    threads = [threading.Thread(target=lambda f=f: _post(f"{url}/api/runs/r/attempts/0/steps", f, hdr)) for f in feeds]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while sup.body_in_flight.held < 4 * (64 << 10):
            assert time.monotonic() < deadline, sup.body_in_flight.held
            time.sleep(0.01)
        assert sup.body_in_flight.held < MB
        ok = httpx.post(f"{url}/api/runs/r/attempts/0/steps", json={"records": [{"step": 2, "loss": 1.0}]},
                        headers=AUTH)
        assert ok.status_code == 200, ok.text
    finally:
        gate.set()
        for t in threads:
            t.join(60)


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


# POST routes that never read a body (sign-out clears a cookie; revoke names its token in the path):
# a declared length means nothing to them. Every other POST route reads one and must answer 413.
READ_NO_BODY = {"/logout", "/api/tokens/someone/revoke"}


def _post_routes(app) -> list[str]:
    """Every POST route of the daemon's app, its path parameters filled in."""
    from fastapi.routing import iter_route_contexts

    fill = {"{run_id}": "r", "{attempt}": "0", "{action_id}": "1", "{name}": "someone", "{silence_id}": "1"}
    out = []
    for ctx in iter_route_contexts(app.routes):
        if "POST" in (ctx.methods or ()):
            path = ctx.path
            for k, v in fill.items():
                path = path.replace(k, v)
            assert "{" not in path, f"fill in the parameter of {ctx.path}"
            out.append(path)
    return sorted(out)


def _headers_only(url: str, path: str, declared: int, token: str | None) -> int | str:
    """A request whose headers declare `declared` bytes and which sends none: the daemon's answer
    (its status), read from a raw socket."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(url)
    head = [f"POST {path} HTTP/1.1", f"Host: {u.netloc}", f"Content-Length: {declared}",
            "Content-Type: application/json", f"Origin: {url}", "Sec-Fetch-Site: same-origin"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    with socket.create_connection((u.hostname, u.port), timeout=15) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
        try:
            status = sock.recv(64).split(b" ", 2)[1]
        except (socket.timeout, IndexError):
            return "no answer"
    return int(status)


def _peak_rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM in /proc/self/status")


def test_a_declared_length_allocates_nothing_on_any_route_that_reads_a_body(db, tmp_path):
    """Issue 33: headers declaring 10 GB and no body bytes, 20 at once to every POST route, signed in
    as admin (past every token check) and without a token. Each is answered at once (413 where the
    route reads its body, 401 before it with no token), and the process's peak memory grows by less
    than 50 MB; before, read_body sized a buffer from the header (2 GB declared took 1.9 GB)."""
    import concurrent.futures as cf
    from pathlib import Path

    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN,
                           slack={"signing_secret_env": "", "signing_secret_file": str(tmp_path / "secret")})
    (tmp_path / "secret").write_text("s" * 32)
    sup = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    sup.open_run(RunInfo("r", 0, world_size=1))
    app = build_app(sup)
    routes = _post_routes(app)
    assert len(routes) >= 12 and "/login" in routes and "/api/runs/r/attempts/0/steps" in routes
    try:
        with running(app) as url:
            Path("/proc/self/clear_refs").write_text("5")  # VmHWM from now on
            before = _peak_rss_mb()
            with cf.ThreadPoolExecutor(20) as pool:
                for token in (ADMIN_TOKEN, None):
                    answers = {path: list(pool.map(lambda _, p=path: _headers_only(url, p, 10 * 1024**3, token),
                                                   range(20)))
                               for path in routes}
                    for path, got in answers.items():
                        assert len(set(got)) == 1, (path, got)
                        status = got[0]
                        assert status != "no answer" and status < 500, (path, token is not None, status)
                        if token is not None and path not in READ_NO_BODY:
                            assert status == 413, (path, status)
            grew = _peak_rss_mb() - before
            assert grew < 50, f"peak memory grew by {grew:.0f} MB for {len(routes) * 40} headers-only requests"
            assert httpx.get(url + "/healthz").status_code == 200
    finally:
        sup.close()
