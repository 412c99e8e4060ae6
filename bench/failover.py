"""Takeover between two daemons on one PostgreSQL (issue 40): how long a standby takes to lead
when the leader is SIGKILLed, or when the leader's connection to the database is cut (its
packets black-holed, as when a machine's network goes), and what that costs.

    python bench/failover.py [--kills 10] [--cuts 10] [--ttl 6]

Two `thermowatch serve` replicas (tests/failover.py), each named as if on its own machine
(THERMOWATCH_REPLICA_NAME), so a takeover waits out the lease (`lease_ttl_s`, 6 s by default)
and never uses the same-host shortcut. Throughout, a writer thread sends a healthy run's steps
(10 a batch, every 0.2 s) to whichever replica answers, and before the kills the fixture's real
divergence is fed to a second run, its rollback acknowledged once the command arrives. Figures:
takeover (the old leader's death or cut -> the other's /readyz says leader), steps lost (sent
and acknowledged - stored), rollbacks decided, alerts sent more than once (per channel, by
title), and what the cut-off leader does meanwhile (it stays up, leading nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import common  # noqa: F401  (the checkout on sys.path)
import sqlalchemy as sa

from tests.failover import Client, Replica, leader
from tests.fixtures.diverging import DETECTORS, POLICY, checkpoint_for, diverging_records, healthy_records
from thermowatch.supervisor.db import make_engine

PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--cuts", type=int, default=10)
    ap.add_argument("--ttl", type=float, default=6.0, help="lease_ttl_s (the daemon's default: 6)")
    ap.add_argument("--pg", default=PG_URL)
    args = ap.parse_args()
    import yaml

    schema = f"tw_failover_{uuid.uuid4().hex[:10]}"
    admin = make_engine(args.pg, isolation_level="AUTOCOMMIT")
    with admin.connect() as c:
        c.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    url = f"{args.pg}?options=-csearch_path%3D{schema}"
    extra = yaml.safe_dump({"policy": dict(POLICY), "detectors": dict(DETECTORS)})
    tmp = Path(tempfile.mkdtemp(prefix="tw-failover-"))
    a, b = (Replica(n, url, tmp, args.ttl, extra_yaml=extra) for n in ("replica-a", "replica-b"))
    replicas = [a, b]
    out: dict = {"ttl_s": args.ttl}
    try:
        a.start(cut_able=True)
        b.start(cut_able=True)
        client = Client(replicas, timeout_s=4 * args.ttl + 30)
        writer = Writer(replicas)
        writer.start()
        out["divergence"] = divergence(client, replicas, args.ttl, tmp)
        for mode, n in (("kill", args.kills), ("cut", args.cuts)):
            times, exits = [], []
            for _ in range(n):
                old, _ = leader(replicas, 30)
                t0 = time.monotonic()
                if mode == "kill":
                    old.kill()
                else:
                    old.relay.cut()
                new, _ = leader(replicas, 4 * args.ttl + 30, exclude=old)
                times.append(time.monotonic() - t0)
                if mode == "cut":
                    # cut off, it can write and send nothing (every write and send checks the token
                    # in the database); it would step down once it reaches the database again
                    exits.append("running, not leading" if old.proc.poll() is None and old.role() != "leader"
                                 else f"exit {old.proc.poll()}")
                    old.kill()
                old.start(cut_able=True)
                time.sleep(0.5)
            out[mode] = {"n": n, "median_s": round(statistics.median(times), 2), "max_s": round(max(times), 2),
                         "min_s": round(min(times), 2), "old_leader": sorted(set(exits)) or None}
            print(f"{mode}: takeover median {out[mode]['median_s']} s, max {out[mode]['max_s']} s over {n}"
                  + (f"; the cut leader: {out[mode]['old_leader']}" if exits else ""), flush=True)
        writer.stop()
        out["steps"] = writer.report(client)
        out["alerts_sent_twice"] = doubled(url)
        client.close()
    finally:
        for r in replicas:
            r.stop()
        with admin.connect() as c:
            c.execute(sa.text(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE'))
        admin.dispose()
    print(json.dumps(out, indent=1))
    return 0


class Writer(threading.Thread):
    """A healthy run's steps, 10 a batch every 0.2 s, to whichever replica answers."""

    RUN = "steady"

    def __init__(self, replicas: list[Replica]) -> None:
        super().__init__(daemon=True)
        self.client = Client(replicas, timeout_s=120)
        self.recs = healthy_records()
        self.sent = 0
        self._halt = threading.Event()

    def run(self) -> None:
        self.client.call("POST", "/api/runs", json={"run_id": self.RUN, "attempt": 0, "world_size": 1})
        step = 0
        while not self._halt.is_set():
            chunk = []
            for _ in range(10):
                r = self.recs[step % len(self.recs)]
                step += 1
                chunk.append({**r.to_json(), "step": step})
            body = json.dumps({"records": chunk})
            resp = self.client.call("POST", f"/api/runs/{self.RUN}/attempts/0/steps", content=body,
                                    headers={"Content-Type": "application/json"})
            assert resp.status_code == 200, resp.text
            self.sent = step
            time.sleep(0.2)

    def stop(self) -> None:
        self._halt.set()
        self.join(60)

    def report(self, client: Client) -> dict:
        runs = client.call("GET", "/api/runs").json()["runs"]
        stored = next(r["last_step"] for r in runs if r["run_id"] == self.RUN)
        return {"sent_and_acknowledged": self.sent, "newest_stored": stored, "lost": self.sent - stored,
                "client_failovers": self.client.failovers}


def divergence(client: Client, replicas: list[Replica], ttl: float, tmp: Path) -> dict:
    """The fixture's divergence with two kills before its detection and one after the command
    went out: the rollback is decided, handed out and booked once."""
    run = "diverging"
    client.call("POST", "/api/runs", json={"run_id": run, "attempt": 0, "world_size": 1})
    recs = diverging_records()
    cmds: list = []
    for i in range(0, len(recs), 10):
        if i // 10 in (2, 5):
            old, _ = leader(replicas, 30)
            old.kill()
            leader(replicas, 4 * ttl + 30, exclude=old)
            old.start(cut_able=True)
        chunk = recs[i:i + 10]
        client.call("POST", f"/api/runs/{run}/attempts/0/steps", content=json.dumps(
            {"records": [x.to_json() for x in chunk]}), headers={"Content-Type": "application/json"})
        for x in chunk:
            if x.step % 5 == 0:
                ck = checkpoint_for(x, tmp / "ckpt")
                client.call("POST", f"/api/runs/{run}/attempts/0/checkpoints", json={
                    "step": ck.step, "path": ck.path, "sample_cursor": ck.sample_cursor, "healthy": True})
        deadline = time.monotonic() + 3
        while not cmds and time.monotonic() < deadline:
            cmds = client.call("GET", f"/api/runs/{run}/commands").json()["commands"]
            time.sleep(0.2)
        if cmds:
            break
    old, _ = leader(replicas, 30)
    old.kill()
    leader(replicas, 4 * ttl + 30, exclude=old)
    old.start(cut_able=True)
    cmd = cmds[0]
    again = []
    deadline = time.monotonic() + 30
    while not again and time.monotonic() < deadline:
        again = client.call("GET", f"/api/runs/{run}/commands").json()["commands"]
        time.sleep(0.2)
    to = cmd["args"]["to_step"]
    client.call("POST", f"/api/runs/{run}/acks", json={"command_id": cmd["id"], "ok": True, "step": to + 1,
                                                       "detail": "rolled back", "checkpoint_step": to})
    acts = client.call("GET", f"/api/runs/{run}/actions").json()["actions"]
    return {"commands_first": [c["kind"] for c in cmds], "redelivered_same_id": [c["id"] for c in again] == [cmd["id"]],
            "actions": [(x["kind"], x["state"]) for x in acts]}


def doubled(url: str) -> dict:
    """Alert rows of one channel with the same title and payload (a decision taken twice, or an
    alert queued twice), and rows marked sent more than once (none can be: mark_sent is per row)."""
    eng = make_engine(url)
    try:
        with eng.connect() as c:
            rows = c.execute(sa.text("SELECT channel, text, count(*) FROM alerts GROUP BY channel, text, "
                                     "CAST(payload AS TEXT) HAVING count(*) > 1")).all()
            total = c.execute(sa.text("SELECT count(*) FROM alerts")).scalar_one()
    finally:
        eng.dispose()
    return {"alert_rows": total, "duplicated": [list(r) for r in rows]}


if __name__ == "__main__":
    sys.exit(main())
