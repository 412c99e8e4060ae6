"""A Slack outage during a live supervised run: does training slow down, is any alert lost?

Cluster mode as deployed: `thermowatch serve` (Slack configured, pointed at a local fake of the
Slack Web API that speaks its wire format: the one thing outside this machine) and
`thermowatch train CONFIG --supervisor URL` (Ray, DeepSpeed ZeRO-2, a learning rate that
really diverges, so the supervisor decides rollbacks and alerts). Slack answers HTTP 429 with
Retry-After 10 from the start, then HTTP 500, then recovers:

    phase 1  [0, --rate-limited-s)      every Slack call: 429, Retry-After: 10
    phase 2  [.., + --server-error-s)   every Slack call: 500
    phase 3  afterwards                 Slack works

Reported: step times (from the steps' wall times in the daemon's database) during the outage against
the same steps of the same run with Slack healthy (run first, side by side) and
against after it, the alerts Slack received, and whether they arrived complete and in the order
the supervisor decided them (the alert rows' ids).

    python bench/slack_outage.py [--steps 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from common import free_port, new_token, repo_env  # first: this checkout on sys.path
from tests.fakes.slack_server import FakeSlack

SUPERVISOR = """
data_dir: {data}
port: {port}
slack: {{channel: "#training-alerts", base_url: "{slack}", token_env: SLACK_BOT_TOKEN}}
policy: {{rollback_margin_steps: 5, recurrence_window_steps: 60, lr_multiplier: 0.2, min_lr_multiplier: 0.01,
          cooldown_steps: 5, cooldown_s: 0.0, max_interventions: 6}}
detectors: {{attn: {{warmup: 20, min_level: 80.0, ceiling: 150.0}}, disabled: [outlier_rank]}}
"""
TRAIN = """
run_id: slack-outage
world_size: 2
zero_stage: 2
steps: {steps}
model: {{n_layer: 4, n_head: 4, d_model: 128, seq_len: 64}}
data: {{seq_len: 64, global_batch: 16, seed: 1234}}
optim: {{lr: 3.0e-2, warmup_steps: 100, schedule: constant, grad_clip: 1.0}}
checkpoint: {{dir: {ckpt}, every: 5, keep_last: 8, keep_every: 10}}
flush_every_steps: 2
"""


def run_once(a: argparse.Namespace, outage: bool) -> dict:
    """One supervised run; with `outage`, Slack misbehaves from the start as the docstring says.
    Returns the steps' wall times, the alert rows and what the fake Slack received."""
    tmp = Path(tempfile.mkdtemp(prefix="tw-slack-outage-"))
    port = free_port()
    # auth on, as deployed: the daemon's admin token, which `train --supervisor` also sends
    env = repo_env(PYTHONUNBUFFERED="1", THERMOWATCH_API_TOKEN=new_token())
    cli = [sys.executable, "-m", "thermowatch.cli"]
    with FakeSlack() as slack:
        env["SLACK_BOT_TOKEN"] = slack.token
        (tmp / "sup.yaml").write_text(SUPERVISOR.format(data=tmp / "srv", port=port, slack=slack.base_url))
        (tmp / "train.yaml").write_text(TRAIN.format(steps=a.steps, ckpt=tmp / "ckpt"))
        daemon = subprocess.Popen([*cli, "serve", "--config", str(tmp / "sup.yaml")], env=env,
                                  stdout=open(tmp / "serve.log", "w"), stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.2)
            t0 = time.time()
            outage_end = t0 + (a.rate_limited_s + a.server_error_s if outage else 0.0)
            if outage:
                slack.rate_limit(10**9, retry_after=10)

                def phases() -> None:
                    time.sleep(a.rate_limited_s)
                    slack.rate_limit(0)
                    slack.server_error(10**9)
                    time.sleep(a.server_error_s)
                    slack.server_error(0)

                threading.Thread(target=phases, daemon=True).start()
            train = subprocess.run([*cli, "train", str(tmp / "train.yaml"), "--supervisor", url,
                                    "--data-dir", str(tmp / "trainer")], env=env, capture_output=True, text=True)
            if train.returncode != 0:
                raise SystemExit(f"training failed:\n{train.stderr[-3000:]}")
            while time.time() < outage_end + 5:  # let Slack recover, then the outbox deliver
                time.sleep(1)
            from thermowatch.supervisor.db import make_engine, make_sessionmaker
            from thermowatch.supervisor.store import alerts as alerts_store
            from thermowatch.supervisor.store import steps as steps_store

            sessions = make_sessionmaker(make_engine(f"sqlite:///{tmp / 'srv' / 'thermowatch.db'}"))
            deadline = time.time() + 900
            while True:
                with sessions() as s:
                    rows = [r for r in alerts_store.alerts(s, limit=10_000) if r.channel.startswith("slack")]
                if rows and all(r.state != "pending" for r in rows):
                    break
                if time.time() > deadline:
                    raise SystemExit("alerts still pending 15 minutes after the outage")
                time.sleep(1)
            rows.sort(key=lambda r: r.id)
            with sessions() as s:
                walls = []
                for attempt in range(0, 20):
                    walls += steps_store.step_wall_times(s, "slack-outage", attempt)
        finally:
            daemon.terminate()
            daemon.wait(30)
        posted = [m["text"] for m in slack.posted()]
        calls = len(slack.calls("chat.postMessage"))
    walls.sort(key=lambda x: x[1])
    # Step durations in the order the steps were trained (a rollback's replays included).
    durs = [(w2, w2 - w1) for (_, w1), (_, w2) in zip(walls, walls[1:]) if 0 < w2 - w1 < 60]
    expected = [f"[{r.payload['severity'].upper()}] {r.payload['title']}" + (f": {r.payload['text']}" if r.payload["text"] else "")
                for r in rows]
    final = [ln for ln in train.stderr.splitlines() if ln.startswith("run slack-outage")]
    return {"durs": durs, "outage_end": outage_end, "rows": rows, "in_order": posted == expected, "calls": calls,
            "final": final[-1] if final else "?"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rate-limited-s", type=float, default=30.0)
    ap.add_argument("--server-error-s", type=float, default=20.0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    base = run_once(a, outage=False)  # the same run with Slack healthy: the step times to compare with
    hit = run_once(a, outage=True)
    during = [d for w, d in hit["durs"] if w <= hit["outage_end"]]
    after = [d for w, d in hit["durs"] if w > hit["outage_end"]]
    # The baseline's steps at the same positions in the run as the outage's steps.
    base_same = [d for _, d in base["durs"][:len(during)]]
    rows = hit["rows"]
    med = lambda xs: round(statistics.median(xs), 4) if xs else None  # noqa: E731
    out = {
        "alerts": len(rows), "alerts_sent": sum(r.state == "sent" for r in rows),
        "delivered_in_order": hit["in_order"], "slack_calls": hit["calls"],
        "max_attempts": max((r.attempts for r in rows), default=0),
        "step_s_during_outage": med(during), "step_s_same_steps_slack_healthy": med(base_same),
        "step_s_after_outage": med(after), "steps_during_outage": len(during), "steps_after_outage": len(after),
        "outage_slowdown_pct": round(100 * (statistics.median(during) / statistics.median(base_same) - 1), 2)
        if during and base_same else None,
        "baseline_alerts_sent": sum(r.state == "sent" for r in base["rows"]),
        "final_line": hit["final"], "baseline_final_line": base["final"], "load_avg": round(os.getloadavg()[0], 2),
    }
    print(f"Slack: 429 (Retry-After 10) for {a.rate_limited_s:.0f} s, then 500 for {a.server_error_s:.0f} s, then up")
    print(f"alerts decided {out['alerts']}, sent {out['alerts_sent']}, in order: {out['delivered_in_order']}; "
          f"{out['slack_calls']} chat.postMessage calls, up to {out['max_attempts']} attempts per alert")
    print(f"median step time during the outage {out['step_s_during_outage']} s over {len(during)} steps; the same "
          f"steps with Slack healthy {out['step_s_same_steps_slack_healthy']} s ({out['outage_slowdown_pct']:+}%); "
          f"after the outage {out['step_s_after_outage']} s over {len(after)} steps")
    print(f"outage run:   {out['final_line']}\nhealthy run:  {out['baseline_final_line']}")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
