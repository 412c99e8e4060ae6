"""Silence and snooze (issue 37 item 4): a run's signal silenced for a while pages no one (its
alerts go out as warnings saying who silenced them until when), its findings still act by policy,
an approval still asks; set and ended over the API and the CLI, audited, with an expiry, and bad
input is a 4xx naming the problem with nothing stored. Real databases, the real app."""

from __future__ import annotations

import argparse
import datetime as dt
import io

import pytest
from fastapi.testclient import TestClient

from thermowatch.monitors.contract import RunInfo, Severity
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.base import Alert
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.operate.manual import _duration
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import silences as silences_store
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH

RUN = "hush"


@pytest.fixture
def sup(db, tmp_path):
    s = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN),
                   notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    s.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    yield s
    s.close()


def _alert(signal: str, title: str = "", **kw) -> Alert:
    return Alert(RUN, Severity.CRITICAL, title or f"{RUN}: {signal} paused the run", fields={"signal": signal}, **kw)


def _sent(sup) -> list[dict]:
    with sup.sessions() as s:
        rows = sorted(alerts_store.alerts(s, RUN, limit=100), key=lambda a: a.id)  # oldest first
        return [a.payload for a in rows if a.channel == "console" and a.payload]


def test_a_silenced_signal_pages_no_one_until_it_ends(sup):
    with TestClient(build_app(sup), headers=AUTH) as c:
        r = c.post(f"/api/runs/{RUN}/silences", json={"signal": "stall", "for_s": 3600, "who": "alice",
                                                      "reason": "node swap, known"})
        assert r.status_code == 201, r.text
        hush = r.json()
        assert hush["signal"] == "stall" and "alice" in hush["who"]
        listed = c.get(f"/api/runs/{RUN}/silences").json()["silences"]
        assert [(x["id"], x["active"]) for x in listed] == [(hush["id"], True)]
        sup.executor.notify(_alert("stall"))
        sup.executor.notify(_alert("loss_spike"))  # another signal pages as before
        sup.executor.notify(_alert("stall", approve_action=7, title=f"{RUN}: approval needed [action 7]"))
        quiet, other, ask = _sent(sup)
        assert quiet["severity"] == "warn" and not quiet["broadcast"]
        assert quiet["fields"]["silenced"].startswith(f"by {hush['who']} until ") and f"(silence {hush['id']})" in \
            quiet["fields"]["silenced"]
        assert other["severity"] == "critical" and ask["severity"] == "critical"  # an approval still asks
        r = c.post(f"/api/silences/{hush['id']}/end", json={"who": "bob"})
        assert r.status_code == 200 and r.json()["ended_at"]
        sup.executor.notify(_alert("stall"))
        assert _sent(sup)[-1]["severity"] == "critical"
        assert c.get(f"/api/runs/{RUN}/silences").json()["silences"][0]["active"] is False
    with sup.sessions() as s:
        events = [(e.event, e.detail.get("silence_id")) for e in audit_store.audit_log(s, RUN, limit=50)
                  if e.event in ("silenced", "unsilenced")]
    assert sorted(events) == [("silenced", hush["id"]), ("unsilenced", hush["id"])]


def test_a_silence_ends_by_itself_and_star_silences_every_signal(sup):
    past = dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=1)
    with sup.sessions.begin() as s:
        silences_store.create(s, RUN, "stall", past, "alice", "expired")
    sup.executor.notify(_alert("stall"))
    assert _sent(sup)[-1]["severity"] == "critical"  # expired: pages again
    sup.executor.silence(RUN, "*", 60, "carol", "maintenance")
    for sig in ("stall", "non_finite"):
        sup.executor.notify(_alert(sig))
        assert _sent(sup)[-1]["severity"] == "warn"


@pytest.mark.parametrize("body, status, words", [
    ({"signal": "loss_spikes", "for_s": 60}, 422, "unknown signal 'loss_spikes'"),
    ({"signal": "stall", "for_s": 0}, 422, "more than 0 and at most 7 days"),
    ({"signal": "stall", "for_s": 8 * 86400}, 422, "at most 7 days"),
    ({"signal": "stall", "for_s": 60, "until": "tomorrow"}, 422, "until"),
    ({"signal": "stall"}, 422, "for_s"),
])
def test_a_bad_silence_is_refused_with_the_reason_and_nothing_stored(sup, body, status, words):
    with TestClient(build_app(sup), headers=AUTH) as c:
        r = c.post(f"/api/runs/{RUN}/silences", json=body)
        assert r.status_code == status and words in r.json()["detail"], r.text
        assert c.get(f"/api/runs/{RUN}/silences").json()["silences"] == []
        assert c.post("/api/runs/nope/silences", json={"signal": "stall", "for_s": 60}).status_code == 404
        assert c.post("/api/silences/999/end", json={}).status_code == 404


def test_the_cli_takes_a_duration_in_words():
    assert (_duration("90s"), _duration("30m"), _duration("2h"), _duration("1d"), _duration("45")) == \
        (90, 1800, 7200, 86400, 45)
    for bad in ("0", "-5m", "8d", "nan", "inf", "soon", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            _duration(bad)
