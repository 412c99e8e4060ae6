"""Request bodies: bounded before they are read, on every route, in one place (issue 21).

Each route declares the most it reads (`max_body(n)` in its `openapi_extra`, which also puts
`x-max-body-bytes` in the OpenAPI document); a route that declares nothing gets the small budget
(`limits.max_small_body_bytes`). `BodyLimits`, an ASGI middleware, enforces it:

- a declared Content-Length over the route's limit is answered 413 when the route first reads,
  before a byte of the body is read, with `Connection: close` so the client stops sending;
- a body without a length (chunked) is counted as it streams and refused (413) the moment it
  passes the limit;
- every body being read counts against one budget for the whole daemon
  (`limits.max_body_bytes_in_flight`); a request that would pass it is answered 503 with
  Retry-After, so a flood of large, authorised batches waits instead of growing the heap (the
  trainer's sink retries a 503 later).

A declared length is a promise, not bytes: nothing is allocated or reserved for it. The budget
counts the bytes received, and `read_body` grows its buffer as they arrive (issue 33: a buffer
sized from the header would let one headers-only request declaring 2 GB take as much of the
daemon's memory before the 413, on any route that reads a body, signed in or not).

A body is reserved against the budget only when its route starts reading it, which every route
does after its token check: a client without a token can make the daemon hold no more than the
small budget of the routes it may reach unauthenticated (the sign-in form, Slack's callback).
"""

from __future__ import annotations

import json
import threading
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse

MAX_BODY_KEY = "x-max-body-bytes"


def max_body(n: int) -> dict[str, Any]:
    """A route's `openapi_extra` declaring the most bytes of body it reads."""
    return {MAX_BODY_KEY: int(n)}


class BodyTooLarge(HTTPException):
    def __init__(self, detail: str) -> None:
        super().__init__(413, detail, headers={"Connection": "close"})


class Busy(HTTPException):
    def __init__(self, detail: str) -> None:
        super().__init__(503, detail, headers={"Retry-After": "2"})


class InFlight:
    """Bytes of request bodies being read or held by a route right now, under one ceiling."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.held = 0
        self.peak = 0
        self.refused = 0
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            if self.held + n > self.ceiling and self.held > 0:  # one body alone is never refused here
                self.refused += 1
                return False
            self.held += n
            self.peak = max(self.peak, self.held)
            return True

    def give(self, n: int) -> None:
        with self._lock:
            self.held -= n


class BodyLimits:
    """ASGI middleware; see the module docstring. `default_bytes`: the budget of a route that
    declares none; `in_flight`: the daemon's shared budget. The route's own limit is read when
    its body is first read, from the route the router put in the scope: by then the request is
    routed and its token checked."""

    def __init__(self, app, *, default_bytes: int, in_flight: InFlight) -> None:
        self.app = app
        self.default = default_bytes
        self.in_flight = in_flight

    def limit(self, scope) -> tuple[int, str]:
        route = scope.get("route")
        extra = getattr(route, "openapi_extra", None) or {}
        where = f"{scope['method']} {getattr(route, 'path', None) or scope['path'][:100]}"
        return int(extra.get(MAX_BODY_KEY, self.default)), where

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared: int | None = None
        chunked = False
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                if not v.isdigit() or len(v) > 18:
                    return await JSONResponse({"detail": f"bad Content-Length header {v[:40]!r}"}, 400)(
                        scope, receive, send)
                declared = int(v)
            elif k == b"transfer-encoding":
                chunked = True
        got = held = 0
        limit, where = -1, ""
        # A large body (or one of unknown length) the route has not read to its end. A small one
        # the server reads past on its own, and the connection stays (issue 11: a trainer's
        # command channel keeps one connection across refusals).
        unread = declared > self.default if declared is not None else chunked

        async def closing(message) -> None:
            # An answer sent before a large body was read to its end (a 401 before the route
            # reads, a 413): close the connection with it, or the server would go on reading the
            # rest of the body to find the next request on a keep-alive connection.
            if message["type"] == "http.response.start" and unread:
                headers = list(message.get("headers", ()))
                if not any(k.lower() == b"connection" for k, _ in headers):
                    message = {**message, "headers": headers + [(b"connection", b"close")]}
            await send(message)

        async def limited():
            nonlocal got, held, limit, where, unread
            if limit < 0:
                limit, where = self.limit(scope)
            if declared is not None and declared > limit:  # refused before a byte is read
                raise BodyTooLarge(_too_large(declared, limit, where))
            message = await receive()
            if message["type"] == "http.request":
                unread = message.get("more_body", False)
                got += len(message.get("body", b""))
                if got > limit:
                    raise BodyTooLarge(_too_large(None, limit, where))
                if got > held:  # bytes received, never bytes promised (issue 33)
                    if not self.in_flight.take(got - held):
                        raise Busy(f"the daemon is reading {self.in_flight.held >> 20} MB of request bodies already "
                                   f"(limits.max_body_bytes_in_flight = {self.in_flight.ceiling >> 20} MB); "
                                   "nothing was stored, retry shortly")
                    held = got
            return message

        try:
            await self.app(scope, limited, closing)
        finally:
            if held:
                self.in_flight.give(held)


def _too_large(size: int | None, limit: int, where: str) -> str:
    what = f"request body of {size} bytes" if size is not None else "request body"
    return (f"{what} exceeds the limit of {limit} bytes for {where or 'this route'}; send smaller batches "
            "(or raise max_body_bytes / limits.max_small_body_bytes in the daemon's config)")


# --- reading, for the routes ----------------------------------------------------------------------


async def read_body(request: Request) -> bytearray:
    """The raw body (its size was bounded by BodyLimits as it streamed in), appended to one buffer
    as its pieces arrive, each piece freed at once: memory follows the bytes received, never the
    Content-Length a client declares (issue 33). A large buffer grows by realloc, which glibc does
    with mremap for mmap'd blocks: no second copy of the body at the peak."""
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
    return buf


async def read_json(request: Request) -> Any:
    """The body as JSON, for small requests (acks, commands): parsed on the event loop."""
    return parse_json(await read_body(request))


def parse_json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPException(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # the C decoder gives up near Python's recursion limit (~1000 levels)
        raise HTTPException(400, "request body is nested too deeply to parse; JSON values may nest at most "
                                 "32 levels (limits.max_json_depth)") from None
