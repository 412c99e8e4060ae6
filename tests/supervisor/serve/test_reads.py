"""thermowatch.supervisor.serve.api.reads: a read budget per client and a gate for all reads (issue 21,
item 4: four clients reading back to back tripled ingest's latency).

The budget against the daemon's app on a real uvicorn and both databases; the gate's queueing
(order, timeout, a client leaving while it waits) against a small ASGI app that holds each
request until the test lets it go, so concurrency is observed rather than timed."""

from __future__ import annotations

import asyncio
import io

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.serve.api.reads import Buckets, ReadGate, is_read
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.app.service import Supervisor
from tests.live_server import running
from tests.supervisor.auth_helpers import AUTH, ADMIN_TOKEN, bearer, make_token

# A bucket of 2 reads refilled at one every 5 s: the test's reads must not outrun the refill on a
# loaded CI machine (at 60 a minute, ten reads that took over a second found the bucket refilled).
PER_MINUTE = 12


@pytest.fixture
def daemon(db, tmp_path):
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN,
                           limits={"max_reads_per_client_per_minute": PER_MINUTE, "max_reads_in_flight": 1})
    sup = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    sup.open_run(RunInfo("r", 0, world_size=1), "trainer")  # as the trainer's token would
    with running(build_app(sup)) as url:
        yield sup, url
    sup.close()


def test_a_client_past_its_read_budget_gets_429_and_nothing_else_is_held_up(db, daemon):
    sup, url = daemon
    other = make_token(sup.sessions, "dashboard", "read")
    trainer = make_token(sup.sessions, "trainer", "ingest")
    with httpx.Client(base_url=url, headers=AUTH, timeout=30) as c:
        assert [c.get("/api/runs").status_code for _ in range(PER_MINUTE // 6)] == [200] * (PER_MINUTE // 6)
        r = c.get("/api/runs/r/status")
        assert r.status_code == 429, r.text
        assert "limits.max_reads_per_client_per_minute" in r.json()["detail"] and "12 a minute" in r.json()["detail"]
        assert 1 <= int(r.headers["Retry-After"]) <= 60 // PER_MINUTE
        # what is not a read is not held up by the budget: ingest, the probes, the trainer's poll
        ingest = c.post("/api/runs/r/attempts/0/steps", json={"records": [{"step": 1, "loss": 2.5}]},
                        headers=bearer(trainer))
        assert ingest.status_code == 200, ingest.text
        assert c.get("/healthz").status_code == 200
        assert c.get("/api/runs/r/commands", params={"attempt": 0}, headers=bearer(trainer)).status_code == 200
        assert c.get("/api/runs").status_code == 429  # still this client's budget
        # another credential has a budget of its own
        assert c.get("/api/runs/r/status", headers=bearer(other)).status_code == 200
        # the bucket refills at PER_MINUTE / 60 a second
        import time

        time.sleep(60 / PER_MINUTE + 0.1)
        r = c.get("/api/runs/r/status")
        assert r.status_code == 200 and r.json()["last_step"] == 1, r.text  # the batch sent meanwhile is stored


def test_is_read_counts_pages_and_lists_not_ingest_polls_probes_or_static():
    assert is_read("GET", "/api/runs") and is_read("GET", "/") and is_read("HEAD", "/runs/x")
    assert is_read("GET", "/metrics") and is_read("GET", "/api/runs/x/steps")
    assert not is_read("POST", "/api/runs/x/attempts/0/steps") and not is_read("POST", "/api/runs/x/actions")
    assert not is_read("GET", "/api/runs/x/commands")  # the trainer must always hear "stop"
    assert is_read("GET", "/api/runs/x/commands/more")  # only the poll itself
    assert is_read("GET", "/api/runs/commands")  # ... nor is the run "commands" itself
    for path in ("/healthz", "/readyz", "/static/app.js", "/login"):
        assert not is_read("GET", path)


@settings(max_examples=60, deadline=None)
@given(per_minute=st.integers(6, 6000), gaps=st.lists(st.floats(0, 5, allow_nan=False), min_size=1, max_size=200))
def test_a_bucket_never_lets_more_through_than_its_burst_plus_its_rate(per_minute, gaps):
    b = Buckets(per_minute, burst=max(1, per_minute // 6))
    now, allowed = 0.0, []
    for g in gaps:
        now += g
        wait = b.take("k", now)
        if wait == 0:
            allowed.append(now)
        else:  # the wait it names is exact: asking again then succeeds
            assert Buckets.take(_clone(b), "k", now + wait + 1e-9) == 0
    for i, t0 in enumerate(allowed):  # any window [t0, t1] holds at most burst + rate * (t1 - t0)
        for j in range(i, len(allowed)):
            assert j - i + 1 <= b.burst + b.rate * (allowed[j] - t0) + 1e-6


def _clone(b: Buckets) -> Buckets:
    c = Buckets(1, 1)
    c.rate, c.burst, c.max_clients, c._tokens = b.rate, b.burst, b.max_clients, type(b._tokens)(b._tokens)
    return c


def test_a_forgotten_client_starts_full_and_memory_is_bounded():
    b = Buckets(60, 10, max_clients=100)
    for i in range(1000):
        b.take(f"c{i}", 0.0)
    assert len(b._tokens) == 100


# --- the gate: concurrency, order, timeouts, clients that leave ---------------------------------


class Held:
    """An ASGI app that holds every request until `release()`; records how many it held at once."""

    def __init__(self) -> None:
        self.now = self.peak = 0
        self.order: list[str] = []
        self.go = asyncio.Event()

    async def __call__(self, scope, receive, send) -> None:
        self.now += 1
        self.peak = max(self.peak, self.now)
        self.order.append(scope["path"])
        await self.go.wait()
        self.now -= 1
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _request(app, path: str, client: str | None = "c", method: str = "GET") -> int:
    """One request through `app` as an ASGI server hands it over; its status. `client` is the
    Authorization header the gate budgets reads by (None: no header)."""
    headers = [] if client is None else [(b"authorization", client.encode())]
    scope = {"type": "http", "method": method, "path": path, "headers": headers, "client": ("127.0.0.1", 1)}
    status = []

    async def receive():
        return {"type": "http.request", "body": b""}

    async def send(msg):
        if msg["type"] == "http.response.start":
            status.append(msg["status"])

    await app(scope, receive, send)
    return status[0]


def test_the_gate_serves_at_most_its_places_at_once_in_arrival_order():
    async def go():
        inner = Held()
        gate = ReadGate(inner, per_client_per_minute=6000, in_flight=2)
        tasks = [asyncio.create_task(_request(gate, f"/r{i}", f"c{i}")) for i in range(6)]
        await asyncio.sleep(0.05)
        assert inner.now == 2 and inner.order == ["/r0", "/r1"]
        inner.go.set()
        assert await asyncio.gather(*tasks) == [200] * 6
        assert inner.peak == 2 and inner.order == [f"/r{i}" for i in range(6)]
        assert gate._active == 0 and not gate._waiters
    asyncio.run(go())


def test_a_read_that_waits_too_long_gets_503_and_a_client_that_leaves_gives_its_place_back():
    async def go():
        inner = Held()
        gate = ReadGate(inner, per_client_per_minute=6000, in_flight=1, queue_s=0.2)
        first = asyncio.create_task(_request(gate, "/a", "c1"))
        await asyncio.sleep(0.02)
        assert await _request(gate, "/b", "c2") == 503  # waited 0.2 s behind /a
        assert gate.busy == 1
        leaver = asyncio.create_task(_request(gate, "/c", "c3"))
        waiter = asyncio.create_task(_request(gate, "/d", "c4"))
        await asyncio.sleep(0.02)
        leaver.cancel()  # the client hung up while queued
        inner.go.set()
        assert await first == 200 and await waiter == 200
        with pytest.raises(asyncio.CancelledError):
            await leaver
        assert inner.order == ["/a", "/d"] and gate._active == 0
        # no place leaked: the next reads go straight through
        assert await asyncio.gather(_request(gate, "/e", "c5"), _request(gate, "/f", "c6")) == [200, 200]
        assert gate._active == 0
    asyncio.run(go())


class HeldByPath(Held):
    """Like Held, but each path waits on its own event (a POST and a read let go apart)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: dict[str, asyncio.Event] = {}

    async def __call__(self, scope, receive, send) -> None:
        self.order.append(scope["path"])
        await self.events.setdefault(scope["path"], asyncio.Event()).wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


async def _post(app, path: str) -> int:
    return await _request(app, path, client=None, method="POST")


def test_a_read_lets_the_writes_in_flight_finish_first_but_waits_no_longer_than_yield_s():
    async def go():
        inner = HeldByPath()
        gate = ReadGate(inner, per_client_per_minute=6000, in_flight=2)
        gate.yield_s = 0.5
        batch = asyncio.create_task(_post(gate, "/api/runs/r/attempts/0/steps"))
        await asyncio.sleep(0.01)
        read = asyncio.create_task(_request(gate, "/api/runs"))
        await asyncio.sleep(0.1)
        assert inner.order == ["/api/runs/r/attempts/0/steps"]  # the read waits for the batch
        inner.events["/api/runs/r/attempts/0/steps"].set()
        assert await batch == 200
        await asyncio.sleep(0.01)
        assert inner.order[-1] == "/api/runs"  # ... and starts as soon as it is stored
        inner.events["/api/runs"].set()
        assert await read == 200
        # a write that never ends delays a read by yield_s, no more
        gate.yield_s = 0.05
        stuck = asyncio.create_task(_post(gate, "/api/runs/r/acks"))
        await asyncio.sleep(0.01)
        inner.events["/api/runs/x/status"] = asyncio.Event()
        inner.events["/api/runs/x/status"].set()
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await _request(gate, "/api/runs/x/status") == 200
        assert 0.04 <= loop.time() - t0 < 0.5
        inner.events["/api/runs/r/acks"].set()
        assert await stuck == 200 and gate._writes == 0 and gate._active == 0
    asyncio.run(go())
