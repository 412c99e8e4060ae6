"""supervisor/judge/consistency.py through the embedded Supervisor: a trainer whose LR multiplier
or skip-ledger digest disagrees with what the supervisor booked from its acks is a critical
`state_mismatch` finding and one page per disagreement, never an action (DESIGN.md, "Trust").
The seam tests (test_lr_seam.py, test_seam_properties.py) show a real trainer never trips it;
this shows it trips when it must."""

from __future__ import annotations

import io

import pytest

from thermowatch.monitors.contract import (
    LR_MULTIPLIER, RunInfo, SampleRange, SetLR, Signal, StepRecord, ledger_digest,
)
from thermowatch.protocol import Outcome, ack_for
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store import findings as findings_store

RUN = "consistent"


@pytest.fixture
def sup(db, tmp_path):
    s = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url), notifier=ConsoleNotifier(io.StringIO()))
    s.open_run(RunInfo(RUN, 0, world_size=1))
    yield s
    s.close()


def steps(lo: int, hi: int, multiplier: float = 1.0, digest: str = "") -> list[StepRecord]:
    return [StepRecord(step=k, values={"loss": 3.0, LR_MULTIPLIER: multiplier}, sample_lo=8 * k, sample_hi=8 * k + 8,
                       ledger_digest=digest) for k in range(lo, hi)]


def carry_out(sup: Supervisor, kind: str, args: dict, at_step: int, out_of) -> None:
    """A command submitted, delivered and acknowledged as a trainer would, after step `at_step`."""
    sup.executor.submit(RUN, kind, args, "alice", "test")
    (cmd,) = sup.poll(RUN)
    sup.ack(RUN, ack_for(cmd, out_of(cmd), None, first_step=at_step + 1, lr_changes=[], skip_ranges=[]))


def mismatches(sup: Supervisor) -> list:
    with sup.sessions() as s:
        return [f.finding for f in findings_store.findings(s, RUN) if f.finding.signal is Signal.STATE_MISMATCH]


def pages(sup: Supervisor) -> list:
    with sup.sessions() as s:
        return [a for a in alerts_store.alerts(s, RUN) if "state mismatch" in a.text]


def test_a_trainer_that_lost_an_lr_change_is_paged_once_and_nothing_is_done_to_it(sup):
    sup.write(RUN, 0, steps(1, 11))
    carry_out(sup, "set_lr", {"lr_multiplier": 0.5}, 10,
              lambda cmd: Outcome("lr x0.5", lr_change=SetLR(multiplier=0.5).change(11), lr_seq=0))
    sup.write(RUN, 0, steps(11, 16, multiplier=0.5))  # runs with it: no finding
    assert mismatches(sup) == []
    sup.write(RUN, 0, steps(16, 21, multiplier=1.0))  # a relaunch from an old checkpoint forgot it
    (found,) = mismatches(sup)
    assert found.metric == LR_MULTIPLIER and found.onset_step == 16 and found.detect_step == 20
    assert found.evidence == {"trainer": 1.0, "supervisor": 0.5}
    sup.write(RUN, 0, steps(21, 26, multiplier=1.0))  # the same disagreement: not paged again
    assert len(mismatches(sup)) == 1
    sup.executor.outbox.drain(10)
    (page,) = pages(sup)
    assert "LR multiplier" in page.text and page.state == "sent", page
    assert "trainer reports 1.0, the supervisor recorded 0.5" in str(page.payload), page.payload
    with sup.sessions() as s:  # never an action: acting on a state nobody understands makes it worse
        assert [a.kind for a in actions_store.actions(s, RUN)] == ["set_lr"]
    sup.write(RUN, 0, steps(26, 31, multiplier=0.5))  # agrees again, then a new disagreement pages again
    sup.write(RUN, 0, steps(31, 36, multiplier=0.25))
    assert [f.evidence["trainer"] for f in mismatches(sup)] == [1.0, 0.25]


def test_a_ledger_digest_that_differs_from_the_booked_skips_is_a_mismatch(sup):
    booked = ledger_digest([SampleRange(0, 64)])
    carry_out(sup, "skip", {"skip_ranges": [[0, 64]]}, 0, lambda cmd: Outcome("skip", skip_ranges=cmd.body.ranges))
    sup.write(RUN, 0, steps(1, 6, digest=booked))
    assert mismatches(sup) == []
    sup.write(RUN, 0, steps(6, 9, digest=ledger_digest([])))  # the trainer lost the skip
    (found,) = mismatches(sup)
    assert found.metric == "ledger_digest" and found.onset_step == 6
    assert found.evidence == {"trainer": ledger_digest([]), "supervisor": booked}


def test_nothing_is_compared_while_a_command_is_in_flight_or_for_an_attempt_the_run_has_left(sup):
    sup.write(RUN, 0, steps(1, 11))
    sup.executor.submit(RUN, "set_lr", {"lr_multiplier": 0.5}, "alice", "test")
    (cmd,) = sup.poll(RUN)  # delivered, not acknowledged: the trainer may already run with it
    sup.write(RUN, 0, steps(11, 13, multiplier=0.5))
    assert mismatches(sup) == []
    sup.ack(RUN, ack_for(cmd, Outcome("lr x0.5", lr_change=SetLR(multiplier=0.5).change(11), lr_seq=0), None,
                         first_step=11, lr_changes=[], skip_ranges=[]))
    sup.open_run(RunInfo(RUN, 1, world_size=1, start_step=12))
    sup.write(RUN, 0, steps(13, 15, multiplier=1.0))  # late records of attempt 0: stored, not compared
    assert mismatches(sup) == []
    sup.write(RUN, 1, steps(13, 15, multiplier=1.0))  # the live attempt without the change: paged
    assert [f.onset_step for f in mismatches(sup)] == [13]
