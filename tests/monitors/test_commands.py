"""The typed command vocabulary (monitors.commands via monitors.contract): one set of rules,
enforced where a value is built, with JSON that round-trips."""

from __future__ import annotations

import math

import pytest

from thermowatch.monitors.contract import (
    INT64_MAX,
    Ack,
    Bisected,
    Command,
    ContractError,
    LRChange,
    Pause,
    Profile,
    Rollback,
    SampleRange,
    SetLR,
    Skip,
    Stop,
    dumps,
    ledger_digest,
    loads,
    merge_ranges,
    multiplier_at,
    parse_command,
)

BODIES = [Pause(), Pause("no healthy checkpoint before the onset at step 30"), Stop(), Profile(3, "/tmp/p"), Skip((SampleRange(0, 10), SampleRange(20, 30))),
          SetLR(0.25, 100, 10, factor=0.5, base=0.5),
          Rollback(30, exact=True, skip=(SampleRange(5, 9),), lr=SetLR(0.5), checkpoint="/c/step_30")]


@pytest.mark.parametrize("body", BODIES, ids=lambda b: type(b).__name__)
def test_commands_round_trip_through_json(body):
    cmd = Command(7, body)
    assert Command.from_json(loads(dumps(cmd.to_json()))) == cmd
    assert parse_command(cmd.kind, cmd.args) == body


@pytest.mark.parametrize("kind, args, words", [
    ("skip", {"skip_ranges": [[0, 2**63]]}, "2**63-1"),
    ("skip", {"skip_ranges": [[5, 5]]}, "lo must be < hi"),
    ("skip", {}, "skip needs skip_ranges"),
    ("set_lr", {"lr_multiplier": 0.5, "lr_steps": 2**63}, "lr_steps"),
    ("set_lr", {"lr_multiplier": math.nan}, "lr_multiplier"),
    ("set_lr", {"lr_multiplier": math.inf}, "lr_multiplier"),
    ("set_lr", {"lr_multiplier": True}, "lr_multiplier"),
    ("set_lr", {"lr_multiplier": 0.5, "lr_mutliplier": 0.4}, "unknown field"),
    ("rollback", {"to_step": 2**63}, "to_step"),
    ("rollback", {"to_step": 3, "exact": "yes"}, "exact"),
    ("pause", {"now": True}, "unknown field"),
    ("pause", {"reason": 7}, "reason must be a string"),  # issue 35: a paused loop prints it
    ("pause", {"reason": "x" * 2001}, "at most 2000 characters"),
    ("profile", {"steps": 0}, "steps"),
    # issue 21: whatever came was str()'d or taken for 0; the OpenAPI says string or null, integer
    ("rollback", {"to_step": 3, "exclude_node": {}}, "exclude_node must be a string"),
    ("rollback", {"to_step": 3, "checkpoint": 7}, "checkpoint must be a string"),
    ("profile", {"out_dir": ["x"]}, "out_dir must be a string"),
    ("set_lr", {"lr_multiplier": 0.5, "rewarmup_steps": {}}, "rewarmup_steps"),
    ("rollback", {"to_step": 3, "lr_multiplier": 0.5, "rewarmup_steps": False}, "rewarmup_steps"),
    ("explode", {}, "unknown command"),
])
def test_invalid_commands_cannot_be_built(kind, args, words):
    with pytest.raises(ContractError) as exc:
        parse_command(kind, args)
    assert words in str(exc.value)


def test_acks_are_strict_and_bounded():
    ack = Ack(3, True, 31, "rolled back", checkpoint_step=30, checkpoint_path="/c", lr_multiplier=0.5,
              lr_change=LRChange(31, 0.5), lr_seq=1, skip_ranges=(SampleRange(1, 2),), ledger_digest="ab")
    assert Ack.from_json(loads(dumps(ack.to_json()))) == ack
    for bad, words in (({"ok": "false"}, "ok must be true or false"), ({"command_id": 2**31}, "command_id"),
                       ({"first_step": -1}, "first_step"), ({"lr_multiplier": math.nan}, "lr_multiplier"),
                       ({"lr_seq": 0}, "go together"), ({"extra": 1}, "unknown field")):
        with pytest.raises(ContractError) as exc:
            Ack.from_json({**Ack(3, True, 31).to_json(), **bad})
        assert words in str(exc.value), (bad, exc.value)


def test_an_ack_read_under_its_old_names_for_one_release():
    """Issue 38: `step` and `skipped` became `first_step` and `skip_ranges`. An older client's ack
    (and Python code using the old keywords) still reads, with a DeprecationWarning; the new JSON
    says the new names only; both names at once, or the old one with a different value, is refused."""
    new = Ack(3, True, 31, skip_ranges=(SampleRange(4, 9),))
    assert set(new.to_json()) >= {"first_step", "skip_ranges"} and not set(new.to_json()) & {"step", "skipped"}
    old_json = {"command_id": 3, "ok": True, "step": 31, "skipped": [[4, 9]]}
    assert Ack.from_json(old_json) == new
    assert Ack.from_json({**new.to_json(), "step": None, "skipped": None}) == new  # null: not given
    with pytest.warns(DeprecationWarning, match="use first_step"):
        assert Ack(3, True, step=31, skip_ranges=(SampleRange(4, 9),)) == new
    with pytest.warns(DeprecationWarning, match="use skip_ranges"):
        assert new.skipped == new.skip_ranges
    with pytest.warns(DeprecationWarning, match="use first_step"):
        assert new.step == 31
    for both in ({"step": 31}, {"skipped": [[4, 9]]}):
        with pytest.raises(ContractError, match="old name"):
            Ack.from_json({**new.to_json(), **both})
    with pytest.raises(ContractError, match="missing field 'first_step'"):
        Ack.from_json({"command_id": 3, "ok": True})
    with pytest.raises(TypeError, match="unexpected keyword argument 'stepp'"):
        Ack(3, True, 31, stepp=4)


def test_an_ack_says_what_a_precise_skip_searched():
    b = Bisected((SampleRange(800, 2432),), probes=16, steps=216, seconds=11.7, outcome="narrowed")
    ack = Ack(3, True, 51, "rolled back", skip_ranges=(SampleRange(2396, 2432),), bisected=b)
    assert Ack.from_json(loads(dumps(ack.to_json()))) == ack and b.samples == 1632
    assert Ack.from_json(Ack(3, True, 51).to_json()).bisected is None
    for bad, words in (({"outcome": "found"}, "outcome must be one of"), ({"probes": -1}, "probes"),
                       ({"seconds": math.inf}, "seconds"), ({"extra": 1}, "unknown field")):
        with pytest.raises(ContractError) as exc:
            Ack.from_json({**ack.to_json(), "bisected": {**b.to_json(), **bad}})
        assert words in str(exc.value), (bad, exc.value)
    with pytest.raises(ContractError, match="missing field 'steps'"):
        Ack.from_json({**ack.to_json(), "bisected": {k: v for k, v in b.to_json().items() if k != "steps"}})


def test_an_ack_says_what_replay_triage_found_and_its_label_agrees_with_its_evidence():
    """Issue 39: Bisected.cause (data, hardware, optimizer), its replays and cost; an older
    client's bisected (no cause) still reads."""
    from thermowatch.monitors.contract import Cause, Replay

    same = Replay(False, False, 96, 3.1, 3.0, 26)
    hw = Cause("hardware", 96, None, (same,), 26, 1.5)
    b = Bisected((SampleRange(1184, 1536),), probes=1, steps=26, seconds=1.5, outcome="cleared", cause=hw)
    ack = Ack(3, True, 71, "rolled back", bisected=b)
    assert Ack.from_json(loads(dumps(ack.to_json()))) == ack
    old = {k: v for k, v in b.to_json().items() if k != "cause"}
    assert Bisected.from_json({**old, "outcome": "narrowed"}).cause is None
    spiked = Replay(False, True, 95, None, 3.0, 25)
    for label, replays in (("data", (same,)), ("optimizer", (spiked, Replay(True, False, 95, 3.0, 3.0, 25))),
                           ("hardware", (spiked, Replay(True, True, 95, 9.0, 3.0, 25))), ("flaky", (same,))):
        with pytest.raises(ContractError):
            Cause(label, 95, None, replays, 50, 1.0)
    with pytest.raises(ContractError, match="cleared"):  # nothing skipped goes with a cause other than data
        Bisected(b.suspects, 1, 26, 1.5, "narrowed", hw)
    with pytest.raises(ContractError, match="cleared"):
        Bisected(b.suspects, 1, 26, 1.5, "cleared")
    with pytest.raises(ContractError, match="unknown field"):
        Ack.from_json({**ack.to_json(), "bisected": {**b.to_json(), "cause": {**hw.to_json(), "node": "n1"}}})
    assert hw.words().startswith("hardware (the replay of the same samples ran clean through step 96")
    # under torchrun: the one rank whose figures went non-finite (an older client sends no rank)
    on1 = Cause("hardware", 96, None, (same,), 26, 1.5, rank=1)
    assert Cause.from_json(loads(dumps(on1.to_json()))) == on1 and on1.words().endswith("only rank 1's figures non-finite)")
    assert Cause.from_json({k: v for k, v in on1.to_json().items() if k != "rank"}).rank is None
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(ContractError, match="rank"):
            Cause.from_json({**on1.to_json(), "rank": bad})


def test_an_ack_empty_skip_range_is_nothing_not_an_error():
    """[x, x) (or lo > hi) skipped no sample: the ack is taken without it (issue 21: JSON Schema
    cannot say lo < hi). A range that is not a pair of sample ids is still refused."""
    base = Ack(3, True, 31).to_json()
    got = Ack.from_json({**base, "skip_ranges": [[0, 0], [4, 9], [7, 3]]})
    assert got.skip_ranges == (SampleRange(4, 9),)
    for bad in ([[-1, -1]], [[1, 2, 3]], [[0, 2**63]]):
        with pytest.raises(ContractError):
            Ack.from_json({**base, "skip_ranges": bad})
    assert parse_command("set_lr", {"lr_multiplier": 0.5, "rewarmup_steps": None}).rewarmup_steps == 0


def test_one_merge_and_one_digest():
    assert merge_ranges([(10, 20), (0, 5), (5, 8), (15, 30)]) == (SampleRange(0, 8), SampleRange(10, 30))
    assert ledger_digest([(0, 5), (5, 8)]) == ledger_digest([SampleRange(0, 8)]) != ledger_digest([(0, 9)])
    assert ledger_digest([]) == ledger_digest(())


def test_the_multiplier_is_absolute_newest_change_wins():
    changes = [LRChange(10, 0.5), LRChange(20, 0.25), LRChange(30, 0.1, steps=5)]
    assert [multiplier_at(k, changes) for k in (9, 10, 20, 30, 34, 35)] == [1.0, 0.5, 0.25, 0.1, 0.1, 0.25]
    assert multiplier_at(INT64_MAX, changes) == 0.25
    assert LRChange.from_json(changes[2].to_json()) == changes[2]


def test_nan_travels_as_data():
    assert math.isnan(loads(dumps({"v": math.nan}))["v"]) and loads(dumps([math.inf]))[0] == math.inf
    with pytest.raises(ContractError, match="not valid JSON"):
        loads(b"{nope")


@pytest.mark.parametrize("kind, args, words", [
    ("rollback", {"to_step": 100}, "roll back to the newest healthy checkpoint at or before step 100"),
    ("rollback", {"to_step": 100, "exact": True, "skip_ranges": [[200, 240], [300, 310]], "lr_multiplier": 0.5},
     "roll back to checkpoint 100, skip samples [200, 240), [300, 310), set the LR to x0.5 of the schedule"),
    ("rollback", {"to_step": 7, "exclude_rank": 3}, "roll back to the newest healthy checkpoint at or before step 7, "
                                                    "without rank 3"),
    ("skip", {"skip_ranges": [[0, 64]]}, "skip samples [0, 64)"),
    ("set_lr", {"lr_multiplier": 0.25, "lr_factor": 0.5, "lr_base": 0.5, "lr_steps": 100},
     "set the LR to x0.25 of the schedule (x0.5 of the x0.5 in force) for 100 steps"),
    ("profile", {"steps": 3}, "profile the next 3 steps"),
    ("pause", {}, "pause"), ("stop", {}, "stop"),
])
def test_a_command_is_described_in_plain_words(kind, args, words):
    """Alerts and the CLI say what a command does, never a Python dict (issue 23)."""
    from thermowatch.monitors.contract import describe

    text = describe(parse_command(kind, args))
    assert text == words
    assert "{" not in text and "'" not in text
