"""A thermometer budget under thermowatch.watch, end to end (issue 36): a budget tight enough to
thin every group it may must not make the supervisor see NaN where nothing was read (before,
non_finite read a thinned act_max's NaN as broken and a healthy run was rolled back), and the run
carries what its thermometers cost and the cadence in force."""

from __future__ import annotations

import math

import pytest
import torch

import thermowatch
from tests.client.user_loop import DATA, calm, train_step, user_batch
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import thermometers as thermo_store

STEPS = 70  # two budget decisions (every 32 steps)


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_thinned_group_is_not_read_as_non_finite_and_the_cost_is_a_figure_of_the_run(db, tmp_path):
    budget = thermowatch.ThermometerConfig(budget=1e-6)  # every group down to its floor
    tw, model, opt = calm(db, tmp_path, "budget", STEPS, checkpoint_every=1000, thermometers=budget)
    for step in tw.steps():
        tw.record(train_step(model, opt, *user_batch(DATA, torch.as_tensor(tw.batch_ids(step)))))
    tw.close()
    assert tw.th.cadence["act"] > 1 and tw.th.cadence["attn"] == 4, tw.th.cadence
    sup = tw.run.supervisor
    with sup.sessions() as s:
        acted = actions_store.actions(s, "budget")
        found = findings_store.findings(s, "budget")
        keys = thermo_store.series_keys(s, "budget")
        act = next(k for k in keys if k.startswith("act_max/"))
        steps, values = thermo_store.history(s, "budget", act)[:2]
    assert not acted, [(a.kind, a.reason) for a in acted]
    assert not found, [(f.finding.signal, f.finding.metric, f.finding.detect_step, f.finding.evidence) for f in found]
    assert "thermometer_cost" in keys and "thermometer_every/act" in keys
    # the act group was read on some steps only, and what was stored is what was read
    assert 0 < len(steps) < STEPS and all(math.isfinite(v) for v in values)
    assert math.isfinite(tw.th.cost) and 0 <= tw.th.cost < 1


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_the_loops_own_clipped_norm_is_the_recorded_one_and_frees_the_gradient_group(db, tmp_path):
    """record(loss, grad_norm=gn): the norm clip_grad_norm_ returned is stored as the run's grad_norm
    on every step (not reduced again), and under a budget the per-layer norms may thin past every
    step, which they may not while the thermometers must reduce the global norm themselves."""
    tw, model, opt = calm(db, tmp_path, "clip", STEPS, checkpoint_every=1000,
                          thermometers=thermowatch.ThermometerConfig(budget=1e-6))
    clipped: dict[int, float] = {}
    for step in tw.steps():
        x, y = user_batch(DATA, torch.as_tensor(tw.batch_ids(step)))
        _, loss = model(x, y)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        clipped[step] = float(gn)
        opt.step()
        opt.zero_grad(set_to_none=True)
        tw.record(loss, grad_norm=gn)
    tw.close()
    assert tw.th.cadence["grad"] > 1, tw.th.cadence  # the global norm came from the loop
    with tw.run.supervisor.sessions() as s:
        steps, values = thermo_store.history(s, "clip", "grad_norm")[:2]
    assert list(steps) == sorted(clipped) and len(steps) == STEPS
    assert values == pytest.approx([clipped[s] for s in steps], rel=1e-6)


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_fixed_cadences_and_a_loop_that_stops_handing_its_norm_over_act_on_nothing(db, tmp_path):
    """budget=None with fixed cadences above 1, through watch and the supervisor: a healthy run
    whose loop hands its clipped norm over for 20 steps and then stops. Before session 27 every
    unread figure went out as NaN (a critical non_finite finding at step 1, then a pause); before
    session 28 the first step without the loop's norm still sent a NaN grad_norm. Now: no finding,
    no action, grad_norm stored for every step but that one (no global norm was read there), the
    activations every 4th step only."""
    fixed = thermowatch.ThermometerConfig(budget=None, act_every=4, attn_every=2, grad_every=4)
    steps = 40
    tw, model, opt = calm(db, tmp_path, "fixed", steps, checkpoint_every=1000, thermometers=fixed)
    for step in tw.steps():
        x, y = user_batch(DATA, torch.as_tensor(tw.batch_ids(step)))
        _, loss = model(x, y)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) if step <= 20 else None
        opt.step()
        opt.zero_grad(set_to_none=True)
        tw.record(loss, grad_norm=gn)
    tw.close()
    with tw.run.supervisor.sessions() as s:
        acted = actions_store.actions(s, "fixed")
        found = findings_store.findings(s, "fixed")
        keys = thermo_store.series_keys(s, "fixed")
        norm_steps, norms = thermo_store.history(s, "fixed", "grad_norm")[:2]
        act = next(k for k in keys if k.startswith("act_max/"))
        act_steps, acts = thermo_store.history(s, "fixed", act)[:2]
    assert not acted, [(a.kind, a.reason) for a in acted]
    assert not found, [(f.finding.signal, f.finding.metric, f.finding.detect_step) for f in found]
    assert list(norm_steps) == [s for s in range(1, steps + 1) if s != 21]
    assert all(math.isfinite(v) for v in norms)
    assert list(act_steps) == list(range(4, steps + 1, 4)) and all(math.isfinite(v) for v in acts)
