"""The thermometers' cost budget (issue 36, monitors/thermometers/budget.py): measured on real
models on the CPU, the cadences thin where a group is expensive relative to the step, stay at
every step where the budget is generous, never pass their floors, and the cost they report
agrees with an independent side-by-side measurement."""

from __future__ import annotations

import copy
import logging
import math
import os
import statistics
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

from tests.fixtures.nanogpt import NanoConfig, NanoGPT
from thermowatch.monitors.collective import CollectiveReducer
from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from thermowatch.monitors.thermometers.budget import ATTN_MAX_EVERY, DECIDE_EVERY, Budget, ThreadTimer, decide

EXTRAS = ["thermometer_cost", "thermometer_every/act", "thermometer_every/attn", "thermometer_every/grad"]


class Deep(nn.Module):
    """Many tiny blocks and a tiny step: the activation and gradient-norm hooks cost as much as
    the model itself."""

    def __init__(self, n: int = 48, d: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n))
        self.head = nn.Linear(d, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + torch.tanh(b(x))
        return self.head(x)


def _deep(seed: int = 0, **kw) -> Deep:
    torch.manual_seed(seed)
    return Deep(**kw)


def _train(model: nn.Module, th, steps: int, *, give_norm: bool, first: int = 1, lr: float = 1e-2,
           records: bool = False):
    """A plain loop: one (values dict, cadence in force) per step, collected at once (`records`:
    the dict the record carries, th.as_dict, the unread left out)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(1)
    out = []
    for s in range(first, first + steps):
        x = torch.randn(4, 8, generator=g)
        th.begin_step(s)
        cadence = th.cadence
        loss = model(x).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) if give_norm else None
        with th.measure_update():
            opt.step()
        th.end_step(loss=loss, lr=lr, grad_norm=norm)
        opt.zero_grad(set_to_none=True)
        vals = th.collect()
        raw = dict(zip(th.names, vals.tolist()))  # NaN where unread
        out.append((s, th.as_dict(vals) if records else raw, cadence))
    return out


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _check_reads(rows, th) -> None:
    """Every group's figures are numbers exactly on the steps its cadence reads, NaN otherwise;
    the vector carries the cadence in force; loss and lr are there every step."""
    keys = {"act": [k for k in th.names if k.startswith("act_max/")],
            "grad": [k for k in th.names if k.startswith("grad_norm/")],
            "attn": [k for k in th.names if k.startswith(("attn_logit_max/", "attn_logit_lse/"))]}
    for s, v, cadence in rows:
        assert math.isfinite(v["loss"]) and math.isfinite(v["lr"]), s
        for group, ks in keys.items():
            every = cadence[group]
            assert v[f"thermometer_every/{group}"] == every, (s, group)
            read = s % every == 0
            for k in ks:
                assert math.isfinite(v[k]) == read, (s, k, every, v[k])


def _check_floors(th, grad_slowest: int = 16) -> None:
    c = th.cadence
    assert all(_power_of_two(c[g]) for g in ("act", "attn", "grad")), c
    assert c["act"] <= 16 and c["attn"] <= ATTN_MAX_EVERY and c["grad"] <= grad_slowest, c


# --- the decision, as a table --------------------------------------------------------------------


@pytest.mark.parametrize("share, fixed, budget, slowest, want, over", [
    ((0.004, 0.004, 0.001), 0.0, 0.01, (16, 4, 16), [1, 1, 1], False),  # fits: every step
    ((0.02, 0.001, 0.001), 0.0, 0.01, (16, 4, 16), [4, 1, 1], False),  # the dear group alone thins
    ((0.02, 0.02, 0.001), 0.0, 0.01, (16, 4, 16), [8, 4, 1], False),  # largest share first, each time
    ((0.5, 0.2, 0.3), 0.0, 0.01, (16, 4, 16), [16, 4, 16], True),  # the floors win
    ((0.5, 0.0, 0.3), 0.0, 0.01, (16, 4, 1), [16, 1, 1], True),  # grad without the caller's norm: every step
    ((0.001, 0.001, 0.001), 0.02, 0.01, (16, 4, 16), [16, 4, 16], True),  # more than it all: the floors
    ((0.0, 0.0, 0.0), 0.0, 0.01, (16, 4, 16), [1, 1, 1], False),  # nothing measured: nothing thinned
])
def test_decide_doubles_the_dearest_group_until_the_budget_fits(share, fixed, budget, slowest, want, over):
    every, is_over = decide(share, fixed, budget, (1, 1, 1), slowest)
    assert every == want and is_over == over
    assert all(_power_of_two(e) and e <= s for e, s in zip(every, slowest))
    if not over:
        assert fixed + sum(s / e for s, e in zip(share, every)) <= budget


def test_a_cadence_set_by_hand_is_left_alone():
    every, over = decide((0.5, 0.5, 0.5), 0.0, 0.01, (1, 3, 1), (16, 3, 1))
    assert every == [16, 3, 1] and over


def test_budget_is_validated():
    for bad in (0, -0.1, 1.5, True, "0.01", math.nan):
        with pytest.raises(ValueError, match=r"budget must be a fraction of the step in \(0, 1\]"):
            ThermometerConfig(budget=bad)
    with pytest.raises(ValueError, match="budget_max_every must be a power of two.*use 8 or 16"):
        ThermometerConfig(budget_max_every=12)
    assert ThermometerConfig(budget=1).budget == 1


# --- measured on real models ---------------------------------------------------------------------


def test_the_thread_timer_measures_a_region_of_known_work():
    """thread_time_ns is fine enough: a ~2 ms region of pure Python work reads as the wall clock
    around it (within 25%) whenever the thread was not preempted, which on a loaded machine some
    of 20 regions are not (a clock ticking in 4 ms jiffies would read 0 or 4 ms for every one),
    and nested regions count once."""
    timer = ThreadTimer()
    walls = []
    for i in range(20):
        timer.mark((True,) * 5)
        t0 = time.perf_counter_ns()
        timer.start()
        timer.start()  # nested: counts once, in the outer region's group
        x = 0
        for j in range(40_000):
            x += j
        timer.stop(1)
        timer.stop(0)
        walls.append(time.perf_counter_ns() - t0)
    timer.mark((True,) * 5)
    got = [ns for _, _, ns in timer.finished()]
    assert len(got) == 20 and all(ns[1] == 0 for ns in got)
    ratios = [ns[0] / w for ns, w in zip(got, walls)]
    assert max(ratios) == pytest.approx(1.0, abs=0.25) and max(ratios) < 1.05, ratios  # CPU time <= wall time


def test_a_step_is_tagged_after_its_mark_and_its_planning_counts():
    """begin_step marks the step first, so the budget's plan() is inside it (BASE), and tags it
    with the groups it reads once plan() has said."""
    timer = ThreadTimer()
    untagged = (False, False, False, False, True)
    timer.mark(untagged)
    timer.start()
    sum(range(20_000))  # the planning
    timer.tag((True, False, True, False, True))
    timer.stop(4)
    timer.mark(untagged)
    (tag, step_ns, ns), = timer.finished()
    assert tag == (True, False, True, False, True) and 0 < ns[4] <= step_ns


def test_a_region_left_open_ends_with_its_step():
    """A hook that raised between start() and stop() does not skew the timing of the steps after."""
    timer = ThreadTimer()
    timer.mark((True,) * 5)
    timer.start()  # never stopped
    timer.mark((True,) * 5)
    timer.start()
    sum(range(20_000))
    timer.stop(2)
    timer.mark((True,) * 5)
    first, second = (ns for _, _, ns in timer.finished())
    assert sum(first) == 0 and second[2] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_the_cuda_timer_reads_its_events_once_done():
    from thermowatch.monitors.thermometers.budget import CudaTimer

    timer = CudaTimer()
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        timer.mark((True,) * 5)
        x @ x  # the step's own work
        timer.start()
        x @ x
        timer.stop(0)
    timer.mark((True,) * 5)
    torch.cuda.synchronize()  # a test may wait; the thermometers never do
    got = list(timer.finished())
    assert len(got) == 3 and not list(timer.finished())  # each step once
    for _, step_ns, ns in got:
        assert 0 < ns[0] < step_ns and sum(ns[1:]) == 0


def test_a_generous_budget_keeps_every_group_every_step():
    model = _deep()
    th = instrument(model, ThermometerConfig(budget=1.0))
    rows = _train(model, th, 3 * DECIDE_EVERY, give_norm=True)
    assert th.cadence == {"act": 1, "attn": 1, "grad": 1, "update": 10} and not th.over_budget
    _check_reads(rows, th)
    assert th.names[:3] == ["loss", "lr", "grad_norm"] and th.names[-4:] == EXTRAS
    cost = [v["thermometer_cost"] for s, v, _ in rows]
    assert all(math.isnan(c) for c in cost[: DECIDE_EVERY - 1])  # not measured: NaN, never 0
    assert all(0 < c < 1 for c in cost[DECIDE_EVERY:]) and th.cost == cost[-1]


def test_cadences_thin_where_the_hooks_cost_more_than_the_budget(caplog):
    """48 tiny blocks: reading their activations and gradient norms costs a large share of the
    step; at 1% the budget thins both (the caller hands over the global norm), in powers of two,
    and every figure is NaN exactly on the steps its group is not read."""
    model = _deep()
    th = instrument(model, ThermometerConfig(budget=0.01))
    with caplog.at_level(logging.WARNING, logger="thermowatch"):
        rows = _train(model, th, 4 * DECIDE_EVERY, give_norm=True)
    assert th.cadence["act"] > 1 and th.cadence["grad"] > 1, (th.cadence, th._budget.shares)
    _check_floors(th)
    _check_reads(rows, th)
    assert th.cost > 0
    # once thinned, the measured cost is far below what every-step reading cost
    first = rows[DECIDE_EVERY][1]["thermometer_cost"]
    assert th.cost < first, (first, th.cost)


def test_without_the_callers_norm_the_gradient_group_reads_every_step():
    """The global gradient norm comes from the grad group's per-parameter norms when end_step is
    not handed one: the group stays at every step, and so does grad_norm."""
    model = _deep()
    th = instrument(model, ThermometerConfig(budget=0.01))
    rows = _train(model, th, 3 * DECIDE_EVERY, give_norm=False)
    assert th.cadence["grad"] == 1 and th.cadence["act"] > 1
    assert all(math.isfinite(v["grad_norm"]) for _, v, _ in rows)
    _check_reads(rows, th)


def test_floors_win_over_a_budget_they_exceed_and_say_so_once(caplog):
    """An attention read exactly over the whole batch, entropy every step, on a tiny model: even
    at the floors (attention every 4th step) the thermometers cost more than 0.01% of the step."""
    torch.manual_seed(0)
    model = NanoGPT(NanoConfig(n_layer=2, n_embd=32, block_size=32))
    cfg = ThermometerConfig(budget=1e-4, attn_mode="exact", attn_entropy_every=1, attn_entropy_batch=None)
    th = instrument(model, cfg)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))
    rows = []
    with caplog.at_level(logging.WARNING, logger="thermowatch"):
        for s in range(1, 4 * DECIDE_EVERY + 1):
            th.begin_step(s)
            cadence = th.cadence
            _, loss = model(data[:, :-1], data[:, 1:])
            loss.backward()
            with th.measure_update():
                opt.step()
            th.end_step(loss=loss, lr=1e-3)
            opt.zero_grad(set_to_none=True)
            rows.append((s, dict(zip(th.names, th.collect().tolist())), cadence))  # raw
    assert th.over_budget
    assert th.cadence == {"act": 16, "attn": ATTN_MAX_EVERY, "grad": 1, "update": 10}
    _check_reads(rows, th)
    warned = [r for r in caplog.records if "floors exceed their budget" in r.getMessage()]
    assert len(warned) == 1 and "attn every 4" in warned[0].getMessage()
    assert th.cost > 1e-4  # what it measured is what it says


@pytest.mark.parametrize("windows, warned", [
    (["warm", "within", "within", "within"], 0),  # the warm-up window alone: no warning
    (["warm", "over", "within"], 1),  # over in two windows running: warned, once
    (["over", "within", "over", "within", "over"], 0),  # never two running
    (["over", "over", "over", "over"], 1),
])
def test_the_floors_warning_needs_two_windows_running_over_budget(caplog, windows, warned):
    """The first window holds the run's warm-up (an H200's first 32 steps: 3.3% at the floors,
    then 0.9% for good). The budget's shares per read and fixed share, as every rank agreed them
    (the agree seam all_ranks_max fills in a process group), per window."""
    shares = {"warm": [0.04, 0.12, 0.005, 0.001], "over": [0.04, 0.12, 0.005, 0.001],
              "within": [0.01, 0.02, 0.001, 0.001]}
    script = iter(np.array(shares[w]) for w in windows)
    b = Budget(0.01, (1, 1, 1), (16, ATTN_MAX_EVERY, 16), ThreadTimer(), torch.device("cpu"),
               agree=lambda mine, device: next(script))
    b.grad_norm_given = True
    seen = []
    with caplog.at_level(logging.WARNING, logger="thermowatch"):
        for w in windows:
            b.plan(DECIDE_EVERY * (len(seen) + 1))
            seen.append(b.over_budget)
    assert seen == [w != "within" for w in windows]  # the flag is each window's own
    said = [r for r in caplog.records if "floors exceed their budget" in r.getMessage()]
    assert len(said) == warned


def test_no_budget_is_the_fixed_cadences_unmeasured():
    """budget=None: NaN where a group was not read, bit for bit the same figures as a budgeted
    twin reading every step where it was, the fixed cadences in the vector (so as_dict leaves the
    unread out), and no timer runs."""
    a, b = _deep(), _deep()
    fixed = instrument(a, ThermometerConfig(budget=None, act_every=2, attn_every=3, grad_every=4))
    twin = instrument(b, ThermometerConfig(budget=1.0))
    assert fixed.names == [n for n in twin.names if n != "thermometer_cost"]
    rows_f = _train(a, fixed, 2 * DECIDE_EVERY, give_norm=True)
    rows_t = _train(b, twin, 2 * DECIDE_EVERY, give_norm=True)
    assert fixed.cadence == {"act": 2, "attn": 3, "grad": 4, "update": 10} and math.isnan(fixed.cost)
    assert not fixed.over_budget and type(fixed._timer).__name__ == "NullTimer"
    for (s, vf, _), (_, vt, _) in zip(rows_f, rows_t):
        for k, x in vf.items():
            if k.startswith("thermometer_every/"):
                assert x == fixed.cadence[k.split("/")[1]], (s, k, x)
                continue
            every = (2 if k.startswith(("act_", "z/")) else 4 if k.startswith("grad_norm/")
                     else 10 if k.startswith("update_ratio") else 1)
            first = s == 1 and k.startswith("grad_norm/")  # read until the loop is seen handing its norm over
            if s % every and not first:
                assert math.isnan(x), (s, k)
            else:
                assert x == vt[k] or (math.isnan(x) and math.isnan(vt[k])), (s, k, x, vt[k])
    assert instrument(_deep(), ThermometerConfig(budget=None)).names == twin.names[: -len(EXTRAS)]  # all at 1: none


def test_a_loop_that_stops_handing_its_norm_over_still_has_the_global_norm_every_step():
    """Under a budget the per-layer norms thin (here to every 16th step) while the loop hands
    end_step its own global norm; when it stops, the thermometers read the norm again from the
    step after, not at the budget's next decision (up to 32 steps on): a step without it sends
    a NaN grad_norm, a critical non-finite finding. The one step on which the loop first does
    not hand it over is unread (begin_step cannot know it yet): its record leaves grad_norm out,
    rather than sending the NaN."""
    model = _deep()
    th = instrument(model, ThermometerConfig(budget=1e-6))
    handed = _train(model, th, 2 * DECIDE_EVERY, give_norm=True)
    assert handed[-1][2]["grad"] == 16  # thinned: the loop's own norm stands in
    first = 2 * DECIDE_EVERY + 1
    after = _train(model, th, 8, give_norm=False, first=first, records=True)
    assert [s for s, v, _ in after if "grad_norm" not in v] == [first]
    assert all(math.isfinite(v["grad_norm"]) for s, v, _ in after if s > first)
    assert all(math.isfinite(v["grad_norm/blocks.0"]) for s, v, _ in after if s > first)  # read with it
    assert all(math.isfinite(x) for _, v, _ in after for k, x in v.items() if k.startswith(("loss", "grad_norm")))


@pytest.mark.parametrize("give_norm", [False, True], ids=["loop's own norm", "norm handed over"])
def test_fixed_cadences_send_no_unread_nan_and_the_detectors_find_nothing(give_norm):
    """A healthy loop with fixed cadences above 1 and no budget: the record (as_dict) leaves out
    what a step did not read, never a NaN a non-finite detector would page on; the global gradient
    norm is there every step (read by the thermometers until the loop hands its own over, then
    the per-layer norms thin to their cadence). The detectors' default bank, fed those records,
    finds nothing. Before, each unread act_max and grad_norm went out as NaN: a CRITICAL
    non_finite finding at step 1 of every such run."""
    from thermowatch.monitors.contract import StepRecord
    from thermowatch.monitors.detectors import BankConfig, DetectorBank

    model = _deep()
    th = instrument(model, ThermometerConfig(budget=None, act_every=2, attn_every=3, grad_every=4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    bank = DetectorBank(BankConfig())
    findings, layers = [], {}
    for s in range(1, 41):
        th.begin_step(s)
        loss = model(torch.randn(4, 8, generator=g)).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9) if give_norm else None
        opt.step()
        th.end_step(loss=loss, lr=1e-2, grad_norm=norm)
        opt.zero_grad(set_to_none=True)
        d = th.as_dict(th.collect())
        assert math.isfinite(d["loss"]) and math.isfinite(d["grad_norm"]), (s, d.get("grad_norm"))
        bad = sorted(k for k, v in d.items() if not math.isfinite(v) and not k.startswith(("update_ratio", "attn_entropy")))
        assert bad == [], (s, bad)
        assert any(k.startswith("act_max/") for k in d) == (s % 2 == 0), s
        layers[s] = any(k.startswith("grad_norm/") for k in d)
        findings += bank.observe(StepRecord(step=s, sample_lo=4 * (s - 1), sample_hi=4 * s, tokens=32,
                                            wall_time=float(s), values=d))
    assert findings == []
    # the per-layer norms: every step while the loop's own norm is not handed over, else every 4th
    assert layers == ({s: True for s in layers} if not give_norm else {s: s % 4 == 0 or s == 1 for s in layers})


def test_the_figures_cross_a_finish_in_their_device_slots():
    """Under a finish (the cross-rank reduction, here one rank) the budget's figures ride in their
    device slots, written when they change: the reduced vector carries what collect() would."""
    a, b = _deep(), _deep()
    ta = instrument(a, ThermometerConfig(budget=1.0))
    tb = instrument(b, ThermometerConfig(budget=1.0))
    tb.finish = CollectiveReducer(tb.names, len(tb.names), tb.device, rank=0, world=1)
    ra = _train(a, ta, DECIDE_EVERY + 4, give_norm=True)
    rb = _train(b, tb, DECIDE_EVERY + 4, give_norm=True)
    for (s, va, _), (_, vb, _) in zip(ra, rb):
        assert math.isnan(va["thermometer_cost"]) == math.isnan(vb["thermometer_cost"]), s
        for k in EXTRAS[1:]:
            assert va[k] == vb[k] == 1
    assert vb["thermometer_cost"] == pytest.approx(tb.cost, rel=1e-6)  # a float32 slot


def _independent(model_fn, cfg: ThermometerConfig, rounds: int, block: int = DECIDE_EVERY):
    """Plain and instrumented copies of one model trained side by side in blocks whose order
    alternates; returns (the instrumented loop's extra thread CPU time per step / its step, the
    cost it reported after each of its blocks)."""
    torch.manual_seed(0)
    base = model_fn()
    models = {"plain": base, "inst": copy.deepcopy(base)}
    th = instrument(models["inst"], cfg)
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    data = torch.randint(0, 256, (64, 33), generator=torch.Generator().manual_seed(0))
    count = dict.fromkeys(models, 0)

    def run(name: str) -> float:
        m, opt = models[name], opts[name]
        t0 = time.thread_time_ns()
        for _ in range(block):
            count[name] += 1
            s = count[name]
            rows = torch.arange(s * 8, (s + 1) * 8) % 64
            if name == "inst":
                th.begin_step(s)
            _, loss = m(data[rows, :-1], data[rows, 1:])
            loss.backward()
            if name == "inst":
                with th.measure_update():
                    opt.step()
                th.end_step(loss=loss, lr=1e-3)
                th.collect()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
        return (time.thread_time_ns() - t0) / block

    run("plain"), run("inst")
    pairs, reported = [], []
    for r in range(rounds):
        order = ("plain", "inst") if r % 2 == 0 else ("inst", "plain")
        t = {k: run(k) for k in order}
        pairs.append((t["inst"] - t["plain"]) / t["inst"])
        reported.append(th.cost)
    return statistics.median(pairs), statistics.median(reported)


def test_the_cost_reported_agrees_with_a_side_by_side_measurement():
    """The thermometers made dear on purpose (an exact attention read over the whole batch with its
    entropy, every step), so the figure stands above a shared machine's noise: the cost they
    report for themselves and the extra time of the instrumented loop over a plain twin agree
    loosely: the hooks' own calls, paid on every step, are not in the report (2L d64 T32 on a
    loaded 2-core CPU: 0.28 of the step measured, 0.20 reported)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the thread's CPU time is then all of the step's
    try:
        cfg = ThermometerConfig(budget=1.0, attn_mode="exact", attn_entropy_every=1, attn_entropy_batch=None)
        measured, reported = _independent(lambda: NanoGPT(NanoConfig(n_layer=2, n_embd=64, block_size=32)), cfg, 8)
    finally:
        torch.set_num_threads(threads)
    assert 0.05 < measured < 0.8, measured  # the setting is dear, as intended
    assert 0.5 * measured < reported < 1.5 * measured, (reported, measured)


# --- ranks agree ---------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = _deep()
    # rank 1 reads no activations: alone it would keep its cheap groups at every step
    cfg = ThermometerConfig(budget=0.01) if rank == 0 else ThermometerConfig(budget=0.01, act_patterns=())
    th = instrument(model, cfg)
    rows = _train(model, th, 3 * DECIDE_EVERY, give_norm=True)
    np.save(os.path.join(out_dir, f"rank{rank}.npy"),
            np.array([[c["act"], c["attn"], c["grad"]] for _, _, c in rows]))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_ranks_decide_the_same_cadences_from_the_dearest_rank(tmp_path):
    import torch.multiprocessing as mp

    from thermowatch.trainer.worker import _free_port

    mp.spawn(_rank_main, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (np.load(tmp_path / f"rank{r}.npy") for r in range(2))
    assert np.array_equal(r0, r1)  # every step, every group: the same cadence on both ranks
    assert r0[-1, 0] > 1  # rank 0's activations thinned, and rank 1 follows
