"""HTTP API routers (FastAPI). Each module exposes a router factory; the app assembles them."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from monitors.contract import ContractError
from supervisor.errors import Conflict, NotFound, UserError
from supervisor.ingest import BatchTooLarge, UnknownRun
from supervisor.limits import INT32_MAX, INT64_MAX, LimitExceeded, check_int, check_run_id, check_text

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
    except (ContractError, UserError) as exc:
        raise HTTPException(422, str(exc)) from None


# --- limits on every route's path and query (supervisor.limits) ----------------------------------

# Path parameters by name, with the column each one is compared with.
_INT_PARAMS = {"action_id": INT32_MAX, "attempt": INT32_MAX}
_DECIMAL = re.compile(r"[+-]?[0-9]+")


def check_params(request: Request) -> None:
    """An app-wide dependency: path and query parameters within what the columns they are
    compared with hold, so a hostile URL is a 422 naming the parameter on both databases rather
    than a driver error (2**31 in an Integer column on PostgreSQL, 2**63 on SQLite, NUL in a
    run id on PostgreSQL). FastAPI then applies each route's own declared types and bounds."""
    try:
        for name, value in request.path_params.items():
            if name == "run_id":
                check_run_id(value)
            elif name in _INT_PARAMS and _DECIMAL.fullmatch(value.strip()):
                check_int(name, int(value), 0, _INT_PARAMS[name])
        for name, value in request.query_params.multi_items():
            check_text(f"query parameter {name!r}", value, 10_000)
            if _DECIMAL.fullmatch(value.strip()) and len(value) < 4000:
                check_int(f"query parameter {name!r}", int(value), -INT64_MAX - 1, INT64_MAX)
            elif _DECIMAL.fullmatch(value.strip()):
                raise ContractError(f"query parameter {name!r} has {len(value)} digits; integers are at most 2**63-1")
    except ContractError as exc:
        raise HTTPException(422, str(exc)) from None


def add_input_error_handlers(app: FastAPI) -> None:
    """The last net under the explicit checks: errors that can only come from what a client sent
    become a 4xx (and keep the connection), every other exception stays a 500. Each is logged,
    since reaching here means a check upstream is missing."""
    from pydantic import ValidationError
    from sqlalchemy.exc import DataError

    def handler(status: int, what: str):
        async def answer(request: Request, exc: Exception) -> JSONResponse:
            log.warning("%s on %s %s answered %d: %s: %s", what, request.method, request.url.path, status,
                        type(exc).__name__, str(exc)[:300])
            return JSONResponse({"detail": f"{what}: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"},
                                status)
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
