"""Detector state saved incrementally in the real database (store/detector_state.py): parts
upserted after each batch (only what changed), read back by a new bank, give the findings of a
bank that never stopped; a save after one step writes a fraction of the whole state."""

from __future__ import annotations

from thermowatch.monitors.contract import StepRecord
from thermowatch.monitors.detectors import BankConfig, DetectorBank
from thermowatch.supervisor.store import detector_state
from thermowatch.supervisor.store import runs as runs_store
from tests.fixtures import streams

RUN = "state"


def _observe(bank, events, attempt=0):
    out = []
    for ev in events:
        if ev[0] == "reset":
            bank.reset(ev[1])
        else:
            out += [f.to_json() for f in bank.observe(StepRecord(step=ev[1], values=ev[2], wall_time=1.0), attempt)]
    return out


def test_incremental_saves_restore_to_the_same_findings(db):
    events = [e for e in streams.stream(3, n_steps=140, n_layers=10) if e[0] == "rec"]
    events = [("rec", i, e[2]) for i, e in enumerate(events)]  # one attempt: steps only go forward
    whole = _observe(DetectorBank(BankConfig.from_dict(streams.CFG)), events)
    with db.sessions.begin() as s:
        runs_store.create_run(s, RUN)
    a = DetectorBank(BankConfig.from_dict(streams.CFG))
    head, cut, written = [], 90, []
    for i in range(0, cut, 10):
        head += _observe(a, events[i:i + 10])
        with db.sessions.begin() as s:
            if i == 0:
                written.append(detector_state.replace_parts(s, RUN, a.state_parts()))
            else:
                written.append(detector_state.save_parts(s, RUN, a.state_parts(dirty_only=True)))
        a.mark_saved()
    b = DetectorBank(BankConfig.from_dict(streams.CFG))
    with db.sessions() as s:
        b.load_state_parts(detector_state.load_parts(s, RUN))
    assert head + _observe(b, events[cut:]) == whole
    # The same records again: judged once, nothing new.
    assert _observe(b, events[cut:]) == []
    assert max(written[1:]) < sum(len(v) for v in a.state_parts().values())


def test_whole_state_round_trips_through_save_and_load(db):
    with db.sessions.begin() as s:
        runs_store.create_run(s, RUN)
    bank = DetectorBank(BankConfig())
    _observe(bank, streams.stream(4, n_steps=60, n_layers=2))
    with db.sessions.begin() as s:
        detector_state.save(s, RUN, bank.state_dict())
    with db.sessions() as s:
        state = detector_state.load(s, RUN)
    twin = DetectorBank(BankConfig())
    twin.load_state_dict(state)
    assert twin.state_dict() == bank.state_dict()
