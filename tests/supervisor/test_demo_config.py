"""`thermowatch demo --config SUPERVISOR.yaml` (issue 37 item 10): a team sees the demo's story
where its runs' will arrive (its Slack and pager sections, its policy and detector settings over
the demo's), and the demo never writes into the database the file names."""

from __future__ import annotations

from pathlib import Path

from thermowatch.cli import main
from thermowatch.demo import DEMO_POLICY, DemoOptions, demo_supervisor_config


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
    assert cfg.policy["approval_pause_after_steps"] == 7 and cfg.policy["cooldown_steps"] == 3
    assert cfg.policy["rollback_margin_steps"] == DEMO_POLICY["rollback_margin_steps"]  # the demo's, not overridden
    assert "prod-db" not in cfg.db_url and Path(cfg.data_dir) == tmp_path / "demo"
    plain = demo_supervisor_config(DemoOptions(data_dir=tmp_path / "demo", json_summary=None))
    assert not plain.slack.channel and plain.policy == DEMO_POLICY


def test_a_missing_config_is_exit_2_with_the_reason(tmp_path, capsys):
    code = main(["demo", "--data-dir", str(tmp_path / "d"), "--config", str(tmp_path / "nope.yaml")])
    err = capsys.readouterr().err
    assert code == 2 and "nope.yaml" in err, err
