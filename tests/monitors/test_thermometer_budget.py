"""The thermometers' cost budget (issue 36, monitors/thermometers/budget.py): the decision, as a
table, and the CPU timer on a region of known work."""

from __future__ import annotations

import statistics
import time

import pytest

from thermowatch.monitors.thermometers.budget import ThreadTimer, decide


def _power_of_two(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


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


def test_the_thread_timer_measures_a_region_of_known_work():
    """thread_time_ns is fine enough: a ~2 ms region reads within 25% of the wall clock around it
    (one thread of pure Python work), and nested regions count once."""
    timer = ThreadTimer()
    walls = []
    for i in range(5):
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
    assert len(got) == 5 and all(ns[1] == 0 for ns in got)
    assert statistics.median(ns[0] / w for ns, w in zip(got, walls)) == pytest.approx(1.0, abs=0.25)
