"""The runs list at 10^5 runs (issue 21, item 4: an ingest token made 400-600 runs a second; at
10^5 runs `GET /api/runs` took 25.9 s on SQLite and 67.1 s on PostgreSQL, the index page 26-53 s,
and ingest p50 went from 5.3 to 44.5 ms while four lists ran). Goal: each read < 200 ms.

    python bench/listing.py                        # 10^5 runs, SQLite and PostgreSQL
    python bench/listing.py --db sqlite --json     # ... ends with one JSON line of figures
    python bench/listing.py --runs 20000 --explain # smaller, and the page's query plan
    python bench/listing.py --recent-flood         # the flood within the last day: /metrics' worst case

Each database is seeded twice by bulk SQL, in a fresh SQLite file and a throwaway PostgreSQL
schema (dropped after): --runs flood runs (one attempt each, made by one token at 500 a second,
as the report's token did) plus the runs a team really has, newest: --real runs of two attempts
(the second re-trains the last 1,000 steps of the first), an open incident each, and one run of
--big-steps steps; and the same real runs beside only --small flood runs. Every read goes through
a real `thermowatch serve` daemon (subprocess, uvicorn, auth on), --repeat times each (median and
max): the first page of GET /api/runs, a page in the middle (its cursor made from the database),
a page of 1,000, the index page `/`, the 404 of an unknown run, and a `/metrics` scrape (13.5 s
at 10^5 runs when it listed every run; now the 21 real runs, active by their open incidents, or
with --recent-flood the first limits.max_runs_in_metrics of 10^5 active ones). The big/small column is the
ratio of the two seeds' medians: about 1 when a read costs the same at any number of runs.
Then the ingest latency of 10-step batches: alone, while four threads read the list and the
index page every 0.5 s (open dashboards), and while they read back to back (the report's case).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import httpx

from common import free_port, new_token, repo_env, wait_up  # first: this checkout on sys.path

PG_URL = os.environ.get("THERMOWATCH_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
FLOOD_PER_S = 500  # runs a second the flooding token made (the report: 400-600)
T0 = dt.datetime(2026, 11, 1, tzinfo=dt.timezone.utc)


# --- the databases -------------------------------------------------------------------------------


def fresh_url(kind: str, tmp: Path, label: str = "listing") -> tuple[str, str | None]:
    """(url, PostgreSQL schema to drop after or None); `label` names the file or schema (the bench)."""
    if kind == "sqlite":
        return f"sqlite:///{tmp}/{label}-{uuid.uuid4().hex[:8]}.db", None
    import sqlalchemy as sa

    schema = f"tw_bench_{label}_{uuid.uuid4().hex[:8]}"
    eng = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    eng.dispose()
    return f"{PG_URL}?options=-csearch_path%3D{schema}", schema


def drop_schema(schema: str | None) -> None:
    if schema is None:
        return
    import sqlalchemy as sa

    eng = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    with eng.connect() as c:
        c.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
    eng.dispose()


def seed(url: str, n_flood: int, n_real: int, big_steps: int, real_steps: int = 5000, t0: dt.datetime = T0) -> dict:
    """Bulk inserts through SQLAlchemy Core (executemany; the steps by INSERT ... SELECT over a
    generated series). The flood's runs are older than the real ones, so the first page is the
    real runs (as a team would see it) and a middle page is all flood. From `t0` (an hour ago
    with --recent-flood: every flood run is then active for /metrics)."""
    import sqlalchemy as sa

    from thermowatch.supervisor.db import make_engine, upgrade
    from thermowatch.supervisor.store.orm import Attempt, Incident, Run

    upgrade(url)
    eng = make_engine(url)
    t = time.perf_counter()
    with eng.begin() as c:
        for lo in range(0, n_flood, 20_000):
            ids = range(lo, min(lo + 20_000, n_flood))
            at = [t0 + dt.timedelta(seconds=i / FLOOD_PER_S) for i in ids]
            c.execute(Run.__table__.insert(), [{"run_id": f"flood-{i:07d}", "config": {"lr": 3e-4}, "created_at": a,
                                                "created_by": "flood"} for i, a in zip(ids, at)])
            c.execute(Attempt.__table__.insert(), [{"run_id": f"flood-{i:07d}", "attempt": 0, "started_at": a,
                                                    "world_size": 8, "start_step": 0, "hosts": {}, "config": {}}
                                                   for i, a in zip(ids, at)])
        real_t0 = t0 + dt.timedelta(seconds=n_flood / FLOOD_PER_S + 60)
        real = [f"team-{i:03d}" for i in range(n_real)] + ["team-big"]
        for i, run_id in enumerate(real):
            at = real_t0 + dt.timedelta(minutes=i)
            c.execute(Run.__table__.insert(), {"run_id": run_id, "config": {"model": "350m"}, "created_at": at,
                                               "created_by": "trainer"})
            c.execute(Attempt.__table__.insert(), [{"run_id": run_id, "attempt": a, "started_at": at, "world_size": 8,
                                                    "start_step": 0, "hosts": {}, "config": {}} for a in (0, 1)])
            c.execute(Incident.__table__.insert(), {"run_id": run_id, "signal": "loss_spike", "module": "",
                                                    "onset_step": 10, "detect_step": 12, "opened_at": at})
            steps = big_steps if run_id == "team-big" else real_steps
            for attempt, lo, hi in ((0, 0, steps), (1, steps - 1000, steps - 200)):
                c.exec_driver_sql(_steps_sql(eng.dialect.name, run_id, attempt, lo, hi))
        if eng.dialect.name == "postgresql":
            # A deployed server's autovacuum analyzes after a bulk load; this test server runs
            # with it off (bench/plot.py), so the bench does it.
            for table in ("runs", "attempts", "incidents", "steps"):
                c.exec_driver_sql(f"ANALYZE {table}")
    eng.dispose()
    return {"runs": n_flood + len(real), "seed_s": time.perf_counter() - t}


def _steps_sql(dialect: str, run_id: str, attempt: int, lo: int, hi: int) -> str:
    cols = "INSERT INTO steps (run_id, step, attempt, sample_lo, sample_hi, tokens, wall_time) "
    row = f"SELECT '{run_id}', i, {attempt}, i * 64, i * 64 + 64, 0, 0.0"
    if dialect == "postgresql":
        return cols + row + f" FROM generate_series({lo}, {hi - 1}) AS i"
    return cols + f"WITH RECURSIVE g(i) AS (SELECT {lo} UNION ALL SELECT i + 1 FROM g WHERE i < {hi - 1}) " + row + " FROM g"


def middle_cursor(url: str) -> str:
    """The cursor of a page halfway down the list, as the API would hand it out."""
    from sqlalchemy import func, select

    from thermowatch.supervisor.store.views import encode_cursor
    from thermowatch.supervisor.db import make_engine, make_sessionmaker
    from thermowatch.supervisor.store.orm import Run
    from thermowatch.supervisor.store.runs import RunKey

    eng = make_engine(url)
    with make_sessionmaker(eng)() as s:
        n = s.execute(select(func.count()).select_from(Run)).scalar()
        row = s.execute(select(Run.created_at, Run.run_id).order_by(Run.created_at.desc(), Run.run_id.desc())
                        .offset(n // 2).limit(1)).one()
    eng.dispose()
    return encode_cursor(RunKey(row[0], row[1]))


def explain(url: str, cursor: str) -> str:
    """The database's plan of a middle page's statement (store.runs.runs_page), caught on its
    way to the driver."""
    from sqlalchemy import event

    from thermowatch.supervisor.store.views import decode_cursor
    from thermowatch.supervisor.db import make_engine, make_sessionmaker
    from thermowatch.supervisor.store import runs as runs_store

    eng = make_engine(url)
    sent: list[tuple[str, object]] = []
    event.listen(eng, "before_cursor_execute", lambda conn, cur, stmt, params, ctx, many: sent.append((stmt, params)))
    with make_sessionmaker(eng)() as s:
        runs_store.runs_page(s, 100, decode_cursor(cursor))
        stmt, params = sent[-1]
        prefix = "EXPLAIN QUERY PLAN " if eng.dialect.name == "sqlite" else "EXPLAIN "
        rows = s.connection().exec_driver_sql(prefix + stmt, params).all()
    eng.dispose()
    return "\n".join(" | ".join(str(x) for x in r) for r in rows)


# --- the daemon ----------------------------------------------------------------------------------


def serve(url: str, port: int) -> None:
    """Subprocess entry: `thermowatch serve`'s app as deployed (auth on, detectors on)."""
    import io

    import uvicorn

    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.notify.console import ConsoleNotifier
    from thermowatch.supervisor.serve.server import build_app, settle_heap
    from thermowatch.supervisor.app.service import Supervisor

    cfg = SupervisorConfig(data_dir=Path(tempfile.mkdtemp(prefix="tw-bench-listing-")), db_url=url,
                           api_token=os.environ["THERMOWATCH_API_TOKEN"],
                           limits=json.loads(os.environ.get("TW_BENCH_LIMITS", "{}")))
    app = build_app(Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), judge_inline=False))
    settle_heap()
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


# The read budget and gate off (supervisor.serve.api.reads): the daemon as it was before them.
UNBOUNDED_READS = {"max_reads_per_client_per_minute": 10**9, "max_reads_in_flight": 10**6}


class Daemon:
    def __init__(self, url: str, limits: dict | None = None) -> None:
        self.port, self.token = free_port(), new_token()
        env = repo_env(THERMOWATCH_API_TOKEN=self.token, TW_BENCH_LIMITS=json.dumps(limits or {}))
        self.proc = subprocess.Popen([sys.executable, __file__, "--serve", url, str(self.port)], env=env)
        self.http = self.client()
        wait_up(lambda: self.http.get("/healthz"), self.proc, "the benchmark daemon did not start")

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=600,
                            headers={"Authorization": f"Bearer {self.token}"})

    def close(self) -> None:
        self.http.close()
        self.proc.terminate()
        self.proc.wait(30)


def timed(http: httpx.Client, path: str, status: int = 200, **params) -> tuple[float, int]:
    t = time.perf_counter()
    r = http.get(path, params=params)
    took = time.perf_counter() - t
    if r.status_code != status:
        raise RuntimeError(f"GET {path} {params}: {r.status_code} {r.text[:300]}")
    return took * 1e3, len(r.content)


def reads(d: Daemon, cursor: str, repeat: int) -> dict[str, dict]:
    cases = {
        "GET /api/runs (first page)": ("/api/runs", 200, {}),
        "GET /api/runs?cursor= (middle)": ("/api/runs", 200, {"cursor": cursor}),
        "GET /api/runs?limit=1000": ("/api/runs", 200, {"limit": 1000}),
        "GET / (index page)": ("/", 200, {}),
        "GET /api/runs/unknown (404)": ("/api/runs/no-such-run", 404, {}),
        "GET /metrics": ("/metrics", 200, {}),
    }
    out = {}
    for name, (path, status, params) in cases.items():
        timed(d.http, path, status, **params)  # warm-up
        got = [timed(d.http, path, status, **params) for _ in range(repeat)]
        ms = [g[0] for g in got]
        out[name] = {"median_ms": statistics.median(ms), "max_ms": max(ms), "kb": got[0][1] / 1024}
    body = d.http.get("/api/runs").json()
    assert body["runs"][0]["run_id"] == "team-big" and body["next_cursor"], body["runs"][:2]
    gauges = {line.split()[0]: float(line.split()[1]) for line in d.http.get("/metrics").text.splitlines()
              if line.startswith(("thermowatch_runs ", "thermowatch_runs_active ", "thermowatch_runs_listed "))}
    out["GET /metrics"].update(gauges)
    return out


def ingest_under_reads(d: Daemon, batches: int, readers: int = 4, paced_s: float = 0.5) -> dict[str, dict]:
    """POST 10-step batches (the daemon judges them) one at a time: alone; while `readers`
    threads, each with a read token of its own, read the list or the index page every
    `paced_s` (open dashboards refreshing); and while they read back to back (the report's
    "four lists running"). Latency per batch; reads served, and refused (429 over a client's
    budget, 503 after waiting for the gate)."""
    tokens = []
    for _ in range(readers):
        r = d.http.post("/api/tokens", json={"name": f"reader-{secrets.token_hex(3)}", "scopes": ["read"]})
        r.raise_for_status()
        tokens.append(r.json()["secret"])
    run = f"ingest-{secrets.token_hex(3)}"
    d.http.post("/api/runs", json={"run_id": run, "attempt": 0, "world_size": 8}).raise_for_status()
    step = 0

    def post_batches(n: int) -> list[float]:
        nonlocal step
        out = []
        for _ in range(n):
            recs = [{"step": step + i, "loss": 3.0 - 1e-4 * (step + i), "grad_norm": 0.5, "lr": 3e-4,
                     **{f"act_max/blocks.{b}.mlp": 4.0 + b for b in range(16)}} for i in range(10)]
            step += 10
            t = time.perf_counter()
            d.http.post(f"/api/runs/{run}/attempts/0/steps", json={"records": recs}).raise_for_status()
            out.append((time.perf_counter() - t) * 1e3)
        return out

    def stats(ms: list[float]) -> dict:
        return {"p50_ms": statistics.median(ms), "p99_ms": sorted(ms)[int(0.99 * (len(ms) - 1))], "max_ms": max(ms)}

    def under(pause_s: float | None) -> dict:
        stop, served, refused = threading.Event(), [0], [0]

        def reader(i: int) -> None:
            with d.client() as c:
                c.headers["Authorization"] = f"Bearer {tokens[i]}"
                while not stop.is_set():
                    r = c.get("/api/runs" if i % 2 == 0 else "/")
                    if r.status_code in (429, 503):  # a well-behaved client waits as it is told
                        refused[0] += 1
                        stop.wait(float(r.headers.get("Retry-After", 1)))
                        continue
                    r.raise_for_status()
                    served[0] += 1
                    if pause_s:
                        stop.wait(pause_s)

        threads = [threading.Thread(target=reader, args=(i,), daemon=True) for i in range(readers)]
        for th in threads:
            th.start()
        time.sleep(0.5)
        t = time.perf_counter()
        ms = post_batches(batches)
        took = time.perf_counter() - t
        stop.set()
        for th in threads:
            th.join(60)
        return {**stats(ms), "reads_per_s": served[0] / took, "refused_per_s": refused[0] / took}

    post_batches(20)  # warm-up: the detectors' windows
    return {"alone": stats(post_batches(batches)),
            f"{readers} readers, each every {paced_s:g} s": under(paced_s),
            f"{readers} readers back to back": under(None)}


# --- main ----------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--runs", type=int, default=100_000, help="flood runs of the big seed")
    ap.add_argument("--small", type=int, default=1_000, help="flood runs of the small seed (the ratio's base)")
    ap.add_argument("--real", type=int, default=20, help="real runs (newest), beside one of --big-steps steps")
    ap.add_argument("--big-steps", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=9, help="timed requests per figure (median)")
    ap.add_argument("--batches", type=int, default=200, help="ingest batches timed alone and under reads (0: skip)")
    ap.add_argument("--explain", action="store_true", help="print the middle page's query plan")
    ap.add_argument("--recent-flood", action="store_true",
                    help="seed from an hour ago, not 2026-11-01: every flood run is active for /metrics (the "
                         "worst case: a scrape lists limits.max_runs_in_metrics runs and counts the rest)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return
    tmp = Path(tempfile.mkdtemp(prefix="tw-bench-listing-"))
    rows, ingest, seeds = [], {}, {}
    for kind in (["sqlite", "postgres"] if args.db == "both" else [args.db]):
        figures = {}
        for size, n in (("small", args.small), ("big", args.runs)):
            url, schema = fresh_url(kind, tmp)
            try:
                t0 = dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=1) if args.recent_flood else T0
                seeds[f"{kind}/{size}"] = seed(url, n, args.real, args.big_steps, t0=t0)
                print(f"  {kind}: seeded {seeds[f'{kind}/{size}']['runs']} runs in "
                      f"{seeds[f'{kind}/{size}']['seed_s']:.0f} s", file=sys.stderr)
                cursor = middle_cursor(url)
                if args.explain and size == "big":
                    print(f"\n{kind}, a middle page's plan:\n{explain(url, cursor)}\n")
                d = Daemon(url)
                try:
                    figures[size] = reads(d, cursor, args.repeat)
                    if size == "big" and args.batches:
                        ingest[kind] = ingest_under_reads(d, args.batches)
                finally:
                    d.close()
                if size == "big" and args.batches:  # side by side: the same seed, reads unbounded
                    d = Daemon(url, UNBOUNDED_READS)
                    try:
                        ingest[f"{kind}, reads unbounded"] = ingest_under_reads(d, args.batches)
                    finally:
                        d.close()
            finally:
                drop_schema(schema)
        for name, big in figures["big"].items():
            small = figures["small"][name]
            rows.append({"db": kind, "read": name, "runs": seeds[f"{kind}/big"]["runs"], **big,
                         "small_runs": seeds[f"{kind}/small"]["runs"], "small_median_ms": small["median_ms"],
                         "big_over_small": big["median_ms"] / small["median_ms"]})
    load = os.getloadavg()[0]
    print(f"\nreads through the daemon, median of {args.repeat} (max); load avg {load:.1f}, {os.cpu_count()} cores")
    print(f"{'db':<9}{'read':<33}{'runs':>8}{'median ms':>11}{'max ms':>9}{'KB':>8}"
          f"{'runs':>8}{'median ms':>11}{'big/small':>10}")
    for r in rows:
        print(f"{r['db']:<9}{r['read']:<33}{r['runs']:>8}{r['median_ms']:>11.1f}{r['max_ms']:>9.1f}{r['kb']:>8.1f}"
              f"{r['small_runs']:>8}{r['small_median_ms']:>11.1f}{r['big_over_small']:>10.2f}")
    for kind, res in ingest.items():
        print(f"{kind}: ingest of 10-step batches at {seeds[kind.split(',')[0] + '/big']['runs']} runs: "
              + "; ".join(f"{k}: p50 {v['p50_ms']:.1f} ms, p99 {v['p99_ms']:.1f}, max {v['max_ms']:.1f}"
                          + (f" ({v['reads_per_s']:.0f} reads/s served, {v['refused_per_s']:.0f}/s refused)"
                             if "reads_per_s" in v else "")
                          for k, v in res.items()))
    for r in rows:
        if r["read"] == "GET /metrics":
            print(f"{r['db']}: /metrics at {r['thermowatch_runs']:.0f} runs ({r['thermowatch_runs_active']:.0f} active) "
                  f"listed {r['thermowatch_runs_listed']:.0f}")
    worst = max((r["median_ms"] for r in rows), default=0.0)
    print(f"goal: every read < 200 ms at {args.runs} runs: {'met' if worst < 200 else 'NOT met'} "
          f"(slowest median {worst:.1f} ms)")
    if args.json:
        print(json.dumps({"load": load, "rows": rows, "ingest": ingest, "seeds": seeds}))


if __name__ == "__main__":
    main()
