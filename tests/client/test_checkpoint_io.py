"""Checkpoints load as data (issue 33, thermowatch/checkpoint_io.py): a file planted in the
checkpoint directory, a pickle whose __reduce__ runs `touch <marker>`, is refused wherever the
client reads one (a resume, a rollback, torchrun's per-rank files) and nothing of it runs; the
loop falls back to the checkpoint before it. The marker file says whether the command ran."""

from __future__ import annotations

import json
import logging
import pickle
import shutil

import numpy as np
import pytest
import torch

import thermowatch
from tests.client.user_loop import B, DATA, train_step, user_batch, user_model
from tests.fixtures.planted import Payload, plant
from tests.live_server import wait_until
from tests.waits import action_handed
from thermowatch.checkpoint_io import CheckpointRefused, load_as_data
from thermowatch.monitors.manifest import file_digest
from thermowatch.supervisor.act.executor import ended
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.store import actions as actions_store


def _train(tw, model, opt, sched, on_step=None) -> list[tuple[int, int]]:
    """The user's loop (docs/any-trainer.md); (attempt, step) of every step trained."""
    trained = []
    for step in tw.steps():
        loss = train_step(model, opt, *user_batch(DATA, tw.batch_ids(step)))
        sched.step()
        tw.record(loss)
        trained.append((tw.attempt, step))
        if on_step is not None:
            on_step(step)
    tw.close()
    return trained


def _reopened(sup, run: str) -> bool:
    with sup.sessions() as s:
        return ended(s, run) is None


def _watch(db, tmp_path, steps: int):
    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    tw = thermowatch.watch(model, opt, run="planted", steps=steps, global_batch=B, checkpoint_dir=tmp_path / "ckpt",
                           checkpoint_every=10, scheduler=sched, poll_interval_s=0.05,
                           supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
    return tw, model, opt, sched


def test_the_planted_file_would_run_its_command_and_load_as_data_refuses_it(tmp_path):
    """The fixture is live (torch.load with weights_only=False runs it), so the tests below that
    see no marker prove a refusal, not a dud."""
    plant(tmp_path / "a.pt", tmp_path / "ran_unsafe")
    torch.load(tmp_path / "a.pt", weights_only=False)
    assert (tmp_path / "ran_unsafe").exists()
    for raw in (False, True):  # torch.save's format, and a bare pickle
        plant(tmp_path / "b.pt", tmp_path / "ran", raw=raw)
        with pytest.raises(CheckpointRefused, match=r"b\.pt: refused to load: it names code"):
            load_as_data(tmp_path / "b.pt")
        assert not (tmp_path / "ran").exists()
    plant(tmp_path / "c.pt", tmp_path / "ran")
    with pytest.raises(CheckpointRefused, match=r"unsupported GLOBAL posix\.system"):  # the reason, named
        load_as_data(tmp_path / "c.pt")


def test_a_planted_newest_checkpoint_is_refused_on_resume_and_on_rollback(db, tmp_path, caplog):
    # A first run saves checkpoints 10, 20 and 30; then the newest is replaced by a planted file.
    tw, model, opt, sched = _watch(db, tmp_path, steps=30)
    _train(tw, model, opt, sched)
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.glob("step_*.pt")) == [f"step_{s:08d}.pt" for s in (10, 20, 30)]
    plant(ckpt / "step_00000030.pt", tmp_path / "ran_resume")
    # ... and its manifest rewritten to vouch for it (whoever can plant the file can do that too;
    # without it the checksum alone passes the file over, unread: test_checkpoint_trust.py)
    body = json.loads((ckpt / "step_00000030.json").read_text())
    body["files"]["step_00000030.pt"] = file_digest(ckpt / "step_00000030.pt", "full")
    (ckpt / "step_00000030.json").write_text(json.dumps(body))

    # Resume: checkpoint 30 is refused, the run resumes from 20; the file is set aside, kept.
    tw, model, opt, sched = _watch(db, tmp_path, steps=40)
    sup = tw.run.supervisor
    submitted = {}

    def at(step: int) -> None:
        if step == 24 and "rollback" not in submitted:
            # Rollback: a planted file named as a newer checkpoint than 20, asked for by a rollback.
            plant(ckpt / "step_00000022.pt", tmp_path / "ran_rollback")
            # The resumed attempt reaches the supervisor on the sink's thread; 4 toy steps (ms) can
            # come before it, when the run still reads as finished and a command is refused.
            wait_until(lambda: _reopened(sup, "planted"), "attempt 2 of 'planted' open in the supervisor")
            submitted["rollback"] = sup.executor.submit("planted", "rollback", {"to_step": 23}, "ana", "spike")
            action_handed(sup, submitted["rollback"])  # a toy step is ms: 16 left could outrun the poll

    with caplog.at_level(logging.ERROR, logger="thermowatch.loop"):
        trained = _train(tw, model, opt, sched, at)
    assert not (tmp_path / "ran_resume").exists() and not (tmp_path / "ran_rollback").exists()
    assert trained[0] == (2, 21), trained[:3]  # resumed after checkpoint 20, as attempt 2
    refusals = [r.getMessage() for r in caplog.records if "was refused, not loaded" in r.getMessage()]
    assert len(refusals) == 2, [r.getMessage() for r in caplog.records]
    assert refusals[0].startswith("thermowatch: checkpoint step 30 was refused, not loaded: ")
    assert refusals[1].startswith("thermowatch: checkpoint step 22 was refused, not loaded: ")
    assert all("posix.system" in m and "trying an older one" in m for m in refusals), refusals
    assert not [r for r in caplog.records if "holds a type outside" in r.getMessage()]  # its own saves load

    # The rollback landed on 20 (the newest that loads), and the run trained on from 21.
    with db.sessions() as s:
        row = actions_store.get_action(s, submitted["rollback"])
    assert row.state == "done" and row.result["checkpoint_step"] == 20 and row.result["first_step"] == 21, row.result
    assert (3, 21) in trained and trained[-1] == (3, 40)
    # Both planted files are kept aside for whoever looks into them and never read again; the run
    # saved its own checkpoint 30 again, and it loads as data.
    assert (ckpt / "step_00000030.pt.refused").is_file() and (ckpt / "step_00000022.pt.refused").is_file()
    assert not (ckpt / "step_00000022.pt").exists()
    assert load_as_data(ckpt / "step_00000030.pt")["step"] == 30


def test_a_checkpoint_the_loader_would_refuse_is_named_when_the_first_one_is_saved(db, tmp_path, caplog):
    """A loop whose own state holds a type outside the allow-list (an LR computed with numpy, in the
    optimizer's param group) hears so at its first checkpoint, not at the rollback that needs it."""
    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    opt.param_groups[0]["lr"] = np.float64(1e-2)
    tw = thermowatch.watch(model, opt, run="numpy-lr", steps=10, global_batch=B, checkpoint_dir=tmp_path / "ckpt",
                           checkpoint_every=4, poll_interval_s=0.05,
                           supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
    with caplog.at_level(logging.ERROR, logger="thermowatch.loop"):
        for step in tw.steps():
            tw.record(train_step(model, opt, *user_batch(DATA, tw.batch_ids(step))))
        tw.close()
    said = [r.getMessage() for r in caplog.records if "holds a type outside" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("thermowatch: checkpoint step 4 holds a type"), said  # once
    assert "multiarray.scalar" in said[0] and "add_safe_globals" in said[0], said
    with pytest.raises(CheckpointRefused):  # what it warned of
        load_as_data(tmp_path / "ckpt" / "step_00000008.pt")


def test_torchruns_per_rank_files_are_read_as_data(tmp_path):
    """thermowatch.ranks' checkpoint (torch.distributed.checkpoint shards plus each rank's
    extra_rank{r}.pt), read in one process: a real one loads; each file DCP or we would unpickle
    (the extra part, DCP's .metadata, a state-dict value inside a .distcp) planted is refused."""
    from thermowatch.ranks import Ranks, rng_state

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    extra = {"step": 7, "cursor": 28, "scheduler": sched.state_dict(), "rng": rng_state()}
    Ranks().save(model, opt, extra, tmp_path / "good")

    fresh = torch.nn.Linear(4, 3)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    state = Ranks().load(fresh, fresh_opt, tmp_path / "good")
    assert (state["step"], state["cursor"]) == (7, 28)
    assert torch.equal(fresh.weight, model.weight) and fresh_opt.param_groups[0]["lr"] == 1e-3

    def planted(name: str) -> str:
        bad = tmp_path / name.strip(".")
        if name == "value":  # a state-dict value DCP stores as bytes in its .distcp file
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            msd, osd = get_state_dict(model, opt)
            osd["param_groups"][0]["lr"] = Payload(tmp_path / f"ran_{name}")
            dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=str(bad))
            torch.save(extra, bad / "extra_rank0.pt")
        else:
            shutil.copytree(tmp_path / "good", bad)
            if name == ".metadata":
                (bad / name).write_bytes(pickle.dumps(Payload(tmp_path / f"ran_{name}")))
            else:
                plant(bad / name, tmp_path / f"ran_{name}")
        target = torch.nn.Linear(4, 3)
        with pytest.raises(CheckpointRefused) as exc:
            Ranks().load(target, torch.optim.AdamW(target.parameters()), bad)
        assert not (tmp_path / f"ran_{name}").exists(), f"loading the planted {name} ran its command"
        return str(exc.value)

    why = {name: planted(name) for name in ("extra_rank0.pt", ".metadata", "value")}
    assert "extra_rank0.pt: refused to load" in why["extra_rank0.pt"], why
    assert ".metadata: refused to load" in why[".metadata"], why
    assert "the value 'optimizer.param_groups.0.lr': refused to load" in why["value"], why
    assert all("posix.system" in m for m in why.values()), why
