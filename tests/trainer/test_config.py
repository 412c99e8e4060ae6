"""The training config as one tree (issue 12.6): an unknown key or a wrong type at any depth is
one ConfigError naming its dotted path, the known keys there and the closest one."""

from __future__ import annotations

from pathlib import Path

import pytest

from thermowatch.trainer.config import ConfigError, TrainConfig
from tests.config_walk import numeric_settings

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("obj, message", [
    # depth 1, 2 and 3 (a list item)
    ({"stepz": 10}, "stepz: unknown key; did you mean 'steps'? known keys at the top level: run_id, seed"),
    ({"optim": {"lrr": 1.0}}, "optim.lrr: unknown key; did you mean 'lr'? known keys at optim: lr, warmup_steps"),
    ({"data": {"global_bach": 8}}, "data.global_bach: unknown key; did you mean 'global_batch'?"),
    ({"model": {"n_layr": 3}}, "model.n_layr: unknown key; did you mean 'n_layer'? known keys at model:"),
    ({"thermometers": {"attn_evry": 2}}, "thermometers.attn_evry: unknown key; did you mean 'attn_every'?"),
    ({"optim": {"betas": [0.9, "high"]}}, "optim.betas[1]: expected a number, got 'high'"),
    # wrong types
    ({"use_gpu": "yes"}, "use_gpu: expected true or false, got 'yes'"),
    ({"checkpoint": {"every": "often"}}, "checkpoint.every: expected an integer, got 'often'"),
    ({"model": {"d_model": 64.5}}, "model.d_model: expected an integer, got 64.5"),
    ({"optim": {"lr": "1e-3"}}, "optim.lr: expected a number, got '1e-3' (YAML reads an exponent without a dot"),
    ({"optim": [1]}, "optim: expected a mapping of keys"),
    ({"read_late": "auto"}, "read_late: expected true or false or null, got 'auto'"),
])
def test_a_bad_key_or_value_at_any_depth_names_its_path(obj, message):
    with pytest.raises(ConfigError) as exc:
        TrainConfig.from_dict(obj)
    assert message in str(exc.value), str(exc.value)


def test_load_prefixes_nothing_and_yaml_errors_are_config_errors(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("optim: {lr: 3.0e-3\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        TrainConfig.load(path)


def test_replace_is_checked_too():
    with pytest.raises(ConfigError, match=r"optim\.lrr: unknown key"):
        TrainConfig().replace(optim={"lrr": 1.0})
    assert TrainConfig().replace(optim={"lr": 1e-3}).optim.lr == 1e-3


def test_every_training_config_in_deploy_loads():
    paths = [p for p in sorted((ROOT / "deploy").rglob("*.yaml")) if "train" in p.name]
    assert {p.relative_to(ROOT).as_posix() for p in paths} >= {"deploy/train.example.yaml", "deploy/local/train.yaml"}
    for p in paths:
        TrainConfig.load(p)
    local = TrainConfig.load(ROOT / "deploy/local/train.yaml")
    # runs on one CPU machine as-is: CPU ranks, 2 of them, a tiny model, checkpoints under the cwd
    assert not local.use_gpu and local.world_size == 2 and local.model.n_layer <= 2
    assert not Path(local.checkpoint.dir).is_absolute()


TRAIN_NUMBERS = list(numeric_settings(TrainConfig))


@pytest.mark.parametrize("path, is_int", TRAIN_NUMBERS, ids=[".".join(p) for p, _ in TRAIN_NUMBERS])
def test_every_numeric_training_setting_refuses_nan_infinity_and_a_negative_number(path, is_int):
    """Issue 34, for the training config: data.seed, seq_multiple, batch_multiple, vocab_size and
    optim.eps took -1; the walk refuses NaN and infinity for every float."""
    import math

    value = {}
    for bad in (math.nan, math.inf, -math.inf, -1 if is_int else -1.0):
        value = bad
        for key in reversed(path[1:]):
            value = {key: value}
        with pytest.raises(ConfigError) as exc:
            TrainConfig.from_dict({path[0]: value})
        assert path[-1] in str(exc.value), (path, bad, str(exc.value))


def test_the_fault_drill_example_in_the_docs_loads_and_bad_drills_and_precise_skip_are_refused():
    """docs/configuration.md's `faults:` example is a config `train` accepts (issue 39), and a drill
    or a precise skip that cannot run as written is refused at load, naming the key."""
    import re

    import yaml

    text = (ROOT / "docs" / "configuration.md").read_text()
    section = text[text.index("### Fault drills"):]
    cfg = TrainConfig.from_dict(yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.S).group(1)))
    assert cfg.faults.poison == (480, 496) and cfg.precise().triage
    off = TrainConfig().faults  # both off by default
    assert (off.flip_step, off.poison, off.lr_step) == (0, (0, 0), 0) and TrainConfig().precise() is None
    for obj, message in [
        ({"faults": {"poison": [496, 480]}}, "faults.poison must be [lo, hi)"),
        ({"faults": {"poison": [1, 2, 3]}}, "faults.poison: expected a list of 2 values"),
        ({"faults": {"flip_step": 5, "flip_rank": 2}}, "faults.flip_rank=2 is not a rank of world_size=2"),
        ({"faults": {"lr_factor": 0.0}}, "faults.lr_factor must be a positive finite float"),
        ({"precise_skip": {"window": 2}}, "precise_skip: settle must be >= 0 and window >= 4"),
        ({"precise_skip": {"triage": "yes"}}, "precise_skip.triage: expected true or false"),
        ({"precise_skip": {}, "data": {"ramp_tokens": 4096, "start_batch": 8, "start_seq_len": 32}},
         "precise_skip needs a fixed batch"),
    ]:
        with pytest.raises(ConfigError) as exc:
            TrainConfig.from_dict(obj)
        assert message in str(exc.value), (obj, str(exc.value))
