"""Ingest throughput of the daemon as deployed: thermometer values/s from HTTP request to the
value committed and judged by the detectors, next to the write-only ingest router and the raw
driver doing the same inserts, on SQLite and PostgreSQL; plus a 10^6-step history read.

    python bench/ingest.py                       # 2,000 steps x 781 values, both databases
    python bench/ingest.py --steps 5000 --json   # ... ends with one JSON line of figures
    python bench/ingest.py --repeat 5 --judge-thread   # 5 interleaved daemon/raw pairs; medians
    python bench/ingest.py --layouts             # narrow vs wide vs chunk rows, raw drivers
    python bench/ingest.py --validation          # what checking a batch costs (no database)

The daemon runs in a subprocess (real uvicorn + thermowatch serve's app), the client posts
pre-encoded batches of --batch steps x --values values with httpx, one at a time like the run
controller does, in the columns body the HttpSink sends (monitors.columns); the write-only
router is also fed the per-step JSON form, beside it. The raw-driver rows are the same chunk + step rows (sqlite3 executemany with
ON CONFLICT DO NOTHING; psycopg COPY, which has no ON CONFLICT). The history read is seeded with
the raw driver: one series of --history-steps steps in 50-step chunks.

--repeat N measures the daemon and the raw driver N times, in turn (fresh database each time),
and reports the medians and the ratio of each pair: a 1,000-step raw run lasts ~0.2 s, and on a
shared VM the raw driver alone has swung 3.6-7.0 M values/s between runs. --judge-thread adds,
in each pair, the daemon with `judge_process: false` (the detectors on a thread of the daemon's
own process, the previous design).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import httpx
import numpy as np

from common import free_port, new_token, repo_env, wait_up

PG_URL = os.environ.get("THERMOWATCH_BENCH_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def serve(url: str, port: int, mode: str = "daemon") -> None:
    """Subprocess entry. mode "daemon": the daemon as deployed (supervisor.serve.server.build_app over a
    Supervisor: detectors, policy and alerts on; it answers, then judges). mode "write_only": the
    ingest router over a bare Ingestor, no detectors (last round's figure, kept beside it)."""
    import tempfile

    import uvicorn
    from fastapi import FastAPI

    from thermowatch.supervisor.db import make_engine, make_sessionmaker, upgrade

    upgrade(url)
    if mode in ("daemon", "daemon_thread"):
        import io

        from thermowatch.supervisor.app.config import SupervisorConfig
        from thermowatch.supervisor.notify.console import ConsoleNotifier
        from thermowatch.supervisor.serve.server import build_app, settle_heap
        from thermowatch.supervisor.app.service import Supervisor

        cfg = SupervisorConfig(data_dir=Path(tempfile.mkdtemp(prefix="tw-bench-daemon-")), db_url=url,
                               api_token=os.environ["THERMOWATCH_API_TOKEN"],  # auth on, as deployed
                               **({"judge_process": False} if mode == "daemon_thread" else {}))
        app = build_app(Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), judge_inline=False))
        settle_heap()  # as `thermowatch serve` does once the app is built
    else:
        from thermowatch.supervisor.serve.guard import Guard
        from thermowatch.supervisor.serve.api.ingest import make_router
        from thermowatch.supervisor.serve.auth import Authenticator
        from thermowatch.supervisor.ingest.ingestor import Ingestor

        sessions = make_sessionmaker(make_engine(url))
        app = FastAPI()
        guard = Guard(Authenticator(sessions, config_token=os.environ["THERMOWATCH_API_TOKEN"]))
        app.include_router(make_router(Ingestor(sessions), guard=guard))
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def _keys(n: int) -> list[str]:
    from detectors import keys

    return keys(n)


def _bodies(steps: int, batch: int, keys: list[str], rng, form: str = "json", positive: bool = False) -> list[bytes]:
    """Batches as the trainer's HttpSink sends them: form "columns" is its body today
    (StepColumns.from_records(records).encode(), monitors.columns); "json" is the per-step JSON
    form (replays of old spools, older clients), the body before issue 10's columns."""
    from thermowatch.monitors.columns import StepColumns
    from thermowatch.monitors.contract import StepRecord

    from detectors import WORLD, ranked

    out = []
    rk = ranked(keys)  # every max/min key names the rank that held it, as the run controller sends
    for lo in range(0, steps, batch):
        vals = rng.standard_normal((batch, len(keys)))
        if positive:  # as real norms, logits and ratios are: every point reaches the log-scale detectors
            vals = np.abs(vals)
        holders = rng.integers(0, WORLD, (batch, len(rk)))
        recs = [StepRecord(step=lo + i, values=dict(zip(keys, vals[i].tolist())), sample_lo=(lo + i) * 64,
                           sample_hi=(lo + i + 1) * 64, tokens=131072, wall_time=1.0,
                           ranks=dict(zip(rk, holders[i].tolist())))
                for i in range(batch)]
        if form == "columns":
            out.append(StepColumns.from_records(recs).encode())
        else:
            out.append(json.dumps({"records": [r.to_json() for r in recs]}).encode())
    return out


def _content_type(body: bytes) -> str:
    from thermowatch.monitors.columns import COLUMNS_CONTENT_TYPE, MAGIC

    return COLUMNS_CONTENT_TYPE if body[:4] == MAGIC else "application/json"


@contextlib.contextmanager
def running_daemon(url: str, mode: str = "daemon", run_id: str = "bench") -> Iterator[tuple[httpx.Client, int]]:
    """`serve` in a subprocess on a free port, auth on with a fresh admin token; yields a client
    holding that token, once attempt 0 of `run_id` is open, and the daemon's pid. Stops it after."""
    port = free_port()
    token = new_token()
    proc = subprocess.Popen([sys.executable, __file__, "--serve", url, str(port), mode],
                            env=repo_env(THERMOWATCH_API_TOKEN=token))
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(base_url=base, timeout=600, headers={"Authorization": f"Bearer {token}"}) as c:
            wait_up(lambda: c.post("/api/runs", json={"run_id": run_id, "attempt": 0, "world_size": 8}).raise_for_status(),
                    proc, "benchmark server did not start", timeout_s=60, every_s=0.1)
            yield c, proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def bench_http(url: str, bodies: list[bytes], n_values: int, mode: str) -> tuple[float, float, float]:
    """(values/s from the first request to the last value stored *and judged*, p99 ms per batch
    request, values/s until the last answer). Without detectors the two rates are the same."""
    with running_daemon(url, mode) as (c, _):
        hdr = {"content-type": _content_type(bodies[0])}
        c.post("/api/runs/bench/attempts/0/steps", content=bodies[0], headers=hdr).raise_for_status()  # warm-up
        _settle(c, mode)
        lat = []
        t = time.perf_counter()
        for b in bodies[1:]:
            t1 = time.perf_counter()
            r = c.post("/api/runs/bench/attempts/0/steps", content=b, headers=hdr)
            r.raise_for_status()
            lat.append(time.perf_counter() - t1)
        answered = time.perf_counter() - t
        _settle(c, mode)
        judged = time.perf_counter() - t
    n = n_values * (len(bodies) - 1) / len(bodies)
    return n / judged, 1e3 * float(np.percentile(lat, 99)), n / answered


def _settle(c: httpx.Client, mode: str) -> None:
    """Wait until the daemon has judged everything it answered (commit, answer, then judge)."""
    while mode.startswith("daemon") and c.get("/healthz").json().get("judge_backlog"):
        time.sleep(0.02)


def bench_inprocess(url: str, bodies: list[bytes], n_values: int) -> float:
    """The server's work without HTTP: StepColumns.decode + Ingestor.write_columns (the columns
    body the sink sends)."""
    from thermowatch.monitors.columns import StepColumns
    from thermowatch.monitors.contract import RunInfo
    from thermowatch.supervisor.db import make_engine, make_sessionmaker, upgrade
    from thermowatch.supervisor.ingest.ingestor import Ingestor

    upgrade(url)
    eng = make_engine(url)
    ing = Ingestor(make_sessionmaker(eng))
    ing.open_run(RunInfo("inproc", 0, 8))
    ing.write_columns("inproc", 0, StepColumns.decode(bodies[0]))  # warm-up
    t = time.perf_counter()
    for b in bodies[1:]:
        ing.write_columns("inproc", 0, StepColumns.decode(b))
    dt = time.perf_counter() - t
    eng.dispose()
    return n_values * (len(bodies) - 1) / len(bodies) / dt


def _chunk_rows(steps: int, batch: int, n_series: int, rng, run="raw"):
    """The rows ingest writes: per batch, one chunk per series and one row per step; the series
    that name a rank (bench/detectors.ranked) carry its int32 blob, as ingest stores it."""
    from detectors import WORLD, ranked

    has = set(ranked(_keys(n_series)))
    has_rank = [k in has for k in _keys(n_series)]
    for lo in range(0, steps, batch):
        vt = np.ascontiguousarray(rng.standard_normal((batch, n_series)).T)
        rt = rng.integers(0, WORLD, (n_series, batch)).astype(np.int32)
        st = np.arange(lo, lo + batch, dtype=np.int64)
        # steps NULL: contiguous, exactly as ingest stores them
        chunks = [(run, j + 1, 0, lo, lo + batch - 1, batch, None, vt[j].tobytes(),
                   rt[j].tobytes() if has_rank[j] else None) for j in range(n_series)]
        step_rows = [(run, int(s), 0, int(s) * 64, int(s + 1) * 64, 131072, 1.0) for s in st]
        yield chunks, step_rows


_INS_CHUNK = ('INSERT INTO thermometer_chunks (run_id, series_id, attempt, first_step, last_step, n, steps, "values", ranks)'
              " VALUES (?,?,?,?,?,?,?,?,?) ON CONFLICT DO NOTHING")
_INS_STEP = ("INSERT INTO steps (run_id, step, attempt, sample_lo, sample_hi, tokens, wall_time) VALUES (?,?,?,?,?,?,?)"
             " ON CONFLICT DO NOTHING")
_CHUNK_COLS = '(run_id, series_id, attempt, first_step, last_step, n, steps, "values", ranks)'
_STEP_COLS = "(run_id, step, attempt, sample_lo, sample_hi, tokens, wall_time)"


def _prepare_raw(kind: str, target: str, n_series: int, run: str) -> None:
    from thermowatch.supervisor.db import make_engine, make_sessionmaker
    from thermowatch.supervisor.store import runs, thermometers
    from thermowatch.monitors.contract import RunInfo

    eng = make_engine(target)
    with make_sessionmaker(eng).begin() as s:
        runs.open_attempt(s, RunInfo(run, 0, 8))
        thermometers.series_ids(s, _keys(n_series))
    eng.dispose()


def bench_raw_sqlite(path: str, steps: int, batch: int, n_series: int, rng) -> float:
    _prepare_raw("sqlite", f"sqlite:///{path}", n_series, "raw")
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA synchronous=NORMAL")
    rows = list(_chunk_rows(steps, batch, n_series, rng))
    t = time.perf_counter()
    for chunks, step_rows in rows:
        con.executemany(_INS_STEP, step_rows)
        con.executemany(_INS_CHUNK, chunks)
        con.commit()
    dt = time.perf_counter() - t
    con.close()
    return steps * n_series / dt


def _pg_conninfo(schema: str) -> str:
    from sqlalchemy.engine import make_url

    u = make_url(PG_URL)
    return f"host={u.host} port={u.port or 5432} user={u.username} dbname={u.database} options=-csearch_path={schema}"


def bench_raw_pg(schema: str, steps: int, batch: int, n_series: int, rng) -> float:
    import psycopg

    _prepare_raw("pg", _pg_url(schema), n_series, "raw")
    rows = list(_chunk_rows(steps, batch, n_series, rng))
    with psycopg.connect(_pg_conninfo(schema)) as con:
        t = time.perf_counter()
        for chunks, step_rows in rows:
            with con.cursor() as cur:
                with cur.copy(f"COPY steps {_STEP_COLS} FROM STDIN") as cp:
                    for r in step_rows:
                        cp.write_row(r)
                with cur.copy(f"COPY thermometer_chunks {_CHUNK_COLS} FROM STDIN") as cp:
                    for r in chunks:
                        cp.write_row(r)
            con.commit()
        dt = time.perf_counter() - t
    return steps * n_series / dt


def _pg_url(schema: str) -> str:
    return f"{PG_URL}?options=-csearch_path%3D{schema}"


def seed_and_read_history(url: str, n_steps: int, reps: int = 5) -> tuple[float, int]:
    """Seed one series of n_steps in 50-step chunks with the raw driver; time history() (ms, best of reps)."""
    from thermowatch.supervisor.db import make_engine, make_sessionmaker
    from thermowatch.supervisor.store import thermometers

    rng = np.random.default_rng(1)
    key = _keys(1)[0]
    _prepare_raw("", url, 1, "hist")
    gen = _chunk_rows(n_steps, 50, 1, rng, run="hist")
    chunks = [c for cs, _ in gen for c in cs]
    if url.startswith("sqlite"):
        con = sqlite3.connect(url.removeprefix("sqlite:///"))
        con.executemany(_INS_CHUNK, chunks)
        con.commit()
        con.close()
    else:
        import psycopg

        schema = url.rsplit("%3D", 1)[1]
        with psycopg.connect(_pg_conninfo(schema)) as con, con.cursor() as cur:
            with cur.copy(f"COPY thermometer_chunks {_CHUNK_COLS} FROM STDIN") as cp:
                for r in chunks:
                    cp.write_row(r)
            cur.execute("ANALYZE thermometer_chunks")
    eng = make_engine(url)
    sessions = make_sessionmaker(eng)
    best = float("inf")
    for _ in range(reps):
        with sessions() as s:
            t = time.perf_counter()
            steps, vals = thermometers.history(s, "hist", key)
            best = min(best, time.perf_counter() - t)
    eng.dispose()
    assert len(steps) == n_steps, (len(steps), n_steps)
    return best * 1e3, len(steps)


def bench_layouts(steps: int, n_series: int, batch: int) -> dict:
    """The measurement behind the chunk layout (store/thermometers.py): raw drivers, three
    layouts, write values/s and one-series read ms, in a throwaway file / schema."""
    import psycopg

    rng = np.random.default_rng(0)
    ddl = {
        "narrow": ("narrow(run int, attempt int, series int, step bigint, rank int, value double precision, "
                   "primary key(run, series, step, attempt))"),
        "wide": "wide(run int, attempt int, step bigint, vals BLOB, primary key(run, step, attempt))",
        "chunk": ("chunk(run int, series int, attempt int, first_step bigint, last_step bigint, vals BLOB, "
                  "primary key(run, series, attempt, first_step))"),
    }
    read = {"narrow": "select step, value from narrow where run=1 and series=7 order by step",
            "wide": "select step, vals from wide where run=1 order by step",
            "chunk": "select first_step, vals from chunk where run=1 and series=7 order by attempt, first_step"}

    def rows(layout, lo):
        v = rng.standard_normal((batch, n_series))
        if layout == "narrow":
            return [(1, 0, j, lo + i, -1, float(v[i, j])) for i in range(batch) for j in range(n_series)]
        if layout == "wide":
            return [(1, 0, lo + i, v[i].tobytes()) for i in range(batch)]
        vt = np.ascontiguousarray(v.T)
        return [(1, j, 0, lo, lo + batch - 1, vt[j].tobytes()) for j in range(n_series)]

    def decode(layout, fetched):
        if layout == "narrow":
            return np.array([r[1] for r in fetched])
        if layout == "wide":
            return np.array([np.frombuffer(r[1], np.float64)[7] for r in fetched])
        return np.frombuffer(b"".join(bytes(r[1]) for r in fetched), np.float64)

    out: dict = {}
    tmp = tempfile.mkdtemp(prefix="tw-layouts-")
    schema = f"tw_layouts_{uuid.uuid4().hex[:8]}"
    admin = psycopg.connect(_pg_conninfo("public"), autocommit=True)
    admin.execute(f'CREATE SCHEMA "{schema}"')
    try:
        for layout in ddl:
            con = sqlite3.connect(f"{tmp}/{layout}.db")
            con.execute("PRAGMA journal_mode=WAL")
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute("create table " + ddl[layout])
            t = time.perf_counter()
            for lo in range(0, steps, batch):
                r = rows(layout, lo)
                con.executemany(f"insert into {layout.split('(')[0]} values ({','.join('?' * len(r[0]))}) "
                                "on conflict do nothing", r)
                con.commit()
            w = steps * n_series / (time.perf_counter() - t)
            t = time.perf_counter()
            n = len(decode(layout, con.execute(read[layout]).fetchall()))
            out[("sqlite", layout)] = (w, (time.perf_counter() - t) * 1e3, n)
            con.close()
            with psycopg.connect(_pg_conninfo(schema)) as con:
                con.execute("create table " + ddl[layout].replace("BLOB", "bytea"))
                t = time.perf_counter()
                for lo in range(0, steps, batch):
                    with con.cursor().copy(f"COPY {layout} FROM STDIN") as cp:
                        for r in rows(layout, lo):
                            cp.write_row(r)
                    con.commit()
                w = steps * n_series / (time.perf_counter() - t)
                t = time.perf_counter()
                n = len(decode(layout, con.execute(read[layout], binary=True).fetchall()))
                out[("postgres", layout)] = (w, (time.perf_counter() - t) * 1e3, n)
    finally:
        admin.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')
        admin.close()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"layouts: {steps} steps x {n_series} series, batches of {batch} steps, raw drivers "
          "(sqlite3 executemany, psycopg COPY)")
    print(f"{'database':10} {'layout':8} {'write values/s':>15} {'read 1 series ms':>17}")
    for (d, layout), (w, r, _) in out.items():
        print(f"{d:10} {layout:8} {w:>15,.0f} {r:>17.1f}")
    return {f"{d}/{layout}": {"write_values_per_s": round(w), "read_ms": round(r, 1)} for (d, layout), (w, r, _) in out.items()}


def bench_validation(steps: int, batch: int, n_values: int, reps: int = 7) -> dict:
    """CPU time per batch of reading it (json.loads + records_from_json), of the checks ingest
    runs on it (Ingestor._validate_batch: types, ranges, metric keys, supervisor.limits), and, for
    comparison, of validating the same JSON with the documented pydantic model (StepsBody), which
    ingest does not do. Process CPU time, best of `reps`: less disturbed by a shared machine."""
    from pydantic import TypeAdapter

    from thermowatch.supervisor.serve.api.schemas import StepsBody
    from thermowatch.supervisor.ingest.ingestor import Ingestor, records_from_json

    bodies = _bodies(steps, batch, _keys(n_values), np.random.default_rng(0), "json")
    objs = [json.loads(b) for b in bodies]
    ing = Ingestor(None)
    recs = [records_from_json(o, ing.limits) for o in objs]
    model = TypeAdapter(StepsBody)

    def best(fn) -> float:
        times = []
        for _ in range(reps):
            t = time.process_time()
            for i in range(len(bodies)):
                fn(i)
            times.append((time.process_time() - t) / len(bodies) * 1e3)
        return min(times)

    out = {"parse_ms": best(lambda i: records_from_json(json.loads(bodies[i]), ing.limits)),
           "checks_ms": best(lambda i: ing._validate_batch("bench", 0, recs[i])),
           "pydantic_model_ms": best(lambda i: model.validate_python(objs[i]))}
    print(f"validation: {len(bodies)} batches of {batch} steps x {n_values} values, CPU ms per batch (best of {reps})")
    print(f"  read (json.loads + records_from_json)  {out['parse_ms']:8.2f}")
    print(f"  ingest's checks (_validate_batch)      {out['checks_ms']:8.2f}  ({out['checks_ms'] / out['parse_ms']:.3f}x read)")
    print(f"  pydantic StepsBody (not used)          {out['pydantic_model_ms']:8.2f}  "
          f"({out['pydantic_model_ms'] / out['parse_ms']:.2f}x read)")
    return {k: round(v, 2) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000, help="steps posted per database (default 2000)")
    ap.add_argument("--batch", type=int, default=50, help="steps per HTTP batch")
    ap.add_argument("--values", type=int, default=781, help="thermometer values per step (a 48-layer model's 781 series)")
    ap.add_argument("--history-steps", type=int, default=1_000_000)
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    ap.add_argument("--positive", action="store_true",
                    help="|standard normal| values (real norms and logits are positive); default: signed, so the "
                         "log-scale detectors skip half the points at random")
    ap.add_argument("--layouts", action="store_true", help="compare storage layouts with the raw drivers instead")
    ap.add_argument("--validation", action="store_true", help="time reading and checking a batch (no database)")
    ap.add_argument("--repeat", type=int, default=1, help="daemon/raw pairs per database, in turn (medians)")
    ap.add_argument("--judge-thread", action="store_true",
                    help="also the daemon with judge_process: false (detectors on a thread), in each pair")
    ap.add_argument("--serve", nargs=3, metavar=("URL", "PORT", "MODE"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        serve(a.serve[0], int(a.serve[1]), a.serve[2])
        return
    if a.validation:
        res = bench_validation(a.steps, a.batch, a.values)
        if a.json:
            print(json.dumps({"bench": "ingest-validation", "steps": a.steps, "batch": a.batch, "values": a.values,
                              **res}))
        return
    import psycopg

    if a.layouts:
        res = bench_layouts(a.steps, a.values, a.batch)
        if a.json:
            print(json.dumps({"bench": "ingest-layouts", "steps": a.steps, "values": a.values, "results": res}))
        return
    rng = np.random.default_rng(0)
    keys = _keys(a.values)
    bodies = _bodies(a.steps, a.batch, keys, rng, "columns", a.positive)
    json_bodies = _bodies(a.steps, a.batch, keys, np.random.default_rng(0), "json", a.positive)
    n_values = a.steps * a.values
    mb = sum(len(b) for b in bodies) / len(bodies) / 1e6
    mb_json = sum(len(b) for b in json_bodies) / len(json_bodies) / 1e6
    results: dict[str, dict] = {}
    tmp = tempfile.mkdtemp(prefix="tw-bench-")
    dbs = ["sqlite", "postgres"] if a.db == "both" else [a.db]
    try:
        for name in dbs:
            if name == "sqlite":
                from thermowatch.supervisor.db import upgrade

                pairs = []
                for r in range(a.repeat):
                    http = bench_http(f"sqlite:///{tmp}/http{r}.db", bodies, n_values, "daemon")
                    thread = (bench_http(f"sqlite:///{tmp}/thread{r}.db", bodies, n_values, "daemon_thread")
                              if a.judge_thread else None)
                    upgrade(f"sqlite:///{tmp}/raw{r}.db")
                    pairs.append((http, thread, bench_raw_sqlite(f"{tmp}/raw{r}.db", a.steps, a.batch, a.values, rng)))
                wo = bench_http(f"sqlite:///{tmp}/write_only.db", bodies, n_values, "write_only")
                wo_json = bench_http(f"sqlite:///{tmp}/write_only_json.db", json_bodies, n_values, "write_only")
                inproc = bench_inprocess(f"sqlite:///{tmp}/inproc.db", bodies, n_values)
                hist_ms, n = seed_and_read_history(f"sqlite:///{tmp}/raw0.db", a.history_steps)
            else:
                from thermowatch.supervisor.db import upgrade

                schemas = [f"tw_bench_{uuid.uuid4().hex[:8]}" for _ in range(5 + 3 * a.repeat)]
                admin = psycopg.connect(_pg_conninfo("public"), autocommit=True)
                for s in schemas:
                    admin.execute(f'CREATE SCHEMA "{s}"')
                try:
                    pairs = []
                    for r in range(a.repeat):
                        sh, st, sr = schemas[5 + 3 * r:8 + 3 * r]
                        http = bench_http(_pg_url(sh), bodies, n_values, "daemon")
                        thread = bench_http(_pg_url(st), bodies, n_values, "daemon_thread") if a.judge_thread else None
                        upgrade(_pg_url(sr))
                        pairs.append((http, thread, bench_raw_pg(sr, a.steps, a.batch, a.values, rng)))
                    wo = bench_http(_pg_url(schemas[3]), bodies, n_values, "write_only")
                    wo_json = bench_http(_pg_url(schemas[4]), json_bodies, n_values, "write_only")
                    inproc = bench_inprocess(_pg_url(schemas[2]), bodies, n_values)
                    hist_ms, n = seed_and_read_history(_pg_url(schemas[5 + 2]), a.history_steps)
                finally:
                    for s in schemas:
                        admin.execute(f'DROP SCHEMA IF EXISTS "{s}" CASCADE')
                    admin.close()
            med = lambda xs: float(np.median(xs))  # noqa: E731
            raw = med([p[2] for p in pairs])
            http = tuple(med([p[0][i] for p in pairs]) for i in range(3))
            results[name] = {
                "detectors_on": {"values_per_s": round(http[0]), "p99_batch_ms": round(http[1], 1),
                                 "answered_values_per_s": round(http[2]),
                                 "over_raw_each": [round(p[0][0] / p[2], 4) for p in pairs]},
                "write_only": {"values_per_s": round(wo[0]), "p99_batch_ms": round(wo[1], 1)},
                "write_only_json": {"values_per_s": round(wo_json[0]), "p99_batch_ms": round(wo_json[1], 1)},
                "inprocess_write_only_values_per_s": round(inproc), "raw_values_per_s": round(raw),
                "detectors_on_over_raw": round(med([p[0][0] / p[2] for p in pairs]), 4),
                "raw_values_per_s_each": [round(p[2]) for p in pairs], "write_only_over_raw": round(wo[0] / raw, 3),
                "write_only_json_over_raw": round(wo_json[0] / raw, 3),
                "history_ms": round(hist_ms, 1), "history_points": n}
            if a.judge_thread:
                results[name]["detectors_on_judge_thread"] = {
                    "values_per_s": round(med([p[1][0] for p in pairs])), "p99_batch_ms": round(med([p[1][1] for p in pairs]), 1),
                    "over_raw": round(med([p[1][0] / p[2] for p in pairs]), 4),
                    "over_raw_each": [round(p[1][0] / p[2], 4) for p in pairs]}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"ingest: {a.steps} steps x {a.values} values in batches of {a.batch} steps ({mb:.2f} MB columns body, "
          f"{mb_json:.2f} MB as per-step JSON), {os.cpu_count()} CPUs")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average at the end: {load:.1f} (shared machine: compare the ratios)")
    print(f"{'database':10} {'daemon values/s':>16} {'p99 ms':>8} {'/raw':>7} {'write-only':>11} {'p99 ms':>8} "
          f"{'/raw':>6} {'w-o JSON':>10} {'/raw':>6} {'raw driver':>11} {'history ms':>11}")
    for name, r in results.items():
        d, w, wj = r["detectors_on"], r["write_only"], r["write_only_json"]
        print(f"{name:10} {d['values_per_s']:>16,} {d['p99_batch_ms']:>8.1f} {r['detectors_on_over_raw']:>7.4f} "
              f"{w['values_per_s']:>11,} {w['p99_batch_ms']:>8.1f} {r['write_only_over_raw']:>6.3f} "
              f"{wj['values_per_s']:>10,} {r['write_only_json_over_raw']:>6.3f} "
              f"{r['raw_values_per_s']:>11,} {r['history_ms']:>11.1f}")
    if a.repeat > 1 or a.judge_thread:
        for name, r in results.items():
            print(f"{name}: daemon/raw per pair {r['detectors_on']['over_raw_each']}, raw {r['raw_values_per_s_each']}")
            if a.judge_thread:
                t = r["detectors_on_judge_thread"]
                print(f"{name}: daemon with the judge on a thread (judge_process: false) {t['values_per_s']:,} values/s, "
                      f"/raw {t['over_raw']:.4f}, per pair {t['over_raw_each']}")
    print("daemon: `thermowatch serve`'s app (detectors, policy, alerts on) in a uvicorn subprocess, fed the columns")
    print("body the trainer's HttpSink sends, from the first request to the last value committed AND judged (it")
    print("answers, then judges). write-only: the ingest router over a bare Ingestor, no detectors, same body;")
    print("w-o JSON: the same with the per-step JSON form. raw driver: sqlite3 executemany / psycopg COPY of the")
    print("same chunk + step rows. history: one metric, --history-steps steps in 50-step chunks, best of 5.")
    if a.json:
        print(json.dumps({"bench": "ingest", "steps": a.steps, "batch": a.batch, "values": a.values, "load": load,
                          "positive": a.positive,
                          **results}))


if __name__ == "__main__":
    main()
