"""The on-call engineer's path, as deployed (issue 11): `thermowatch serve` started with the
shipped `deploy/supervisor.example.yaml` (adapted only by its data dir, port, and Slack's
address, which points at the local fake of the Slack API: the one thing outside this machine),
a live `thermowatch train` run feeding it with an `ingest` token, and the CLI run from another
"laptop" directory with only the daemon's address and an `operate` token: no database URL, no
data dir. `thermowatch runs` sees the run, `rollback --wait` is carried out by the trainer and
reports what it did, `stop --wait` ends the run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes.slack_server import FakeSlack
from tests.live_server import free_port, wait_healthy
from tests.supervisor import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TRAIN = """
run_id: drill
world_size: 1
zero_stage: 2
steps: 100000
model: {{n_layer: 2, n_head: 2, d_model: 32, seq_len: 32}}
data: {{seq_len: 32, global_batch: 4, max_bytes: 262144}}
optim: {{lr: 1.0e-3, warmup_steps: 10}}
checkpoint: {{dir: {ckpt}, every: 10, keep_last: 50, keep_every: 0}}
flush_every_steps: 2
"""


def _example_config(data_dir: Path, port: int, slack_url: str) -> str:
    text = (ROOT / "deploy" / "supervisor.example.yaml").read_text()
    text, n1 = re.subn(r"(?m)^data_dir: .*$", f"data_dir: {data_dir}", text)
    text, n2 = re.subn(r"(?m)^port: .*$", f"port: {port}", text)
    text, n3 = re.subn(r"(?m)^(slack:\n)", f"\\1  base_url: {slack_url}\n", text)
    assert (n1, n2, n3) == (1, 1, 1), "the example config changed shape; adapt this test"
    return text


def test_oncall_cli_rolls_back_and_stops_a_live_run_with_no_database_access(tmp_path):
    port = free_port()
    cli = [sys.executable, "-m", "thermowatch.cli"]
    base = {k: v for k, v in os.environ.items() if not k.startswith(("THERMOWATCH_", "SLACK_"))}
    base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])
    cfg = tmp_path / "supervisor.yaml"
    with FakeSlack() as slack:
        cfg.write_text(_example_config(tmp_path / "srv", port, slack.base_url))
        server_env = {**base, "SLACK_BOT_TOKEN": slack.token, "PYTHONUNBUFFERED": "1"}
        daemon = subprocess.Popen([*cli, "serve", "--config", str(cfg)], env=server_env, cwd=tmp_path,
                                  stdout=open(tmp_path / "serve.log", "w"), stderr=subprocess.STDOUT)
        train = None
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, daemon, tmp_path / "serve.log", timeout_s=120)

            def token(name: str, *scopes: str) -> str:  # the admin's job, on the daemon's host
                args = [a for s in scopes for a in ("--scope", s)]
                made = subprocess.run([*cli, "token", "create", name, *args, "--config", str(cfg)], env=base,
                                      capture_output=True, text=True, timeout=120)
                assert made.returncode == 0, made.stderr
                return made.stdout.strip()

            (tmp_path / "train.yaml").write_text(TRAIN.format(ckpt=tmp_path / "ckpt"))
            train = subprocess.Popen([*cli, "train", str(tmp_path / "train.yaml"), "--supervisor", url,
                                      "--data-dir", str(tmp_path / "trainer")],
                                     env={**base, "THERMOWATCH_TOKEN": token("trainer", "ingest")}, cwd=tmp_path,
                                     stdout=subprocess.DEVNULL, stderr=open(tmp_path / "train.log", "w"))

            laptop = tmp_path / "laptop"
            laptop.mkdir()
            shell = {**base, "THERMOWATCH_SERVER": url, "THERMOWATCH_TOKEN": token("oncall", "operate"),
                     "THERMOWATCH_CLIENT_CONFIG": str(laptop / "client.json")}

            def tw(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
                return subprocess.run([*cli, *argv], env=shell, cwd=laptop, capture_output=True, text=True,
                                      timeout=timeout)

            deadline = time.monotonic() + 400
            while True:  # `thermowatch runs` until the run is past its checkpoint at step 20
                out = tw("runs", "--json")
                assert out.returncode == 0, out.stderr
                runs = {r["run_id"]: r for r in json.loads(out.stdout)}
                if (runs.get("drill", {}).get("last_step") or 0) >= 25:
                    break
                assert train.poll() is None and time.monotonic() < deadline, (tmp_path / "train.log").read_text()[-3000:]
                time.sleep(1)

            rb = tw("rollback", "drill", "--to-step", "20", "--wait", "--json", "--reason", "on-call drill",
                    timeout=300)
            assert rb.returncode == 0, rb.stdout + rb.stderr
            did = json.loads(rb.stdout)
            assert (did["state"], did["checkpoint_step"], did["first_step"]) == ("done", 20, 21), did

            stop = tw("stop", "drill", "--wait", "--json", timeout=300)
            assert stop.returncode == 0 and json.loads(stop.stdout)["state"] == "done", stop.stdout + stop.stderr
            assert train.wait(timeout=180) == 0, (tmp_path / "train.log").read_text()[-3000:]

            acts = tw("actions", "drill", "--json")
            assert acts.returncode == 0, acts.stderr
            mine = [(a["kind"], a["state"], a["who"].split(" ")[0]) for a in json.loads(acts.stdout)
                    if a["origin"] == "manual"]
            assert sorted(mine) == [("rollback", "done", "oncall"), ("stop", "done", "oncall")]
            # The laptop never held a database: nothing was created there but the CLI's own nothing.
            assert sorted(p.name for p in laptop.iterdir()) == []
        finally:
            if train is not None and train.poll() is None:
                train.kill()
            daemon.terminate()
            daemon.wait(timeout=30)
