"""The one transition both loops take for pause / resume / stop (thermowatch.protocol.directed):
the client's Watch and the bundled RunController apply the Directive it returns and nothing else
sets theirs. Property-based over any sequence of the three commands."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from thermowatch.monitors.contract import Pause, Resume, SampleRange, Skip, Stop
from thermowatch.protocol import Directive, directed, resumed_by_rollback

BODIES = {"pause": Pause(), "resume": Resume(), "stop": Stop()}


@given(seq=st.lists(st.sampled_from(sorted(BODIES)), max_size=12), step=st.integers(0, 10**6))
def test_any_sequence_ends_where_an_operator_expects(seq, step):
    d = Directive.RUN
    for name in seq:
        out = directed(d, BODIES[name], step)
        assert out.directive is not None and out.checkpoint is None and out.skip_ranges == ()
        d = out.directive
    if "stop" in seq:  # a stop is final: nothing after it restarts the loop
        assert d is Directive.STOP
    else:
        last = [n for n in seq if n in ("pause", "resume")]
        assert d is (Directive.PAUSE if last and last[-1] == "pause" else Directive.RUN)


def test_the_acks_say_where_the_loop_is():
    assert directed(Directive.RUN, Pause(), 41).detail == "paused before step 42"
    assert directed(Directive.PAUSE, Resume(), 41).detail == "resumed"
    assert directed(Directive.RUN, Resume(), 41).detail == "was not paused"
    assert directed(Directive.PAUSE, Stop(), 41).detail == "stopping after step 41"
    assert directed(Directive.STOP, Resume(), 41).detail == "stopping after step 41"


def test_other_commands_are_not_directives():
    with pytest.raises(TypeError, match="not a pause, resume or stop: Skip"):
        directed(Directive.RUN, Skip((SampleRange(0, 8),)), 3)


def test_a_rollback_ends_a_pause_and_leaves_a_stop_or_a_run_alone():
    """Issue 35: an acked manual rollback did not end a pause, contrary to docs/any-trainer.md."""
    assert resumed_by_rollback(Directive.PAUSE) is Directive.RUN
    assert resumed_by_rollback(Directive.STOP) is None and resumed_by_rollback(Directive.RUN) is None
