"""HTTP API routers (FastAPI). Each module exposes a router factory; the app assembles them."""

from __future__ import annotations

from fastapi import HTTPException
from starlette.concurrency import run_in_threadpool

from monitors.contract import ContractError
from supervisor.errors import Conflict, NotFound, UserError
from supervisor.ingest import BatchTooLarge, UnknownRun


async def call(fn, *args):
    """Run a blocking call off the event loop; a client's mistake becomes a 4xx with its message
    (the daemon stays up and nothing stored is touched: each call is its own transaction)."""
    try:
        return await run_in_threadpool(fn, *args)
    except (UnknownRun, NotFound) as exc:
        raise HTTPException(404, str(exc)) from None
    except BatchTooLarge as exc:
        raise HTTPException(413, str(exc)) from None
    except Conflict as exc:
        raise HTTPException(409, str(exc)) from None
    except (ContractError, UserError) as exc:
        raise HTTPException(422, str(exc)) from None
