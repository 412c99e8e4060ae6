"""The supervisor's config as one tree (issue 12.6): a typo or a wrong type at any depth is one
ConfigError naming its dotted path and the known keys, and `serve` exits 2 with it, no traceback."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

from thermowatch.cli import main
from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from tests.config_walk import numeric_settings
from tests.supervisor import ROOT


@pytest.mark.parametrize("yaml_text, message", [
    # depth 1, 2 and 3
    ("prot: 8765\n", "prot: unknown key; did you mean 'port'? known keys at the top level: data_dir, db_url"),
    ("policy:\n  lr_multiplir: 0.5\n", "policy.lr_multiplir: unknown key; did you mean 'lr_multiplier'? "
                                       "known keys at policy: rollback_margin_steps"),
    ("detectors:\n  attn: {celing: 50}\n", "detectors.attn.celing: unknown key; did you mean 'ceiling'? "
                                          "known keys at detectors.attn: ceiling,"),
    ("detectors:\n  atn: {ceiling: 50}\n", "detectors.atn: unknown key; did you mean 'attn'?"),
    ("slack: {chanel: '#x'}\n", "slack.chanel: unknown key; did you mean 'channel'?"),
    ("limits: {max_records: many}\n", "limits.max_records: expected an integer, got 'many'"),
    # wrong types
    ("policy: {lr_factor: half}\n", "policy.lr_factor: expected a number, got 'half'"),
    ("detectors:\n  attn: {ceiling: high}\n", "detectors.attn.ceiling: expected a number, got 'high'"),
    ("policy: {rollback_signals: [loss_spike, bogus]}\n", "policy.rollback_signals[1]: expected one of"),
    ("auth: maybe\n", "auth: expected true or false, got 'maybe'"),
    ("policy: [1, 2]\n", "policy: expected a mapping of keys"),
    # a value of the right type out of range: the section's own check, prefixed with its name
    ("policy: {lr_factor: 2.0}\n", "policy: lr_factor=2.0 must be in (0, 1)"),
    ("policy: {lr_multiplier: 2.0}\n", "policy: lr_multiplier=2.0 (the old name of lr_factor) must be in (0, 1)"),
    ("detectors: {disabled: [nope]}\n", "detectors: unknown detector names in disabled: ['nope']"),
    # who may click in Slack (issue 21): typed by the tree walk, ids checked by SlackConfig
    ("slack: {approvers: U0ALICE}\n", "slack.approvers: expected a list, got 'U0ALICE'"),
    ("slack: {approvers: [U0ALICE, 42]}\n", "slack.approvers[1]: expected a string, got 42"),
    ("slack: {approver: [U0ALICE]}\n", "slack.approver: unknown key; did you mean 'approvers'?"),
    ("slack: {approvers: [alice]}\n", "slack.approvers[0]: 'alice' is not a Slack member id (U... or W...;"),
    ("slack: {approver_groups: [U0ALICE]}\n", "slack.approver_groups[0]: 'U0ALICE' is not a Slack user-group id (S..."),
    ("slack: {approver_groups_ttl_s: soon}\n", "slack.approver_groups_ttl_s: expected a number, got 'soon'"),
    ("slack: {approver_groups_ttl_s: 0}\n", "slack.approver_groups_ttl_s must be in (0, 3600] seconds, got 0"),
])
def test_a_bad_key_or_value_at_any_depth_names_its_path(tmp_path, yaml_text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as exc:
        SupervisorConfig.load(path, env={})
    assert message in str(exc.value), str(exc.value)
    assert str(exc.value).startswith(str(path)) or message.startswith(("policy: ", "detectors: ", "slack.approver"))


def test_sections_built_in_code_are_checked_too():
    with pytest.raises(ConfigError, match=r"detectors\.loss\.z_threshold: unknown key"):
        SupervisorConfig(detectors={"loss": {"z_threshold": 3}})
    cfg = SupervisorConfig(policy={"lr_factor": 0.25, "rollback_signals": ["loss_spike"]},
                           detectors={"attn": {"ceiling": 80}, "disabled": ["stall"]})
    assert cfg.policy.lr_factor == 0.25 and cfg.policy.rollback_signals == {"loss_spike"}
    assert cfg.detectors.attn.ceiling == 80
    # A section given as its typed object is taken as it is; the top level's advise_only still holds.
    typed = SupervisorConfig(policy=cfg.policy, detectors=cfg.detectors, advise_only=True)
    assert typed.detectors is cfg.detectors and typed.policy.lr_factor == 0.25 and typed.policy.advise_only


def test_the_old_relative_lr_multiplier_is_read_as_lr_factor_with_a_warning():
    """Issue 38: `policy.lr_multiplier` was the one relative lr_multiplier (absolute everywhere
    else). It is `lr_factor` now; the old key works for one release, saying so."""
    with pytest.warns(FutureWarning, match="policy.lr_multiplier is deprecated: it is now policy.lr_factor"):
        cfg = SupervisorConfig(policy={"lr_multiplier": 0.25})
    assert (cfg.policy.lr_factor, cfg.policy.lr_multiplier) == (0.25, None)
    with pytest.raises(ConfigError, match="both set"):
        SupervisorConfig(policy={"lr_multiplier": 0.25, "lr_factor": 0.3})


def test_slack_approvers_are_read_and_checked_when_built_in_code_too():
    cfg = SupervisorConfig(slack={"approvers": ("U0ALICE", "W0GRID"), "approver_groups": ["S0ONCALL"],
                                  "approver_groups_ttl_s": 30})
    assert (cfg.slack.approvers, cfg.slack.approver_groups, cfg.slack.approver_groups_ttl_s) == (
        ["U0ALICE", "W0GRID"], ["S0ONCALL"], 30)
    assert SupervisorConfig().slack.approvers == [] and SupervisorConfig().slack.approver_groups == []  # closed
    from thermowatch.supervisor.app.config import SlackConfig

    with pytest.raises(ConfigError, match=r"slack\.approvers must be a list of ids, got 'U0ALICE'"):
        SlackConfig(approvers="U0ALICE")  # a bare string is not a list of its letters
    with pytest.raises(ConfigError, match=r"slack\.approvers\[0\]: 'u0alice' is not a Slack member id"):
        SlackConfig(approvers=["u0alice"])


def test_environment_overrides_still_apply_and_are_checked(tmp_path):
    path = tmp_path / "ok.yaml"
    path.write_text("policy: {lr_factor: 0.25}\nslack: {token_env: MY_TOKEN}\n")
    cfg = SupervisorConfig.load(path, env={"THERMOWATCH_PORT": "9001", "THERMOWATCH_SLACK_CHANNEL": "#oncall",
                                           "THERMOWATCH_DATA_DIR": str(tmp_path / "d"),
                                           "THERMOWATCH_ADVISE_ONLY": "yes"})
    assert (cfg.port, cfg.slack.channel, cfg.slack.token_env, cfg.advise_only) == (9001, "#oncall", "MY_TOKEN", True)
    assert cfg.data_dir == tmp_path / "d"
    with pytest.raises(ConfigError, match=r"THERMOWATCH_PORT must be an integer in \[1, 65535\], got 'x'"):
        SupervisorConfig.load(None, env={"THERMOWATCH_PORT": "x"})


def test_serve_exits_2_naming_the_path_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("detectors:\n  attn: {celing: 50}\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "detectors.attn.celing: unknown key; did you mean 'ceiling'?" in err and "Traceback" not in err


def test_serve_as_a_process_exits_2(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("policy: {lr_factor: half}\n")
    proc = subprocess.run([sys.executable, "-m", "thermowatch.cli", "serve", "--config", str(bad)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2, proc.stderr
    assert "policy.lr_factor: expected a number, got 'half'" in proc.stderr and "Traceback" not in proc.stderr


def test_every_supervisor_config_in_deploy_loads(tmp_path):
    paths = [p for p in sorted((ROOT / "deploy").rglob("*.yaml")) if "supervisor" in p.name]
    assert {p.relative_to(ROOT).as_posix() for p in paths} >= {"deploy/supervisor.example.yaml",
                                                                 "deploy/local/supervisor.yaml"}
    for p in paths:
        SupervisorConfig.load(p, env={})
    # ... and those Kubernetes mounts from a ConfigMap (deploy/k8s/daemon.yaml)
    import yaml

    embedded = [(p, key, text) for p in sorted((ROOT / "deploy").rglob("*.yaml"))
                for doc in yaml.safe_load_all(p.read_text()) if isinstance(doc, dict) and doc.get("kind") == "ConfigMap"
                for key, text in doc.get("data", {}).items() if "supervisor" in key]
    assert [(p.relative_to(ROOT).as_posix(), key) for p, key, _ in embedded] == [("deploy/k8s/daemon.yaml",
                                                                                   "supervisor.yaml")]
    for _, key, text in embedded:
        (tmp_path / key).write_text(text)
        assert SupervisorConfig.load(tmp_path / key, env={}).host == "0.0.0.0"


def test_the_local_supervisor_config_is_what_serve_reads(tmp_path, monkeypatch):
    """Through `serve`'s own config path (the CLI's flags), from a fresh directory: loopback, the
    data dir under it, auth on, SQLite there."""
    import thermowatch.cli as cli

    monkeypatch.chdir(tmp_path)
    args = cli.build_parser().parse_args(["serve", "--config", str(ROOT / "deploy/local/supervisor.yaml")])
    cfg = cli._supervisor_config(args)
    assert cfg.host == "127.0.0.1" and cfg.auth and not cfg.slack.channel
    assert cfg.db_url == f"sqlite:///{tmp_path / '.thermowatch-local' / 'thermowatch.db'}"


def test_replay_settings_files_are_checked_the_same_way(tmp_path, capsys):
    (tmp_path / "det.yaml").write_text("loss: {zz: 3}\n")
    (tmp_path / "run.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    assert main(["replay", str(tmp_path / "run.jsonl"), "--detectors", str(tmp_path / "det.yaml")]) == 2
    assert f"{tmp_path / 'det.yaml'}: loss.zz: unknown key" in capsys.readouterr().err
    (tmp_path / "pol.yaml").write_text("cooldown_steps: soon\n")
    assert main(["replay", str(tmp_path / "run.jsonl"), "--policy", str(tmp_path / "pol.yaml")]) == 2
    assert "cooldown_steps: expected an integer, got 'soon'" in capsys.readouterr().err


def test_the_limits_example_in_docs_configuration_loads(tmp_path):
    """docs/configuration.md's `limits:` example is a config `serve` accepts, with those values."""
    import re

    from thermowatch.supervisor.limits import Limits

    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text[text.index("## What a client may send"):]
    example = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "sup.yaml").write_text(example)
    cfg = SupervisorConfig.load(tmp_path / "sup.yaml", env={}, data_dir=tmp_path)
    limits = cfg.limits
    assert isinstance(limits, Limits) and cfg.max_body_bytes == 64 << 20
    assert limits.max_body_bytes_in_flight == 256 << 20 and limits.max_new_runs_per_token_per_hour == 1000


# --- strict settings (issue 34): a value not understood is refused, never read as false --------

@pytest.mark.parametrize("text, value", [
    ("1", True), ("true", True), ("yes", True), ("on", True), ("TRUE ", True), (" On", True), ("YES", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("Off\n", False),
])
def test_a_boolean_in_the_environment_takes_the_documented_spellings(tmp_path, text, value):
    cfg = SupervisorConfig.load(None, env={"THERMOWATCH_ADVISE_ONLY": text}, data_dir=tmp_path)
    assert cfg.advise_only is value and cfg.policy.advise_only is value


@pytest.mark.parametrize("text", ["y", "n", "enabled", "disabled", "2", "-1", "truee", "t rue", "   "])
def test_any_other_boolean_spelling_is_refused_naming_the_variable(tmp_path, text):
    """Before, everything but 1/true/yes read as false: `on` meant automatic actions."""
    with pytest.raises(ConfigError) as exc:
        SupervisorConfig.load(None, env={"THERMOWATCH_ADVISE_ONLY": text}, data_dir=tmp_path)
    assert str(exc.value) == (f"THERMOWATCH_ADVISE_ONLY={text!r} is not a boolean; use one of 1, true, yes, on "
                              "(true) or 0, false, no, off (false), in any case")


def test_a_bad_boolean_in_the_environment_stops_the_command_with_exit_2(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("THERMOWATCH_ADVISE_ONLY", "enabled")
    assert main(["db", "current", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "THERMOWATCH_ADVISE_ONLY='enabled' is not a boolean" in err and "Traceback" not in err
    assert not (tmp_path / "thermowatch.db").exists()  # refused before anything was opened


@pytest.mark.parametrize("yaml_text, message", [
    ("max_body_bytes: -1\n", "max_body_bytes must be an integer >= 1, got -1"),
    ("policy: {cooldown_s: .inf}\n", "policy.cooldown_s: expected a finite number, got inf"),
    ("ack_retries: -3\n", "ack_retries must be an integer in [0, 100], got -3"),
    ("ack_timeout_s: .nan\n", "ack_timeout_s: expected a finite number, got nan"),
    ("command_expiry_s: .inf\n", "command_expiry_s: expected a finite number, got inf"),
    ("envelope: {start: -5}\n", "envelope: start must be >= 0 steps, got -5"),
    ("detectors:\n  attn: {ceiling: -.inf}\n", "detectors.attn.ceiling: expected a finite number, got -inf"),
    ("slack: {flap_window_s: .nan}\n", "slack.flap_window_s: expected a finite number, got nan"),
])
def test_validate_config_refuses_a_number_out_of_range_with_exit_2_naming_the_key(tmp_path, capsys, yaml_text,
                                                                                   message):
    path = tmp_path / "sup.yaml"
    path.write_text(yaml_text)
    assert main(["validate-config", str(path), "--kind", "supervisor"]) == 2
    err = capsys.readouterr().err
    assert err == f"thermowatch: {path}: {message}\n", err
    # serve reads the file with the same code and stops at start-up with the same words
    assert main(["serve", "--config", str(path), "--data-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err


def _nested(path: tuple[str, ...], value):
    for key in reversed(path[1:]):
        value = {key: value}
    return {path[0]: value}


NUMERIC_SETTINGS = list(numeric_settings(SupervisorConfig))


@pytest.mark.parametrize("path, is_int", NUMERIC_SETTINGS, ids=[".".join(p) for p, _ in NUMERIC_SETTINGS])
def test_every_numeric_setting_refuses_nan_infinity_and_a_negative_number(tmp_path, path, is_int):
    """Every number of the supervisor config, found by walking its classes (a new one is covered
    without a line here): finite, and none of them means anything below zero."""
    assert len(NUMERIC_SETTINGS) > 100
    for bad in (math.nan, math.inf, -math.inf, -1 if is_int else -1.0):
        with pytest.raises(ConfigError) as exc:
            SupervisorConfig.load(None, env={}, data_dir=tmp_path, **_nested(path, bad))
        assert path[-1] in str(exc.value), (path, bad, str(exc.value))
