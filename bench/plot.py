"""Charts at real-run size (issue 12): a per-layer chart of 100 series x 10^6 steps, as JSON
(GET /api/runs/{run}/chart) and as PNG (GET /api/runs/{run}/chart.png), timed against a real
`thermowatch serve` daemon (subprocess, uvicorn, auth on) with its peak RSS; side by side with
today's full-read paths on a smaller history in the same run: the JSON a page fetched per series
(GET /history?key=K&attempts=all for each of the 100 keys) and the old plot path (every point
of every attempt of every series, then matplotlib; timed in a subprocess with its peak RSS).

    python bench/plot.py                        # SQLite and PostgreSQL, 10^6 x 100 and 10^5 x 100
    python bench/plot.py --db sqlite --json     # ... ends with one JSON line of figures
    python bench/plot.py --steps 200000         # a smaller big history

The histories are written once through the store (thermometers._insert_chunks: 50-step chunks,
as a 50-step ingest batch writes them; rollups.backfill: the same code the ingest hook runs) and
cached: SQLite files under --cache (default /tmp/tw-bench-plot), PostgreSQL schemas named by
size, reused while they are complete. Attempt 0 runs to 60% of the steps and diverges (a spike
to 1e4 and a NaN in layer 7); attempt 1 re-trains from 55% to the end, so every chart holds an
abandoned trajectory.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from common import free_port, new_token, repo_env, wait_up  # first: this checkout on sys.path

PG_URL = os.environ.get("THERMOWATCH_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
FAMILY = "attn_logit_max"
CHUNK = 50  # steps per raw chunk, as a 50-step ingest batch writes them


def keys(n: int) -> list[str]:
    return [f"{FAMILY}/blocks.{i}.attn" for i in range(n)]


# --- the histories -------------------------------------------------------------------------------


def seed(url: str, run_id: str, steps: int, n_series: int) -> None:
    """Write the run unless it is already complete (its config says seeded)."""
    from thermowatch.supervisor.db import make_engine, make_sessionmaker, upgrade
    from thermowatch.monitors.contract import RunInfo
    from thermowatch.supervisor.store import rollups, runs, thermometers

    upgrade(url)
    sessions = make_sessionmaker(make_engine(url))
    with sessions() as s:
        run = runs.get_run(s, run_id)
        if run is not None and run.config.get("seeded"):
            return
    t0 = time.perf_counter()
    with sessions.begin() as s:
        for a in (0, 1):
            runs.open_attempt(s, RunInfo(run_id, a, world_size=1, config={"seeded": False}))
        ids = thermometers.series_ids(s, keys(n_series))
        thermometers._register(s, run_id, ids.values(), None)
    sids = [ids[k] for k in keys(n_series)]
    rng = np.random.default_rng(0)
    block = CHUNK * 1310  # ~65k steps per transaction
    for attempt, lo, hi in ((0, 0, int(steps * 0.6)), (1, int(steps * 0.55) // CHUNK * CHUNK, steps - 1)):
        for blo in range(lo, hi + 1, block):
            bhi = min(blo + block - 1, hi)
            st = np.arange(blo, bhi + 1)
            vals = 10 + 0.1 * np.log1p(st)[:, None] + np.arange(n_series) * 0.01 + rng.standard_normal((len(st), n_series)) * 0.05
            if attempt == 0:  # the divergence the rollback abandoned
                vals[(st >= hi - 20) & (st < hi - 10), 7 % n_series] = 1e4
                vals[st == hi - 5, 7 % n_series] = np.nan
            vt = np.ascontiguousarray(vals.T)
            rows = [(run_id, sid, attempt, int(st[c]), int(st[min(c + CHUNK, len(st)) - 1]), len(st[c:c + CHUNK]),
                     None, vt[j, c:c + CHUNK].tobytes(), None)  # thermometers._COLS order; steps None: contiguous
                    for j, sid in enumerate(sids) for c in range(0, len(st), CHUNK)]
            with sessions.begin() as s:
                thermometers._insert_chunks(s, rows)
    t1 = time.perf_counter()
    with sessions.begin() as s:
        n = rollups.backfill(s, run_id)
        runs.get_run(s, run_id)
        from thermowatch.supervisor.store.orm import Run

        s.get(Run, run_id).config = {"seeded": True, "steps": steps, "series": n_series}
    print(f"  seeded {run_id}: {steps} steps x {n_series} series in {t1 - t0:.0f} s, "
          f"{n} rollup rows in {time.perf_counter() - t1:.0f} s", file=sys.stderr)


def analyze(url: str) -> None:
    """ANALYZE the PostgreSQL tables a chart reads. A deployed server's autovacuum does this after
    a bulk load; this machine's test server runs with autovacuum off, and without statistics the
    planner scanned a whole run's rollup index per query (series_id as a filter, not an index
    condition): 25-115 ms a query instead of 0.1-1 ms, most of a chart's time (EXPLAIN ANALYZE)."""
    if not url.startswith("postgresql"):
        return  # SQLite's planner uses the IN list on the primary key without statistics
    from thermowatch.supervisor.db import make_engine

    eng = make_engine(url)
    with eng.connect() as c:
        for t in ("thermometer_rollups", "thermometer_chunks", "run_series", "series", "attempts"):
            c.exec_driver_sql(f"ANALYZE {t}")
        c.commit()
    eng.dispose()


def db_url(kind: str, cache: Path, steps: int, n_series: int) -> str:
    if kind == "sqlite":
        cache.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{cache}/plot-{steps}x{n_series}.db"
    import sqlalchemy as sa

    schema = f"tw_bench_plot_{steps}x{n_series}"
    eng = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sa.text(f'CREATE SCHEMA IF NOT EXISTS "{schema}"'))
    eng.dispose()
    return f"{PG_URL}?options=-csearch_path%3D{schema}"


# --- the daemon ----------------------------------------------------------------------------------


def serve(url: str, port: int) -> None:
    """Subprocess entry: `thermowatch serve`'s app as deployed (auth on, detectors on)."""
    import io
    import tempfile

    import uvicorn

    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.notify.console import ConsoleNotifier
    from thermowatch.supervisor.serve.server import build_app, settle_heap
    from thermowatch.supervisor.app.service import Supervisor

    cfg = SupervisorConfig(data_dir=Path(tempfile.mkdtemp(prefix="tw-bench-plot-")), db_url=url,
                           api_token=os.environ["THERMOWATCH_API_TOKEN"])
    app = build_app(Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), judge_inline=False))
    settle_heap()  # as `thermowatch serve` does once the app is built
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _rss_mb(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS since start) of a process, MB."""
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            got[line.split(":")[0]] = int(line.split()[1]) / 1024
    return got["VmRSS"], got["VmHWM"]


class Daemon:
    def __init__(self, url: str) -> None:
        self.port, token = free_port(), new_token()
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", url, str(self.port)],
                                     env=repo_env(THERMOWATCH_API_TOKEN=token))
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=900,
                                 headers={"Authorization": f"Bearer {token}"})
        wait_up(lambda: self.http.get("/api/runs").raise_for_status(), self.proc, "the benchmark daemon did not start")

    def get(self, path: str, **params) -> tuple[float, bytes]:
        t = time.perf_counter()
        r = self.http.get(path, params=params)
        r.raise_for_status()
        return time.perf_counter() - t, r.content

    def rss(self) -> tuple[float, float]:
        return _rss_mb(self.proc.pid)

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(30)


def _median_ms(fn, repeat: int) -> float:
    return 1e3 * statistics.median(fn() for _ in range(repeat))


def new_paths(url: str, runs_: list[tuple[str, int]], repeat: int) -> list[dict]:
    """Chart JSON (1000 buckets per series, the default) and chart.png (1100 px) of the family,
    whole run, through one daemon; RSS peak after each history."""
    d = Daemon(url)
    try:
        d.get(f"/api/runs/{runs_[0][0]}/chart.png", metric=keys(1)[0], step_lo=0, step_hi=100)  # imports
        base = d.rss()[0]
        out = []
        for run_id, steps in runs_:
            _, body = d.get(f"/api/runs/{run_id}/chart", metric=FAMILY)
            chart = json.loads(body)
            assert chart["series"] and any(not x["current"] for x in chart["series"])
            js = _median_ms(lambda: d.get(f"/api/runs/{run_id}/chart", metric=FAMILY)[0], repeat)
            png = _median_ms(lambda: d.get(f"/api/runs/{run_id}/chart.png", metric=FAMILY)[0], repeat)
            zoom = _median_ms(lambda: d.get(f"/api/runs/{run_id}/chart", metric=FAMILY, step_lo=steps // 2,
                                            step_hi=steps // 2 + 999)[0], repeat)
            out.append({"run": run_id, "steps": steps, "path": "rollups", "json_ms": js, "png_ms": png,
                        "zoom_1000_steps_json_ms": zoom, "bucket_steps": chart["bucket_steps"],
                        "json_kb": len(body) / 1024, "rss_base_mb": base, "rss_peak_mb": d.rss()[1]})
        return out
    finally:
        d.close()


OLD_PLOT = r"""
import resource, sys, time
from thermowatch.supervisor.db import make_engine, make_sessionmaker
from thermowatch.supervisor.store import thermometers
from thermowatch.supervisor.charts.plots import Chart, render
from thermowatch.supervisor.store.views import envelope
url, run_id, family = sys.argv[1:4]
sessions = make_sessionmaker(make_engine(url))
render(Chart("warm-up", [("x", __import__("numpy").arange(3), __import__("numpy").arange(3.0))]))
t = time.perf_counter()
with sessions() as s:  # the plot path before rollups (pages.plot before issue 12), verbatim in effect
    ks = [k for k in thermometers.series_keys(s, run_id) if k.startswith(family + "/")]
    series, superseded = [], []
    for i, k in enumerate(ks):
        (st, v), old = thermometers.split_superseded(thermometers.history_by_attempt(s, run_id, k))
        series.append((k.split("/", 1)[1], *envelope(st, v, 2200)))  # plots.py thinned each line then
        superseded.extend((i, a, *envelope(st_, v_, 2200)) for a, (st_, v_) in old.items())
png = render(Chart(run_id, series, superseded, logy=True))
print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(png))
"""


def old_paths(url: str, run_id: str, steps: int, n_series: int, repeat: int) -> dict:
    """The full reads on the smaller history: the page's per-series JSON through a daemon, and
    the old plot path in a subprocess of its own (time and peak RSS)."""
    d = Daemon(url)
    try:
        d.get(f"/api/runs/{run_id}/series")
        base = d.rss()[0]

        def all_series() -> float:
            return sum(d.get(f"/api/runs/{run_id}/history", key=k, attempts="all")[0] for k in keys(n_series))

        js = _median_ms(all_series, max(1, repeat // 3))
        js_peak = d.rss()[1]
    finally:
        d.close()
    env = repo_env()
    times, peaks = [], []
    for _ in range(max(1, repeat // 3)):
        out = subprocess.run([sys.executable, "-c", OLD_PLOT, url, run_id, FAMILY], env=env, check=True,
                             capture_output=True, text=True).stdout.split()
        times.append(float(out[0]))
        peaks.append(float(out[1]))
    return {"run": run_id, "steps": steps, "path": "full read", "json_ms": js, "png_ms": 1e3 * statistics.median(times),
            "rss_base_mb": base, "rss_peak_mb": max(js_peak, max(peaks))}


def ingest_cost(url: str, steps: int, n_series: int, batch: int) -> dict:
    """What rolling up adds to the ingest transaction: thermometers.append of the same batches
    into two fresh runs, alternating batch by batch (this machine's load hits both alike), one
    with the rollup hook and one with it replaced by a no-op."""
    from thermowatch.monitors.contract import RunInfo, StepRecord
    from thermowatch.supervisor.db import make_engine, make_sessionmaker
    from thermowatch.supervisor.store import rollups, runs, thermometers

    sessions = make_sessionmaker(make_engine(url))
    tag = secrets.token_hex(4)
    with sessions.begin() as s:
        for r in ("with", "without"):
            runs.open_attempt(s, RunInfo(f"ingest-{r}-{tag}", 0, world_size=1))
    rng = np.random.default_rng(1)
    ks = [f"act_max/blocks.{i}.mlp" for i in range(n_series)]
    batches = []
    for b in range(0, steps, batch):
        vals = rng.standard_normal((batch, n_series)).tolist()
        batches.append([StepRecord(step=b + i, values=dict(zip(ks, row))) for i, row in enumerate(vals)])
    real, took = rollups.on_append, {"with": 0.0, "without": 0.0}
    try:
        for recs in batches:
            for r in ("with", "without"):
                rollups.on_append = real if r == "with" else (lambda *a, **k: 0)
                t = time.perf_counter()
                with sessions.begin() as s:
                    thermometers.append(s, f"ingest-{r}-{tag}", 0, recs)
                took[r] += time.perf_counter() - t
    finally:
        rollups.on_append = real
    n = steps * n_series
    return {"values": n, "with_values_per_s": n / took["with"], "without_values_per_s": n / took["without"],
            "overhead": took["with"] / took["without"] - 1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--steps", type=int, default=1_000_000, help="the big history's steps")
    ap.add_argument("--old-steps", type=int, default=100_000, help="the history both paths are timed on")
    ap.add_argument("--series", type=int, default=100)
    ap.add_argument("--repeat", type=int, default=5, help="timed requests per figure (median)")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/tw-bench-plot"))
    ap.add_argument("--ingest-steps", type=int, default=8192, help="steps of the ingest-cost comparison (0: skip)")
    ap.add_argument("--ingest-series", type=int, default=1000)
    ap.add_argument("--only-ingest", action="store_true", help="only the ingest-cost comparison")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    rows, costs = [], {}
    for kind in (["sqlite", "postgres"] if args.db == "both" else [args.db]):
        url = db_url(kind, args.cache, args.steps, args.series)
        small, big = f"small-{args.old_steps}", f"big-{args.steps}"
        if not args.only_ingest:
            seed(url, small, args.old_steps, args.series)
            seed(url, big, args.steps, args.series)
            analyze(url)
            old = old_paths(url, small, args.old_steps, args.series, args.repeat)
            new = new_paths(url, [(small, args.old_steps), (big, args.steps)], args.repeat)
            rows += [{"db": kind, **r} for r in [old, *new]]
        if args.ingest_steps:
            costs[kind] = ingest_cost(url, args.ingest_steps, args.ingest_series, CHUNK)
    load = os.getloadavg()[0]
    print(f"\nchart of {args.series} series ({FAMILY}), whole run, 1000 buckets / 1100 px; load avg {load:.1f}, "
          f"{os.cpu_count()} cores")
    print(f"{'db':<9}{'history':>16} {'path':<10}{'JSON ms':>10}{'PNG ms':>10}{'zoom ms':>9}{'RSS base':>10}{'RSS peak':>10}")
    for r in rows:
        zoom = f"{r['zoom_1000_steps_json_ms']:.0f}" if "zoom_1000_steps_json_ms" in r else "-"
        print(f"{r['db']:<9}{r['steps']:>9} x {args.series:<4} {r['path']:<10}{r['json_ms']:>10.0f}{r['png_ms']:>10.0f}"
              f"{zoom:>9}{r['rss_base_mb']:>8.0f}MB{r['rss_peak_mb']:>8.0f}MB")
    for kind in sorted({r["db"] for r in rows}):
        o = next(r for r in rows if r["db"] == kind and r["path"] == "full read")
        n = next(r for r in rows if r["db"] == kind and r["path"] == "rollups" and r["steps"] == o["steps"])
        print(f"{kind}: on {o['steps']} steps the rollups are x{o['json_ms'] / n['json_ms']:.0f} faster as JSON, "
              f"x{o['png_ms'] / n['png_ms']:.0f} as PNG")
    for kind, c in costs.items():
        print(f"{kind}: ingest of {args.ingest_steps} steps x {args.ingest_series} series in {CHUNK}-step batches "
              f"(thermometers.append): {c['with_values_per_s'] / 1e6:.2f} M values/s with rollups, "
              f"{c['without_values_per_s'] / 1e6:.2f} M/s without ({c['overhead']:+.0%})")
    if args.json:
        print(json.dumps({"load": load, "rows": rows, "ingest": costs}))


if __name__ == "__main__":
    main()
