"""monitors/replay.py: reading JSONL/CSV thermometer logs and replaying them through the bank."""

import io
import json
import math

import numpy as np

from thermowatch.monitors.contract import Finding
from thermowatch.monitors.detectors import BankConfig
from thermowatch.monitors.replay import EXIT_CLEAN, EXIT_ERROR, EXIT_FINDINGS, read_records, replay


def _diverging_lines(n=600, blowup_at=400, seed=0):
    rng = np.random.default_rng(seed)
    lines = []
    for step in range(n):
        logit = 8.0 * math.exp(rng.normal(0, 0.03) + (0.04 * (step - blowup_at + 1) if step >= blowup_at else 0.0))
        rec = {"step": step, "loss": 2.5 + rng.normal(0, 0.02), "attn_logit_max/blocks.0.attn": logit}
        lines.append(json.dumps(rec))
    return lines


def test_read_jsonl_nan_literals_unknown_keys_and_malformed_line(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text(
        '{"step": 1, "loss": NaN, "grad_norm": Infinity, "act_min/b": -Infinity, "my_metric": 3}\n'
        "\n"
        '{"step": 2, "loss": 2.0\n'  # torn line
        '{"step": 3, "loss": 1.9, "phase": "train", "ranks": {"grad_norm": 1}}\n'
        '[1, 2]\n'
        '{"loss": 1.8}\n'  # no step
    )
    err = io.StringIO()
    got = list(read_records(path, err))
    assert [(ln, r.step) for ln, r in got] == [(1, 1), (4, 3)]
    r1 = got[0][1]
    assert math.isnan(r1.values["loss"]) and r1.values["grad_norm"] == math.inf
    assert r1.values["act_min/b"] == -math.inf and r1.values["my_metric"] == 3.0
    assert got[1][1].ranks == {"grad_norm": 1} and "phase" not in got[1][1].values
    msgs = err.getvalue()
    for lineno in (3, 5, 6):
        assert f"run.jsonl:{lineno}: skipped malformed record" in msgs
    assert "'phase'" in msgs


def test_read_csv_empty_cells_are_missing(tmp_path):
    path = tmp_path / "run.csv"
    path.write_text("step,loss,grad_norm,attn_logit_max/b.0,wall_time\n"
                    "1,2.5,,7.0,100.5\n"
                    "2,nan,inf,,101.5\n"
                    "three,1,1,1,1\n"
                    "4,2.4\n")
    err = io.StringIO()
    got = list(read_records(path, err))
    assert [(ln, r.step) for ln, r in got] == [(2, 1), (3, 2)]
    assert got[0][1].values == {"loss": 2.5, "attn_logit_max/b.0": 7.0} and got[0][1].wall_time == 100.5
    assert math.isnan(got[1][1].values["loss"]) and got[1][1].values["grad_norm"] == math.inf
    assert "run.csv:4:" in err.getvalue() and "run.csv:5:" in err.getvalue()


def test_replay_json_output_and_policy_decision(tmp_path):
    path = tmp_path / "run.jsonl"
    lines = _diverging_lines()
    lines.insert(100, "{oops")
    path.write_text("\n".join(lines) + "\n")
    out, err = io.StringIO(), io.StringIO()
    code = replay(path, BankConfig(), out, json_out=True,
                  policy=lambda f: {"action": "rollback", "to_before": f.onset_step}, err=err)
    assert code == EXIT_FINDINGS
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert rows
    growth = [r for r in rows if r["signal"] == "attn_logit_growth"]
    assert growth and abs(growth[0]["onset_step"] - 400) <= 5
    for r in rows:
        assert {"signal", "module", "onset_step", "detect_step", "severity", "outcome", "metric", "evidence"} <= set(r)
        assert r["decision"] == {"action": "rollback", "to_before": r["onset_step"]}
        Finding.from_json(r)  # the contract can read it back
    assert "run.jsonl:101: skipped malformed record" in err.getvalue()


def test_replay_readable_output_and_clean_exit(tmp_path):
    path = tmp_path / "run.jsonl"
    path.write_text("\n".join(_diverging_lines(n=300, blowup_at=10_000)) + "\n")
    out = io.StringIO()
    assert replay(path, None, out, json_out=False, err=io.StringIO()) == EXIT_CLEAN
    assert out.getvalue().strip() == "300 records, 0 findings"

    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(_diverging_lines()) + "\n")
    out = io.StringIO()
    assert replay(bad, None, out, json_out=False, err=io.StringIO()) == EXIT_FINDINGS
    text = out.getvalue()
    assert "ATTN_LOGIT_GROWTH" not in text and "attn_logit_growth" in text and "onset=" in text
    assert "blocks.0.attn" in text


def test_replay_missing_unreadable_and_empty_files_exit_2(tmp_path):
    err = io.StringIO()
    assert replay(tmp_path / "nope.jsonl", None, io.StringIO(), False, err=err) == EXIT_ERROR
    assert "nope.jsonl" in err.getvalue() and "no such file" in err.getvalue()
    assert replay(tmp_path, None, io.StringIO(), False, err=io.StringIO()) == EXIT_ERROR  # a directory
    empty = tmp_path / "empty.jsonl"
    empty.write_text("garbage\n")
    err = io.StringIO()
    assert replay(empty, None, io.StringIO(), False, err=err) == EXIT_ERROR
    assert "no readable step record" in err.getvalue()


def test_replay_unreadable_path_exit_2(tmp_path):
    # A directory where the file should be: unreadable for everyone, root included (a chmod 000
    # file is readable by root, so that variant could not fail here).
    path = tmp_path / "run.jsonl"
    path.mkdir()
    err = io.StringIO()
    assert replay(path, None, io.StringIO(), False, err=err) == EXIT_ERROR
    assert "cannot read" in err.getvalue() and "run.jsonl" in err.getvalue()