"""Retention's one rule (monitors/retention.py), for the bundled trainer and thermowatch.watch."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from thermowatch.monitors.retention import retained


def test_the_newest_anchors_and_the_target_behind():
    steps = list(range(25, 201, 25))  # 25 ... 200
    assert retained(steps, 3) == {150, 175, 200}
    assert retained(steps, 3, 100) == {25, 100, 150, 175, 200}  # the first of each 100-step span
    # checkpointing every 25 and keeping 2: at step 175 the policy's target for a divergence found
    # at 171 (onset 170 - 100 -> 50) is kept, and every checkpoint of the last 110 steps
    assert retained(steps[:7], 2, now=175, behind=110) >= {50, 75, 100, 125, 150, 175}
    assert retained([], 5, 100, now=10, behind=110) == set()


def test_checkpointing_every_10_and_keeping_3_keeps_every_target_a_rollback_can_ask_for():
    """Issue 35: with checkpoint_every=10 and keep_checkpoints=3 (the docs' own examples), the
    client deleted the checkpoints a rollback needed: asked for <= 40 at step 80, it landed on 10.
    Every checkpoint of the last 110 steps stays, and older targets lose at most a factor of two."""
    kept: set[int] = set()
    for now in range(10, 1001, 10):  # the loop saves, then prunes, every 10 steps
        kept = retained(sorted(kept | {now}), 3, 0, now=now, behind=110)
        if now == 80:
            assert kept == {10, 20, 30, 40, 50, 60, 70, 80}
    assert {s for s in kept if s > 1000 - 110} == set(range(900, 1001, 10))
    for asked in range(10, 890, 10):  # a rollback to `asked` lands at most 1.67 x as far back
        landed = max(s for s in kept if s <= asked)
        assert 1000 - landed <= (1000 - asked) / 0.6, (asked, landed, sorted(kept))
    assert len(kept) <= 11 + 4 * 3 + 3, sorted(kept)


@given(st.lists(st.integers(0, 10**6), unique=True, max_size=60).map(sorted), st.integers(1, 8),
       st.integers(0, 5000), st.integers(0, 10**6), st.integers(1, 500))
def test_what_is_kept(steps, keep_last, keep_every, now, behind):
    keep = retained(steps, keep_last, keep_every, now=now, behind=behind)
    assert keep <= set(steps) and set(steps[-keep_last:]) <= keep
    old = [s for s in steps if s <= now - behind]
    if old:
        assert old[-1] in keep
    for asked in range(0, now + 1, max(1, now // 97)):  # any target lands not too far behind the best
        best = max((s for s in steps if s <= asked), default=None)
        if best is not None and best <= now - behind:
            landed = max(s for s in keep if s <= asked)
            assert now - landed <= (now - best) / 0.6, (asked, best, landed)
    window = {s for s in steps if s > now - behind}
    bucket = max(1, behind // 10)
    # within the last `behind` steps a rollback lands less than a tenth of `behind` before the step it
    # asks for (the rule's blocks are powers of two up to that: a bucket of exactly behind // 10
    # can straddle two of them, so "the first of every such bucket" is not the rule's promise)
    for s in window:
        assert max(k for k in keep if k <= s) > s - bucket, (s, bucket, sorted(keep))
    spans = len({s // keep_every for s in window}) if keep_every else 0
    assert len(window & keep) <= len({s // bucket for s in window}) + keep_last + spans  # thinned to a tenth
