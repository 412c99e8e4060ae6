"""Export -> replay round trip (issue 23): `thermowatch export RUN` (every attempt by default) of a
run the daemon rolled back twice, replayed by `thermowatch replay` with the daemon's detector
settings, finds the daemon's acting incidents: same signal, same detection step. Before, export
kept the newest attempt only and a replay found none of them. Real records of a diverging run
(tests/fixtures/diverging.py), the real daemon app over HTTP, both databases."""

from __future__ import annotations

import json
from collections import Counter

from thermowatch.cli import main
from thermowatch.monitors.contract import Ack, Bisected, Cause, Replay, RunInfo, SampleRange
from thermowatch.supervisor.serve.server import build_app
from tests.fixtures.diverging import DETECTORS, after_skip
from tests.live_server import running
from tests.supervisor.auth_helpers import ADMIN_TOKEN
from tests.supervisor.app.test_service import RUN, acted, diverge, feed_until_action, make_sup, open_actions


def _acting(capsys) -> Counter:
    out = capsys.readouterr().out
    found = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return Counter((f["signal"], f["detect_step"]) for f in found if "event" not in f and f["outcome"] == "act")


def _within(want: Counter, got: Counter) -> bool:
    return all(got[k] >= n for k, n in want.items())


def test_an_export_of_every_attempt_replays_to_the_daemons_acting_incidents(db, tmp_path, capsys):
    sup = make_sup(db, tmp_path, api_token=ADMIN_TOKEN)
    try:
        recs, _, _, act = diverge(sup, tmp_path)
        sup.poll(RUN)
        to_step, skip = act.args["to_step"], act.args["skip_ranges"][0]
        # the first rollback's precise skip named the data (issue 39): export and replay carry it
        same, without = Replay(False, True, 60, 9.5, 4.0, 20), Replay(True, False, 60, 3.1, 4.0, 20)
        cause = Cause("data", 60, 9.5, (same, without), 40, 2.5)
        suspects = (SampleRange(skip[0], skip[1] + 64),)
        sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=to_step + 1, checkpoint_step=to_step,
                         skip_ranges=(SampleRange(*skip),), bisected=Bisected(suspects, 3, 70, 5.0, "narrowed", cause)))
        sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=to_step))
        feed_until_action(sup, 1, after_skip(recs, to_step + 1, cursor=recs[to_step - 1].sample_hi,
                                             skip=tuple(skip)), tmp_path)
        (act2,) = open_actions(sup)
        sup.poll(RUN)
        sup.ack(RUN, Ack(command_id=act2.id, ok=True, first_step=act2.args["to_step"] + 1))
        # both divergences are detected at the same step of their attempt: counted, not a set
        daemon = Counter((i.signal, i.detect_step) for i in acted(sup))
        assert sum(daemon.values()) == 2, daemon

        every, newest = tmp_path / "all.jsonl", tmp_path / "newest.jsonl"
        with running(build_app(sup)) as url:
            flags = ["--server", url, "--token", ADMIN_TOKEN]
            assert main(["export", RUN, "--out", str(every), *flags]) == 0
            assert main(["export", RUN, "--out", str(newest), "--attempts", "newest", *flags]) == 0
        assert "2 attempts" in capsys.readouterr().out
        lines = [json.loads(line) for line in every.read_text().splitlines()]
        recs = [r for r in lines if "event" not in r]
        assert [r["attempt"] for r in recs] == sorted(r["attempt"] for r in recs) and {r["attempt"] for r in recs} == {0, 1}
        # each rollback a line of its own, before the attempt it opened: the first with its cause
        events = [(i, r) for i, r in enumerate(lines) if "event" in r]
        assert [r["action"] for _, r in events] == [act.id, act2.id], events
        (i, first), (_, second) = events
        assert lines[i + 1]["attempt"] == first["attempt"] == 1 and lines[i + 1]["step"] == to_step + 1
        assert first["cause"]["label"] == "data" and first["search"] == "narrowed" and first["skip_ranges"] == [skip]
        assert first["checkpoint_step"] == to_step and second["cause"] is None and "attempt" not in second
        detectors = tmp_path / "detectors.json"
        detectors.write_text(json.dumps(DETECTORS))

        assert main(["replay", str(every), "--detectors", str(detectors), "--no-policy", "--json"]) == 1
        replayed = _acting(capsys)
        assert _within(daemon, replayed), (daemon, replayed)
        assert "attempt" not in capsys.readouterr().err  # read beside the record, never as a metric
        main(["replay", str(newest), "--detectors", str(detectors), "--no-policy", "--json"])
        assert not _within(daemon, _acting(capsys))  # the old export lost the abandoned attempts' divergences
        # read by a person: the rollback and its cause where attempt 1 starts, between the findings
        main(["replay", str(every), "--detectors", str(detectors), "--no-policy"])
        text = capsys.readouterr().out.splitlines()
        said = [k for k, line in enumerate(text) if line.startswith("attempt 1: rollback")]
        assert len(said) == 1 and 0 < said[0] < len(text) - 1, text
        assert (f"to checkpoint {to_step}, re-training from step {to_step + 1}; skipped [{skip[0]}, {skip[1]}); "
                "precise skip: narrowed; cause: data (the run had spiked at step 60; replays 2, 40 steps, 2.5 s)"
                in text[said[0]]), text[said[0]]
    finally:
        sup.close()
