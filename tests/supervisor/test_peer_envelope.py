"""A run behind the runs of its model config pages (issue 24, item 1: monitors/envelope.py, run by
supervisor.jobs.peer_envelope), on SQLite and PostgreSQL, with real recorded runs
(tests/fixtures/traces): qk-LN at 3e-3 and at 3e-1, whose logits never grow and whose own loss
curve never turns up; it just ends ~0.5 nats behind."""

from __future__ import annotations

import io

import numpy as np
import pytest

from thermowatch.monitors.contract import RunInfo, Signal
from thermowatch.monitors.envelope import Curve, EnvelopeConfig, behind_peers
from thermowatch.supervisor import jobs
from thermowatch.supervisor.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.service import Supervisor
from thermowatch.supervisor.store import incidents as incidents_store
from tests.fixtures import traces

QKLN = {"n_layer": 3, "d_model": 64, "n_head": 4, "qk_layernorm": True}


@pytest.fixture
def stream():
    return io.StringIO()


@pytest.fixture
def sup(db, tmp_path, stream):
    s = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url), notifier=ConsoleNotifier(stream))
    yield s
    s.close()


def _train(sup, run_id: str, trace: str, model: dict) -> None:
    sup.open_run(RunInfo(run_id=run_id, attempt=0, world_size=1, config={"model": model}))
    recs = traces.load(trace)
    for lo in range(0, len(recs), 50):
        sup.write(run_id, 0, recs[lo:lo + 50])


def _incidents(sup, run_id: str):
    with sup.sessions() as s:
        return [i for i in incidents_store.incidents(s, run_id) if i.signal == Signal.LOSS_BEHIND_PEERS.value]


def test_a_run_behind_its_peers_pages_once_and_its_peer_does_not(sup, stream):
    _train(sup, "healthy", "healthy_qkln", QKLN)
    _train(sup, "degrade", "qkln_degrade", QKLN)
    _train(sup, "alone", "qkln_degrade", {**QKLN, "d_model": 128})  # another model: no peers
    found = jobs.peer_envelope(sup)
    assert [(rid, f.signal) for rid, f in found] == [("degrade", Signal.LOSS_BEHIND_PEERS)]
    f = found[0][1]
    assert 150 <= f.onset_step < f.detect_step <= 250, (f.onset_step, f.detect_step)
    assert f.evidence["peer_run"] == "healthy" and f.evidence["gap_nats"] >= 0.25
    assert f.evidence["peer_lr_area"] <= f.evidence["lr_area"]  # the peer trained with less LR
    (inc,) = _incidents(sup, "degrade")
    assert inc.onset_step == f.onset_step
    assert _incidents(sup, "healthy") == [] and _incidents(sup, "alone") == []
    assert sup.executor.outbox.drain(30)
    out = stream.getvalue()
    assert "loss_behind_peers" in out and "degrade" in out
    # The next tick finds the same stretch: recorded once, not decided again.
    jobs.peer_envelope(sup)
    assert len(_incidents(sup, "degrade")) == 1


def test_a_slow_run_behind_faster_runs_is_not_behind_its_peers():
    """A run at a low LR is behind runs at a higher LR and is not damaged: only runs that trained
    with no more LR so far make the envelope."""
    slow = _curve("slow", "healthy_qkln", lr_scale=0.1)
    # A peer 0.5 nats ahead that trained at 10x the LR: the slow run is slow, not behind ...
    assert behind_peers(slow, [_curve("fast-lr", "healthy_qkln", lr_scale=1.0, loss_shift=-0.5)]) is None
    # ... the same peer with less LR than the slow run: the slow run's LR bought it nothing.
    f = behind_peers(slow, [_curve("low-lr", "healthy_qkln", lr_scale=0.01, loss_shift=-0.5)])
    assert f is not None and f.evidence["gap_nats"] == pytest.approx(0.5) and f.onset_step == 150
    assert behind_peers(slow, []) is None


def _curve(name: str, trace: str, lr_scale: float = 1.0, loss_shift: float = 0.0) -> Curve:
    recs = traces.load(trace)
    return Curve(name, np.array([r.step for r in recs]), np.array([r.values["loss"] for r in recs]) + loss_shift,
                 np.array([r.values["lr"] for r in recs]) * lr_scale)


def test_config_refuses_nonsense():
    with pytest.raises(ValueError, match="gap_nats"):
        EnvelopeConfig(gap_nats=0)
    assert jobs.model_key({}) is None and jobs.model_key({"model": {"a": 1, "b": 2}}) == jobs.model_key(
        {"model": {"b": 2, "a": 1}})
