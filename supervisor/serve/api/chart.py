"""The chart endpoints: a metric's series in a step window as min/max/last/count buckets read
from the rollups (supervisor/store/chart.py), as JSON for the interactive page and as a PNG
for `thermowatch plot` (and anything else that wants a picture). Scope `read`.

    GET /api/runs/{run_id}/chart?metric=&step_lo=&step_hi=&buckets=1000&attempts=all|current&fields=min,max,last,count
    GET /api/runs/{run_id}/times?step_lo=&step_hi=&points=1000   -> the live path's wall-clock time at those steps
        -> {"run_id", "metric", "step_lo", "step_hi", "bucket_steps",
            "series": [{"key", "module", "attempt", "current", "step", "min", "max", "last", "count"}]}
    GET /api/runs/{run_id}/chart.png?metric=&step_lo=&step_hi=&attempts=&onset=&incident=&logy=&width=&height=

`metric` is a full key (loss, attn_logit_max/blocks.3.attn) or a family prefix (attn_logit_max:
every key equal to it or starting with "attn_logit_max/"). Series are ordered by key, then
attempt; an attempt that a rollback cut short comes as its live part (`current` true) and its
abandoned part (`current` false). bucket_steps 1 is full zoom: every point, min = max = last.
Non-finite values travel as the strings "NaN", "Infinity", "-Infinity" (JSON has no NaN).
Unknown run or metric: 404 naming it (and the known families). step_lo > step_hi is an empty
window: 200 with no series (the PNG: empty axes), as a range that matches nothing answers in REST.
"""

from __future__ import annotations

import numpy as np
import orjson
from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import Response

from thermowatch.supervisor.serve.guard import Guard
from thermowatch.supervisor.serve.daemon import Daemon
from thermowatch.supervisor.store.views import require_run, values_json
from thermowatch.supervisor.errors import NotFound, UserError
from thermowatch.supervisor.store import chart as chart_store
from thermowatch.supervisor.store import steps as steps_store


def _values(values: np.ndarray) -> np.ndarray | list:
    """A float64 array as orjson writes it natively (C, shortest round-trip repr: exact at full
    zoom), or, where it holds a non-finite value (orjson would write null), the list with the
    contract's strings in those places only (values_json)."""
    if np.isfinite(values).all():
        return np.ascontiguousarray(values, np.float64)
    return values_json(values)


FIELDS = ("min", "max", "last", "count")  # the per-bucket arrays a chart response may carry
FIELDS_PATTERN = r"^(min|max|last|count)(,(min|max|last|count))*$"


def series_json(s: chart_store.ChartSeries, fields: tuple[str, ...] = FIELDS) -> dict:
    out = {"key": s.key, "module": s.module, "attempt": s.attempt, "current": s.current,
           "step": np.ascontiguousarray(s.step, np.int64)}
    for f in FIELDS:  # in this order, whatever order they were asked in
        if f in fields:
            out[f] = np.ascontiguousarray(s.count, np.int64) if f == "count" else _values(getattr(s, f))
    return out


def chart_json(data: chart_store.ChartData, fields: tuple[str, ...] = FIELDS) -> dict:
    return {"run_id": data.run_id, "metric": data.metric, "step_lo": data.step_lo, "step_hi": data.step_hi,
            "bucket_steps": data.bucket_steps, "series": [series_json(s, fields) for s in data.series]}


def chart_body(data: chart_store.ChartData, fields: tuple[str, ...] = FIELDS) -> bytes:
    """chart_json(data) as JSON bytes. orjson writes the numpy arrays straight from their
    buffers: no Python float per value (the stdlib encoder built and repr'd ~400k of them for a
    100-layer chart, ~0.4 s of its ~0.8 s; bench/plot.py)."""
    return orjson.dumps(chart_json(data, fields), option=orjson.OPT_SERIALIZE_NUMPY)


def _http(exc: Exception) -> HTTPException:
    return HTTPException(404 if isinstance(exc, NotFound) else 422, str(exc))


def make_router(sup: Daemon, *, guard: Guard) -> APIRouter:
    router = APIRouter(prefix="/api", tags=["runs"], dependencies=[Depends(guard.require("read"))])

    @router.get("/runs/{run_id}/chart")
    def chart(
        run_id: str,
        metric: str = Query(min_length=1, description="a full key (loss) or a family prefix (attn_logit_max)"),
        step_lo: int | None = Query(None, ge=0, description="first step of the window (default: the run's first)"),
        step_hi: int | None = Query(None, ge=0, description="last step of the window, inclusive (default: the last)"),
        buckets: int = Query(chart_store.DEFAULT_BUCKETS, ge=chart_store.MIN_BUCKETS, le=chart_store.MAX_BUCKETS,
                             description="at most this many buckets per series"),
        attempts: str = Query("all", pattern="^(all|current)$",
                              description="all: abandoned trajectories too; current: only the live path"),
        fields: str = Query(",".join(FIELDS), pattern=FIELDS_PATTERN,
                            description="the per-bucket arrays to send besides `step`, comma-separated: the run "
                                        "page asks for the one it draws (a 100-layer chart on a phone: ~0.4 of the bytes)"),
    ) -> Response:
        with sup.sessions() as s:
            require_run(s, run_id)
            try:
                data = chart_store.chart(s, run_id, metric, step_lo, step_hi, buckets, attempts)
            except UserError as exc:
                raise _http(exc) from None
        return Response(chart_body(data, tuple(fields.split(","))), media_type="application/json")

    @router.get("/runs/{run_id}/times")
    def times(
        run_id: str,
        step_lo: int | None = Query(None, ge=0, description="first step of the window (default: 0)"),
        step_hi: int | None = Query(None, ge=0, description="last step of the window, inclusive (default: the last)"),
        points: int = Query(1000, ge=2, le=chart_store.MAX_BUCKETS, description="at most this many steps, evenly spread"),
    ) -> dict:
        """When the live path trained its steps (unix seconds, the trainer's clock): the run page's
        wall-clock axis. {"run_id", "step": [...], "wall_time": [...]}."""
        with sup.sessions() as s:
            require_run(s, run_id)
            steps, walls = steps_store.live_wall_times(s, run_id, step_lo, step_hi, points)
        return {"run_id": run_id, "step": steps, "wall_time": walls}

    @router.get("/runs/{run_id}/chart.png", response_class=Response, responses={200: {
        "description": "the chart as a PNG", "content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}}})
    def chart_png(
        run_id: str,
        metric: str = Query(min_length=1, description="a full key (loss) or a family prefix (attn_logit_max)"),
        step_lo: int | None = Query(None, ge=0),
        step_hi: int | None = Query(None, ge=0),
        attempts: str = Query("all", pattern="^(all|current)$"),
        onset: int | None = Query(None, ge=0, description="draw a finding's onset at this step"),
        incident: int | None = Query(None, ge=0, description="incident to draw heavier"),
        logy: bool | None = Query(None, description="log y axis (default: by metric)"),
        width: int = Query(1100, ge=200, le=4000),
        height: int = Query(320, ge=120, le=2000),
    ) -> Response:
        from thermowatch.supervisor.charts.png import chart_png as render_png
        from thermowatch.supervisor.charts.png import marks_for

        with sup.sessions() as s:
            require_run(s, run_id)
            try:
                png = render_png(s, run_id, metric, step_lo, step_hi, onset=onset, marks=marks_for(s, run_id, incident),
                                 logy=logy, width_px=width, height_px=height, attempts=attempts)
            except UserError as exc:
                raise _http(exc) from None
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    return router
