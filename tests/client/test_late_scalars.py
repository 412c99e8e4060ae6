"""thermowatch.watch without thermometers: each step's loss, gradient norm and LR reach the record
of that step, read without making the host wait for the device (recorder.LateScalars)."""

from __future__ import annotations

import math

import pytest
import torch

from thermowatch.ranks import Ranks
from thermowatch.recorder import Recorder


def _recorder(sent: list) -> Recorder:
    return Recorder(torch.nn.Linear(2, 2), False, Ranks(), sent.append, lambda: "d")


def _tensors(losses: list, norms: list, device: str) -> list:
    return [(torch.tensor(loss, device=device), None if gn is None else torch.tensor(gn, device=device))
            for loss, gn in zip(losses, norms)]


def _steps(rec: Recorder, tensors: list) -> None:
    for step, (loss, gn) in enumerate(tensors, start=1):
        rec.begin(step, 10 * step, 10 * step + 10, 1.0, 0.1, 0.01 * step, probe=False)
        rec.end(step, loss, gn, {"tokens": float(step)})


def _check(sent: list, losses: list, norms: list) -> None:
    assert [r.step for r in sent] == list(range(1, len(losses) + 1))
    for r, loss, gn in zip(sent, losses, norms):
        s = r.step
        assert (r.sample_lo, r.sample_hi) == (10 * s, 10 * s + 10)
        assert r.values["loss"] == pytest.approx(loss, nan_ok=True) and r.values["lr"] == pytest.approx(0.01 * s)
        assert r.values["tokens"] == s  # the step's own extra scalars, not a neighbour's
        assert ("grad_norm" in r.values) == (gn is not None)
        if gn is not None:
            assert r.values["grad_norm"] == pytest.approx(gn)


def test_a_cpu_loss_is_sent_with_its_own_step_at_once():
    sent: list = []
    rec = _recorder(sent)
    losses, norms = [2.5, 2.25, math.nan, 2.0], [1.5, None, 3.0, 0.5]
    _steps(rec, _tensors(losses, norms, "cpu"))
    _check(sent, losses, norms)  # nothing waits on a CPU: every step is out before drain
    assert math.isnan(sent[2].values["loss"]) and not rec.healthy and rec.final_loss == 2.0


def test_a_rollback_drops_what_is_pending_and_a_float_loss_is_taken_as_it_is():
    sent: list = []
    rec = _recorder(sent)
    rec.begin(1, 0, 10, 1.0, 0.1, 0.01, probe=False)
    rec.end(1, 3.5, 2.0, {})
    assert sent[0].values["loss"] == 3.5 and sent[0].values["grad_norm"] == 2.0
    rec.begin(2, 10, 20, 1.0, 0.1, 0.02, probe=False)
    rec._late._pending.append((2, (9.0, None), None, {}))  # as a CUDA step still copying would be
    rec.rewind(1)
    rec.drain(True)
    assert [r.step for r in sent] == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the deferred copy is CUDA's")
def test_a_cuda_loss_is_read_without_a_sync_and_sent_with_its_own_step():
    sent: list = []
    rec = _recorder(sent)
    losses, norms = [2.5, 2.25, math.inf, 2.0, 1.75], [1.5, None, 3.0, 0.5, 0.25]
    tensors = _tensors(losses, norms, "cuda")
    torch.cuda.set_sync_debug_mode("error")  # any host wait for the device raises
    try:
        _steps(rec, tensors)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    rec.drain(True)
    _check(sent, losses, norms)
    assert not rec.healthy and rec.final_loss == 1.75


def test_with_thermometers_a_step_whose_global_norm_was_not_read_leaves_it_out():
    """A loop that hands record() its norm lets the per-layer norms thin (fixed grad_every 4
    here); the first step on which it stops handing it over has no global norm read at all: the
    record leaves grad_norm out, never NaN (a critical non-finite finding on a healthy run); from
    the next step the thermometers read it themselves, and every other step has it."""
    from thermowatch.monitors.thermometers import ThermometerConfig

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    sent: list = []
    rec = Recorder(model, ThermometerConfig(budget=None, grad_every=4), Ranks(), sent.append, lambda: "d")
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt.register_step_post_hook(lambda *_: rec.grads_from_params())  # as watch reads .grad
    g = torch.Generator().manual_seed(0)
    for step in range(1, 13):
        rec.begin(step, step, step + 1, 1.0, 0.1, 1e-2, probe=False)
        loss = model(torch.randn(8, 4, generator=g)).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) if step <= 6 else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        rec.end(step, loss, norm, {})
    rec.drain(True)
    assert [r.step for r in sent] == list(range(1, 13))
    assert [r.step for r in sent if "grad_norm" not in r.values] == [7]
    assert all(math.isfinite(v) for r in sent for k, v in r.values.items() if k.startswith("grad_norm"))
