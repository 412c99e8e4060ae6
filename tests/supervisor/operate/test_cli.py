"""`thermowatch` command line (thermowatch.cli.main): exit codes, output, and the rows the
manual commands write, on SQLite and PostgreSQL; `replay` on a log of a real diverging run."""

from __future__ import annotations

import io
import json
import math
import time
from dataclasses import dataclass

import pytest

from thermowatch.monitors.contract import RunInfo
from thermowatch.cli import main
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from tests.supervisor.auth_helpers import ADMIN_TOKEN, make_token
from tests.fixtures.diverging import (
    DETECTORS,
    POLICY,
    diverging_records,
    first_step_over,
    healthy_records,
)

RUN = "cli-run"


@pytest.fixture
def run(db, tmp_path):
    """A run with 30 real steps in the DB (through the supervisor's own ingest)."""
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, detectors=dict(DETECTORS)),
                     notifier=ConsoleNotifier(io.StringIO()))
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1), "trainer")  # the trainer's token opened it
    sup.write(RUN, 0, healthy_records()[:30])
    sup.close()
    return RUN


@dataclass
class Daemon:
    url: str
    token: str | None  # the on-call engineer's: read + operate
    trainer_token: str  # the run controller's: ingest

    @property
    def token_flags(self) -> list[str]:
        return ["--token", self.token] if self.token else []

    @property
    def flags(self) -> list[str]:
        return ["--server", self.url, *self.token_flags]


@pytest.fixture
def daemon(db, run, tmp_path):
    """`thermowatch serve`'s app on the test database, over real HTTP: the manual commands are
    its clients and never open the database themselves."""
    from thermowatch.supervisor.serve.server import build_app
    from tests.live_server import running

    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "daemon", db_url=db.url, api_token=ADMIN_TOKEN),
                     notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    try:
        with running(build_app(sup)) as url:
            yield Daemon(url, make_token(db.sessions, "oncall", "read", "operate"),
                         make_token(db.sessions, "trainer", "ingest"))
    finally:
        sup.close()


def actions(db, run_id=RUN):
    with db.sessions() as s:
        return actions_store.actions(s, run_id)


def test_db_upgrade_and_current(tmp_path, capsys):
    url = f"sqlite:///{tmp_path / 'fresh.db'}"
    assert main(["db", "current", "--db", url]) == 1
    err = capsys.readouterr().err
    assert "has no thermowatch schema" in err and "thermowatch db upgrade" in err
    assert main(["db", "upgrade", "--db", url]) == 0
    assert "newest revision" in capsys.readouterr().out
    assert main(["db", "current", "--db", url]) == 0
    assert "database is current" in capsys.readouterr().out
    assert main(["db", "upgrade", "--db", url]) == 0  # idempotent


def test_db_current_on_the_test_databases(db, capsys):
    assert main(["db", "current", "--db", db.url]) == 0
    assert "database is current" in capsys.readouterr().out


def test_runs_and_actions_json(daemon, capsys):
    assert main(["runs", *daemon.flags, "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [{k: r[k] for k in ("run_id", "last_step", "attempts", "open_incidents")} for r in rows] == [
        {"run_id": RUN, "last_step": 30, "attempts": 1, "open_incidents": 0}]
    assert main(["runs", *daemon.flags]) == 0
    assert f"{RUN}  last step 30" in capsys.readouterr().out
    assert main(["actions", RUN, *daemon.flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == []
    assert main(["actions", RUN, *daemon.flags]) == 0
    assert "(none)" in capsys.readouterr().out


def test_rollback_writes_a_manual_action(db, daemon, capsys):
    code = main(["rollback", RUN, "--to-step", "20", "--skip", "160:320", "--skip", "400:416", "--multiplier", "0.5",
                 "--who", "x", "--reason", "spike at 25", *daemon.flags])
    out = capsys.readouterr().out
    assert code == 0, out
    (row,) = actions(db)
    assert (f"action {row.id} queued for run {RUN}: roll back to the newest healthy checkpoint at or before step 20, "
            "skip samples [160, 320), [400, 416), set the LR to x0.5 of the schedule") in out
    assert "{" not in out  # plain words, never a Python dict (issue 23)
    # Recorded under the token's name; --who rides along as the person's own claim.
    assert (row.kind, row.state, row.origin, row.who, row.reason, row.requires_approval) == (
        "rollback", "pending", "manual", "oncall (x)", "spike at 25", False)
    assert row.args == {"to_step": 20, "skip_ranges": [[160, 320], [400, 416]], "lr_multiplier": 0.5,
                        "lr_steps": None, "rewarmup_steps": 0}
    with db.sessions() as s:
        assert [e.event for e in audit_store.audit_log(s, RUN)].count("enqueued") == 1
    assert main(["actions", RUN, *daemon.flags, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(a["id"], a["kind"], a["state"], a["who"]) for a in listed] == [(row.id, "rollback", "pending", "oncall (x)")]


def test_cancel_from_the_cli(db, daemon, capsys):
    assert main(["pause", RUN, "--who", "x", *daemon.flags]) == 0
    (row,) = actions(db)
    assert main(["cancel", str(row.id), "--who", "y", *daemon.flags]) == 0
    assert "cancelled by y" in capsys.readouterr().out
    assert actions(db)[0].state == "cancelled"
    assert main(["cancel", str(row.id), "--who", "y", *daemon.flags]) == 2
    assert "cannot go from 'cancelled'" in capsys.readouterr().err


def test_ack_takes_a_page_once_from_the_cli(db, daemon, capsys):
    """`thermowatch ack` (issue 37): a manual pause's page taken by the token's holder, audited
    once; the second says who had it; a story of another run or none exits 2 naming it."""
    assert main(["pause", RUN, "--who", "x", *daemon.flags]) == 0
    (row,) = actions(db)
    capsys.readouterr()
    assert main(["ack", RUN, "--action", str(row.id), "--who", "al", "--reason", "on it", *daemon.flags]) == 0
    assert f"you have the page for action {row.id} of run {RUN}" in capsys.readouterr().out
    assert main(["ack", RUN, "--action", str(row.id), *daemon.flags]) == 0
    assert "already acknowledged by oncall (al)" in capsys.readouterr().out
    with db.sessions() as s:
        (ev,) = audit_store.events(s, RUN, "page_acknowledged")
        assert (ev.actor, ev.detail) == ("oncall (al)", {"action_id": row.id, "reason": "on it"})
    assert main(["ack", RUN, "--incident", "777", *daemon.flags]) == 2
    assert f"no incident 777 in run '{RUN}'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["ack", RUN, *daemon.flags])
    assert exc.value.code == 2 and "one of the arguments --incident --action is required" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["rollback", RUN, "--to-step", "20", "--skip", "5"], "--skip takes LO:HI"),
    (["rollback", RUN, "--to-step", "20", "--skip", "9:3"], "lo must be < hi"),
    (["rollback", "no-such-run", "--to-step", "20"], "no run 'no-such-run'"),
    (["actions", "no-such-run"], "no run 'no-such-run'"),
    (["approve", "12345"], "no action 12345"),
])
def test_bad_input_exits_2_with_the_daemons_message(db, daemon, capsys, argv, words):
    code = main([*argv, "--who", "x", *daemon.flags] if argv[0] not in ("actions",) else [*argv, *daemon.flags])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and "Traceback" not in err
    assert actions(db) == []


@pytest.mark.parametrize("argv, words", [
    (["lr", RUN, "--multiplier", "nan"], "thermowatch lr: error: argument --multiplier: must be a finite number "
                                         "in (0, 10], got nan"),
    (["lr", RUN, "--multiplier", "inf"], "argument --multiplier: must be a finite number in (0, 10], got inf"),
    (["lr", RUN, "--multiplier", "1e999"], "argument --multiplier: must be a finite number in (0, 10], got inf"),
    (["lr", RUN, "--multiplier", "50"], "argument --multiplier: must be a finite number in (0, 10], got 50.0"),
    (["lr", RUN, "--multiplier", "0"], "argument --multiplier: must be a finite number in (0, 10], got 0.0"),
    (["lr", RUN, "--factor=-nan"], "argument --factor: must be a finite number in (0, 10], got nan"),
    (["lr", RUN, "--multiplier", "0.5", "--for-steps", "0"], "argument --for-steps: must be an integer in [1, 2**63-1], got 0"),
    (["rollback", RUN, "--to-step", "-4"], "argument --to-step: must be an integer in [0, 2**63-1], got -4"),
    (["rollback", RUN, "--to-step", "1.5"], "argument --to-step: must be an integer in [0, 2**63-1], got '1.5'"),
    (["stop", RUN, "--wait", "--timeout", "nan"], "argument --timeout: must be a finite number > 0, got nan"),
    (["runs", "--limit", "0"], "argument --limit: must be an integer in [1, 1000], got 0"),
    (["approve", "-1"], "argument action_id: must be an integer in [1, 2**31-1], got -1"),
    (["plot", RUN, "loss", "-o", "x.png", "--width", "5"], "argument --width: must be an integer in [200, 4000], got 5"),
    (["quarantine", RUN, "--horizon", "0"], "argument --horizon: must be an integer in [1, 2**63-1], got 0"),
    (["serve", "--port", "70000"], "argument --port: must be an integer in [1, 65535], got 70000"),
    (["simulate", "--seed", "-1"], "argument --seed: must be an integer in [0, 2**63-1], got -1"),
])
def test_a_number_a_flag_cannot_take_exits_2_with_one_line_and_asks_no_daemon(tmp_path, capsys, monkeypatch, argv,
                                                                             words):
    """Issue 34: `thermowatch lr RUN --multiplier nan` ended in a traceback. Every numeric flag is
    checked as it is parsed (monitors.settings): argparse's usage error, exit 2. Nothing listens
    at the address, so a command that asked a daemon would exit 3 instead."""
    from tests.live_server import free_port

    monkeypatch.setenv("THERMOWATCH_SERVER", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("THERMOWATCH_CLIENT_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.splitlines()[-1].endswith(words), err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["status", ".."], ["export", "..", "--out", "x.jsonl"], ["actions", "a/b"],
                                  ["lr", ".", "--multiplier", "0.5"]])
def test_a_run_id_the_daemon_would_refuse_exits_2_before_asking_it(tmp_path, capsys, monkeypatch, argv):
    """The CLI is a client too: it checks RUN with the daemon's rule (monitors.names); `..` would
    be resolved away by the URL and ask another route. Nothing listens: asking would exit 3."""
    from tests.live_server import free_port

    monkeypatch.setenv("THERMOWATCH_SERVER", f"http://127.0.0.1:{free_port()}")
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"thermowatch: RUN {argv[1]!r}" in err and "Traceback" not in err, err
    assert not list(tmp_path.iterdir())


def test_lr_multiplier_nan_as_a_process_exits_2_without_a_traceback(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "THERMOWATCH_CLIENT_CONFIG": str(tmp_path / "none.json")}
    p = subprocess.run([sys.executable, "-m", "thermowatch", "lr", RUN, "--multiplier", "nan"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.splitlines()[-1] == ("thermowatch lr: error: argument --multiplier: must be a finite number in "
                                         "(0, 10], got nan")


def test_no_daemon_names_the_address_and_how_to_point_elsewhere(tmp_path, capsys, monkeypatch):
    from tests.live_server import free_port

    monkeypatch.setenv("THERMOWATCH_CLIENT_CONFIG", str(tmp_path / "none.json"))
    monkeypatch.delenv("THERMOWATCH_SERVER", raising=False)
    port = free_port()  # nothing listens there
    monkeypatch.setenv("THERMOWATCH_SERVER", f"http://127.0.0.1:{port}")
    assert main(["runs"]) == 3
    err = capsys.readouterr().err
    assert f"http://127.0.0.1:{port} (from THERMOWATCH_SERVER)" in err and "--server URL" in err
    assert "Traceback" not in err


def test_login_remembers_the_server_for_this_user_only(db, daemon, tmp_path, capsys, monkeypatch):
    path = tmp_path / "cfg" / "client.json"
    monkeypatch.setenv("THERMOWATCH_CLIENT_CONFIG", str(path))
    monkeypatch.delenv("THERMOWATCH_SERVER", raising=False)
    monkeypatch.delenv("THERMOWATCH_TOKEN", raising=False)
    assert main(["login", "--server", daemon.url, *daemon.token_flags, *([] if daemon.token else ["--no-token"])]) == 0
    assert "1 run(s) visible" in capsys.readouterr().out
    assert path.stat().st_mode & 0o777 == 0o600
    assert json.loads(path.read_text())["server"] == daemon.url
    assert main(["runs", "--json"]) == 0  # no flags: the saved address (and token) are used
    assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == [RUN]


def test_several_addresses_the_first_dead_the_second_a_standby(db, daemon, tmp_path, capsys, monkeypatch):
    """Issue 40: --server names every replica, comma-separated; a read and a manual command reach
    the leader past a dead address and a standby's 503, the command once; `login` keeps the list."""
    from tests.fakes.replica import Replica
    from tests.live_server import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens
    with Replica(daemon.url, "standby") as standby:
        servers = ",".join([dead, standby.url, daemon.url])
        assert main(["runs", "--server", servers, *daemon.token_flags, "--json"]) == 0
        assert [r["run_id"] for r in json.loads(capsys.readouterr().out)] == [RUN]
        assert main(["pause", RUN, "--who", "ana", "--server", servers, *daemon.token_flags]) == 0
        assert [(a.kind, a.who) for a in actions(db)] == [("pause", "oncall (ana)")]  # once
        assert standby.refused("POST") == [f"/api/runs/{RUN}/actions"]
        path = tmp_path / "cfg" / "client.json"
        monkeypatch.setenv("THERMOWATCH_CLIENT_CONFIG", str(path))
        monkeypatch.delenv("THERMOWATCH_SERVER", raising=False)
        assert main(["login", "--server", servers, *daemon.token_flags, *([] if daemon.token else ["--no-token"])]) == 0
        assert json.loads(path.read_text())["server"] == servers
        capsys.readouterr()
        assert main(["actions", RUN, "--json"]) == 0  # the saved list, the dead one first
    assert len(json.loads(capsys.readouterr().out)) == 1


def test_every_address_dead_names_them_all(tmp_path, capsys, monkeypatch):
    from tests.live_server import free_port

    monkeypatch.setenv("THERMOWATCH_CLIENT_CONFIG", str(tmp_path / "none.json"))
    a, b = (f"http://127.0.0.1:{free_port()}" for _ in range(2))
    monkeypatch.setenv("THERMOWATCH_SERVER", f"{a}, {b}/")
    assert main(["runs"]) == 3
    err = capsys.readouterr().err
    assert f"at any of {a}, {b} (from THERMOWATCH_SERVER)" in err and "Traceback" not in err


def _write_log(path, recs, replace=None, torn_at=None):
    """JSONL as a run controller would log it (Python's json writes NaN/Infinity literals);
    `replace` swaps in raw lines by step, `torn_at` inserts a torn line before that index."""
    replace = replace or {}
    lines = [replace.get(r.step, json.dumps(r.to_json())) for r in recs]
    if torn_at is not None:
        lines.insert(torn_at, '{"step": 3, "loss": ')
    path.write_text("\n".join(lines) + "\n")


def test_replay_json_on_a_real_divergence(tmp_path, capsys):
    recs = diverging_records()
    bad_step = recs[10].step
    nan_line = json.dumps({**recs[10].to_json(), "grad_norm": math.nan})
    assert '"grad_norm": NaN' in nan_line
    log = tmp_path / "run.jsonl"
    _write_log(log, recs, replace={bad_step: nan_line}, torn_at=3)
    (tmp_path / "det.json").write_text(json.dumps(DETECTORS))
    (tmp_path / "pol.json").write_text(json.dumps({**POLICY, "checkpoint_every": 5}))
    code = main(["replay", str(log), "--json", "--detectors", str(tmp_path / "det.json"),
                 "--policy", str(tmp_path / "pol.json")])
    cap = capsys.readouterr()
    assert code == 1, cap.err  # 1: findings
    assert f"{log}:4: skipped malformed record" in cap.err
    findings = [json.loads(line) for line in cap.out.splitlines()]
    assert findings
    for f in findings:
        assert {"signal", "module", "onset_step", "detect_step", "severity", "decision"} <= set(f)
        assert f["onset_step"] <= f["detect_step"]
    # the NaN literal is data: the non-finite detector sees it at its step
    nf = [f for f in findings if f["signal"] == "non_finite"]
    assert [(f["detect_step"], f["metric"]) for f in nf] == [(bad_step, "grad_norm")]
    attn = [f for f in findings if f["signal"].startswith("attn_logit")]
    assert attn, findings
    first = min(attn, key=lambda f: f["detect_step"])
    assert first["detect_step"] >= first_step_over(recs, DETECTORS["attn"]["ceiling"]) - 20
    assert first["module"].startswith("blocks.")
    decided = [f["decision"]["kind"] for f in findings]
    assert "rollback" in decided
    rb = next(f["decision"] for f in findings if f["decision"]["kind"] == "rollback")
    assert rb["to_step"] % 5 == 0 and rb["reasons"]


def test_replay_of_the_healthy_run_is_clean(tmp_path, capsys):
    log = tmp_path / "ok.jsonl"
    _write_log(log, healthy_records())
    (tmp_path / "det.json").write_text(json.dumps(DETECTORS))
    assert main(["replay", str(log), "--detectors", str(tmp_path / "det.json")]) == 0
    assert "120 records, 0 findings" in capsys.readouterr().out


def test_replay_missing_file_exits_2(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.jsonl"), "--json"]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "x.jsonl"), "--policy", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml: no such file" in capsys.readouterr().err


def _answer(daemon, make_ack):
    """Play the run controller through its real HTTP command channel: poll the daemon until the
    CLI's command is there and acknowledge it with make_ack(command)."""
    import time

    from thermowatch.transport import HttpCommandChannel

    channel = HttpCommandChannel(daemon.url, token=daemon.trainer_token)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            cmds = channel.poll(RUN)
            if cmds:
                for c in cmds:
                    channel.ack(RUN, make_ack(c))
                return cmds
            time.sleep(0.05)
        raise AssertionError("the CLI never submitted its command")
    finally:
        channel.close()


def _in_thread(argv):
    import threading

    out = {}
    t = threading.Thread(target=lambda: out.setdefault("code", main(argv)))
    t.start()
    return t, out


def test_wait_and_json_print_what_the_trainer_did(daemon, capsys):
    from thermowatch.monitors.contract import Ack, LRChange

    t, out = _in_thread(["lr", RUN, "--factor", "0.5", "--wait", "--json", "--who", "x", *daemon.flags])
    (cmd,) = _answer(daemon, lambda c: Ack(c.id, True, 31, "lr x0.5 from step 31", lr_multiplier=0.5,
                                                 lr_change=LRChange(31, 0.5), lr_seq=0))
    t.join(30)
    assert cmd.args["lr_multiplier"] == 0.5 and cmd.args["lr_base"] == 1.0  # relative -> absolute
    got = json.loads(capsys.readouterr().out)
    assert out["code"] == 0
    assert {k: got[k] for k in ("state", "first_step", "effective_lr_multiplier", "checkpoint_step",
                                "skip_ranges", "action_id")} == {
        "state": "done", "first_step": 31, "effective_lr_multiplier": 0.5, "checkpoint_step": None,
        "skip_ranges": [], "action_id": cmd.id}
    assert got["requested_lr"] == "x0.5 (= x1 in force, times 0.5)"


def test_wait_exits_1_when_the_trainer_refuses(daemon, capsys):
    from thermowatch.monitors.contract import Ack

    t, out = _in_thread(["rollback", RUN, "--to-step", "20", "--wait", "--who", "x", *daemon.flags])
    _answer(daemon, lambda c: Ack(c.id, False, 31, "no valid healthy checkpoint at or before step 20"))
    t.join(30)
    text = capsys.readouterr().out
    assert out["code"] == 1
    assert "rollback failed" in text and "no valid healthy checkpoint at or before step 20" in text


def test_wait_returns_when_the_run_finishes_and_a_finished_run_refuses_with_exit_2(daemon, capsys):
    """Issue 23: `--wait` on a command the run never took blocked ~10 minutes, then said
    "pending". Now the run's finish expires it at once and --wait says so (exit 1); a command to
    the finished run is refused at submit (409, exit 2) naming how it ended."""
    import httpx

    t, out = _in_thread(["pause", RUN, "--wait", "--who", "x", *daemon.flags])
    with httpx.Client(base_url=daemon.url, headers={"Authorization": f"Bearer {daemon.trainer_token}"}) as api:
        deadline = time.monotonic() + 30
        reader = {"Authorization": f"Bearer {daemon.token}"}
        while not httpx.get(f"{daemon.url}/api/runs/{RUN}/actions", headers=reader).json()["actions"]:
            assert time.monotonic() < deadline, "the CLI never submitted its command"
            time.sleep(0.05)
        t0 = time.monotonic()
        r = api.post(f"/api/runs/{RUN}/attempts/0/finished", json={"step": 30, "final_loss": 2.5, "reason": "closed"})
        assert r.status_code == 200, r.text
    t.join(30)
    assert not t.is_alive() and time.monotonic() - t0 < 5
    text = capsys.readouterr().out
    assert out["code"] == 1, text
    assert "pause expired" in text and "the run finished (closed at step 30) before the trainer carried it out" in text
    assert main(["skip", RUN, "--skip", "0:8", "--who", "x", *daemon.flags]) == 2
    err = capsys.readouterr().err
    assert f"run '{RUN}' has finished (closed at step 30, final loss 2.5 (the last step's))" in err, err


# --- the read commands for 3 a.m. (issue 12): --version, status, incidents, export ----------------


def test_version(capsys):
    from thermowatch.supervisor import version

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"thermowatch {version()}" and version() != "unknown"


def test_status_running_then_awaiting_approval_then_paused(db, daemon, capsys):
    from thermowatch.monitors.contract import Ack

    assert main(["status", RUN, *daemon.flags, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert (st["state"], st["last_step"], st["attempt"], st["open_incidents"], st["pending_approvals"]) == (
        "running", 30, 0, [], [])
    assert 0 <= st["last_record_age_s"] < 120
    with db.sessions.begin() as s:  # what the policy writes in advise-only mode
        waiting = actions_store.enqueue_action(s, RUN, "rollback", {"to_step": 20}, "attn blowup", "auto",
                                               "supervisor", requires_approval=True)
    t, out = _in_thread(["pause", RUN, "--wait", "--who", "x", *daemon.flags])
    (cmd,) = _answer(daemon, lambda c: Ack(c.id, True, 31, "paused after step 30"))
    t.join(30)
    capsys.readouterr()
    assert main(["status", RUN, *daemon.flags, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["state"] == "paused" and f"action {cmd.id}" in st["why"]
    assert [(a["id"], a["kind"], a["approve"]) for a in st["pending_approvals"]] == [
        (waiting, "rollback", f"thermowatch approve {waiting}")]
    assert [(a["id"], a["state"], a["did"]) for a in st["last_actions"]][0] == (cmd.id, "done", "paused after step 30")
    assert main(["status", RUN, *daemon.flags]) == 0
    text = capsys.readouterr().out
    assert f"run {RUN}: PAUSED" in text and "step 30" in text
    assert f"thermowatch approve {waiting}" in text and f"thermowatch cancel {waiting}" in text
    assert main(["status", "no-such-run", *daemon.flags]) == 2
    assert "no run 'no-such-run'" in capsys.readouterr().err


@pytest.fixture
def diverging_daemon(db, tmp_path):
    """A daemon that judged a real diverging run (tests.fixtures.diverging) as the trainer sends it."""
    from thermowatch.supervisor.serve.server import build_app
    from tests.live_server import running

    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "div", db_url=db.url, api_token=ADMIN_TOKEN,
                                      detectors=dict(DETECTORS), policy=dict(POLICY)),
                     notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    try:
        sup.open_run(RunInfo(run_id="div", attempt=0, world_size=1), "trainer")  # the trainer's token
        recs = diverging_records()
        for i in range(0, len(recs), 10):
            sup.write("div", 0, recs[i:i + 10])
        assert sup.judge.wait(60)
        with running(build_app(sup)) as url:
            yield Daemon(url, make_token(db.sessions, "oncall", "read"), make_token(db.sessions, "trainer", "ingest"))
    finally:
        sup.close()


def test_incidents_and_export_replays_to_the_daemons_findings(db, diverging_daemon, tmp_path, capsys):
    from thermowatch.supervisor.store import findings as findings_store

    d = diverging_daemon
    assert main(["incidents", "div", *d.flags, "--json"]) == 0
    incidents = json.loads(capsys.readouterr().out)
    assert incidents and all(i["findings"] for i in incidents)
    assert any(f["signal"].startswith("attn_logit") for i in incidents for f in i["findings"])
    assert main(["incidents", "div", *d.flags]) == 0
    text = capsys.readouterr().out
    first = incidents[0]
    assert f"#{first['id']} {first['state']}" in text and first["signal"] in text

    out = tmp_path / "div.jsonl"
    assert main(["export", "div", *d.flags, "--out", str(out)]) == 0
    assert f"to {out}" in capsys.readouterr().out
    lines = out.read_text().splitlines()
    recs = diverging_records()
    assert len(lines) == len(recs) and json.loads(lines[0])["step"] == recs[0].step
    (tmp_path / "det.json").write_text(json.dumps(DETECTORS))
    code = main(["replay", str(out), "--json", "--no-policy", "--detectors", str(tmp_path / "det.json")])
    replayed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert code == 1 and replayed
    with db.sessions() as s:
        stored = [f.finding.to_json() for f in findings_store.findings(s, "div")]

    def key(f):
        return f["signal"], f["module"], f["metric"], f["onset_step"], f["detect_step"]

    assert sorted(map(key, replayed)) == sorted(map(key, stored))
    # the same history as CSV (issue 23): a row per record, the same values, NaN kept as NaN
    import csv
    import math

    assert main(["export", "div", *d.flags, "--out", str(tmp_path / "div.csv")]) == 0
    assert "as CSV" in capsys.readouterr().out
    with (tmp_path / "div.csv").open(newline="") as fh:
        table = list(csv.DictReader(fh))
    rows = [json.loads(line) for line in lines]
    assert len(table) == len(rows) and list(table[0])[:2] == ["attempt", "step"]
    for got, want in zip(table, rows):
        assert int(got["step"]) == want["step"] and int(got["attempt"]) == want["attempt"]
        for k, v in want.items():
            if k not in ("step", "attempt"):
                f = float(got[k])
                assert (math.isnan(f) and math.isnan(v)) or f == v, (k, got[k], v)
    assert main(["export", "no-such-run", *d.flags, "--out", str(tmp_path / "x.jsonl")]) == 2
    assert not (tmp_path / "x.jsonl").exists()


def _not_regular_targets(tmp_path):
    """(name, path) of things a CLI writer must refuse to replace, all made inside tmp_path (the old
    export renamed its file over whatever --out named: as root, /dev/full became a regular file)."""
    import os
    import stat

    (tmp_path / "fifo").parent.mkdir(exist_ok=True)
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "to-dev-full").symlink_to("/dev/full")
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "to-a-dir").symlink_to(tmp_path / "a-dir")
    out = [("fifo", tmp_path / "fifo"), ("symlink to /dev/full", tmp_path / "to-dev-full"),
           ("symlink to a directory", tmp_path / "to-a-dir")]
    if os.geteuid() == 0:  # a device node of our own, never the machine's
        os.mknod(tmp_path / "full", stat.S_IFCHR | 0o666, os.makedev(1, 7))
        out.append(("character device", tmp_path / "full"))
    return out


def _snapshot(path):
    import os

    st = os.lstat(path)
    return st.st_mode, st.st_ino, os.readlink(path) if path.is_symlink() else None


def test_export_refuses_to_replace_anything_but_a_regular_file(daemon, tmp_path, capsys):
    import os

    targets = _not_regular_targets(tmp_path / "t")
    for what, path in targets:
        before = _snapshot(path)
        assert main(["export", RUN, *daemon.flags, "--out", str(path)]) == 2, what
        err = capsys.readouterr().err
        assert f"--out {path}" in err and "Traceback" not in err, err
        assert "writes only to a regular file" in err or "is a directory; give a file name" in err, err
        assert _snapshot(path) == before, what  # untouched: same kind, same inode, same link
    assert "is a fifo (named pipe)" in err or "is a character device" in err
    assert sorted(p.name for p in (tmp_path / "t").iterdir()) == sorted(
        ["fifo", "to-dev-full", "a-dir", "to-a-dir"] + (["full"] if os.geteuid() == 0 else []))  # no .partial left
    assert os.path.exists("/dev/full") and not os.path.isfile("/dev/full")
    # over a regular file, through a symlink: the file named is replaced whole, the link kept
    real = tmp_path / "real.jsonl"
    real.write_text("old\n")
    (tmp_path / "link.jsonl").symlink_to(real)
    assert main(["export", RUN, *daemon.flags, "--out", str(tmp_path / "link.jsonl")]) == 0
    assert (tmp_path / "link.jsonl").is_symlink() and len(real.read_text().splitlines()) == 30
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]


def test_plot_refuses_a_fifo_before_asking_the_daemon(tmp_path, capsys, monkeypatch):
    from tests.live_server import free_port

    monkeypatch.setenv("THERMOWATCH_SERVER", f"http://127.0.0.1:{free_port()}")  # nothing listens: exit 3 if asked
    targets = dict(_not_regular_targets(tmp_path))
    assert main(["plot", RUN, "loss", "-o", str(targets["fifo"])]) == 2
    assert f"-o {targets['fifo']} is a fifo (named pipe)" in capsys.readouterr().err
    assert main(["plot", RUN, "loss", "-o", str(tmp_path / "no-such-folder" / "x.png")]) == 2
    assert "the folder" in capsys.readouterr().err


def test_a_closed_pipe_and_no_terminal_end_with_a_reason_not_a_traceback(daemon, tmp_path):
    """Issue 23's papercuts: `thermowatch actions RUN | head` printed a BrokenPipe traceback, and
    `login` without --token in a non-interactive shell a getpass traceback."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "THERMOWATCH_CLIENT_CONFIG": str(tmp_path / "client.json")}
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the first line: every write fails with EPIPE
    try:
        p = subprocess.run([sys.executable, "-m", "thermowatch", "runs", *daemon.flags], stdout=w,
                           stderr=subprocess.PIPE, text=True, env=env, timeout=120)
    finally:
        os.close(w)
    assert p.returncode == 0 and "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr, p.stderr
    p = subprocess.run([sys.executable, "-m", "thermowatch", "login", "--server", daemon.url], stdin=subprocess.DEVNULL,
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "no terminal to type it in: pass --token TOKEN" in p.stderr


def test_a_clients_free_text_is_printed_escaped_never_as_terminal_control(db, run, tmp_path, capsys):
    """Issue 34: a reason or an ack's detail is free text (only NUL is refused); printed as is, a
    newline forged a line of the listing and an escape sequence drove the reader's terminal."""
    from thermowatch.monitors.contract import Ack
    from thermowatch.supervisor.serve.server import build_app
    from tests.live_server import running

    console = io.StringIO()
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "daemon", db_url=db.url, api_token=ADMIN_TOKEN),
                     notifier=ConsoleNotifier(console), judge_inline=False)
    try:
        evil = "ok\x1b[2J\x1b]0;pwned\x07\n#999 rollback done     manual by root"
        action_id = sup.executor.submit(RUN, "pause", {}, "alice", evil)
        (cmd,) = sup.poll(RUN)
        sup.ack(RUN, Ack(cmd.id, True, 31, evil))
        with running(build_app(sup)) as url:
            assert main(["actions", RUN, "--server", url, "--token", ADMIN_TOKEN]) == 0
    finally:
        sup.close()
    out = capsys.readouterr().out
    assert f"#{action_id} pause" in out and "\x1b" not in out and "\x07" not in out
    assert r"ok\x1b[2J\x1b]0;pwned\x07\n#999 rollback done" in out  # shown, on its own line
    assert not any(line.startswith("#999") for line in out.splitlines())
    said = console.getvalue()  # the daemon's console alerts: the same text, escaped per line
    assert "\x1b" not in said and "\x07" not in said and r"ok\x1b[2J\x1b]0;pwned\x07" in said
    assert not any(line.startswith("#999") for line in said.splitlines())
