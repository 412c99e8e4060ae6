"""Flap damping (supervisor.notify.flap) with real findings: a recorded healthy run's gradient norm
judged by an over-sensitive grad-spike detector opens an incident every ~20 steps. Through the real
Supervisor, the real outbox, slack-sdk and the fake Slack, on SQLite and PostgreSQL: the first
`flap_max_alerts` incidents get threads of their own, every later one is a counted reply in the
last of them that does not broadcast, the top message says "flapping (N times in M min)", and a
folded incident's later alerts join that thread too."""

from __future__ import annotations

import io
import json

import pytest

from thermowatch.monitors.contract import RunInfo, Severity
from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from thermowatch.supervisor.notify.base import Alert, FanOut
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.notify.flap import FOLDED
from thermowatch.supervisor.notify.slack import SlackNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import incidents as incidents_store
from tests.fakes.slack_server import FakeSlack
from tests.fixtures import traces
from tests.fixtures.diverging import POLICY, feed

pytestmark = pytest.mark.timeout(120)
RUN = "flappy"
# z 2 and a 1.3x excess on a 32-point window: a gradient-norm detector set far too tight, the
# kind of misconfiguration that pages all night. On the recorded healthy run (400 steps) it
# fires ~20 times, each a new incident once the last one cleared (2 in-band points).
TIGHT_GRAD = {"grad": {"warmup": 20, "window": 32, "z": 2.0, "min_ratio": 1.3, "confirm": 1, "clear_steps": 2},
              "disabled": ["outlier_rank", "attn_ceiling", "attn_growth", "loss_spike", "loss_degradation"]}


@pytest.fixture
def slack():
    with FakeSlack() as fake:
        yield fake


def make_sup(db, tmp_path, slack: FakeSlack, interactive: bool = False, **slack_cfg) -> Supervisor:
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY), detectors=TIGHT_GRAD,
                           slack=slack_cfg)
    notifier = FanOut([ConsoleNotifier(io.StringIO()),
                       SlackNotifier(slack.token, "#training-alerts", base_url=slack.base_url, retries=1,
                                     interactive=interactive)])
    sup = Supervisor(cfg, notifier=notifier)
    sup.executor.outbox.retry_s = 0.1
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    return sup


def _grad_incidents(sup) -> list[int]:
    with sup.sessions() as s:
        return [i for i, _ in incidents_store.opened_since(s, RUN, "grad_spike", "", _epoch())]


def _epoch():
    import datetime as dt

    return dt.datetime(2000, 1, 1, tzinfo=dt.timezone.utc)


def test_a_flapping_signal_pages_three_times_then_counts_in_one_thread(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        feed(sup, RUN, 0, traces.load("healthy"), ckpt_root=tmp_path / "ckpt")
        assert sup.executor.outbox.drain(60)
        ids = _grad_incidents(sup)
        assert len(ids) >= 10, f"the tight detector should flap on the healthy trace; got {len(ids)} incidents"
        # The incidents lie within EPISODE_GAP_STEPS of each other: one divergence episode, one
        # thread (issue 37), under the first incident's message.
        top = [m for m in slack.top_level() if "grad_spike" in m["text"]]
        assert len(top) == 1, [m["text"] for m in top]
        with sup.sessions() as s:
            rows = [r for r in alerts_store.alerts(s, RUN, limit=1000) if r.channel == "slack:#training-alerts"]
            folds = audit_store.events(s, RUN, FOLDED)
            assert {incidents_store.episode(s, i) for i in ids} == {ids[0]}
        assert sorted(f.detail["incident_id"] for f in folds) == ids[3:]  # flap_max_alerts (3) alert in full
        assert {f.detail["into"] for f in folds} == {ids[2]}  # the last incident alerted in full
        assert {r.thread_key for r in rows} == {f"incident:{ids[0]}"}
        # Each repeat is a counted reply in that thread, never broadcast, without a chart.
        anchor = next(r.ts for r in sorted(rows, key=lambda r: r.id) if r.thread_key == f"incident:{ids[0]}")
        assert slack.messages[anchor]["text"] == top[0]["text"]
        replies = [m for m in slack.thread(anchor)[1:] if m.get("subtype") != "file_share"]
        repeats = [m for m in replies if "(repeat " in m["text"]]
        assert len(replies) == len(ids) - 1 and len(repeats) == len(ids) - 3
        for n, m in enumerate(repeats, start=4):
            assert f"(repeat {n} in " in m["text"] and "grad_spike" in m["text"]
            assert m.get("subtype") != "thread_broadcast"
        charts = [u for u in slack.shared_files()]
        assert len(charts) == 3 and all("grad_norm" in u.filename for u in charts)
        # The top message says the signal is flapping, with the count and the span.
        blocks = json.dumps(slack.messages[anchor]["blocks"])
        assert f"*now:* flapping ({len(ids)} times in " in blocks and " min)" in blocks
        assert slack.calls("chat.update")[-1].body["ts"] == anchor
        # A later alert of a folded incident (here: a note about it) joins the same thread.
        sup.executor.notify(Alert(RUN, Severity.INFO, f"{RUN}: note on incident {ids[-1]}", incident_id=ids[-1]))
        assert sup.executor.outbox.drain(30)
        assert slack.thread(anchor)[-1]["text"].endswith(f"note on incident {ids[-1]}")
        assert len([m for m in slack.top_level() if "grad_spike" in m["text"] or "note" in m["text"]]) == 1
    finally:
        sup.close()


def test_flap_damping_follows_the_config(db, tmp_path, slack):
    # A window shorter than the feed takes: nothing counts as a repeat, every incident is a thread.
    sup = make_sup(db, tmp_path, slack, flap_max_alerts=1, flap_window_s=1e-6)
    try:
        feed(sup, RUN, 0, traces.load("healthy")[:200], ckpt_root=tmp_path / "ckpt")
        assert sup.executor.outbox.drain(60)
        ids = _grad_incidents(sup)
        assert len(ids) >= 4
        # nothing folds; the incidents of one divergence episode share a thread (issue 37)
        with sup.sessions() as s:
            episodes = {incidents_store.episode(s, i) for i in ids}
            assert not audit_store.events(s, RUN, FOLDED)
        assert len([m for m in slack.top_level() if "grad_spike" in m["text"]]) == len(episodes) < len(ids)
    finally:
        sup.close()


@pytest.mark.parametrize("slack_cfg, match", [
    ({"flap_max_alerts": 0}, r"slack.flap_max_alerts=0 must be an integer >= 1"),
    ({"flap_window_s": -5.0}, r"slack.flap_window_s=-5.0 must be a number of seconds > 0"),
    ({"flap_max_alerts": "many"}, r"slack.flap_max_alerts"),
    ({"flap_windows": 60}, r"did you mean 'flap_window_s'"),
])
def test_bad_flap_settings_are_refused_at_start(tmp_path, slack_cfg, match):
    with pytest.raises(ConfigError, match=match):
        SupervisorConfig(data_dir=tmp_path, slack=slack_cfg)


def test_only_alert_only_repeats_fold_an_approval_gets_its_own_thread_and_buttons(db, tmp_path, slack):
    """Issue 23: "Approval needed: rollback [action 3]" was posted as a "repeat 2 in 1 min" reply in
    another incident's thread. With one thread allowed per signal and module, a repeat that asks a
    human (an approval) or changes the run still starts a thread of its own, [CRITICAL] with its
    buttons; an alert-only repeat folds and, having changed nothing, reads [INFO]."""
    from thermowatch.monitors.contract import Finding, Signal
    from thermowatch.monitors.commands import SetLR
    from thermowatch.supervisor.decide.policy import Decision

    sup = make_sup(db, tmp_path, slack, flap_max_alerts=1, interactive=True)
    try:
        made = []
        for n, (command, approval) in enumerate([(None, False), (None, False), (SetLR(0.5), True)]):
            f = Finding(Signal.GRAD_SPIKE, "", Severity.CRITICAL, 100 + 10 * n, 101 + 10 * n, metric="grad_norm")
            d = Decision(command, [f"decision {n}"], requires_approval=approval, rung=1 if approval else 0)
            with sup.sessions.begin() as s:
                inc = incidents_store.open_incident(s, RUN, f.signal.value, f.module, f.onset_step, f.detect_step,
                                                    f.severity.value)
                made.append((inc, sup.executor.carry_out(s, RUN, inc, f, d)))
                incidents_store.resolve_incident(s, inc, "cleared")  # the next one is a new incident
        assert len({inc for inc, _ in made}) == 3
        assert sup.executor.outbox.drain(60)
        (first, _), (second, _), (third, ids) = made
        with sup.sessions() as s:
            assert [e.detail["incident_id"] for e in audit_store.events(s, RUN, FOLDED)] == [second]
        top = [m for m in slack.top_level() if "grad_spike" in m["text"]]
        assert [m["text"].split(" ")[0] for m in top] == ["[INFO]", "[CRITICAL]"], [m["text"] for m in top]
        ask = top[1]
        assert f"[action {ids[0]}]" in ask["text"] and "approval needed" in ask["text"].lower()
        assert f'"value": "{ids[0]}"' in json.dumps(ask["blocks"]) and "approve" in json.dumps(ask["blocks"])
        folded = slack.thread(top[0]["ts"])[1:]
        assert len(folded) == 1 and "(repeat 2 in " in folded[0]["text"] and folded[0]["text"].startswith("[INFO]")
    finally:
        sup.close()
