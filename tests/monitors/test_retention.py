"""Retention's one rule (monitors/retention.py), for the bundled trainer and thermowatch.watch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from thermowatch.monitors.retention import retained


def test_the_newest_anchors_and_the_target_behind():
    steps = list(range(25, 201, 25))  # 25 ... 200
    assert retained(steps, 3) == {150, 175, 200}
    assert retained(steps, 3, 100) == {25, 100, 150, 175, 200}  # the first of each 100-step span
    # checkpointing every 25 and keeping 5: at step 175 the policy's target for a divergence found
    # at 171 (onset 170 - 100 -> 50) is kept, and 25 (no span anchors) is not
    assert retained(steps[:7], 5, now=175, behind=110) == {50, 75, 100, 125, 150, 175}
    assert retained([], 5, 100, now=10, behind=110) == set()


@given(st.lists(st.integers(0, 10**6), unique=True, max_size=60).map(sorted), st.integers(1, 8),
       st.integers(0, 5000), st.integers(0, 10**6), st.integers(0, 500))
def test_what_is_kept(steps, keep_last, keep_every, now, behind):
    keep = retained(steps, keep_last, keep_every, now=now, behind=behind)
    assert keep <= set(steps) and set(steps[-keep_last:]) <= keep
    old = [s for s in steps if s <= now - behind]
    if behind and old:
        assert old[-1] in keep
    assert len(keep) <= keep_last + 1 + (len({s // keep_every for s in steps}) if keep_every else 0)
