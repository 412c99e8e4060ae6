"""Notifiers against the real slack-sdk WebClient and a local fake of the Slack Web API."""

from __future__ import annotations

import io
import json
import logging
import socket
import time

import pytest

from thermowatch.monitors.contract import CheckpointInfo, Finding, Outcome, Severity, Signal
from thermowatch.supervisor.notify import Alert, ConsoleNotifier, FanOut, NotifyConfigError, NotifyError, NullNotifier
from thermowatch.supervisor.notify.slack import SlackNotifier, resolve_token
from thermowatch.supervisor.decide.policy import PolicyInput, make_decision
from tests.fakes.slack_server import FakeSlack, fake_slack  # noqa: F401 - the fixture

NOW = 1_800_000_000.0


def spike_alert(**kw) -> Alert:
    finding = Finding(Signal.ATTN_LOGIT_GROWTH, "blocks.3.attn", Severity.CRITICAL, onset_step=990, detect_step=1000,
                      outcome=Outcome.ACT)  # corroborated growth: the policy may act
    ckpts = [CheckpointInfo(800, "/c/800", 800 * 64, True), CheckpointInfo(880, "/c/880", 880 * 64, False)]
    decision = make_decision(PolicyInput(finding=finding, now=NOW, checkpoints=ckpts))
    return Alert.from_decision("run-7", finding, decision, incident_id=42, **kw)


def slack(fake: FakeSlack, **kw) -> SlackNotifier:
    kw.setdefault("retries", 2)
    return SlackNotifier(kw.pop("token", fake.token), kw.pop("channel", "#train-alerts"), base_url=fake.base_url, **kw)


def blocks_text(body: dict) -> str:
    blocks = body["blocks"]
    return json.dumps(json.loads(blocks) if isinstance(blocks, str) else blocks, ensure_ascii=False)


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}/api/"


def test_alert_from_decision_carries_the_policys_reasons():
    alert = spike_alert()
    assert alert.severity is Severity.WARN and alert.run_id == "run-7"
    assert "rollback to step 800" in alert.title and "blocks.3.attn" in alert.title
    assert alert.fields["onset step"] == 990 and alert.fields["skip steps"] == "890-1000"
    assert any("880" in r and "unhealthy" in r for r in alert.reasons)


def test_slack_posts_block_kit_through_the_real_client(fake_slack):
    notifier = slack(fake_slack, web_base_url="http://thermowatch.internal:8765/")
    ts = notifier.send(spike_alert())
    assert ts and ts in fake_slack.messages
    (req,) = fake_slack.calls("chat.postMessage")
    assert req.headers["Authorization"] == f"Bearer {fake_slack.token}"
    assert req.body["channel"] == "#train-alerts"
    assert "run-7: rollback to step 800" in req.body["text"]
    text = blocks_text(req.body)
    for expected in ("rollback to step 800", "rung 1", "unhealthy", "*onset step*\\n990", "*detect step*\\n1000",
                     "http://thermowatch.internal:8765/runs/run-7?incident=42|thermometer plot"):
        assert expected in text, expected
    assert json.loads(text)[0]["type"] == "header"


def test_slack_threads_a_follow_up_under_the_first_message(fake_slack):
    notifier = slack(fake_slack)
    first = notifier.send(spike_alert())
    second = notifier.send(Alert("run-7", Severity.INFO, "rollback acknowledged", thread_ts=first))
    assert second != first
    assert fake_slack.messages[second]["thread_ts"] == first
    assert "<" not in blocks_text(fake_slack.posted()[1])  # no link without a web base URL


def test_slack_escapes_mrkdwn(fake_slack):
    slack(fake_slack).send(Alert("r", Severity.WARN, "t", text="loss <inf> & rising"))
    assert "loss &lt;inf&gt; &amp; rising" in blocks_text(fake_slack.posted()[0])


def test_slack_retries_after_429_then_delivers(fake_slack):
    fake_slack.rate_limit(2, retry_after=0)
    ts = slack(fake_slack, retries=2).send(spike_alert())
    statuses = [r.status for r in fake_slack.calls("chat.postMessage")]
    assert statuses == [429, 429, 200] and ts in fake_slack.messages


def test_slack_waits_for_retry_after_but_caps_it(fake_slack):
    fake_slack.rate_limit(1, retry_after=5)
    start = time.monotonic()
    slack(fake_slack, retries=1, max_retry_wait_s=0.3).send(spike_alert())
    assert 0.3 <= time.monotonic() - start < 3.0
    assert len(fake_slack.posted()) == 1


def test_slack_gives_up_after_retries_with_a_clear_error(fake_slack):
    fake_slack.rate_limit(10, retry_after=0)
    with pytest.raises(NotifyError, match=r"rate limited \(HTTP 429\) after 2 retries"):
        slack(fake_slack, retries=2).send(spike_alert())
    assert len(fake_slack.calls("chat.postMessage")) == 3


def test_slack_bad_token_says_where_the_token_came_from(fake_slack):
    notifier = SlackNotifier.from_config(
        _settings(fake_slack), environ={"SLACK_BOT_TOKEN": "xoxb-revoked"}, retries=2)
    with pytest.raises(NotifyError, match="invalid_auth.*environment variable SLACK_BOT_TOKEN"):
        notifier.send(spike_alert())
    assert len(fake_slack.calls("chat.postMessage")) == 1  # an auth error is not retried


def test_slack_unknown_channel_says_to_invite_the_bot():
    with FakeSlack(channels={"#train-alerts"}) as fake:
        with pytest.raises(NotifyError, match="invite the bot"):
            slack(fake, channel="#nope").send(spike_alert())
        assert slack(fake).send(spike_alert())


def test_slack_check_runs_auth_test(fake_slack):
    assert slack(fake_slack).check()["bot_id"] == "B0THERMO"


def test_slack_unreachable_is_a_notify_error():
    notifier = SlackNotifier("xoxb-x", "#c", base_url=dead_url(), retries=0)
    with pytest.raises(NotifyError, match="could not reach"):
        notifier.send(spike_alert())


class _Settings:
    def __init__(self, base_url, token_env="SLACK_BOT_TOKEN", token_file=""):
        self.channel, self.base_url, self.token_env, self.token_file = "#train-alerts", base_url, token_env, token_file


def _settings(fake: FakeSlack, **kw) -> _Settings:
    return _Settings(fake.base_url, **kw)


def test_from_config_reads_a_secret_file(fake_slack, tmp_path):
    secret = tmp_path / "slack-token"
    secret.write_text(fake_slack.token + "\n")
    notifier = SlackNotifier.from_config(_settings(fake_slack, token_file=str(secret)), environ={})
    assert notifier.send(spike_alert())


@pytest.mark.parametrize("env, token_file, match", [
    ({}, "", "environment variable SLACK_BOT_TOKEN is unset.*token_file"),
    ({"SLACK_BOT_TOKEN": "  "}, "", "SLACK_BOT_TOKEN is unset or empty"),
    ({}, "/nonexistent/slack-token", "/nonexistent/slack-token cannot be read"),
    ({}, "EMPTY", "is empty"),
], ids=["env-unset", "env-blank", "file-missing", "file-empty"])
def test_missing_token_is_a_clear_config_error(tmp_path, env, token_file, match):
    if token_file == "EMPTY":
        token_file = str(tmp_path / "empty")
        (tmp_path / "empty").write_text("\n")
    with pytest.raises(NotifyConfigError, match=match):
        resolve_token("SLACK_BOT_TOKEN", token_file, env)


def test_slack_rejects_a_base_url_slack_sdk_cannot_use():
    with pytest.raises(NotifyConfigError, match="must end with '/api/'"):
        SlackNotifier("xoxb-x", "#c", base_url="http://127.0.0.1:9/")


def test_console_writes_title_reasons_and_fields():
    out = io.StringIO()
    assert ConsoleNotifier(out).send(spike_alert()) is None
    text = out.getvalue()
    assert text.startswith("[WARN] run-7: rollback to step 800")
    assert "  - rung 1" in text and "onset step: 990" in text and "incident 42" in text


def test_fan_out_delivers_despite_a_broken_notifier(fake_slack, caplog):
    out = io.StringIO()
    broken = SlackNotifier("xoxb-x", "#c", base_url=dead_url(), retries=0)
    fan = FanOut([broken, slack(fake_slack), ConsoleNotifier(out), NullNotifier()])
    with caplog.at_level(logging.ERROR, logger="thermowatch.supervisor.notify.base"):
        ts = fan.send(spike_alert())
    assert ts in fake_slack.messages
    assert "rollback to step 800" in out.getvalue()
    (record,) = [r for r in caplog.records if r.name == "thermowatch.supervisor.notify.base"]
    assert "SlackNotifier failed" in record.getMessage() and record.exc_info is not None


def test_fan_out_raises_when_every_part_fails(fake_slack):
    fan = FanOut([slack(fake_slack, token="xoxb-wrong"), SlackNotifier("xoxb-x", "#c", base_url=dead_url(), retries=0)])
    with pytest.raises(NotifyError, match="every notifier failed.*invalid_auth"):
        fan.send(spike_alert())


def test_fan_out_close_survives_a_failing_part(caplog, tmp_path):
    closed_stream = open(tmp_path / "alerts.log", "w")
    closed_stream.close()  # flushing a closed file raises ValueError
    first, last = ConsoleNotifier(closed_stream), ConsoleNotifier(io.StringIO())
    with caplog.at_level(logging.ERROR, logger="thermowatch.supervisor.notify.base"):
        FanOut([first, last]).close()
    assert last.closed and "closing notifier ConsoleNotifier failed" in caplog.text
    with pytest.raises(NotifyError, match="closed"):
        last.send(spike_alert())


def test_slack_reply_broadcast_and_commands(fake_slack):
    notifier = slack(fake_slack)
    first = notifier.send(spike_alert())
    quiet = notifier.send(Alert("run-7", Severity.INFO, "rollback done", thread_ts=first, broadcast=False))
    loud = notifier.send(Alert("run-7", Severity.CRITICAL, "rollback FAILED", thread_ts=first, broadcast=True,
                               commands=("thermowatch approve 7", "thermowatch cancel 7")))
    bodies = fake_slack.posted()
    assert "reply_broadcast" not in bodies[1] and bodies[2]["reply_broadcast"] is True
    assert "subtype" not in fake_slack.messages[quiet]
    assert fake_slack.messages[loud]["subtype"] == "thread_broadcast"
    assert fake_slack.messages[first]["reply_count"] == 2
    assert "`thermowatch approve 7`\\n`thermowatch cancel 7`" in blocks_text(bodies[2])
    # a top-level message never broadcasts (Slack would refuse reply_broadcast without a thread)
    notifier.send(Alert("run-7", Severity.CRITICAL, "paused", broadcast=True))
    assert "reply_broadcast" not in fake_slack.posted()[3]


def test_slack_reply_to_a_deleted_thread_goes_top_level_and_says_so(fake_slack):
    ts = slack(fake_slack).send(Alert("run-7", Severity.INFO, "done", text="ok", thread_ts="1699999999.000001"))
    assert "thread_ts" not in fake_slack.messages[ts]
    assert "thread it belongs to was deleted" in blocks_text(fake_slack.posted()[0])


def test_slack_check_refuses_a_bad_token_as_configuration(fake_slack):
    assert slack(fake_slack).check()["user_id"] == "U0THERMO"
    with pytest.raises(NotifyConfigError, match="auth.test: invalid_auth.*the token argument"):
        slack(fake_slack, token="xoxb-nope").check()
    fake_slack.server_error(10)
    with pytest.raises(NotifyError) as got:  # an outage is not a configuration error
        slack(fake_slack, retries=0).check()
    assert not isinstance(got.value, NotifyConfigError)


# --- Block Kit from slack_sdk.models, buttons, uploads (issue 12) ---------------------------------


def test_blocks_are_valid_block_kit_with_buttons_only_when_interactive(fake_slack):
    from slack_sdk.models.blocks import Block

    ask = Alert("run-7", Severity.WARN, "approval needed: rollback [action 9]", approve_action=9,
                commands=("thermowatch approve 9", "thermowatch cancel 9"))
    plain, interactive = slack(fake_slack), slack(fake_slack, interactive=True)
    assert [b["type"] for b in plain.blocks(ask)] == ["header", "section", "context"]
    blocks = interactive.blocks(ask)
    assert [b["type"] for b in blocks] == ["header", "section", "actions", "context"]
    # every block parses back into slack_sdk's models (what Slack's validator checks, locally)
    assert all(Block.parse(b).to_dict() == b for b in blocks)
    buttons = blocks[2]["elements"]
    assert [(b["action_id"], b["value"], b["style"]) for b in buttons] == [
        ("thermowatch_approve", "9", "primary"), ("thermowatch_cancel", "9", "danger")]
    assert all(b["confirm"]["text"]["text"] for b in buttons)  # a phone tap asks first
    assert not [b for b in interactive.blocks(Alert("run-7", Severity.INFO, "done")) if b["type"] == "actions"]
    ts = interactive.send(ask)  # and Slack (the fake) takes them, with the text fallback beside
    assert fake_slack.messages[ts]["blocks"][2]["type"] == "actions"
    assert fake_slack.messages[ts]["text"] == "[WARN] approval needed: rollback [action 9]"


def test_upload_speaks_files_upload_v2_into_the_thread(fake_slack):
    from thermowatch.supervisor.notify.base import ChartRequest

    notifier = slack(fake_slack)
    parent = notifier.send(spike_alert())
    png = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
    chart = Alert("run-7", Severity.INFO, "run-7: loss around the onset", thread_ts=parent,
                  chart=ChartRequest("loss", 0, 100, 40, 60))
    file_id = notifier.upload(chart, png)
    (up,) = fake_slack.shared_files()
    assert (up.file_id, up.data, up.thread_ts, up.filename) == (file_id, png, parent, "run-7-loss.png")
    assert up.channel == fake_slack.messages[parent]["channel"]  # the id chat.postMessage answered
    assert [r.api_method for r in fake_slack.requests][1:] == [
        "files.getUploadURLExternal", "upload", "files.completeUploadExternal"]
    fake_slack.fail_uploads(1)  # the upload URL answers 500: retryable, the text is elsewhere
    with pytest.raises(NotifyError, match="upload URL answered HTTP 500") as got:
        notifier.upload(chart, png)
    assert got.value.retryable and len(fake_slack.shared_files()) == 1


def _mrkdwn_and_plain(blocks: list) -> tuple[list[str], list[str]]:
    """Every text object of the blocks: (mrkdwn ones, plain_text ones), at any depth."""
    mrkdwn, plain = [], []

    def walk(x):
        if isinstance(x, dict):
            if x.get("type") in ("mrkdwn", "plain_text") and isinstance(x.get("text"), str):
                (mrkdwn if x["type"] == "mrkdwn" else plain).append(x["text"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(blocks)
    return mrkdwn, plain


def test_a_run_id_with_mentions_reaches_slack_escaped_in_the_text_and_the_blocks(fake_slack):
    """Issue 34: a run id `<!channel> <@U0ALICE>` reached the message's fallback `text` as is, and
    Slack parses that text: a trainer's run id could page a whole channel or name a person."""
    run_id = "<!channel> <@U0ALICE> & co"
    finding = Finding(Signal.ATTN_LOGIT_GROWTH, "<!here>", Severity.CRITICAL, onset_step=990, detect_step=1000,
                      outcome=Outcome.ACT)
    ckpts = [CheckpointInfo(800, "/c/800", 800 * 64, True)]
    decision = make_decision(PolicyInput(finding=finding, now=NOW, checkpoints=ckpts))
    alert = Alert.from_decision(run_id, finding, decision, incident_id=42)
    alert = Alert(alert.run_id, alert.severity, alert.title, text=f"by <@U0BOB>: because <!everyone>",
                  reasons=alert.reasons, fields=alert.fields, commands=alert.commands)
    notifier = slack(fake_slack, web_base_url="http://tw.internal:8765")
    ts = notifier.send(alert)
    notifier.update(ts, alert)
    for req in (*fake_slack.calls("chat.postMessage"), *fake_slack.calls("chat.update")):
        text = req.body["text"]
        assert run_id in alert.title and "&lt;!channel&gt; &lt;@U0ALICE&gt; &amp; co" in text, text
        assert "&lt;@U0BOB&gt;: because &lt;!everyone&gt;" in text and "&lt;!here&gt;" in text, text
        blocks = req.body["blocks"]
        mrkdwn, plain = _mrkdwn_and_plain(json.loads(blocks) if isinstance(blocks, str) else blocks)
        assert any("&lt;!channel&gt; &lt;@U0ALICE&gt; &amp; co" in t for t in mrkdwn), mrkdwn
        for t in [text, *mrkdwn]:  # Slack parses these: no mention, no special command survives
            for raw in ("<!channel>", "<@U0ALICE>", "<@U0BOB>", "<!everyone>", "<!here>"):
                assert raw not in t, (raw, t)
        # the header is plain_text: shown as typed, never parsed for mentions or links
        assert any(run_id in t for t in plain), plain
