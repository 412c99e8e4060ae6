"""The skip ledger with a period (issue 35): a loop that passes over its data more than once
indexes it `data[ids % len(data)]`, so a skipped id stands for a data index skipped in every pass.
Checked against the definition, id by id, on random ledgers: what `take` hands out, `contains`,
`next_unskipped` and `skipped_between` all agree with "id % period lies in a folded range"."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thermowatch.monitors.ledger import SkipLedger


def _brute(ranges, period, upto):
    bad = np.zeros(period, dtype=bool)
    for lo, hi in ranges:
        for i in range(lo, hi):
            bad[i % period] = True
    return bad[np.arange(upto) % period]


ranges_st = st.lists(st.tuples(st.integers(0, 300), st.integers(0, 40)).map(lambda t: (t[0], t[0] + t[1])),
                     max_size=6)


@settings(max_examples=150, deadline=None)
@given(ranges=ranges_st, period=st.integers(1, 90), cursor=st.integers(0, 400), n=st.integers(0, 60))
def test_a_periodic_ledger_is_its_definition(ranges, period, cursor, n):
    try:
        led = SkipLedger(ranges, period=period)
    except ValueError:  # nothing left to train on: the definition agrees
        assert _brute(ranges, period, period).all()
        return
    upto = cursor + (n + 2) * period + 400  # past the n-th free id however much of a pass is skipped
    skipped = _brute(ranges, period, upto)
    assert np.array_equal(led.contains(np.arange(upto)), skipped)
    took = led.take(cursor, n)
    free = np.flatnonzero(~skipped[cursor:]) + cursor
    assert took.tolist() == free[:n].tolist()
    assert led.next_unskipped(cursor) == int(free[0])
    assert led.skipped_between(cursor, upto) == int(skipped[cursor:].sum())
    # the ranges it was given (the supervisor's, the digest's) are kept as given, merged
    assert led.ranges == SkipLedger(ranges).ranges


def test_a_skipped_sample_is_skipped_in_every_pass():
    led = SkipLedger([(103, 106)], period=50)  # ids 103-105: data 3-5, seen in the third pass
    assert led.data_ranges == [(3, 6)]
    assert led.take(0, 6).tolist() == [0, 1, 2, 6, 7, 8]
    assert led.take(50, 4).tolist() == [50, 51, 52, 56]
    assert not led.contains(np.arange(1000))[np.isin(np.arange(1000) % 50, [0, 1, 2, 6, 49])].any()
    assert led.skipped_between(0, 1000) == 20 * 3
    wraps = SkipLedger([(48, 53)], period=50)  # a range across a pass's end: both ends of the data
    assert wraps.data_ranges == [(0, 3), (48, 50)]
    assert wraps.take(45, 6).tolist() == [45, 46, 47, 53, 54, 55]


def test_a_ledger_that_would_leave_nothing_to_train_refuses_and_keeps_what_it_had():
    led = SkipLedger([(0, 10)], period=20)
    with pytest.raises(ValueError, match="whole dataset"):
        led.add(100, 125)
    with pytest.raises(ValueError, match="every one of the dataset's 20 samples"):
        led.add(30, 40)  # data 10-19: with 0-9, all of it
    assert led.ranges == [(0, 10)] and led.data_ranges == [(0, 10)]
    with pytest.raises(ValueError, match="period"):
        SkipLedger(period=0)


def _shuffled(period, seed=7):
    perms = {}

    def index(ids):
        ids = np.asarray(ids, dtype=np.int64)
        out = np.empty_like(ids)
        for e in np.unique(ids // period):  # a loop over passes, not ids
            if e not in perms:
                perms[e] = np.random.default_rng([seed, int(e)]).permutation(period)
            m = ids // period == e
            out[m] = perms[e][ids[m] % period]
        return out

    return index


@settings(max_examples=80, deadline=None)
@given(ranges=ranges_st, period=st.integers(2, 90), cursor=st.integers(0, 400), n=st.integers(0, 60))
def test_a_shuffled_ledger_skips_the_data_wherever_a_pass_puts_it(ranges, period, cursor, n):
    index = _shuffled(period)
    bad = np.unique(np.concatenate([index(np.arange(lo, hi)) for lo, hi in ranges] + [np.zeros(0, np.int64)]))
    try:
        led = SkipLedger(ranges, period=period, index=index)
    except ValueError:
        assert len(bad) == period or any(hi - lo >= period for lo, hi in SkipLedger(ranges).ranges)
        return
    upto = cursor + (n + 2) * period + 400
    skipped = np.isin(index(np.arange(upto)), bad)
    assert np.array_equal(led.contains(np.arange(upto)), skipped)
    free = np.flatnonzero(~skipped[cursor:]) + cursor
    assert led.take(cursor, n).tolist() == free[:n].tolist()
    assert led.skipped_between(cursor, upto) == int(skipped[cursor:].sum())
    assert led.copy().take(cursor, n).tolist() == free[:n].tolist()
