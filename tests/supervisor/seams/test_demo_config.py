"""`thermowatch demo --config SUPERVISOR.yaml` (issue 37 item 10): a team sees the demo's story
where its runs' will arrive (its Slack and pager sections, its policy and detector settings over
the demo's), and the demo never writes into the database the file names."""

from __future__ import annotations

from pathlib import Path

from thermowatch.cli import main
from thermowatch.demo import DEMO_POLICY, DemoOptions, demo_supervisor_config
from thermowatch.supervisor.decide.policy import PolicyConfig


def test_a_teams_config_brings_its_channels_and_policy_not_its_database(tmp_path):
    cfg_file = tmp_path / "supervisor.yaml"
    cfg_file.write_text("db_url: postgresql+psycopg://prod-db.example/thermowatch\n"
                        "data_dir: /var/lib/thermowatch\n"
                        "slack:\n  channel: '#training-alerts'\n"
                        "webhook:\n  url: https://hooks.example/thermowatch\n"
                        "policy:\n  approval_pause_after_steps: 7\n  cooldown_steps: 3\n")
    opts = DemoOptions(data_dir=tmp_path / "demo", json_summary=None, config=cfg_file)
    cfg = demo_supervisor_config(opts)
    assert cfg.slack.channel == "#training-alerts" and cfg.webhook.url == "https://hooks.example/thermowatch"
    assert cfg.policy.approval_pause_after_steps == 7 and cfg.policy.cooldown_steps == 3
    assert cfg.policy.rollback_margin_steps == DEMO_POLICY["rollback_margin_steps"]  # the demo's, not overridden
    assert "prod-db" not in cfg.db_url and Path(cfg.data_dir) == tmp_path / "demo"
    plain = demo_supervisor_config(DemoOptions(data_dir=tmp_path / "demo", json_summary=None))
    assert not plain.slack.channel and plain.policy == PolicyConfig(**DEMO_POLICY)


def test_a_missing_config_is_exit_2_with_the_reason(tmp_path, capsys):
    code = main(["demo", "--data-dir", str(tmp_path / "d"), "--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "nope.yaml" in err, err


def test_the_demo_bar_shows_the_last_attention_figure_read_never_nan(capsys):
    """Under the thermometers' budget the attention figure is read every few steps: the demo's
    progress bar showed "max attn logit nan" on every other step. It shows the last one read,
    with its step when it is not this one's."""
    import math

    from thermowatch.demo import _progress
    from thermowatch.monitors.contract import StepRecord

    bar, update = _progress(10, True, "demo")
    update(StepRecord(step=1, values={"loss": 3.0}), 0)
    update(StepRecord(step=2, values={"loss": 2.9, "attn_logit_lse/blocks.0.attn": 12.5}), 0)
    update(StepRecord(step=3, values={"loss": 2.8, "attn_logit_lse/blocks.0.attn": math.nan}), 0)
    bar.close()
    err = capsys.readouterr().err
    assert "max attn logit -" in err and "max attn logit 12.5 " in err and "max attn logit 12.5 (step 2)" in err
    assert "logit nan" not in err
