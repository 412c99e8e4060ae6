"""Precise skip's search (thermowatch/precise_skip.py), alone: adaptive group testing against an
oracle that spikes exactly when a probe trains an offender, at the first one it trains."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thermowatch.monitors.contract import SampleRange
from thermowatch.precise_skip import PreciseSkip, Search, SpikeBar, ids_of, ranges_of


def run(suspects: np.ndarray, bad: set[int], min_samples: int, max_probes: int | None = None) -> Search:
    search = Search(suspects, min_samples)
    while (probe := search.next()) is not None:
        if max_probes is not None and search.probes >= max_probes:
            search.give_up()
            break
        hits = np.flatnonzero(np.isin(probe, list(bad)))
        spiked = len(hits) > 0
        search.report(spiked, probe[: hits[0] + 1] if spiked else probe[:0])
    return search


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), lo=st.integers(0, 10**6), min_samples=st.integers(1, 64),
       bad=st.lists(st.tuples(st.floats(0, 1), st.integers(1, 40)), max_size=3), budget=st.none() | st.integers(0, 12))
def test_every_offender_is_found_and_little_else(n, lo, min_samples, bad, budget):
    suspects = np.arange(lo, lo + n, dtype=np.int64)
    culprits = {lo + int(f * (n - 1)) + k for f, width in bad for k in range(width) if int(f * (n - 1)) + k < n}
    search = run(suspects, culprits, min_samples, budget)
    found = search.offenders()
    assert culprits <= set(found.tolist())  # never resumes onto an offender, whatever the budget
    # past the budget, a block of the samples after the suspects not yet cleared is skipped too
    assert set(found.tolist()) <= set(search.universe.tolist())
    if search.outcome == "budget":
        return
    assert set(found.tolist()) <= set(suspects.tolist())  # the blocks past them ran clean
    if culprits:
        # each found group is a known group of <= min_samples holding an offender
        assert len(found) <= len(culprits) * min_samples
        assert search.inseparable == 0
        assert search.outcome == ("narrowed" if len(found) < n else "inseparable")
    else:  # no half spikes alone: not the data; everything stays skipped, said so
        assert search.outcome == "inseparable" and len(found) == n and search.probes == (2 if n > min_samples else 0)


def test_probes_halve_and_count():
    search = run(np.arange(0, 1024), {700}, 16)
    found = search.offenders().tolist()
    assert 700 in found and len(found) <= 16 and found == list(range(found[0], found[0] + len(found)))
    assert search.outcome == "narrowed"
    assert search.probes <= 2 * 7  # two probes a halving, 1024 -> 16
    with pytest.raises(RuntimeError, match="without a probe"):
        search.report(True, np.arange(3))


def test_ranges_and_ids_round_trip():
    ranges = (SampleRange(5, 9), SampleRange(12, 13), SampleRange(100, 140))
    assert ranges_of(ids_of(ranges)) == ranges
    assert ranges_of(np.array([3, 1, 2, 2, 7])) == (SampleRange(1, 4), SampleRange(7, 8))
    assert ranges_of(np.zeros(0, np.int64)) == () and len(ids_of([])) == 0


def test_the_spike_bar_follows_a_falling_loss_and_catches_a_jump():
    falling = list(np.linspace(5.0, 3.0, 16))  # early training: a steep fall, little noise around it
    bar = SpikeBar(falling, PreciseSkip())
    assert not any(bar.spiked(v) for v in np.linspace(2.95, 2.7, 10))  # the fall goes on: no spike
    assert bar.spiked(3.6)  # 30 % over the newest level
    assert bar.spiked(float("nan")) and bar.spiked(float("inf"))


def test_the_config_says_what_is_wrong():
    for bad, word in (({"max_steps": 0}, "max_steps"), ({"min_samples": 0}, "min_samples"),
                      ({"max_seconds": 0}, "max_seconds"), ({"settle": -1}, "settle"), ({"window": 2}, "window")):
        with pytest.raises(ValueError, match=word):
            PreciseSkip(**bad)


# --- the bad stretch, whole (issue 35) -----------------------------------------------------------
# A simulator of the loop's probes, batch by batch: a probe trains from the checkpoint with the
# rest of the search's samples skipped (the base data before and after them is not), `B` ids a
# step, through the step that holds its last id; a step spikes when its batch holds a bad id (bad
# data shows in its own batch's loss). The ids after the search's samples fill a probe's last
# step as they would in the loop: unknown data, poisoned where the stretch runs past them.

def probe_by_steps(search: Search, probe: np.ndarray, bad: set[int], start: int, B: int, base: set[int]):
    skipped = (set(search.universe.tolist()) - set(probe.tolist())) | base
    last_id, cur, trained = int(probe[-1]), start, []
    while True:
        batch = []
        while len(batch) < B:
            if cur not in skipped:
                batch.append(cur)
            cur += 1
        trained.append(np.array(batch, np.int64))
        if any(i in bad for i in batch):
            seen = np.intersect1d(probe, np.concatenate(trained))
            return True, seen, np.intersect1d(probe, trained[-1])
        if batch[-1] >= last_id:
            return False, probe[:0], None


def search_by_steps(search: Search, bad: set[int], start: int, B: int, base: set[int] = frozenset(),
                    max_probes: int = 400) -> Search:
    while (probe := search.next()) is not None:
        assert search.probes < max_probes, "the search does not end"
        search.report(*probe_by_steps(search, probe, bad, start, B, base))
    return search


def test_a_stretch_running_past_the_suspects_is_found_whole():
    """The issue's run: the rollback skips steps 51-152 and the abandoned path trained through 154
    (suspects [800, 2464)); the poisoned stretch is [2400, 2640), 176 of its ids past the suspects.
    The search follows it past their end, in growing blocks, until a block runs clean."""
    B = 16
    bad = set(range(2400, 2640))
    search = Search(np.arange(800, 2464), B, align=B)
    found = set(search_by_steps(search, bad, 800, B).offenders().tolist())
    assert bad <= found, f"{len(bad - found)} poisoned ids released: {ranges_of(np.array(sorted(bad - found)))}"
    assert found == bad, f"clean ids skipped: {ranges_of(np.array(sorted(found - bad)))}"
    assert search.outcome == "narrowed"
    assert set(search.universe.tolist()) >= bad | set(range(800, 2464))  # what it searched, reported


def test_a_halving_never_cuts_a_step_so_clean_ids_are_not_blamed_for_what_follows():
    """A recurrence's suspects (a hole where an earlier skip was: [800, 2400) and [2464, 2544),
    1,680 ids, 105 steps): halving at 840 ids put half a step of clean ids beside the unknown
    data after the suspects in a probe's last batch, and the poison there was blamed on them."""
    B = 16
    bad = set(range(2464, 2640))
    suspects = np.concatenate([np.arange(800, 2400), np.arange(2464, 2544)])
    search = Search(suspects, B, align=B)
    # the base ledger skips [2400, 2464) already
    found = set(search_by_steps(search, bad, 800, B, base=set(range(2400, 2464))).offenders().tolist())
    assert found - bad == set(), f"clean ids skipped: {ranges_of(np.array(sorted(found - bad)))}"
    assert found == bad


# --- replay triage (issue 39): the two replays before the search label the cause -----------------

@pytest.mark.parametrize("same, without, cause, outcome", [
    (False, None, "hardware", "cleared"),  # the same samples ran clean: not reproduced
    (True, True, "optimizer", "cleared"),  # diverged without the suspects too
    (True, False, "data", "narrowed"),  # with them, not without: bisect
])
def test_triage_labels_the_cause_from_the_two_replays(same, without, cause, outcome):
    suspects = np.arange(0, 256)
    bad = 100
    search = Search(suspects, 16, align=16, triage=True)
    assert search.replaying and search.next() is suspects  # the same samples: nothing skipped
    seen = suspects[: 113] if same else suspects[:0]
    search.report(same, seen, suspects[96:113] if same else None)
    if without is not None:
        assert search.replaying and len(search.next()) == 0  # every suspect skipped
        search.report(without, suspects[:0])
    assert search.cause == cause and not search.replaying and search.replays == [same] + ([without] if without is not None else [])
    while (probe := search.next()) is not None:  # the bisection, data only
        hit = bad in probe.tolist()
        search.report(hit, probe[: probe.tolist().index(bad) + 1] if hit else probe[:0])
    found = search.offenders().tolist()
    assert search.outcome == outcome
    assert (found == []) if cause != "data" else (bad in found and len(found) <= 16)


def test_triage_cut_short_by_the_budget_skips_every_suspect_and_names_no_cause():
    search = Search(np.arange(0, 64), 16, triage=True)
    search.next()
    search.give_up()
    assert search.cause is None and search.outcome == "budget" and len(search.offenders()) == 64


def test_the_abandoned_paths_first_spike_is_what_the_replays_run_through():
    from thermowatch.precise_skip import first_spike

    healthy = list(np.linspace(4.0, 3.0, 16))
    path = [(51 + i, 2.95 - 0.01 * i) for i in range(10)] + [(61, 6.0), (62, float("nan"))]
    step, loss, level = first_spike(healthy, path, PreciseSkip())
    assert (step, loss) == (61, 6.0) and level == pytest.approx(2.875, abs=0.02)
    assert first_spike(healthy, path[:10], PreciseSkip()) is None  # a calm loss: no triage
