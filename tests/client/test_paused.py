"""Never a silent hang (issue 35, item 3): a paused loop says so on stderr and the `thermowatch`
logger, with the reason it was given and the commands that end it, repeats a short line while it
waits, and a resume, a rollback or a stop ends the pause.

The seams run a real thermowatch.watch loop (tests/client/user_loop.py, on its own thread, as a
user's script would run while the on-call acts) against the embedded supervisor on both
databases; the on-call is this test, through the executor's manual commands."""

from __future__ import annotations

import io
import logging
import threading
import time
from typing import Callable

import pytest
import torch

from tests.client.user_loop import DATA, calm, diverging, train_step, user_batch
from tests.live_server import wait_until
from tests.waits import action_final
from thermowatch.paused import PauseNotice, say
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store.views import run_status


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_pause_says_why_and_what_ends_it_then_repeats_once_per_interval_then_says_how_it_ended():
    lines: list[str] = []
    clock = Clock()
    n = PauseNotice("my-run", every_s=300.0, clock=clock, emit=lines.append)
    n.tick()  # not paused: nothing
    n.paused(72, "no healthy checkpoint before the onset at step 71\n[CRITICAL] forged", [30, 10, 20])
    assert lines == ["thermowatch: run my-run is PAUSED before step 72: no healthy checkpoint before the onset at "
                     "step 71\\n[CRITICAL] forged. Training waits here until one of: `thermowatch resume my-run` "
                     "(train on from here), `thermowatch rollback my-run --to-step N` (train on from the newest "
                     "checkpoint at or before step N; on disk: 10, 20, 30), `thermowatch stop my-run` (end the run)"]
    for dt in (1.0, 298.0):
        clock.now += dt
        n.tick()
    assert len(lines) == 1  # 299 s: not yet
    clock.now += 1.0
    n.tick()
    n.tick()
    assert lines[1:] == ["thermowatch: run my-run still paused before step 72 (5 min); `thermowatch resume my-run` "
                         "trains on"]
    clock.now += 301.0
    n.tick()
    assert lines[-1].endswith("(10 min 1 s); `thermowatch resume my-run` trains on") and len(lines) == 3
    n.ended("rolled back to checkpoint 10 (asked <= 10); attempt 1 -> 2")
    assert lines[-1] == ("thermowatch: run my-run no longer paused after 10 min 1 s: rolled back to checkpoint 10 "
                         "(asked <= 10); attempt 1 -> 2")
    assert n.since is None
    n.tick()
    n.ended("again")
    assert len(lines) == 4  # over: nothing more


def test_a_pause_with_no_reason_and_no_checkpoint_says_so():
    lines: list[str] = []
    PauseNotice("r", emit=lines.append).paused(1, "", [])
    assert "PAUSED before step 1: (no reason given)." in lines[0] and "none on disk yet" in lines[0]
    lines.clear()
    PauseNotice("r", emit=lines.append).paused(900, "x", range(10, 900, 10))
    assert "on disk: 10, 20, ..., 870, 880, 890 (89 in all)" in lines[0]


@pytest.mark.parametrize("handler, on_stderr", [
    ("stderr", 1),  # logging writes it there itself: not twice
    ("file", 1),  # logging writes it elsewhere: stderr directly
    ("none", 1),  # no handler at all: logging's last resort writes it to stderr
    ("above", 1),  # a stderr handler set above WARNING: stderr directly
])
def test_a_line_reaches_the_logger_and_stderr_exactly_once(capsys, handler, on_stderr):
    logger = logging.getLogger(f"thermowatch.test_paused.{handler}")
    logger.propagate = False  # this test's own logger tree: pytest's handlers stay out of it
    logger.setLevel(logging.INFO)
    other = io.StringIO()
    import sys

    h = {"stderr": logging.StreamHandler(sys.stderr), "file": logging.StreamHandler(other),
         "above": logging.StreamHandler(sys.stderr), "none": None}[handler]
    if h is not None:
        if handler == "above":
            h.setLevel(logging.ERROR)
        logger.addHandler(h)
    try:
        say("thermowatch: run r is PAUSED before step 3: look", logger)
    finally:
        if h is not None:
            logger.removeHandler(h)
    assert capsys.readouterr().err.count("PAUSED before step 3") == on_stderr
    assert other.getvalue().count("PAUSED") == (handler == "file")


# --- the seams: a real loop, the embedded supervisor, the on-call acting meanwhile ----------------


class Loop(threading.Thread):
    """The user's loop (docs/any-trainer.md) on its own thread, as their script runs it."""

    def __init__(self, tw, step_fn: Callable[[int], torch.Tensor], on_step: Callable[[int], None] = lambda s: None):
        super().__init__(daemon=True)
        self.tw, self.step_fn, self.on_step = tw, step_fn, on_step
        self.trained: list[tuple[int, int]] = []  # (attempt, step)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for step in self.tw.steps():
                self.tw.record(self.step_fn(step))
                self.trained.append((self.tw.attempt, step))
                self.on_step(step)
        except BaseException as exc:  # noqa: BLE001 - raised again in the test's thread
            self.error = exc

    def finish(self, timeout: float = 60.0) -> None:
        self.join(timeout)
        assert not self.is_alive(), f"the loop still runs (trained {self.trained[-3:]})"
        if self.error is not None:
            raise self.error


class Stderr:
    """What the loop wrote to stderr so far (capsys hands it out in pieces)."""

    def __init__(self, capsys) -> None:
        self.capsys, self.seen = capsys, ""

    def __call__(self) -> str:
        self.seen += self.capsys.readouterr().err
        return self.seen


def _rows(sup, run: str, kind: str):
    with sup.sessions() as s:
        return [a for a in sorted(actions_store.actions(s, run), key=lambda a: a.id) if a.kind == kind]


def test_a_loop_the_supervisor_pauses_says_why_and_how_to_resume_within_a_second_and_resumes(db, tmp_path, capsys,
                                                                                            caplog):
    """A real divergence (a user's SDPA model at LR 0.1) with no checkpoint before its onset: the
    policy pauses (rung 3, the one pause the margin leaves). The loop says so on stderr within a
    second of the pause being written, with the policy's reason and `thermowatch resume hot`, and
    trains on when the on-call resumes it."""
    caplog.set_level(logging.WARNING, logger="thermowatch")
    model, opt, data, tw = diverging(db, tmp_path, "hot", checkpoint_every=1000, poll_interval_s=0.05)
    sup = tw.run.supervisor
    err = Stderr(capsys)
    loop = Loop(tw, lambda step: train_step(model, opt, *user_batch(data, tw.batch_ids(step), 32)))
    loop.start()
    try:
        pause = wait_until(lambda: next(iter(_rows(sup, "hot", "pause")), None), "pause from the policy", 120)
        written = time.monotonic()
        wait_until(lambda: "is PAUSED" in err(), "PAUSED line on stderr", 10)
        assert time.monotonic() - written < 1.0
        assert pause.origin == "auto" and "rung 3" in pause.reason and "no healthy checkpoint before the onset" in pause.reason
        line = next(ln for ln in err().splitlines() if "is PAUSED" in ln)
        assert pause.args["reason"][:80] in line  # the policy's reason, as the pause carried it
        assert "`thermowatch resume hot`" in line and "`thermowatch rollback hot --to-step N`" in line
        assert "none on disk yet" in line and "`thermowatch stop hot`" in line
        assert any(r.name.startswith("thermowatch") and r.levelno == logging.WARNING and "is PAUSED" in r.getMessage()
                   for r in caplog.records)  # the logger HF's and Lightning's users read
        paused_at = action_final(sup, pause.id).result["first_step"]  # the step it waits before
        time.sleep(0.3)
        assert max(s for _, s in loop.trained) == paused_at - 1  # waiting, not training
        resume = sup.executor.submit("hot", "resume", {}, "ana", "looked; go on")
        wait_until(lambda: max(s for _, s in loop.trained) >= paused_at, "step trained after the resume", 30)
        assert action_final(sup, resume).state == "done"
        assert "thermowatch: run hot no longer paused after" in err() and ": resumed" in err()
    finally:
        for kind in ("stop",):  # end it however it stands (a diverging run may pause again)
            sup.executor.submit("hot", kind, {}, "ana", "enough")
        loop.finish()
        tw.close()


@pytest.mark.parametrize("ends", ["rollback", "stop"])
def test_a_rollback_or_a_stop_ends_a_pause(db, tmp_path, capsys, ends):
    """Issue 35: an acked manual rollback left the loop paused; only `resume` ended it. A person
    pauses a healthy loop; while it waits it repeats a short line; a rollback then trains on from
    the rollback's checkpoint (a new attempt from step 11), a stop ends the loop."""
    tw, model, opt = calm(db, tmp_path, "calm", 30)
    tw.pause_notice.every_s = 0.3  # the repeat, at a test's pace (300 s in a run)
    sup = tw.run.supervisor
    asked: dict[str, int] = {}

    def on_step(step: int) -> None:
        if step == 12 and "pause" not in asked:
            asked["pause"] = sup.executor.submit("calm", "pause", {}, "ana", "looking at the logits")

    err = Stderr(capsys)
    loop = Loop(tw, lambda step: train_step(model, opt, *user_batch(DATA, tw.batch_ids(step))), on_step)
    loop.start()
    try:
        wait_until(lambda: "is PAUSED" in err(), "PAUSED line on stderr", 60)  # a loaded machine: 30 s ran out once
        line = next(ln for ln in err().splitlines() if "is PAUSED" in ln)
        assert ": paused by ana: looking at the logits." in line and "on disk: 5, 10" in line
        wait_until(lambda: "still paused" in err(), "repeated line while it waits", 10)
        paused_at = action_final(sup, asked["pause"]).result["first_step"]
        assert max(s for _, s in loop.trained) == paused_at - 1 and paused_at > 11
        if ends == "rollback":
            asked[ends] = sup.executor.submit("calm", "rollback", {"to_step": 10}, "ana", "from 10")
        else:
            asked[ends] = sup.executor.submit("calm", "stop", {}, "ana", "enough")
        loop.finish()
    finally:
        if loop.is_alive():
            sup.executor.submit("calm", "stop", {}, "ana", "test cleanup")
            loop.finish()
        tw.close()
    row = action_final(sup, asked[ends])
    assert row.state == "done", row.error
    ended = next(ln for ln in err().splitlines() if "no longer paused" in ln)
    with sup.sessions() as s:
        finished = runs_store.latest_attempt(s, "calm").finished
        state = run_status(s, "calm", stall_after_s=600)["state"]
    if ends == "rollback":
        assert (row.result["checkpoint_step"], row.result["first_step"]) == (10, 11)
        assert "rolled back to checkpoint 10" in ended
        after = loop.trained[loop.trained.index((1, paused_at - 1)) + 1:]
        assert after[0] == (2, 11) and after[-1] == (2, 30)  # trained on from the checkpoint, to the end
        assert finished.reason.value == "completed"
    else:
        assert "stopping after step" in ended
        assert loop.trained[-1] == (1, paused_at - 1) and finished.reason.value == "stopped"
    assert state == "finished"
