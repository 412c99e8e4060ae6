"""WatchConfig (issue 38 item 3): what thermowatch.watch is told, checked at once, before anything
is made from it; `Watch(model, optimizer, WatchConfig(...))` and `thermowatch.watch(model,
optimizer, **the same settings)` are one loop."""

from __future__ import annotations

import math

import pytest
import torch

import thermowatch
from thermowatch.watch_config import WatchConfig


@pytest.mark.parametrize("bad, message", [
    ({"steps": 0}, "steps must be an integer >= 1, got 0"),
    ({"global_batch": "8"}, "global_batch must be an integer >= 1, got '8'"),
    ({"checkpoint_every": True}, "checkpoint_every must be an integer >= 1, got True"),
    ({"keep_checkpoints": 0}, "keep_checkpoints must be an integer >= 1, got 0"),
    ({"dataset_size": 0}, "dataset_size must be"),
    ({"poll_interval_s": math.nan}, "poll_interval_s must be"),
    ({"close_timeout_s": -1.0}, "close_timeout_s must be"),
    ({"precise_skip": "yes"}, "precise_skip must be True, False or a PreciseSkip, got 'yes'"),
    ({"thermometers": 1}, "thermometers must be True, False or a ThermometerConfig, got 1"),
    ({"run": ".."}, "cannot be a run id"),
])
def test_a_bad_setting_is_refused_by_name_before_anything_is_made(bad, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = {"run": "cfg", "steps": 10, "global_batch": 4, **bad}
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        WatchConfig(**settings)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        thermowatch.watch(torch.nn.Linear(2, 2), torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1),
                          **settings)
    assert not (tmp_path / "checkpoints").exists()  # refused before the checkpoint directory was made


def test_a_config_and_the_same_keyword_arguments_are_one_loop(tmp_path):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    cfg = WatchConfig(run="cfg", steps=7, global_batch=4, checkpoint_dir=str(tmp_path / "a"), checkpoint_every=3,
                      keep_checkpoints=2, thermometers=False, precise_skip=True, dataset_size=100)
    assert cfg.precise == thermowatch.PreciseSkip() and cfg.dir == tmp_path / "a"
    by_cfg = thermowatch.Watch(model, opt, cfg)
    by_kwargs = thermowatch.watch(model, opt, run="cfg", steps=7, global_batch=4, checkpoint_dir=str(tmp_path / "b"),
                                  checkpoint_every=3, keep_checkpoints=2, thermometers=False, precise_skip=True,
                                  dataset_size=100)
    try:
        for w in (by_cfg, by_kwargs):
            assert (w.total, w.global_batch, w.checkpoint_every, w.keep_checkpoints, w.dataset_size) == (7, 4, 3, 2, 100)
            assert w.precise == thermowatch.PreciseSkip() and w.th is None
        assert by_kwargs.cfg == WatchConfig(**{**cfg.__dict__, "checkpoint_dir": str(tmp_path / "b")})
        with pytest.raises(TypeError, match=r"not both: \['steps'\]"):
            thermowatch.Watch(model, opt, cfg, steps=8)
        with pytest.raises(TypeError, match="chekpoint_every"):
            thermowatch.watch(model, opt, run="cfg", steps=7, global_batch=4, chekpoint_every=3)
    finally:
        by_cfg.close(finished=False)
        by_kwargs.close(finished=False)
