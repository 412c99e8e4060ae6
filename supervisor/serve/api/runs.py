"""The read API: runs, their thermometer history, incidents, actions and audit (thin routers
over supervisor.store; each request is one read-only session). Every route needs the `read`
scope unless the config says `public_read: true` (supervisor.serve.guard).

    GET /api/runs?limit=&cursor=                    -> {"runs": [{run_id, created_at, last_step, attempt,
                                                        attempts, open_incidents}], "next_cursor"}: newest first,
                                                        a page at a time (limit 1..1000, default 100); pass
                                                        next_cursor as cursor for the next page (null: the last);
                                                        attempt: the newest attempt's number, attempts: how many
    GET /api/runs/{run_id}?attempts_limit=&attempts_before=
                                                    -> {"run_id", "created_at", "config", "last_step",
                                                        "attempt" (the newest attempt's number), "attempts",
                                                        "attempts_total", "next_attempts_before",
                                                        "checkpoints", "skip_ranges", "lr_changes"}: a page of
                                                        attempts, the newest attempts_limit (1..1000, default
                                                        100) numbered below attempts_before (default: all),
                                                        oldest first; pass next_attempts_before as
                                                        attempts_before for the older page (null: none left)
    GET /api/runs/{run_id}/series                   -> {"keys": [...]}
    GET /api/runs/{run_id}/history?key=&step_lo=&step_hi=&max_points=
                                                    -> {"key", "steps": [...], "values": [...], "downsampled"}
    GET /api/runs/{run_id}/history?key=&attempts=all&step_lo=&step_hi=&max_points=
                                                    -> {"key", "attempts": {"0": {"steps", "values", "points",
                                                        "downsampled"}, ...}}: every attempt's own points,
                                                        including steps a rollback re-trained
                                                    step_lo > step_hi is an empty window: no points
    GET /api/runs/{run_id}/status                   -> state (starting/running/paused/stalled/finished) and
                                                        why, last step and record age, open incidents,
                                                        pending approvals, the newest actions
    GET /api/runs/{run_id}/incidents                -> incidents, each with its findings
    GET /api/runs/{run_id}/actions?limit=           -> newest first
    GET /api/runs/{run_id}/audit?limit=             -> newest first
    GET /api/actions/{action_id}                    -> its state and what the trainer did (supervisor.act.outcome)

Non-finite values are data (DESIGN.md). JSON has no NaN/Infinity, so they travel as the
strings "NaN", "Infinity" and "-Infinity": both Python's float() and JavaScript's Number()
read those back, unlike null (which would lose the sign of an overflow).
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi import Path as FPath
from fastapi.responses import Response

from thermowatch.monitors.contract import INT32_MAX
from thermowatch.supervisor.serve.guard import Guard
from thermowatch.supervisor.serve.daemon import Daemon
from thermowatch.supervisor.act.outcome import outcome
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import quarantine as quarantine_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import thermometers
from thermowatch.supervisor.store.views import (
    ATTEMPTS_DEFAULT,
    ATTEMPTS_MAX,
    PAGE_DEFAULT,
    PAGE_MAX,
    incidents_with_findings,
    to_wire,
    points_json,
    require_run,
    run_detail,
    run_status,
    runs_page,
    unknown_key_message,
)

def json_response(payload: Any) -> Response:
    # json.dumps directly: FastAPI's encoder walks every element in Python (slow at 10^6 points).
    return Response(json.dumps(payload, allow_nan=False, separators=(",", ":")), media_type="application/json")


# --- the router --------------------------------------------------------------------------------


def make_router(sup: Daemon, *, guard: Guard) -> APIRouter:
    router = APIRouter(prefix="/api", tags=["runs"], dependencies=[Depends(guard.require("read"))])
    # Plain `def` handlers: FastAPI runs them in its threadpool, off the event loop.

    @router.get("/runs")
    def list_runs(
        limit: int = Query(PAGE_DEFAULT, ge=1, le=PAGE_MAX, description="runs per page"),
        cursor: str | None = Query(None, max_length=1000,
                                   description="the previous page's next_cursor; leave out for the newest runs"),
    ) -> Response:
        """Runs newest first, a page at a time: {"runs": [...], "next_cursor": "..." or null}."""
        with sup.sessions() as s:
            return json_response(runs_page(s, limit, cursor))

    @router.get("/runs/{run_id}")
    def get_run(
        run_id: str,
        attempts_limit: int = Query(ATTEMPTS_DEFAULT, ge=1, le=ATTEMPTS_MAX, description="attempts per page"),
        attempts_before: int | None = Query(None, ge=0, le=INT32_MAX,
                                            description="the previous page's next_attempts_before; leave out for "
                                                        "the newest attempts"),
    ) -> Response:
        """The run, its checkpoints, skip ranges and LR changes, and a page of its attempts: the
        newest `attempts_limit` numbered below `attempts_before`, oldest first; `attempts_total`
        counts them all, `next_attempts_before` is the older page's attempts_before (null: none)."""
        with sup.sessions() as s:
            return json_response(run_detail(s, run_id, attempts_limit, attempts_before))

    @router.get("/runs/{run_id}/series")
    def series(run_id: str) -> Response:
        with sup.sessions() as s:
            require_run(s, run_id)
            return json_response({"run_id": run_id, "keys": thermometers.series_keys(s, run_id)})

    @router.get("/runs/{run_id}/history")
    def history(
        run_id: str,
        key: str = Query(min_length=1, description="a metric key, e.g. loss or attn_logit_max/blocks.3.attn"),
        step_lo: int | None = Query(None, ge=0),
        step_hi: int | None = Query(None, ge=0),
        max_points: int | None = Query(None, ge=3, le=1_000_000,
                                       description="downsample to at most this many points (min/max per bucket)"),
        attempts: str | None = Query(None, pattern="^all$",
                                     description="all: every attempt's own points, keyed by attempt, instead of "
                                                 "the newest attempt's point per step (max_points applies per attempt)"),
    ) -> Response:
        with sup.sessions() as s:  # step_lo > step_hi is an empty window: no points, not an error
            require_run(s, run_id)
            keys = thermometers.series_keys(s, run_id)
            if key not in keys:
                raise HTTPException(404, unknown_key_message(run_id, key, keys))
            if attempts == "all":
                by_attempt = thermometers.history_by_attempt(s, run_id, key, step_lo, step_hi)
            else:
                steps, values = thermometers.history(s, run_id, key, step_lo, step_hi)
        if attempts == "all":
            return json_response({"run_id": run_id, "key": key, "attempts": {
                str(a): points_json(st, v, max_points, step_lo, step_hi) for a, (st, v) in by_attempt.items()}})
        return json_response({"run_id": run_id, "key": key, **points_json(steps, values, max_points, step_lo, step_hi)})

    @router.get("/runs/{run_id}/status")
    def status(run_id: str) -> Response:
        stall_s = sup.cfg.detectors.stall.timeout_s
        with sup.sessions() as s:
            return json_response(run_status(s, run_id, stall_after_s=stall_s))

    @router.get("/runs/{run_id}/incidents")
    def incidents(run_id: str) -> Response:
        with sup.sessions() as s:
            require_run(s, run_id)
            return json_response({"run_id": run_id, "incidents": incidents_with_findings(s, run_id)})

    @router.get("/runs/{run_id}/actions")
    def actions(run_id: str, limit: int = Query(200, ge=1, le=10_000)) -> Response:
        with sup.sessions() as s:
            require_run(s, run_id)
            return json_response({"run_id": run_id, "actions": to_wire(actions_store.actions(s, run_id, limit))})

    @router.get("/actions/{action_id}")
    def action(action_id: int = FPath(ge=0, le=INT32_MAX)) -> Response:
        """One action as `thermowatch ... --json` prints it: state, what the trainer did (its ack)."""
        with sup.sessions() as s:
            row = actions_store.get_action(s, action_id)
        if row is None:
            raise HTTPException(404, f"no action {action_id}; GET /api/runs/{{run_id}}/actions lists a run's actions")
        return json_response(outcome(row))

    @router.get("/runs/{run_id}/quarantine")
    def quarantine(run_id: str, horizon: int = Query(
            quarantine_store.HORIZON, ge=1, le=10_000_000,
            description="steps past the old detection the re-trained path must run without the divergence")) -> Response:
        """Which samples did it (issue 24): every rollback that skipped samples, whether its
        divergence came back on the path re-trained without them (quarantine, recurred, pending),
        and the sample ranges [lo, hi) whose skip held: the quarantine. A run that said its
        `data.dataset_size` also gets them as data indices (`data_indices`, id % dataset_size),
        unless its loader shuffles each pass (`data.shuffled`: the loader maps them)."""
        with sup.sessions() as s:
            require_run(s, run_id)
            found = quarantine_store.verdicts(s, run_id, horizon)
            size, shuffled = quarantine_store.data_order(s, run_id)
        held = quarantine_store.quarantined(found)
        body = {"run_id": run_id, "horizon": horizon, "verdicts": [v.to_json() for v in found],
                "quarantine": [list(r) for r in held], "samples": sum(hi - lo for lo, hi in held),
                "dataset_size": size, "shuffled": shuffled}
        if size is not None and not shuffled:
            body["data_indices"] = [list(r) for r in quarantine_store.data_indices(held, size)]
        return json_response(body)

    @router.get("/runs/{run_id}/audit")
    def audit(run_id: str, limit: int = Query(200, ge=1, le=10_000)) -> Response:
        with sup.sessions() as s:
            require_run(s, run_id)
            return json_response({"run_id": run_id, "audit": to_wire(audit_store.audit_log(s, run_id, limit))})

    return router
