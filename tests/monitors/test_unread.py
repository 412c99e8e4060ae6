"""A budget's unread figures leave absent, never as NaN (issue 36): a NaN act_max is a non-finite
finding, so a step that did not read the act group must not send its NaN slots; a NaN in a group
read that step is real and goes."""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn as nn

from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from thermowatch.monitors.thermometers.unread import Unread


def test_only_the_figures_of_groups_read_this_step_are_kept():
    names = ["loss", "lr", "grad_norm", "act_max/b0", "act_min/b0", "attn_logit_max/b0.attn", "grad_norm/b0",
             "update_ratio", "thermometer_cost", "thermometer_every/act", "thermometer_every/attn",
             "thermometer_every/grad"]
    u = Unread(names)
    nan = math.nan
    v = np.array([2.0, 1e-3, 0.5, nan, nan, 9.0, nan, nan, 0.004, 16, 4, 8], dtype=np.float64)
    keep = {n: bool(k) for n, k in zip(names, u.keep(v, step=4))}
    assert not keep["act_max/b0"] and not keep["grad_norm/b0"]  # act every 16th, grad every 8th: not read at 4
    assert keep["attn_logit_max/b0.attn"] and keep["loss"] and keep["grad_norm"] and keep["update_ratio"]
    keep16 = {n: bool(k) for n, k in zip(names, u.keep(v, step=16))}
    assert keep16["act_max/b0"] and keep16["grad_norm/b0"]  # read at step 16: their NaN is real and goes
    assert not Unread(["loss", "act_max/b0"]).active  # no budget: nothing to drop


def test_a_budgeted_model_sends_no_nan_for_what_it_did_not_read():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(3)])
    names_re = ThermometerConfig(act_patterns=(r"^\d+$",), grad_patterns=(r"^\d+$",), budget=1e-6,
                                 attn_find=False)
    th = instrument(model, names_re)
    u = Unread(th.names)
    assert u.active
    sent_nan = 0
    for step in range(1, 80):
        th.begin_step(step)
        loss = model(torch.randn(4, 16)).square().mean()
        loss.backward()
        th.end_step(loss=loss, lr=1e-3)
        vals = th.collect()
        keep = u.keep(vals, step)
        sent = {n: x for n, x, k in zip(th.names, vals.tolist(), keep.tolist()) if k}
        sent_nan += sum(1 for n, x in sent.items() if n.startswith(("act_", "grad_norm/")) and not math.isfinite(x))
    assert sent_nan == 0
    assert th.cadence["act"] > 1  # the tiny budget thinned it, so there was something to drop


def test_as_dict_of_a_collected_step_leaves_out_what_the_budget_did_not_read():
    """docs/any-trainer.md's own-checkpointing loop sends `th.as_dict(th.collect())`: under the
    default budget a thinned group's NaN would read as a non-finite finding on the daemon. as_dict
    leaves out what was not read, keeps what was (NaN included), and a budget-less vector whole."""
    import torch
    import torch.nn as nn

    from thermowatch.monitors.thermometers import ThermometerConfig, instrument

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    th = instrument(model, ThermometerConfig(budget=1e-6, act_patterns=(r".*",)))
    sent = []
    for step in range(1, 80):
        th.begin_step(step)
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        th.end_step(loss=loss, lr=1e-2)
        sent.append(th.as_dict(th.collect()))
    assert th.cadence["act"] > 1
    acts = [d for d in sent if any(k.startswith("act_max/") for k in d)]
    assert 0 < len(acts) < len(sent)  # read on some steps only, absent on the others
    assert all(math.isfinite(v) for d in sent for k, v in d.items() if k.startswith(("act_max/", "act_min/")))
    assert all("loss" in d for d in sent)
    raw = th.collect  # nothing pending: the last step was collected
    assert raw(block=True) is None
