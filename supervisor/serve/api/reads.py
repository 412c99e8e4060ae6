"""Reads never crowd out ingest (issue 21, item 4): a budget per client and a gate for all.

The daemon is one process: its ingest route, its judge's responder and every page and list
share the CPU and, in Python, one interpreter lock. Unbounded, four clients reading the runs
list back to back at 10^5 runs (205 reads/s) take ingest's p50 from 7.8 to 22 ms on SQLite (10
reads/s has no effect). So reads are bounded twice, before any of them reaches a route:

- **A budget per client** (`limits.max_reads_per_client_per_minute`, a token bucket holding a
  sixth of it, i.e. 10 s of reads at once): an open dashboard, a CLI or a script reads far less;
  past it the client gets 429 with Retry-After, the seconds until its next read is allowed. A
  client is its credential (the bearer token or the sign-in cookie, hashed; never kept in
  clear), or its address when it sent none.
- **A gate for everyone** (`limits.max_reads_in_flight`): at most that many reads run at once;
  the others wait their turn (first come, first served) for up to `READ_QUEUE_S`, then get 503
  with Retry-After. However many clients or tokens read, ingest competes with at most that many
  read threads.
- **Writes first**: a read that has its place still lets the POSTs in flight (a trainer's batch,
  an ack) finish before it starts, waiting at most `YIELD_S`, so a read delays a batch only when
  the batch arrives while the read already runs; under a stream of writes with no gap, reads
  still start every `YIELD_S`.

What is not a read here: every POST (ingest, acks, actions; their own bounds are in
supervisor.serve.body and supervisor.ingest.quota), the trainer's command poll (`GET .../commands`: a
trainer must always learn that it is asked to stop), the probes (`/healthz`, `/readyz`), the
sign-in form and the static files of the page (a few small files the browser caches).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import OrderedDict, deque

from fastapi.responses import JSONResponse

# How long a read waits for the gate before it is refused (503): longer than any page takes at
# 10^5 runs (~0.3 s), shorter than a browser's or a script's patience.
READ_QUEUE_S = 10.0
# The most a read that has its place waits for the writes in flight to finish before it starts.
YIELD_S = 0.05
# Clients whose buckets are remembered; the oldest is forgotten first (it starts full again).
MAX_CLIENTS = 10_000

_EXEMPT_PREFIXES = ("/static/", "/healthz", "/readyz", "/login", "/logout")


def is_read(method: str, path: str) -> bool:
    """Whether a request counts against the read budget and the gate (see the module docstring)."""
    if method not in ("GET", "HEAD") or path.startswith(_EXEMPT_PREFIXES):
        return False
    segs = path.split("/")
    # /api/runs/{run_id}/commands: the trainer's poll
    return not (len(segs) == 5 and segs[1] == "api" and segs[2] == "runs" and segs[4] == "commands")


def client_key(scope) -> str:
    """The credential a request carries, hashed (bearer token first, then the sign-in cookie), or
    its peer address. Hashing keeps secrets out of memory dumps; the prefix keeps the kinds apart."""
    from thermowatch.supervisor.serve.guard import COOKIE

    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            return "token:" + hashlib.sha256(value).hexdigest()[:24]
    for name, value in scope.get("headers", ()):
        if name == b"cookie" and COOKIE.encode() in value:
            for part in value.split(b";"):
                k, _, v = part.strip().partition(b"=")
                if k == COOKIE.encode() and v:
                    return "cookie:" + hashlib.sha256(v).hexdigest()[:24]
    client = scope.get("client")
    return "addr:" + (client[0] if client else "?")


class Buckets:
    """Token buckets by client: `per_minute` reads a minute, up to `burst` at once."""

    def __init__(self, per_minute: int, burst: int, max_clients: int = MAX_CLIENTS) -> None:
        self.rate = per_minute / 60.0
        self.burst = float(burst)
        self.max_clients = max_clients
        self._tokens: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)
        self.refused = 0

    def take(self, key: str, now: float | None = None) -> float:
        """0 when the read may go on (one token taken), else the seconds until it may."""
        now = time.monotonic() if now is None else now
        tokens, at = self._tokens.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        if tokens >= 1.0:
            self._tokens[key] = (tokens - 1.0, now)
            wait = 0.0
        else:
            self._tokens[key] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
            self.refused += 1
        while len(self._tokens) > self.max_clients:
            self._tokens.popitem(last=False)
        return wait


class ReadGate:
    """ASGI middleware; see the module docstring. Runs on the event loop (no lock needed: the
    buckets and the semaphore are only touched there)."""

    def __init__(self, app, *, per_client_per_minute: int, in_flight: int, queue_s: float = READ_QUEUE_S) -> None:
        self.app = app
        self.buckets = Buckets(per_client_per_minute, max(1, per_client_per_minute // 6))
        self.in_flight = in_flight
        self.queue_s = queue_s
        self.yield_s = YIELD_S
        self._writes = 0
        self._no_writes: asyncio.Event | None = None
        self._active = 0
        self._waiters: deque[asyncio.Future] = deque()
        self.busy = 0

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST":
            return await self._write(scope, receive, send)
        if not is_read(scope["method"], scope["path"]):
            return await self.app(scope, receive, send)
        wait = self.buckets.take(client_key(scope))
        if wait > 0:
            secs = max(1, math.ceil(wait))
            return await JSONResponse(
                {"detail": f"too many reads from this client: at most {round(self.buckets.rate * 60)} a minute "
                           f"(limits.max_reads_per_client_per_minute); retry in {secs} s"},
                429, headers={"Retry-After": str(secs)})(scope, receive, send)
        if not await self._enter():
            self.busy += 1
            return await JSONResponse(
                {"detail": f"the daemon is serving {self.in_flight} reads and more waited {self.queue_s:g} s "
                           f"(limits.max_reads_in_flight); retry shortly"},
                503, headers={"Retry-After": "2"})(scope, receive, send)
        try:
            if self._writes:
                try:
                    await asyncio.wait_for(self._no_writes.wait(), self.yield_s)
                except asyncio.TimeoutError:
                    pass
            await self.app(scope, receive, send)
        finally:
            self._leave()

    async def _write(self, scope, receive, send) -> None:
        if self._no_writes is None:
            self._no_writes = asyncio.Event()
        self._writes += 1
        self._no_writes.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self._writes -= 1
            if not self._writes:
                self._no_writes.set()

    async def _enter(self) -> bool:
        """Take a place among the reads in flight, waiting up to queue_s in arrival order. A place
        handed over by _leave is a resolved future, so a timeout racing a hand-over keeps it."""
        if self._active < self.in_flight and not self._waiters:
            self._active += 1
            return True
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.queue_s)
        except asyncio.TimeoutError:
            pass
        except BaseException:  # the client went away while waiting: give back a place handed over
            if fut.done() and not fut.cancelled():
                self._leave()
            fut.cancel()
            raise
        if fut.done() and not fut.cancelled():
            return True
        fut.cancel()  # _leave skips it
        return False

    def _leave(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(True)  # the place passes on; _active is unchanged
                return
        self._active -= 1
