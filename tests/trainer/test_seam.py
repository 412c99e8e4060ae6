"""trainer.seam: what crosses Ray between the controller and a rank is a frozen dataclass that
pickles as it is (Ray pickles actor arguments and answers), never a dict read by key."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from thermowatch.monitors.contract import LRChange
from thermowatch.trainer.seam import RankReady, TrainedStep


def _step() -> TrainedStep:
    return TrainedStep(step=7, values=np.array([2.5, float("nan"), 1e4], dtype=np.float32), loss=2.5, sample_lo=48,
                       sample_hi=56, tokens=2048, global_batch=8, seq_len=256, time_s=0.12, lr_multiplier=0.5,
                       lr_peak_ahead=3e-4, ledger_digest="abc123")


@pytest.mark.parametrize("value", [_step(), RankReady(names=["loss", "tokens_per_s"], host="h", flops_per_token=6),
                                   LRChange(start_step=5, multiplier=0.25, steps=10, rewarmup_steps=2)],
                         ids=lambda v: type(v).__name__)
def test_what_crosses_the_seam_is_frozen_and_pickles_as_it_is(value):
    back = pickle.loads(pickle.dumps(value))
    assert type(back) is type(value)
    for f in dataclasses.fields(value):
        a, b = getattr(value, f.name), getattr(back, f.name)
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)  # NaN equal to NaN, bit for bit
            assert a.dtype == b.dtype
        else:
            assert a == b, f.name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, dataclasses.fields(value)[0].name, None)
