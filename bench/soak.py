"""Soak: the daemon as deployed (detectors, policy and alerts on, auth on) ingesting at full rate
for a long time (issue 13 item 6): is its memory flat, does its rate hold?

    python bench/soak.py                          # 10 minutes, SQLite
    python bench/soak.py --db postgres --json     # ... ends with one JSON line of figures

The daemon runs in a subprocess (bench/ingest.py's `serve`: uvicorn + thermowatch serve's app).
The client posts 50-step batches of --values values in the columns body the trainer's HttpSink
sends, one at a time as the run controller does, with positive values (as real norms and logits
are, so every point reaches the log-scale detectors). "Full rate" is the rate the daemon
sustains with its detectors on: the client waits while the judge is more than --max-backlog
batches behind (commit, answer, then judge), so what is measured is the daemon keeping up, not
a queue growing. Every --sample-s the client records the daemon's resident memory (VmRSS), the
values stored and judged in the interval, the request latency and the judge backlog.

Memory is "flat" when the least-squares slope of RSS over the second half of the run, times the
run's length, is under 5% of the RSS at the half: what a leak of that slope would add over a
run as long as this one. The first half is warm-up (caches, SQLite's page cache, the detectors'
rings filling).
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ingest import PG_URL, _keys, _pg_url, running_daemon  # noqa: E402  (the same daemon and series names as the ingest bench)


def _rss_mb(pid: int) -> float:
    """The daemon's RSS plus its children's (the detectors' process, supervisor.judge.bank_process)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except FileNotFoundError:
            pass
    return total or float("nan")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return out


def _body(step0: int, batch: int, keys: list[str], rng) -> bytes:
    """A batch as the trainer's HttpSink sends it: columns, and the rank that held each max/min
    key's extreme (bench/detectors.ranked), as the run controller names them."""
    from detectors import WORLD, ranked
    from thermowatch.monitors.columns import StepColumns

    steps = np.arange(step0, step0 + batch, dtype=np.int64)
    has = np.isin(keys, ranked(keys))
    ranks = np.where(has[None, :], rng.integers(0, WORLD, (batch, len(keys))), -1).astype(np.int32)
    return StepColumns(steps=steps, keys=keys, values=np.abs(rng.standard_normal((batch, len(keys)))) + 0.1,
                       sample_lo=steps * 64, sample_hi=(steps + 1) * 64, tokens=np.full(batch, 131072, np.int64),
                       wall_time=time.time() + np.arange(batch) * 1e-3, ranks=ranks).encode()


def soak(url: str, minutes: float, n_values: int, batch: int, sample_s: float, max_backlog: int) -> dict:
    from thermowatch.monitors.columns import COLUMNS_CONTENT_TYPE

    keys, rng = _keys(n_values), np.random.default_rng(0)
    samples: list[dict] = []
    with running_daemon(url, "daemon", run_id="soak") as (c, pid):
        hdr = {"content-type": COLUMNS_CONTENT_TYPE}
        t0 = time.monotonic()
        end, next_sample = t0 + minutes * 60, t0 + sample_s
        step, stored, lat, waited = 1, 0, [], 0.0
        last_t, last_stored = t0, 0
        while time.monotonic() < end:
            body = _body(step, batch, keys, rng)
            t1 = time.perf_counter()
            c.post("/api/runs/soak/attempts/0/steps", content=body, headers=hdr).raise_for_status()
            lat.append(time.perf_counter() - t1)
            step, stored = step + batch, stored + batch * n_values
            w0 = time.perf_counter()
            while (c.get("/healthz").json().get("judge_backlog") or 0) > max_backlog:
                time.sleep(0.02)
            waited += time.perf_counter() - w0
            now = time.monotonic()
            if now >= next_sample:
                health = c.get("/healthz").json()
                samples.append({"t_s": round(now - t0, 1), "rss_mb": round(_rss_mb(pid), 1),
                                "values_per_s": round((stored - last_stored) / (now - last_t)),
                                "p99_ms": round(1e3 * float(np.percentile(lat, 99)), 1),
                                "judge_backlog": health.get("judge_backlog"), "steps": step - 1})
                print(json.dumps(samples[-1]), file=sys.stderr, flush=True)
                last_t, last_stored, lat = now, stored, []
                next_sample += sample_s
        # the backlog judged: what was answered is also judged
        while c.get("/healthz").json().get("judge_backlog"):
            time.sleep(0.05)
        wall = time.monotonic() - t0
    t = np.array([s["t_s"] for s in samples])
    rss = np.array([s["rss_mb"] for s in samples])
    half = t >= t[-1] / 2
    slope = float(np.polyfit(t[half] / 60, rss[half], 1)[0]) if half.sum() >= 2 else float("nan")
    at_half = float(rss[half][0])
    return {"minutes": round(wall / 60, 2), "steps": step - 1, "series": n_values, "values": stored,
            "values_per_s": round(stored / wall), "rss_mb_first": float(rss[0]), "rss_mb_half": at_half,
            "rss_mb_last": float(rss[-1]), "rss_mb_max": float(rss.max()),
            "rss_slope_mb_per_min_second_half": round(slope, 3),
            "flat": bool(abs(slope) * wall / 60 < 0.05 * at_half), "client_waited_for_judge_s": round(waited, 1),
            "samples": samples}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--db", choices=["sqlite", "postgres"], default="sqlite")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--values", type=int, default=781, help="series per step (the ingest bench's 781)")
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--sample-s", type=float, default=15.0)
    ap.add_argument("--max-backlog", type=int, default=4, help="batches the judge may be behind before the client waits")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tw-soak-"))
    if a.db == "sqlite":
        url = f"sqlite:///{tmp / 'soak.db'}"
    else:
        import psycopg

        schema = f"tw_soak_{secrets.token_hex(4)}"
        with psycopg.connect(PG_URL.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
            conn.execute(f"CREATE SCHEMA {schema}")
        url = _pg_url(schema)
    try:
        r = soak(url, a.minutes, a.values, a.batch, a.sample_s, a.max_backlog)
    finally:
        if a.db == "postgres":
            with psycopg.connect(PG_URL.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
                conn.execute(f"DROP SCHEMA {schema} CASCADE")
    print(f"soak, {a.db}: {r['minutes']} min, {r['steps']:,} steps x {r['series']} series = {r['values']:,} values "
          f"({r['values_per_s']:,}/s, detectors on); daemon RSS (with its detectors process) {r['rss_mb_first']:.0f} MB at the first sample, "
          f"{r['rss_mb_half']:.0f} at half time, {r['rss_mb_last']:.0f} at the end (max {r['rss_mb_max']:.0f}); "
          f"slope over the second half {r['rss_slope_mb_per_min_second_half']:+.2f} MB/min: "
          f"{'flat' if r['flat'] else 'NOT flat'}")
    if a.json:
        print(json.dumps({a.db: {k: v for k, v in r.items() if k != 'samples'}, "samples": r["samples"]}))


if __name__ == "__main__":
    main()
