"""The hostile-network probes of issue 21, re-run against `thermowatch serve` as deployed (auth on,
a Slack signing secret set, SQLite or PostgreSQL), with the daemon's memory measured from /proc.

    python bench/hostile.py                  # both databases, every probe
    python bench/hostile.py --db sqlite --json

Probes (each reports what the daemon answered and its resident memory):
  big-posts     three 400 MB bodies, no token, to POST /login and to POST /api/slack/interactions,
                once with Content-Length declared and once chunked (no length): peak RSS
  key-headers   ten 12 MB columnar headers of 10^6 metric keys and 0 steps, with an ingest token
  overlap       40 trials of two overlapping batches of one attempt with different values, sent at
                once from two threads: how many trials got 200 twice (history rewritten)
  empty-keys    a step with no metric (`{"records":[{"step":1023}]}`) and a columns batch of `keys: []`
  control-byte  `GET /healthz?a=%1C0` with a Cookie header (a 0x1C byte before digits)
  cross-run     issue 33: team B's ingest token writes into team A's run (a NaN step, a checkpoint, a
                deletion, a finished report, a command poll, an ack, a new attempt): the answers
  claims        issue 34: steps claiming samples [0, 10^15) with NaN losses: the answer, and the skip
                the policy ordered (before: the whole dataset)
  attempts      issue 34: 10^4 new attempts of one run by one token: how many were accepted, and the
                run page's time after
  declared      headers only, declaring 10 GB, no body byte: 20 at once to every POST route of the
                OpenAPI document and /login, with the admin token and without (issue 33: a buffer
                sized from the header took 1.9 GB for 2 GB declared): answers and peak RSS

The daemon's RSS is read from /proc/<pid>/status (VmRSS, and VmHWM, the peak, reset before each
probe by writing 5 to /proc/<pid>/clear_refs); its detectors' child process is not counted.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import struct
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

from common import free_port, new_token, repo_env, wait_up
from ingest import PG_URL

MB = 1 << 20


def rss(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")


class Daemon:
    """`thermowatch serve` in a subprocess: auth on (an admin token from the environment), a Slack
    signing secret set (so the interactions route reads bodies), the given database."""

    def __init__(self, url: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tw-hostile-"))
        self.port = free_port()
        self.token = new_token()
        env = repo_env(THERMOWATCH_API_TOKEN=self.token, SLACK_SIGNING_SECRET="s" * 32)
        self.log = open(self.dir / "serve.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "thermowatch.cli", "serve", "--data-dir", str(self.dir),
                                      "--db", url, "--port", str(self.port)], env=env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.base = f"http://127.0.0.1:{self.port}"
        self.auth = {"Authorization": f"Bearer {self.token}"}
        wait_up(lambda: httpx.get(f"{self.base}/healthz", timeout=5).status_code in (200, 503), self.proc,
                f"the daemon did not start; see {self.dir / 'serve.log'}", timeout_s=90)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def _chunks(total: int, piece: int = MB):
    block = b"a" * piece
    sent = 0
    while sent < total:
        yield block[: min(piece, total - sent)]
        sent += piece


def big_posts(d: Daemon, size: int = 400 * MB) -> dict:
    out = {}
    for path in ("/login", "/api/slack/interactions"):
        for declared in (True, False):
            reset_peak(d.proc.pid)
            before = rss(d.proc.pid)[0]
            codes = []
            for _ in range(3):
                headers = {"content-type": "application/x-www-form-urlencoded", "origin": d.base,
                           "x-slack-request-timestamp": str(int(time.time())), "x-slack-signature": "v0=00"}
                if declared:
                    headers["content-length"] = str(size)
                try:
                    r = httpx.post(d.base + path, content=_chunks(size), headers=headers, timeout=120)
                    codes.append(r.status_code)
                except httpx.HTTPError as exc:  # the daemon may close the connection after its answer
                    codes.append(type(exc).__name__)
            now, peak = rss(d.proc.pid)
            out[f"{path} {'length' if declared else 'chunked'}"] = {
                "answers": codes, "rss_before_mb": round(before), "peak_mb": round(peak), "rss_after_mb": round(now)}
    return out


def _columns_header_body(n_keys: int) -> bytes:
    header = json.dumps({"steps": 0, "keys": [f"k{i}" for i in range(n_keys)]}, separators=(",", ":")).encode()
    return b"TWC1" + struct.pack("<I", len(header)) + header


def key_headers(c: httpx.Client, pid: int) -> dict:
    c.post("/api/runs", json={"run_id": "keys", "attempt": 0, "world_size": 1}).raise_for_status()
    body = _columns_header_body(10**6)
    reset_peak(pid)
    before = rss(pid)[0]
    codes = [c.post("/api/runs/keys/attempts/0/steps", content=body,
                    headers={"content-type": "application/vnd.thermowatch.step-columns"}).status_code
             for _ in range(10)]
    now, peak = rss(pid)
    return {"body_mb": round(len(body) / MB, 1), "answers": sorted(set(codes)), "rss_before_mb": round(before),
            "peak_mb": round(peak), "rss_after_mb": round(now)}


def overlap(d: Daemon, trials: int = 40) -> dict:
    twice = 0
    codes: dict[str, int] = {}
    with httpx.Client(base_url=d.base, headers=d.auth, timeout=60) as c0:
        for t in range(trials):
            run = f"overlap-{t}"
            c0.post("/api/runs", json={"run_id": run, "attempt": 0, "world_size": 1}).raise_for_status()
            a = {"records": [{"step": s, "loss": 1.0 + s, "wall_time": 0.1} for s in range(0, 20)]}
            b = {"records": [{"step": s, "loss": 2.0 + s, "wall_time": 0.1} for s in range(10, 30)]}
            clients = [httpx.Client(base_url=d.base, headers=d.auth, timeout=60) for _ in range(2)]
            with cf.ThreadPoolExecutor(2) as ex:
                futs = [ex.submit(cl.post, f"/api/runs/{run}/attempts/0/steps", json=body)
                        for cl, body in zip(clients, (a, b))]
                got = [f.result().status_code for f in futs]
            for cl in clients:
                cl.close()
            for g in got:
                codes[str(g)] = codes.get(str(g), 0) + 1
            twice += got == [200, 200]
    return {"trials": trials, "both_accepted": twice, "answers": codes}


def empty_keys(c: httpx.Client) -> dict:
    c.post("/api/runs", json={"run_id": "empty", "attempt": 0, "world_size": 1}).raise_for_status()
    r1 = c.post("/api/runs/empty/attempts/0/steps", json={"records": [{"step": 1023}]})
    header = json.dumps({"steps": 1, "keys": []}).encode()
    body = b"TWC1" + struct.pack("<I", len(header)) + header + struct.pack("<qqqqd", 1024, -1, -1, 0, 0.0)
    r2 = c.post("/api/runs/empty/attempts/0/steps", content=body,
                headers={"content-type": "application/vnd.thermowatch.step-columns"})
    after = c.post("/api/runs/empty/attempts/0/steps", json={"records": [{"step": 1025, "loss": 1.0}]})
    return {"json_no_metric": r1.status_code, "columns_no_keys": r2.status_code, "next_batch": after.status_code,
            "detail": (r1.json().get("detail") if r1.status_code >= 400 else None)}


def control_byte(d: Daemon) -> dict:
    r = httpx.get(f"{d.base}/healthz?a=%1C0", headers={"Cookie": "x=y"})
    r2 = httpx.get(f"{d.base}/api/runs/x/actions?limit=%1F5", headers=d.auth)
    return {"healthz_cookie": r.status_code, "actions_limit": r2.status_code}


def _headers_only(base: str, path: str, declared: int, token: str | None) -> str:
    """POST headers declaring `declared` bytes, then nothing: the status line's code, or why none came."""
    import socket
    from urllib.parse import urlparse

    u = urlparse(base)
    head = [f"POST {path} HTTP/1.1", f"Host: {u.netloc}", f"Content-Length: {declared}",
            "Content-Type: application/json", f"Origin: {base}", "Sec-Fetch-Site: same-origin"]
    if token:
        head.append(f"Authorization: Bearer {token}")
    try:
        with socket.create_connection((u.hostname, u.port), timeout=10) as sock:
            sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode())
            return sock.recv(64).split(b" ", 2)[1].decode()
    except (OSError, IndexError) as exc:
        return type(exc).__name__


def declared(d: Daemon, size: int = 10 << 30, at_once: int = 20, paths_only: list[str] | None = None) -> dict:
    fill = {"{run_id}": "declared", "{attempt}": "0", "{action_id}": "1", "{name}": "nobody"}
    paths = ["/login"]
    for path, ops in ({} if paths_only else httpx.get(f"{d.base}/openapi.json").json()["paths"]).items():
        if "post" in ops:
            for k, v in fill.items():
                path = path.replace(k, v)
            paths.append(path)
    paths = paths_only or paths
    reset_peak(d.proc.pid)
    before = rss(d.proc.pid)[0]
    answers: dict[str, dict[str, int]] = {}
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(at_once) as ex:
        for token in (d.token, None):
            for path in paths:
                for code in ex.map(lambda _, p=path: _headers_only(d.base, p, size, token), range(at_once)):
                    key = f"{'admin' if token else 'no token'} {code}"
                    answers.setdefault(key, {}).setdefault(path, 0)
                    answers[key][path] += 1
    now, peak = rss(d.proc.pid)
    return {"routes": len(paths), "requests": 2 * len(paths) * at_once, "declared_gb": round(size / (1 << 30), 2),
            "seconds": round(time.monotonic() - t0, 1), "answers": {k: sorted(v) for k, v in answers.items()},
            "rss_before_mb": round(before), "peak_mb": round(peak), "rss_after_mb": round(now),
            "peak_growth_mb": round(peak - before)}


def _token(d: Daemon, name: str, scope: str = "ingest") -> dict[str, str]:
    r = httpx.post(f"{d.base}/api/tokens", json={"name": name, "scopes": [scope]}, headers=d.auth)
    r.raise_for_status()
    return {"Authorization": f"Bearer {r.json()['secret']}"}


def cross_run(d: Daemon) -> dict:
    a, b = _token(d, "team-a"), _token(d, "team-b")
    run = "team-a-llm"
    httpx.post(f"{d.base}/api/runs", json={"run_id": run, "attempt": 0, "world_size": 1,
                                           "config": {"steps": 1000, "data": {"global_batch": 16}}},
               headers=a).raise_for_status()
    httpx.post(f"{d.base}/api/runs/{run}/attempts/0/steps", json={"records": [{"step": 0, "loss": 2.5}]},
               headers=a).raise_for_status()
    hdr = {**b, "content-type": "application/json"}
    probes = {
        "NaN step": ("POST", f"/api/runs/{run}/attempts/0/steps", '{"records": [{"step": 1, "loss": NaN}]}'),
        "checkpoint": ("POST", f"/api/runs/{run}/attempts/0/checkpoints",
                       json.dumps({"step": 1, "path": "/tmp/planted", "sample_cursor": 16, "healthy": True})),
        "deletion": ("POST", f"/api/runs/{run}/attempts/0/checkpoints/deleted", '{"steps": [0], "reason": "x"}'),
        "finished": ("POST", f"/api/runs/{run}/attempts/0/finished",
                     '{"step": 1, "final_loss": 9.0, "reason": "closed"}'),
        "command poll": ("GET", f"/api/runs/{run}/commands", None),
        "ack": ("POST", f"/api/runs/{run}/acks", '{"command_id": 1, "ok": true, "step": 1}'),
        "new attempt": ("POST", "/api/runs", json.dumps({"run_id": run, "attempt": 1, "world_size": 1})),
    }
    out = {name: httpx.request(m, d.base + path, content=body, headers=hdr).status_code
           for name, (m, path, body) in probes.items()}
    steps = httpx.get(f"{d.base}/api/runs/{run}/history?key=loss", headers=d.auth).json()["steps"]
    return {"answers": out, "run_a_steps": steps}


def claims(d: Daemon) -> dict:
    a = _token(d, "claims-trainer")
    run = "claims"
    httpx.post(f"{d.base}/api/runs", json={"run_id": run, "attempt": 0, "world_size": 1,
                                           "config": {"steps": 1000, "data": {"global_batch": 16}}},
               headers=a).raise_for_status()
    hdr = {**a, "content-type": "application/json"}
    ok = [{"step": s, "loss": 2.0, "sample_lo": 16 * s, "sample_hi": 16 * s + 16} for s in range(60)]
    first = httpx.post(f"{d.base}/api/runs/{run}/attempts/0/steps", content=json.dumps({"records": ok}), headers=hdr)
    bad = [{"step": s, "loss": float("nan"), "sample_lo": 0, "sample_hi": 10**15 + s} for s in range(60, 70)]
    r = httpx.post(f"{d.base}/api/runs/{run}/attempts/0/steps", content=json.dumps({"records": bad}), headers=hdr)
    time.sleep(3)  # the judge runs after the commit
    actions = httpx.get(f"{d.base}/api/runs/{run}/actions", headers=d.auth).json()
    skips = [a.get("args", {}).get("skip") for a in actions.get("actions", [])]
    return {"honest": first.status_code, "claim_1e15": r.status_code, "detail": r.json().get("detail", "")[:160],
            "actions": len(actions.get("actions", [])), "skips": skips}


def attempts(d: Daemon, n: int = 10_000) -> dict:
    a = _token(d, "restarter")
    run = "restarts"
    accepted, codes = 0, {}
    with httpx.Client(base_url=d.base, headers=a, timeout=60) as c:
        for k in range(n):
            code = c.post("/api/runs", json={"run_id": run, "attempt": k, "world_size": 1}).status_code
            codes[code] = codes.get(code, 0) + 1
            accepted += code == 201
            if code == 429 and k > 200:  # the rest would be refused alike: say so, spare the minutes
                codes["not sent"] = n - k - 1
                break
    t0 = time.perf_counter()
    page = httpx.get(f"{d.base}/runs/{run}", headers=d.auth, timeout=120)
    return {"sent": sum(v for k, v in codes.items() if k != "not sent"), "accepted": accepted,
            "answers": {str(k): v for k, v in codes.items()}, "page": page.status_code,
            "page_ms": round((time.perf_counter() - t0) * 1000, 1)}


DECLARED = {"size": 10 << 30, "at_once": 20, "paths_only": None}  # --declared-gb, --at-once, --route


PROBES = ("cross_run", "claims", "attempts", "declared", "big_posts", "key_headers", "overlap", "empty_keys", "control_byte")


def run(url: str, only: tuple[str, ...] = PROBES) -> dict:
    d = Daemon(url)
    try:
        with httpx.Client(base_url=d.base, headers=d.auth, timeout=300) as c:
            res = {"rss_start_mb": round(rss(d.proc.pid)[0])}
            probes = {"cross_run": lambda: cross_run(d), "claims": lambda: claims(d),
                      "attempts": lambda: attempts(d), "declared": lambda: declared(d, **DECLARED), "big_posts": lambda: big_posts(d),
                      "key_headers": lambda: key_headers(c, d.proc.pid), "overlap": lambda: overlap(d),
                      "empty_keys": lambda: empty_keys(c), "control_byte": lambda: control_byte(d)}
            for name in only:
                res[name] = probes[name]()
            res["alive"] = c.get("/healthz").status_code
        return res
    finally:
        d.close()


# What each probe's figures print as, in this order; a probe left out by --only prints nothing.
REPORT = {
    "cross_run": lambda v: [f"team B's token into team A's run: {v['answers']}; run A's steps after: "
                            f"{v['run_a_steps']}"],
    "claims": lambda v: [f"steps claiming [0, 1e15): {v['claim_1e15']} ({v['detail'][:100]}...); actions "
                         f"{v['actions']}, skips {v['skips']}"],
    "attempts": lambda v: [f"10^4 new attempts of one run: sent {v['sent']}, accepted {v['accepted']}, answers "
                           f"{v['answers']}; run page {v['page']} in {v['page_ms']} ms"],
    "declared": lambda v: [f"headers only, {v['declared_gb']} GB declared, {DECLARED['at_once']} at once x "
                           f"{v['routes']} routes x 2 tokens: peak {v['peak_mb']} MB (+{v['peak_growth_mb']} MB), "
                           f"after {v['rss_after_mb']} MB, {v['seconds']} s"]
                          + [f"    {key}: {len(paths)} routes" for key, paths in sorted(v["answers"].items())],
    "big_posts": lambda v: [f"400 MB x3 {probe:36s} answers {b['answers']}  peak {b['peak_mb']} MB  after "
                            f"{b['rss_after_mb']} MB" for probe, b in v.items()],
    "key_headers": lambda v: [f"10^6-key headers x10 ({v['body_mb']} MB)      answers {v['answers']}  peak "
                              f"{v['peak_mb']} MB  after {v['rss_after_mb']} MB"],
    "overlap": lambda v: [f"overlapping batches at once: both accepted {v['both_accepted']}/{v['trials']}  answers "
                          f"{v['answers']}"],
    "empty_keys": lambda v: [f"empty keys: {v}"],
    "control_byte": lambda v: [f"control byte: {v}"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    ap.add_argument("--json", action="store_true", help="end with one JSON line of the figures")
    ap.add_argument("--only", nargs="+", choices=PROBES, default=list(PROBES), help="run these probes only")
    ap.add_argument("--declared-gb", type=float, default=10.0, help="declared: the Content-Length, in GB (10)")
    ap.add_argument("--at-once", type=int, default=20, help="declared: requests at once per route (20)")
    ap.add_argument("--route", action="append", help="declared: only these routes (e.g. /login); default every "
                                                     "POST route of the OpenAPI document and /login")
    a = ap.parse_args()
    DECLARED.update(size=int(a.declared_gb * (1 << 30)), at_once=a.at_once, paths_only=a.route)
    results = {}
    for name in (["sqlite", "postgres"] if a.db == "both" else [a.db]):
        if name == "sqlite":
            url = f"sqlite:///{tempfile.mkdtemp(prefix='tw-hostile-db-')}/tw.db"
        else:
            import sqlalchemy as sa

            schema = f"tw_hostile_{uuid.uuid4().hex[:8]}"
            eng = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
            with eng.connect() as conn:
                conn.execute(sa.text(f"CREATE SCHEMA {schema}"))
            url = f"{PG_URL}?options=-csearch_path%3D{schema}"
        try:
            results[name] = run(url, tuple(a.only))
        finally:
            if name == "postgres":
                with eng.connect() as conn:
                    conn.execute(sa.text(f"DROP SCHEMA {schema} CASCADE"))
                eng.dispose()
        r = results[name]
        print(f"\n== {name}: daemon RSS at start {r['rss_start_mb']} MB")
        for probe, lines in REPORT.items():
            for line in lines(r[probe]) if probe in r else ():
                print("  " + line)
        print(f"  /healthz after: {r['alive']}")
    if a.json:
        print(json.dumps({"bench": "hostile", "results": results}))


if __name__ == "__main__":
    main()
