"""deploy/k8s/daemon.yaml run as its pod would run it (issue 13.7): the init container's
command, then the daemon's, each with the container's own arguments and environment, the
ConfigMap's config and the Secret's keys as files. Real PostgreSQL (the StatefulSet is for
PostgreSQL; the Secret's db-url points at it), real uvicorn; the one thing faked is Slack's API.

Adapted only where a pod and this machine differ, each substitution counted: the mount paths
(into a temp dir), the data dir and port, host 127.0.0.1 instead of the pod network's 0.0.0.0
(this machine is shared), and Slack's address. tests/test_deploy.py checks the same objects
against Kubernetes' schemas."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.fakes.slack_server import FakeSlack
from tests.live_server import free_port
from tests.supervisor.conftest import new_pg_schema, pg_schema_url
from tests.supervisor import ROOT

pytestmark = pytest.mark.timeout(180)


def _sub(pattern: str, repl: str, text: str) -> str:
    out, n = re.subn(pattern, repl, text, flags=re.M)
    assert n == 1, f"daemon.yaml changed shape ({pattern!r} matched {n} times); adapt this test"
    return out


def test_the_daemon_pod_migrates_then_serves_with_its_secrets(tmp_path, pg_admin):
    docs = {d["kind"]: d for d in yaml.safe_load_all((ROOT / "deploy/k8s/daemon.yaml").read_text())}
    pod = docs["StatefulSet"]["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    root = tmp_path / "pod"

    def local(path: str) -> str:  # a path inside the pod -> the same path under the temp dir
        return str(root / path.lstrip("/"))

    port = free_port()
    with FakeSlack() as slack:
        text = docs["ConfigMap"]["data"]["supervisor.yaml"]
        text = _sub(r"^data_dir: .*$", f"data_dir: {local(mounts['data'])}", text)
        text = _sub(r"^host: .*$", "host: 127.0.0.1", text)
        text = _sub(r"^port: .*$", f"port: {port}", text)
        text = _sub(r"^(slack:\n)", f"\\1  base_url: {slack.base_url}\n", text)
        config_dir = Path(local(mounts["config"]))
        config_dir.mkdir(parents=True)
        (config_dir / "supervisor.yaml").write_text(text)
        # The Secret's keys as files, with this machine's values in place of the CHANGE-MEs.
        secrets = Path(local(mounts["secrets"]))
        secrets.mkdir(parents=True)
        values = {"db-url": pg_schema_url(new_pg_schema(pg_admin)), "api-token": "tw_deploy-test-admin-token",
                  "slack-bot-token": slack.token}
        assert set(values) == set(docs["Secret"]["stringData"])
        for key, val in values.items():
            (secrets / key).write_text(val)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("THERMOWATCH_", "SLACK_"))}
        base["PYTHONPATH"] = os.pathsep.join([str(ROOT), base.get("PYTHONPATH", "")])

        def container(spec: dict) -> tuple[list[str], dict[str, str]]:
            env = {e["name"]: local(e["value"]) if e["value"].startswith("/") else e["value"] for e in spec["env"]}
            args = [local(a) if a.startswith("/etc/") else a for a in spec["args"]]
            return [sys.executable, "-m", "thermowatch.cli", *args], {**base, **env, "PYTHONUNBUFFERED": "1"}

        cmd, env = container(pod["initContainers"][0])
        init = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert init.returncode == 0, init.stderr
        assert "is at the newest revision" in init.stdout and "deploy-test" not in init.stdout + init.stderr

        cmd, env = container(pod["containers"][0])
        assert "--no-upgrade" in cmd
        log = tmp_path / "serve.log"
        daemon = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            probe = pod["containers"][0]["readinessProbe"]["httpGet"]["path"]
            deadline = time.monotonic() + 120
            while True:
                try:
                    ready = httpx.get(url + probe, timeout=2)
                    if ready.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert daemon.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.3)
            assert ready.json()["checks"]["schema"]["ok"] is True
            live = pod["containers"][0]["livenessProbe"]["httpGet"]["path"]
            assert httpx.get(url + live, timeout=5).status_code == 200
            # Auth is on: the Secret's api-token is the admin, nothing else gets in.
            assert httpx.get(f"{url}/api/runs", timeout=5).status_code == 401
            ok = httpx.get(f"{url}/api/runs", headers={"authorization": f"Bearer {values['api-token']}"}, timeout=5)
            assert ok.status_code == 200 and ok.json()["runs"] == []
            # The Slack bot token file was read and checked against (the fake of) Slack at start.
            checked = slack.calls("auth.test")
            assert checked and checked[0].headers["Authorization"] == f"Bearer {slack.token}" and checked[0].answer["ok"]
        finally:
            daemon.terminate()
            daemon.wait(timeout=30)
        assert "tw_deploy-test-admin-token" not in log.read_text()  # never logged
