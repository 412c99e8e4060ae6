"""The client checks a run id with the daemon's own function (issue 34): `thermowatch.watch` with
run `..` trained with every request refused and wrote its checkpoints into the working directory.
Now thermowatch.Run, thermowatch.watch, the contract's RunInfo and the bundled trainer's config
all refuse, before anything is made or trained, what the daemon would refuse, in its words."""

from __future__ import annotations

import os

import pytest
import torch

import thermowatch
from thermowatch.monitors.commands import ContractError
from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor import limits
from thermowatch.trainer.config import ConfigError, TrainConfig

BAD = ["..", ".", "a/b", "/etc", "../escape", "run\nid", "tab\there", "", "x" * 201]


def _daemons_words(run_id: str) -> str:
    with pytest.raises(ContractError) as exc:
        limits.check_run_id(run_id)  # what supervisor/ingest and the API call
    return str(exc.value)


def _files_under(path) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


@pytest.mark.parametrize("run_id", BAD, ids=repr)
def test_run_refuses_what_the_daemon_refuses_in_its_words_before_making_anything(tmp_path, monkeypatch, run_id):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ContractError) as exc:
        thermowatch.Run(run_id)  # no server: it would start an embedded supervisor under .thermowatch/
    assert str(exc.value) == _daemons_words(run_id)
    assert os.listdir(tmp_path) == []
    with pytest.raises(ContractError) as exc:
        RunInfo.from_json({"run_id": run_id, "attempt": 1, "world_size": 1})
    assert str(exc.value) == _daemons_words(run_id)
    with pytest.raises(ConfigError) as exc:
        TrainConfig(run_id=run_id)  # the bundled trainer: <checkpoint.dir>/<run_id>
    assert str(exc.value) == _daemons_words(run_id)


def test_watch_with_run_dotdot_is_refused_before_a_step_trains(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ContractError, match=r"run_id '\.\.' cannot be a run id: it is a relative path segment"):
        thermowatch.watch(model, opt, run="..", steps=10, global_batch=2, checkpoint_every=1)
    assert _files_under(tmp_path) == []  # no checkpoint, no database, no state file in the working directory
    assert os.listdir(tmp_path) == []  # not even an empty checkpoints/ folder
    assert not (tmp_path / ".thermowatch").exists()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_one_function_serves_the_daemon_and_the_client():
    from thermowatch.monitors import names

    assert limits.check_run_id is names.check_run_id and limits.RUN_ID_CHARS == names.RUN_ID_CHARS
    assert thermowatch.Run.__init__.__globals__["check_run_id"] is names.check_run_id
    good = "my-run 2024-06-01 <ok> ünïcode"
    assert names.check_run_id(good) == good and RunInfo.from_json({"run_id": good, "attempt": 0,
                                                                   "world_size": 1}).run_id == good
