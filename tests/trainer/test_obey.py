"""trainer/obey.py: a command's handler only reads the run controller and returns a Transition;
RunController.transition is the one place a command changes the run. A real RunController over
a real CheckpointStore (no gang: the handlers never touch it; the gang's part is covered end to
end in test_controller.py and tests/supervisor/seams/test_lr_seam.py)."""

from __future__ import annotations

import copy

import pytest

from thermowatch.monitors.contract import (
    Command, Pause, Profile, Resume, Rollback, SampleRange, SetLR, Skip, Stop,
)
from thermowatch.protocol import Directive
from thermowatch.trainer.checkpoint import make_manifest
from thermowatch.trainer.controller import RunController
from thermowatch.trainer.local import ListSink, QueueCommands
from thermowatch.trainer.obey import ABANDONED, Applied, Refused, Transition, outcome

from tests.trainer.conftest import tiny_config


@pytest.fixture
def ctl(tmp_path):
    """A controller at step 30 with checkpoints 10 (healthy), 20 (healthy), 25 (unhealthy)."""
    c = RunController(tiny_config(tmp_path, world_size=1), ListSink(), QueueCommands())
    for step, healthy in ((10, True), (20, True), (25, False)):
        state = {"cursor": step * 8, "tokens_consumed": step * 512, "step": step, "skip_ranges": []}
        c.store.save(step, lambda d: (d / "rank0.bin").write_bytes(b"x"), make_manifest(state, healthy=healthy))
    c.step = 30
    return c


def _state(c: RunController) -> tuple:
    manifests = {s: c.store.load_manifest(s) for s in c.store.steps()}
    return (c.ledger.to_json(), list(c.lr_changes), list(c.excluded_nodes), c.directive, c.attempt, c.step,
            copy.deepcopy(manifests))


BODIES = [
    Pause(), Resume(), Stop(), Skip(ranges=(SampleRange(0, 16),)), SetLR(multiplier=0.5),
    Profile(steps=2), Rollback(to_step=22), Rollback(to_step=25, skip=(SampleRange(160, 200),), lr=SetLR(multiplier=0.3)),
    Rollback(to_step=20, exact=True),
]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_a_handler_reads_the_controller_and_changes_nothing(ctl, body):
    before = _state(ctl)
    t = ctl.obey.handlers[type(body)](body)
    assert isinstance(t, Transition)
    assert _state(ctl) == before


def test_rollback_plans_the_newest_healthy_checkpoint_and_says_why_not_the_one_asked(ctl):
    t = ctl.obey.handlers[Rollback](Rollback(to_step=25, lr=SetLR(multiplier=0.3)))
    assert t.restart_from.step == 20  # 25 is unhealthy
    assert t.lr_from == 21 and t.lr.multiplier == 0.3
    assert "unhealthy" in t.why
    # one abandoned by an earlier rollback is passed over too
    ctl.store.abandon_after(10, f"{ABANDONED} by a test")
    assert ctl.obey.handlers[Rollback](Rollback(to_step=25)).restart_from.step == 10


def test_rollback_that_cannot_be_done_as_asked_is_refused_before_anything_changes(ctl):
    before = _state(ctl)
    with pytest.raises(Refused, match="--exact: checkpoint 25"):
        ctl.obey.handlers[Rollback](Rollback(to_step=25, exact=True))
    with pytest.raises(Refused, match="nothing to roll back to"):
        ctl.obey.handlers[Rollback](Rollback(to_step=5))
    assert _state(ctl) == before


def test_pause_resume_stop_change_the_loop_only_through_transition(ctl):
    cmds = QueueCommands()
    ctl.commands = cmds
    for i, (body, directive) in enumerate([(Pause(), Directive.PAUSE), (Resume(), Directive.RUN),
                                            (Stop(), Directive.STOP), (Resume(), Directive.STOP)], start=1):
        ack = ctl.obey.apply(Command(id=i, body=body), lambda exc: None, ())
        assert ack.ok, ack.detail
        assert ctl.directive is directive
    assert ctl.stopped and not ctl.paused
    # delivered again: the same ack, and nothing changes
    again = ctl.obey.apply(Command(id=2, body=Resume()), lambda exc: None, ())
    assert again.detail == "resumed" and ctl.directive is Directive.STOP


def test_a_rollback_ends_a_pause_and_never_a_stop(ctl):
    """Issue 35: an acked manual rollback left the loop paused until a resume, though the docs say
    it ends the pause. Its Transition now sets the loop running; a stopped loop stays stopped."""
    rollback = ctl.obey.handlers[Rollback]
    assert rollback(Rollback(to_step=20)).directive is None  # running: unchanged
    ctl.obey.apply(Command(id=1, body=Pause("look")), lambda exc: None, ())
    assert ctl.paused
    assert rollback(Rollback(to_step=20)).directive is Directive.RUN
    ctl.obey.apply(Command(id=2, body=Stop()), lambda exc: None, ())
    assert rollback(Rollback(to_step=20)).directive is None and ctl.stopped


def test_a_refused_rollback_is_a_refused_ack_and_the_ledger_is_untouched(ctl):
    cmd = Command(id=7, body=Rollback(to_step=5, skip=(SampleRange(0, 8),)))
    ack = ctl.obey.apply(cmd, lambda exc: None, ())
    assert not ack.ok and "nothing to roll back to" in ack.detail
    assert ctl.ledger.to_json() == [] and ctl.lr_changes == []
    assert ctl.obey.apply(cmd, lambda exc: None, ()) == ack  # answered once


def test_a_rollback_outcome_names_the_checkpoint_really_loaded(ctl):
    t = ctl.obey.handlers[Rollback](Rollback(to_step=20, skip=(SampleRange(0, 8),)))
    older = ctl.store.latest_valid(max_step=10)
    out = outcome(t, Applied(loaded=older, attempts=(0, 1)))  # 20 turned out unreadable on load
    assert out.checkpoint.step == 10
    assert "rolled back to checkpoint 10; asked <= 20; 20 could not be loaded" in out.detail
    assert "attempt 0 -> 1, skipping [0, 8)" in out.detail
    assert out.skip_ranges == (SampleRange(0, 8),)
