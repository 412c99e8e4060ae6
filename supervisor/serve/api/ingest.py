"""HTTP side of ingest: thin routes over supervisor.ingest.ingestor.Ingestor (which owns the transaction).

    POST /api/runs                                       RunInfo JSON          -> 201 {"ok": true}
    POST /api/runs/{run_id}/attempts/{attempt}/steps       {"records": [...]}    -> 200 {"ok": true, "records": n, "values": m}
         or, with content type application/vnd.thermowatch.step-columns, the same batch as columns
         (monitors.columns: one array per series; what thermowatch.transport sends)
    POST /api/runs/{run_id}/attempts/{attempt}/checkpoints CheckpointInfo JSON   -> 201 {"ok": true}
    POST /api/runs/{run_id}/attempts/{attempt}/checkpoints/deleted {"steps", "reason"} -> {"ok": true}
    POST /api/runs/{run_id}/attempts/{attempt}/finished  RunFinished JSON      -> 200 {"ok": true}
         (the same report again is 200; a different one 409: an attempt finishes once)

Every route needs a token with the `ingest` scope (supervisor.serve.guard), and one that is not an
admin writes only the runs it opened: 403 naming the rule (supervisor.serve.auth; issue 33).
Bad input is a 4xx {"detail": "..."} naming the problem: 400 unreadable JSON, 401/403 token,
404 unknown run/attempt, 413 body or batch too large, 422 wrong types. Bodies are read as raw
bytes and parsed with json.loads (accepts NaN/Infinity, which Python's json emits) in a worker
thread; pydantic models per record would cost more than the database insert.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import APIRouter, Depends, HTTPException, Request

from thermowatch.monitors.columns import COLUMNS_CONTENT_TYPE, StepColumns
from thermowatch.supervisor.serve.api import call
from thermowatch.supervisor.serve.guard import Guard
from thermowatch.supervisor.serve.body import max_body, parse_json, read_body
from thermowatch.supervisor.serve.auth import Principal
from thermowatch.supervisor.ingest.ingestor import (
    Ingestor,
    checkpoint_from_json,
    deleted_from_json,
    finished_from_json,
    records_from_json,
    run_info_from_json,
)
from thermowatch.supervisor.ingest.columns import check_header_size
from thermowatch.supervisor.limits import INT32_MAX

if TYPE_CHECKING:
    from thermowatch.supervisor.serve.metrics import Counters

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # a 50-step x 10k-value batch is ~15 MB of JSON
_FINISHED_BODY_BYTES = 4096  # three small fields: a finished report is ~80 bytes


def _is_columns(content_type: str) -> bool:
    return content_type.split(";", 1)[0].strip().lower() == COLUMNS_CONTENT_TYPE


def _attempt(raw: str) -> int:
    # Parsed here, not by FastAPI, so the 422 detail is one sentence like every other error.
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if not 0 <= value <= INT32_MAX:  # attempts.attempt is an Integer column
        raise HTTPException(422, f"attempt must be a non-negative integer of at most 2**31-1, got {raw[:40]!r}")
    return value


def make_router(ingestor: Ingestor, *, guard: Guard, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                counters: "Counters | None" = None) -> APIRouter:
    """`counters`: the app's /metrics counts (supervisor.serve.metrics); refusals are counted by its
    middleware from the answer, successes here where the batch's size is known."""
    # The token is checked before the body is read: a caller without one learns nothing.
    router = APIRouter(prefix="/api", tags=["ingest"])
    trainer = Depends(guard.require("ingest"))
    # A run's own trainer: an ingest token writes only the runs it opened (supervisor.serve.auth).
    owner = Depends(guard.require_run("ingest"))
    big = max_body(max_body_bytes)  # supervisor.serve.body enforces it before the body is read

    @router.post("/runs", status_code=201, openapi_extra=big, responses={429: {
        "description": "the token opened limits.max_new_runs_per_token_per_hour new runs in the last hour "
                       "(supervisor.ingest.quota); Retry-After says when one more is allowed. New attempts of an "
                       "existing run are never refused for it"}})
    async def open_run(request: Request, who: Principal = trainer) -> dict:
        body = await read_body(request)
        await call(lambda: ingestor.open_run(run_info_from_json(parse_json(body)), who.name, who.check_open))
        return {"ok": True}

    @router.post("/runs/{run_id}/attempts/{attempt}/steps", openapi_extra=big)
    async def write_steps(run_id: str, attempt: str, request: Request, _: Principal = owner) -> dict:
        att = _attempt(attempt)
        body = await read_body(request)

        columnar = _is_columns(request.headers.get("content-type", ""))

        def work() -> dict:
            if columnar:
                check_header_size(body, ingestor.limits)
                cols = StepColumns.decode(body)
                n, n_records = ingestor.write_columns(run_id, att, cols), len(cols)
            else:
                records = records_from_json(parse_json(body), ingestor.limits)
                n, n_records = ingestor.write(run_id, att, records), len(records)
            if counters is not None:
                counters.batch(n_records, n)
            return {"ok": True, "records": n_records, "values": n}

        return await call(work)

    @router.post("/runs/{run_id}/attempts/{attempt}/checkpoints", status_code=201, openapi_extra=big)
    async def checkpoint_saved(run_id: str, attempt: str, request: Request, _: Principal = owner) -> dict:
        att = _attempt(attempt)
        body = await read_body(request)
        await call(lambda: ingestor.checkpoint_saved(run_id, att, checkpoint_from_json(parse_json(body))))
        return {"ok": True}

    @router.post("/runs/{run_id}/attempts/{attempt}/checkpoints/deleted", openapi_extra=big)
    async def checkpoints_deleted(run_id: str, attempt: str, request: Request, who: Principal = owner) -> dict:
        att = _attempt(attempt)
        body = await read_body(request)
        await call(lambda: ingestor.checkpoints_deleted(run_id, att, *deleted_from_json(parse_json(body)),
                                                             actor=who.name))
        return {"ok": True}

    @router.post("/runs/{run_id}/attempts/{attempt}/finished", openapi_extra=max_body(_FINISHED_BODY_BYTES),
                 responses={409: {"description": "this attempt already finished with a different report"}})
    async def finish_run(run_id: str, attempt: str, request: Request, who: Principal = owner) -> dict:
        att = _attempt(attempt)
        body = await read_body(request)
        await call(lambda: ingestor.finish_run(run_id, att, finished_from_json(parse_json(body)), actor=who.name))
        return {"ok": True}

    # The bodies' schemas in the OpenAPI (supervisor.serve.api.schemas). They document what the
    # contract's from_json and supervisor.limits check; no pydantic pass over the records
    # (bench/ingest.py --validation: it would add ~15% to reading a batch, for no new check).
    from thermowatch.supervisor.serve.api import document_bodies
    from thermowatch.supervisor.serve.api.schemas import (
        CheckpointBody, CheckpointsDeleted, RunFinishedBody, RunInfoBody, StepsBody,
    )

    document_bodies(router, {("POST", "/api/runs"): RunInfoBody,
                             ("POST", "/api/runs/{run_id}/attempts/{attempt}/steps"): StepsBody,
                             ("POST", "/api/runs/{run_id}/attempts/{attempt}/checkpoints"): CheckpointBody,
                             ("POST", "/api/runs/{run_id}/attempts/{attempt}/checkpoints/deleted"): CheckpointsDeleted,
                             ("POST", "/api/runs/{run_id}/attempts/{attempt}/finished"): RunFinishedBody})
    _document_columns(router)
    return router


def _document_columns(router: APIRouter) -> None:
    """The steps route's second body: the batch as columns (monitors.columns, its docstring has
    the byte layout), beside the per-step JSON form that replays and older clients send."""
    for route in router.routes:
        if getattr(route, "path", "") == "/api/runs/{run_id}/attempts/{attempt}/steps":
            body = route.openapi_extra["requestBody"]
            body["content"] = {**body["content"], COLUMNS_CONTENT_TYPE: {"schema": {
                "type": "string", "format": "binary", "description": _COLUMNS_DOC}}}
            return
    raise RuntimeError("_document_columns: no steps route")


_COLUMNS_DOC = (
    "The batch as columns, one array per series (what the trainer's HttpSink sends): b'TWC1', a uint32 LE "
    "header length, a JSON header {\"steps\": n, \"keys\": [...], \"ranked\": [key indices], \"present\": bool, "
    "\"ledger_digest\": [n strings], optional}, then little-endian arrays: int64[n] step, sample_lo, sample_hi, "
    "tokens; float64[n] wall_time; float64[keys x n] values, series after series (NaN and +-Inf bit-exact); "
    "uint8[keys x n] present mask when \"present\"; int32[ranked x n] ranks, -1 for none. The same checks and "
    "limits as the JSON form apply.")
