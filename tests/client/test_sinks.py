"""Every record sink is a contract.RecordSink: it has each of the protocol's methods, and each
takes the protocol's arguments by the same names in the same places (extra ones have defaults).
Run and RunController call `drain` on whatever sink they hold, with no getattr probe.

thermowatch.Run over HTTP hands its sink each step on the caller's thread: the sink's queue is the
one place records wait (issue 38), and what follows an ack still waits for the ack (a real daemon
over real HTTP; the slow answers are the network's, tests/fakes/network.py)."""

from __future__ import annotations

import inspect
import time

import httpx
import pytest

import thermowatch
from tests.fakes.network import LateProxy
from tests.live_server import running, wait_until
from tests.supervisor.auth_helpers import AUTH, make_token, sup  # noqa: F401  (sup: the fixture)
from thermowatch.monitors.contract import RecordSink, StepRecord
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.ingest.ingestor import Ingestor
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import thermometers
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


# --- thermowatch.Run over HTTP: the sink's queue is the one place records wait ---------------------

RUN = "one-queue"


def _run_over(url: str, sup, tmp_path, **kw) -> "thermowatch.Run":
    return thermowatch.Run(RUN, steps=100, global_batch=4, server=url, state_dir=tmp_path / "state",
                           token=make_token(sup.sessions, "trainer", "ingest"), **kw)


def _stored_steps(sup) -> list[int]:
    with sup.sessions() as s:
        return thermometers.history(s, RUN, "loss")[0].tolist()


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)  # the client's order and timing; ingest is tested elsewhere
def test_a_step_goes_to_the_sink_at_once_while_the_run_waits_on_a_poll(sup, tmp_path):
    """Every answer 4 s late: once the run is registered its I/O thread sits in a command poll
    for 4 s. A step sent meanwhile is in the daemon well before that poll returns: it went into
    the sink's queue on the caller's thread and waited nowhere else (it used to wait in Run's
    own queue behind the poll)."""
    with running(build_app(sup)) as url, LateProxy(url, delay_s=4.0) as proxy:
        run = _run_over(proxy.url, sup, tmp_path, send_interval_s=0.05, poll_interval_s=0.05)
        run.start()
        wait_until(lambda: any(p == "/api/runs" for _, _, p, _ in proxy.answered), "registration answer", 30)
        time.sleep(0.3)  # the run knows it is registered and polls (answered 4 s late); the sink is idle
        sent = time.monotonic()
        run.send(StepRecord(step=1, values={"loss": 1.0}, sample_lo=0, sample_hi=4))
        wait_until(lambda: _stored_steps(sup) == [1], "step 1 stored", 30, every_s=0.02)
        took = time.monotonic() - sent
        run.finish()
    assert took < 2.0, f"step 1 took {took:.1f} s to reach the daemon: it waited behind the poll"
    assert run.errors == 0


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_what_follows_an_ack_reaches_the_daemon_after_it(sup, tmp_path):
    """Acks go over the command channel, apart from the sink, so what the loop makes after an ack
    waits behind it in Run's queue until the ack is sent. The finish report first would expire
    the stop it answers (Executor.run_finished): every answer 0.5 s late, the I/O thread mostly
    in a poll when the loop acks and finishes at once."""
    with running(build_app(sup)) as url, LateProxy(url, delay_s=0.5) as proxy, \
            httpx.Client(base_url=url, headers=AUTH, timeout=30) as api:
        run = _run_over(proxy.url, sup, tmp_path, poll_interval_s=0.05)
        run.start()
        run.send(StepRecord(step=1, values={"loss": 1.0}, sample_lo=0, sample_hi=4))
        wait_until(lambda: api.get(f"/api/runs/{RUN}/status").status_code == 200, "registration", 30)
        made = api.post(f"/api/runs/{RUN}/actions", json={"kind": "stop", "who": "ana", "reason": "enough"})
        assert made.status_code == 201, made.text
        cmd, = wait_until(run.commands, "the stop handed out", 30)
        run.done(cmd, first_step=2)
        run.send(StepRecord(step=2, values={"loss": 0.5}, sample_lo=4, sample_hi=8))  # made after the ack too
        run.finish(final_step=2, final_loss=0.5, reason="stopped")
        posted = [p.rsplit("/", 1)[-1] for _, m, p, _ in proxy.answered if m == "POST"]
        action = next(a for a in api.get(f"/api/runs/{RUN}/actions").json()["actions"]
                      if a["id"] == made.json()["action_id"])
        status = api.get(f"/api/runs/{RUN}/status").json()
    assert action["state"] == "done", action
    assert posted.index("acks") < posted.index("finished"), posted
    assert status["state"] == "finished" and status["final_step"] == 2 and status["finish_reason"] == "stopped"
    assert _stored_steps(sup) == [1, 2] and run.errors == 0
