"""Every record sink is a contract.RecordSink: it has each of the protocol's methods, and each
takes the protocol's arguments by the same names in the same places (extra ones have defaults).
Run and RunController call `drain` on whatever sink they hold, with no getattr probe."""

from __future__ import annotations

import inspect

import pytest

from thermowatch.monitors.contract import RecordSink, StepRecord
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.ingest.ingestor import Ingestor
from thermowatch.trainer.local import ListSink
from thermowatch.transport import Batched, HttpSink

SINKS = [HttpSink, Batched, ListSink, Supervisor, Ingestor]
METHODS = sorted(n for n, v in vars(RecordSink).items() if callable(v) and not n.startswith("_"))


def _mismatches(cls: type) -> list[str]:
    """How cls's methods fail to accept the protocol's calls (empty: they all do)."""
    bad = []
    for name in METHODS:
        if not callable(getattr(cls, name, None)):
            bad.append(f"{cls.__name__} has no {name}")
            continue
        want = list(inspect.signature(getattr(RecordSink, name)).parameters.values())[1:]
        have = list(inspect.signature(getattr(cls, name)).parameters.values())[1:]
        for i, p in enumerate(want):
            q = have[i] if i < len(have) else None
            if q is None or q.name != p.name or q.kind in (q.KEYWORD_ONLY, q.VAR_KEYWORD):
                bad.append(f"{cls.__name__}.{name} does not take {p.name!r} as argument {i + 1}")
            elif p.default is not p.empty and q.default is q.empty:
                bad.append(f"{cls.__name__}.{name} needs {p.name!r}; the protocol lets callers leave it out")
        bad += [f"{cls.__name__}.{name} needs {q.name!r}, which the protocol never passes"
                for q in have[len(want):] if q.default is q.empty and q.kind not in (q.VAR_POSITIONAL, q.VAR_KEYWORD)]
    return bad


def test_the_protocol_lists_what_the_run_and_the_controller_call():
    assert METHODS == ["checkpoint_saved", "checkpoints_deleted", "close", "drain", "finish_run", "open_run", "write"]


@pytest.mark.parametrize("cls", SINKS, ids=lambda c: c.__name__)
def test_every_sink_implements_record_sink(cls):
    assert issubclass(cls, RecordSink)
    assert _mismatches(cls) == []


def test_the_check_catches_a_sink_without_drain_or_with_other_arguments():
    class NoDrain(ListSink):
        drain = None  # type: ignore[assignment]

    class RenamedArg(ListSink):
        def write(self, run, attempt, records):  # noqa: D102 - `run`, not `run_id`
            pass

    class NeedsMore(ListSink):
        def drain(self, timeout, how):  # noqa: D102
            return True

    assert not isinstance(NoDrain(), RecordSink) and _mismatches(NoDrain) == ["NoDrain has no drain"]
    assert _mismatches(RenamedArg) == ["RenamedArg.write does not take 'run_id' as argument 1"]
    assert _mismatches(NeedsMore) == ["NeedsMore.drain needs 'timeout'; the protocol lets callers leave it out",
                                      "NeedsMore.drain needs 'how', which the protocol never passes"]


def test_in_process_sinks_drain_at_once_and_batched_writes_what_waits():
    inner = ListSink()
    sink = Batched(inner, every_steps=100, every_s=3600)
    assert isinstance(sink, RecordSink) and isinstance(inner, RecordSink)
    sink.write("r", 0, [StepRecord(step=1, values={"loss": 1.0}, sample_lo=0, sample_hi=4)])
    assert inner.attempt("r", 0) == [] and inner.drain(0.0) is True
    sink.close()  # writes what waits; the inner sink is its owner's to close
    assert [r.step for r in inner.attempt("r", 0)] == [1] and not inner.closed
