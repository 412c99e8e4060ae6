"""thermowatch.Run as a contract (issue 35, item 6): a loop with its own checkpointing answers
every command the supervisor can send with `run.done` or `run.refuse`, which build the ack from
the command and the run's book; no exception reaches the loop. Before, such a loop built its
Acks by hand and an on-call's `thermowatch lr` crashed it ("ack: lr_change and lr_seq go
together").

A real daemon over real HTTP on both databases; the commands are a person's, through the API,
as `thermowatch lr/skip/pause/resume/rollback/stop/profile` send them."""

from __future__ import annotations

import time

import httpx
import pytest

import thermowatch
from tests.live_server import running, wait_until
from tests.supervisor.auth_helpers import AUTH, make_token, sup  # noqa: F401  (sup: the fixture)
from thermowatch.monitors.contract import SampleRange, StepRecord
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import findings as findings_store

RUN = "own-loop"
B = 8


def _final(sup, action_id: int):
    """The action's row once it is done or failed, else None."""
    with sup.sessions() as s:
        row = actions_store.get_action(s, action_id)
    return row if row.state in ("done", "failed") else None


def _step(run, step: int, cursor: int) -> StepRecord:
    """A step as the docs' loop sends it: its ids, the multiplier in force, the ledger's digest."""
    return StepRecord(step=step, values={"loss": 2.0, "lr_multiplier": run.lr_multiplier(step)},
                      sample_lo=cursor, sample_hi=cursor + B, wall_time=time.time(), ledger_digest=run.ledger_digest)


def test_every_command_is_done_or_refused_with_a_correct_ack_and_the_books_agree(sup, tmp_path):
    with running(build_app(sup)) as url, httpx.Client(base_url=url, headers=AUTH, timeout=30) as api:
        run = thermowatch.Run(RUN, steps=200, global_batch=B, server=url, state_dir=tmp_path / "state",
                              token=make_token(sup.sessions, "trainer", "ingest"), poll_interval_s=0.1)
        run.start()
        for s in range(1, 11):
            run.send(_step(run, s, (s - 1) * B))
        run.checkpoint_saved(10, str(tmp_path / "ck10"), sample_cursor=10 * B)
        run.flush()
        step = 10
        asked = [("set_lr", {"lr_multiplier": 0.5}, "done"),  # `thermowatch lr RUN --multiplier 0.5`
                 ("skip", {"skip_ranges": [[200, 240]]}, "done"),
                 ("pause", {}, "done"), ("resume", {}, "done"),
                 ("rollback", {"to_step": 10, "skip_ranges": [[72, 80]]}, "done"),
                 ("profile", {"steps": 3}, "failed"),  # this loop cannot: refused, saying why
                 ("stop", {}, "done")]
        for kind, args, want in asked:
            r = api.post(f"/api/runs/{RUN}/actions", json={"kind": kind, "args": args, "who": "ana", "reason": "t"})
            assert r.status_code == 201, (kind, r.text)
            aid = r.json()["action_id"]
            (cmd,) = wait_until(run.commands, f"{kind} handed out")
            assert cmd.id == aid
            if kind == "rollback":
                run.start(start_step=10)
                ack = run.done(cmd, 11, checkpoint_step=10, checkpoint_path=tmp_path / "ck10")
                assert (ack.checkpoint_step, ack.first_step) == (10, 11)
                step = 10
            elif kind == "profile":
                ack = run.refuse(cmd, step + 1, "this loop does not profile")
                assert not ack.ok and ack.detail == "this loop does not profile"
            else:
                ack = run.done(cmd, step + 1)
                assert ack.ok
            if kind == "set_lr":
                assert (ack.lr_change.multiplier, ack.lr_seq, ack.lr_multiplier) == (0.5, 0, 0.5)
            step += 1
            run.send(_step(run, step, (step - 1) * B))
            run.flush()
            row = wait_until(lambda: _final(sup, aid), f"{kind} acknowledged")
            assert row.state == want, (kind, row.state, row.error)
        run.finish()
        assert not list((tmp_path / "state").rglob("rejected.jsonl")), "the daemon refused a step or an ack"
        assert run.skip_ranges == (SampleRange(72, 80), SampleRange(200, 240))
        assert run.lr_multiplier(step) == 0.5 and len(run.lr_changes) == 1
    with sup.sessions() as s:
        mismatches = [f for f in findings_store.findings(s, RUN) if f.signal == "state_mismatch"]
    assert mismatches == [], "the trainer's book and the supervisor's disagree"
