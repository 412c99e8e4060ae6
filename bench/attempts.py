"""One run of 10^4 attempts (issue 34: one token opened 10,000 attempts of one run, all accepted,
and that run's page then took 3.4-4.0 s on SQLite and 8.2-9.4 s on PostgreSQL). Goal: every read
of the run costs the same at 10^4 attempts as at 10^2, each < 200 ms.

    python bench/attempts.py                          # 10^4 attempts, SQLite and PostgreSQL
    python bench/attempts.py --db sqlite --json       # ... ends with one JSON line of figures
    py-spy record -o attempts.svg -- python bench/attempts.py --db sqlite   # where the time goes

Each database (a fresh SQLite file, a throwaway PostgreSQL schema dropped after) gets one run of
--attempts attempts, opened through the store functions the ingest path calls
(store.runs.open_attempt and its attempt_opened audit row, 500 a transaction: the quota being
added for issue 34 would refuse them through the API), and a second run of --small attempts made
the same way, the ratio's base. Like a rollback-heavy run, every --stepped-every-th attempt trains
--steps steps through Supervisor.write (stored, judged), starting 2 steps before its predecessor's
last, so each re-trains a little of the one before. Every read goes through the daemon's app on a
real uvicorn (auth on, the read budget off), --repeat times (median, max): the run page, the run
API, /status, /events, /times, the loss chart's JSON, the runs list, and the CLI's `thermowatch
status` and `thermowatch runs` against it (in-process: no interpreter start in the figure). Beside
each time, the SQL statements the read sent (a listener on the daemon's engine): a read that sends
a query per attempt shows it there.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from listing import drop_schema, fresh_url  # noqa: E402 (one way to make and drop a bench database)

RUN = "rollbacks"
T0 = 1.79e9  # the steps' wall clock (unix seconds)
# The read budget and gate off (supervisor.serve.api.reads): the bench reads back to back.
UNBOUNDED_READS = {"max_reads_per_client_per_minute": 10**9, "max_reads_in_flight": 10**6}


def supervisor(url: str, token: str):
    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.app.service import Supervisor
    from thermowatch.supervisor.db import upgrade
    from thermowatch.supervisor.notify.console import ConsoleNotifier

    upgrade(url)
    cfg = SupervisorConfig(data_dir=Path(tempfile.mkdtemp(prefix="tw-bench-attempts-")), db_url=url,
                           api_token=token, limits=UNBOUNDED_READS)
    return Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)


def seed(sup, run_id: str, n_attempts: int, stepped_every: int, n_steps: int) -> dict:
    """`n_attempts` attempts of `run_id`; every `stepped_every`-th trains `n_steps` steps, from 2
    steps before the last stepped attempt's end (a short rollback each time)."""
    from thermowatch.monitors.contract import RunInfo, StepRecord
    from thermowatch.supervisor.store import audit as audit_store
    from thermowatch.supervisor.store import runs as runs_store

    t = time.perf_counter()
    sup.open_run(RunInfo(run_id, 0, world_size=8, config={"model": "350m"}), "trainer")
    for lo in range(1, n_attempts, 500):
        with sup.sessions.begin() as s:
            for a in range(lo, min(lo + 500, n_attempts)):
                runs_store.open_attempt(s, RunInfo(run_id, a, world_size=8, start_step=a // stepped_every * (n_steps - 2)),
                                        created_by="trainer")
                audit_store.audit(s, run_id, "trainer", "attempt_opened",
                                  {"attempt": a, "world_size": 8, "start_step": a // stepped_every * (n_steps - 2)})
    opened = time.perf_counter() - t
    stepped = 0
    for a in range(0, n_attempts, stepped_every):
        first = a // stepped_every * (n_steps - 2)
        recs = [StepRecord(step, {"loss": 3.0 - 1e-4 * step + 1e-3 * (a % 7), "grad_norm": 0.5, "lr": 3e-4,
                                  "act_max/blocks.0.mlp": 4.0, "act_max/blocks.1.mlp": 5.0},
                           sample_lo=step * 64, sample_hi=step * 64 + 64, tokens=64 * 2048, wall_time=T0 + a + step)
                for step in range(first, first + n_steps)]
        sup.write(run_id, a, recs)
        stepped += 1
    sup.judge.wait(timeout=600)
    return {"attempts": n_attempts, "stepped_attempts": stepped, "open_s": opened, "seed_s": time.perf_counter() - t}


def timed(fn, repeat: int, sent: list[int]) -> dict:
    """Median and max of `repeat` reads after a warm-up, and the statements the last one sent."""
    try:
        fn()  # warm-up
    except RuntimeError as exc:  # a read that fails is a figure too (before the fix: a 500)
        return {"median_ms": None, "max_ms": None, "kb": None, "statements": None, "error": str(exc)[:200]}
    ms = []
    for _ in range(repeat):
        sent[0] = 0
        t = time.perf_counter()
        size = fn()
        ms.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(ms), "max_ms": max(ms), "kb": size / 1024, "statements": sent[0]}


def get(http: httpx.Client, path: str, **params):
    def read() -> int:
        r = http.get(path, params=params)
        if r.status_code != 200:
            raise RuntimeError(f"GET {path} {params}: {r.status_code} {r.text[:300]}")
        return len(r.content)
    return read


def cli(url: str, token: str, *argv: str):
    from thermowatch.cli import main as cli_main

    def read() -> int:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            rc = cli_main([*argv[:1], "--server", url, "--token", token, *argv[1:]])
        if rc != 0:
            raise RuntimeError(f"thermowatch {' '.join(argv)}: exit {rc}")
        return len(out.getvalue())
    return read


def cases(http: httpx.Client, url: str, token: str, run_id: str) -> dict:
    r = f"/api/runs/{run_id}"
    out = {
        "GET /runs/{run} (the page)": get(http, f"/runs/{run_id}"),
        "GET /api/runs/{run}": get(http, r),
        "GET /api/runs/{run}/status": get(http, f"{r}/status"),
        "GET /api/runs/{run}/events": get(http, f"{r}/events"),
        "GET /api/runs/{run}/times": get(http, f"{r}/times"),
        "GET /api/runs/{run}/chart?metric=loss": get(http, f"{r}/chart", metric="loss"),
        "GET /api/runs/{run}/chart?metric=act_max": get(http, f"{r}/chart", metric="act_max"),
        "GET /api/runs (list)": get(http, "/api/runs"),
        "thermowatch status RUN": cli(url, token, "status", run_id),
        "thermowatch runs": cli(url, token, "runs"),
    }
    # The older attempts, where the page links them (a paged listing): the link's own page.
    page = http.get(f"/runs/{run_id}").text
    older = re.search(r"href='([^']*attempts_before=[^']*)'", page)
    if older:
        out["GET /runs/{run}?attempts_before= (older)"] = get(http, older.group(1).replace("&amp;", "&"))
    return out


def reads(sup, token: str, run_id: str, repeat: int) -> dict:
    from sqlalchemy import event

    from thermowatch.supervisor.serve.server import build_app
    from tests.live_server import running

    sent = [0]

    def count(*_) -> None:
        sent[0] += 1

    event.listen(sup.engine, "before_cursor_execute", count)
    try:
        with running(build_app(sup)) as url, httpx.Client(base_url=url, timeout=600,
                                                            headers={"Authorization": f"Bearer {token}"}) as http:
            return {name: timed(fn, repeat, sent) for name, fn in cases(http, url, token, run_id).items()}
    finally:
        event.remove(sup.engine, "before_cursor_execute", count)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--attempts", type=int, default=10_000, help="attempts of the big run")
    ap.add_argument("--small", type=int, default=100, help="attempts of the small run (the ratio's base)")
    ap.add_argument("--stepped-every", type=int, default=10, help="every n-th attempt trains steps")
    ap.add_argument("--steps", type=int, default=5, help="steps each of those trains")
    ap.add_argument("--repeat", type=int, default=5, help="timed reads per figure (median)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tw-bench-attempts-"))
    token = "tw_" + secrets.token_urlsafe(32)
    rows, seeds = [], {}
    for kind in (["sqlite", "postgres"] if args.db == "both" else [args.db]):
        url, schema = fresh_url(kind, tmp, "attempts")
        sup = supervisor(url, token)
        try:
            figures = {}
            for size, n in (("small", args.small), ("big", args.attempts)):
                run_id = f"{RUN}-{size}"
                seeds[f"{kind}/{size}"] = seed(sup, run_id, n, args.stepped_every, args.steps)
                print(f"  {kind}: {run_id}: {n} attempts in {seeds[f'{kind}/{size}']['seed_s']:.0f} s", file=sys.stderr)
            if kind == "postgres":
                # A deployed server's autovacuum vacuums and analyzes inserted tables (PostgreSQL 13+);
                # this test server runs with it off (bench/plot.py), so the bench does it.
                with sup.engine.connect() as c:
                    c = c.execution_options(isolation_level="AUTOCOMMIT")
                    for table in ("runs", "attempts", "steps", "audit", "judge_marks", "thermometer_chunks",
                                  "thermometer_rollups"):
                        c.exec_driver_sql(f"VACUUM ANALYZE {table}")
            for size in ("small", "big"):
                figures[size] = reads(sup, token, f"{RUN}-{size}", args.repeat)
        finally:
            sup.close()
            drop_schema(schema)
        for name, big in figures["big"].items():
            small = figures["small"].get(name) or {}
            ratio = (big["median_ms"] / small["median_ms"]
                     if big["median_ms"] is not None and small.get("median_ms") is not None else None)
            rows.append({"db": kind, "read": name, "attempts": args.attempts, **big, "small_attempts": args.small,
                         "small_median_ms": small.get("median_ms"), "small_statements": small.get("statements"),
                         "big_over_small": ratio})
    load = os.getloadavg()[0]
    print(f"\nreads of one run through the daemon, median of {args.repeat} (max); "
          f"load avg {load:.1f}, {os.cpu_count()} cores")
    print(f"{'db':<9}{'read':<42}{'attempts':>9}{'median ms':>11}{'max ms':>9}{'KB':>8}{'SQL':>7}"
          f"{'attempts':>9}{'median ms':>11}{'SQL':>7}{'big/small':>10}")

    def num(x, fmt: str) -> str:  # "-" where a read failed or has no base, in the column's width
        return format(x, fmt) if x is not None else format("-", ">" + re.match(r">(\d+)", fmt).group(1))

    for r in rows:
        print(f"{r['db']:<9}{r['read']:<42}{r['attempts']:>9}{num(r['median_ms'], '>11.1f')}{num(r['max_ms'], '>9.1f')}"
              f"{num(r['kb'], '>8.1f')}{num(r['statements'], '>7')}{r['small_attempts']:>9}"
              f"{num(r['small_median_ms'], '>11.1f')}{num(r['small_statements'], '>7')}"
              f"{num(r['big_over_small'], '>10.2f')}" + (f"  {r['error']}" if r.get("error") else ""))
    failed = [r for r in rows if r["median_ms"] is None]
    worst = max((r["median_ms"] for r in rows if r["median_ms"] is not None), default=0.0)
    print(f"goal: every read < 200 ms at {args.attempts} attempts: "
          f"{'met' if worst < 200 and not failed else 'NOT met'} (slowest median {worst:.1f} ms"
          + (f", {len(failed)} failed" if failed else "") + ")")
    if args.json:
        print(json.dumps({"load": load, "rows": rows, "seeds": seeds}))


if __name__ == "__main__":
    main()
