"""HTTP API routers (FastAPI). Each module exposes a router factory; the app assembles them."""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING, Iterable, Mapping
from urllib.parse import parse_qsl

from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from thermowatch.monitors.contract import ContractError
from thermowatch.supervisor.errors import Conflict, Forbidden, NotFound, NotLeader, QuotaExceeded, UserError
from thermowatch.supervisor.ingest.ingestor import BatchTooLarge, UnknownRun
from thermowatch.supervisor.limits import INT32_MAX, INT64_MAX, LimitExceeded, check_int, check_run_id, check_text

if TYPE_CHECKING:
    from thermowatch.supervisor.serve.body import InFlight
    from thermowatch.supervisor.limits import Limits

log = logging.getLogger(__name__)


async def call(fn, *args):
    """Run a blocking call off the event loop; a client's mistake becomes a 4xx with its message
    (the daemon stays up and nothing stored is touched: each call is its own transaction)."""
    try:
        return await run_in_threadpool(fn, *args)
    except (UnknownRun, NotFound) as exc:
        raise HTTPException(404, str(exc)) from None
    except (BatchTooLarge, LimitExceeded) as exc:
        raise HTTPException(413, str(exc)) from None
    except Conflict as exc:
        raise HTTPException(409, str(exc)) from None
    except Forbidden as exc:
        raise HTTPException(403, str(exc)) from None
    except QuotaExceeded as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
    except NotLeader as exc:
        raise HTTPException(503, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
    except (ContractError, UserError) as exc:
        raise HTTPException(422, str(exc)) from None


# --- limits on every route's path and query (supervisor.limits) ----------------------------------

# Path parameters by name, with the column each one is compared with.
_INT_PARAMS = {"action_id": INT32_MAX, "attempt": INT32_MAX, "silence_id": INT32_MAX}
_DECIMAL = re.compile(r"[+-]?[0-9]+")
# Query parameters that are text whatever they hold (an opaque cursor, a metric key): a run of
# digits there is not an integer to bound (issue 21: a 1000-digit cursor is schema-valid).
_TEXT_QUERY = frozenset({"cursor", "key", "metric"})


def check_params(path_params: Mapping[str, str], query: Iterable[tuple[str, str]]) -> None:
    """Path and query parameters within what the columns they are compared with hold, so a
    hostile URL is a 422 naming the parameter on both databases rather than a driver error
    (2**31 in an Integer column on PostgreSQL, 2**63 on SQLite, NUL in a run id on PostgreSQL).
    Each route's own declared types and bounds apply after this. Raises ContractError."""
    for name, value in path_params.items():
        if name == "run_id":
            check_run_id(value)
        elif name in _INT_PARAMS and _DECIMAL.fullmatch(value):
            if len(value) > 30:
                raise ContractError(f"{name} has {len(value)} digits; it is at most 2**31-1")
            check_int(name, int(value), 0, _INT_PARAMS[name])
    for name, value in query:
        check_text(f"query parameter {name!r}", value, 10_000)
        if name not in _TEXT_QUERY and _DECIMAL.fullmatch(value):
            if len(value) > 30:
                raise ContractError(f"query parameter {name!r} has {len(value)} digits; integers are at most 2**63-1")
            check_int(f"query parameter {name!r}", int(value), -INT64_MAX - 1, INT64_MAX)


def path_params(path: str) -> dict[str, str]:
    """The id segments of this API's paths, by the segment before each: /api/runs/{run_id}/...,
    /runs/{run_id}/... (web), .../attempts/{attempt}/..., /api/actions/{action_id}/...
    Read from the path itself, not from the router: it runs before routing."""
    segs = path.split("/")
    out: dict[str, str] = {}
    for i in range(1, len(segs) - 1):
        seg, value = segs[i], segs[i + 1]
        if seg == "runs" and "run_id" not in out:
            out["run_id"] = value
        elif seg == "attempts" and "run_id" in out:
            out["attempt"] = value
        elif seg == "actions" and i == 2 and segs[1] == "api":
            out["action_id"] = value
    return out


_ROUTED = frozenset({"GET", "HEAD", "POST"})  # every route of the daemon is one of these


class ParamLimits:
    """ASGI middleware: check_params on every request that carries credentials, before routing (it
    reads only the URL). A middleware rather than a route dependency so it covers every router,
    present and future, without touching their signatures. A request with no credentials at all
    goes on unchecked to its route, whose token check answers 401 before any parameter is used:
    a client without a token learns nothing from the daemon but that it needs one."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        # Only the methods some route has: any other is the router's 405 (with Allow), whatever its URL.
        if scope["type"] == "http" and scope["method"] in _ROUTED and \
                any(k in (b"authorization", b"cookie") for k, _ in scope.get("headers", ())):
            try:
                check_params(path_params(scope["path"]), parse_qsl(scope.get("query_string", b"").decode("latin-1"),
                                                    keep_blank_values=True))
            except ContractError as exc:
                return await JSONResponse({"detail": str(exc)}, 422)(scope, receive, send)
        await self.app(scope, receive, send)


def install_input_limits(app: FastAPI, limits: "Limits", in_flight: "InFlight") -> None:
    """ParamLimits, BodyLimits (supervisor.serve.body), and the last net under the explicit checks:
    errors that can only come from what a client sent become a 4xx (and keep the connection),
    every other exception stays a 500. Each is logged, since reaching the net means a check
    upstream is missing."""
    from pydantic import ValidationError
    from sqlalchemy.exc import DataError

    from thermowatch.supervisor.serve.body import BodyLimits

    from thermowatch.supervisor.serve.api.reads import ReadGate

    app.add_middleware(ParamLimits)
    app.add_middleware(ReadGate, per_client_per_minute=limits.max_reads_per_client_per_minute,
                       in_flight=limits.max_reads_in_flight)
    app.add_middleware(BodyLimits, default_bytes=limits.max_small_body_bytes, in_flight=in_flight)

    def handler(status: int, what: str):
        async def answer(request: Request, exc: Exception) -> JSONResponse:
            log.warning("%s on %s %s answered %d: %s: %s", what, request.method, request.url.path, status,
                        type(exc).__name__, str(exc)[:300])
            text = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            return JSONResponse({"detail": f"{what}: {text}"}, status)
        return answer

    # json.loads and any recursive walk of a deeply nested body
    app.add_exception_handler(RecursionError, handler(400, "request nested too deeply"))
    # an integer too large for a float or a column (SQLite: "Python int too large to convert")
    app.add_exception_handler(OverflowError, handler(422, "a number in the request is out of range"))
    # a str that is not valid Unicode (a lone surrogate) meeting a driver that encodes UTF-8
    app.add_exception_handler(UnicodeEncodeError, handler(422, "a string in the request is not valid Unicode"))
    app.add_exception_handler(ValidationError, handler(422, "invalid request"))
    # PostgreSQL: out-of-range integer, too long a string, NUL in text ("data exception" class 22)
    app.add_exception_handler(DataError, handler(422, "a value in the request does not fit its column"))


def document_bodies(router: APIRouter, bodies: Mapping[tuple[str, str], type]) -> None:
    """Attach each route's request-body model to the OpenAPI document ((method, path) -> model,
    path as declared on the router). The routes read their bodies themselves, after the token
    check and under a byte limit, so the model is documentation here (supervisor.serve.api.schemas)."""
    from thermowatch.supervisor.serve.api.schemas import body_doc

    found = set()
    for route in router.routes:
        for method in getattr(route, "methods", ()):
            model = bodies.get((method, route.path))
            if model is not None:
                route.openapi_extra = {**(route.openapi_extra or {}), **body_doc(model)}
                found.add((method, route.path))
    missing = set(bodies) - found
    if missing:
        raise RuntimeError(f"document_bodies: no route for {sorted(missing)}")


def install_error_handlers(app: FastAPI) -> None:
    """supervisor.errors as HTTP answers: NotFound 404, Forbidden 403, Conflict 409, QuotaExceeded 429 (with
    Retry-After), any other UserError 422, each with its message as `detail`. The read model and
    the rest of the store raise these, never an HTTP type (supervisor/store/views.py); call() maps
    the same for the routes that run through it."""
    def user_error(status: int):
        async def answer(request: Request, exc: Exception) -> JSONResponse:
            headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, QuotaExceeded) else None
            return JSONResponse({"detail": str(exc)}, status, headers=headers)
        return answer

    for cls, status in ((NotFound, 404), (Forbidden, 403), (Conflict, 409), (QuotaExceeded, 429), (UserError, 422)):
        app.add_exception_handler(cls, user_error(status))

    async def not_leader(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, 503, headers={"Retry-After": str(NotLeader.retry_after_s)})

    app.add_exception_handler(NotLeader, not_leader)
