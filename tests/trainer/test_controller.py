"""The run controller with real Ray actors and real DeepSpeed ZeRO 2 on CPU: rollback replay,
skips, worker death, corrupt checkpoints, LR commands, curriculum, pause, profile."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from thermowatch.monitors.contract import CommandKind, ContractError
from tests.trainer.conftest import tiny_config

def test_reducer_follows_the_contract_and_keeps_non_finite_values():
    from thermowatch.trainer.controller import Reducer

    names = ["loss", "grad_norm", "act_max/blocks.0", "act_min/blocks.0", "tokens_per_s"]
    ranks = np.array([[2.0, 1.0, 5.0, -1.0, 100.0], [4.0, 1.0, np.nan, -3.0, 50.0]])
    out, who = Reducer(names)(ranks)
    assert out[0] == 3.0 and out[1] == 1.0 and np.isnan(out[2]) and out[3] == -3.0 and out[4] == 150.0
    # grad_norm is the same on every rank (a global norm): no rank holds its extreme, and
    # attributing the tie to rank 0 made rank 0 a permanent "outlier".
    assert who == {"act_max/blocks.0": 1, "act_min/blocks.0": 1}


def test_a_collective_broken_by_a_lost_peer_is_a_gang_failure_and_other_errors_are_not():
    import torch.distributed as dist

    from thermowatch.trainer.controller import _GANG_FAILURES
    from thermowatch.trainer.worker import PeerLost, _collective_failure

    gloo = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:8610: "
                        "Connection reset by peer")
    assert _collective_failure(gloo) and _collective_failure(dist.DistBackendError("NCCL error: remote process exited"))
    assert not _collective_failure(RuntimeError("rank 1 was asked for step 9 but its data state is at step 7"))
    assert not _collective_failure(None) and PeerLost in _GANG_FAILURES


def _run(cfg, on_step, sink=None):
    """Run a controller; on_step(ctl, record, attempt, q) is called after every step."""
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import ListSink, QueueCommands

    sink, q = sink or ListSink(), QueueCommands()
    holder = {}
    ctl = RunController(cfg, sink, q, progress=lambda rec, att: on_step(holder["ctl"], rec, att, q))
    holder["ctl"] = ctl
    return ctl.run(), sink, q


def _run_acting(cfg, act, step: int, attempt: int = 0):
    """Run a controller; act(ctl, q) is called once, after `step` of `attempt`."""
    return _run(cfg, lambda ctl, rec, att, q: act(ctl, q) if (rec.step, att) == (step, attempt) else None)


def _rollback_onto_damaged_12(cfg, damage):
    """Run `cfg` (14 steps, a checkpoint every 4); after step 13, damage(ctl, checkpoint 12's folder)
    and ask for a rollback to 12: it lands on checkpoint 8 and the run ends at 14. The ack."""
    cmd = {}

    def damage_then_roll_back(ctl, q):
        damage(ctl, ctl.store.path(12))
        cmd["rb"] = q.push(cfg.run_id, CommandKind.ROLLBACK, to_step=12)

    result, sink, q = _run_acting(cfg, damage_then_roll_back, step=13)
    ack = q.ack_for(cmd["rb"])
    assert ack.ok and ack.first_step == 9 and ack.checkpoint_step == 8, ack
    assert [(i.attempt, i.start_step) for i in sink.runs] == [(0, 0), (1, 8)]
    assert result.final_step == 14 and result.attempts == [0, 1]
    return ack


def _ids_seen(ctl, attempt):
    import ray

    return np.concatenate(ray.get([w.sample_ids_seen.remote(attempt) for w in ctl.gang.workers]))


@pytest.mark.slow
def test_rollback_replays_bit_exact_and_skips_never_reach_the_model(ray_session, tmp_path):
    cfg = tiny_config(tmp_path, run_id="rb", steps=16, checkpoint={"every": 8})
    seen = {}

    def on_step(ctl, rec, attempt, q):
        if rec.step == 14 and attempt == 0:
            seen["rb1"] = q.push("rb", CommandKind.ROLLBACK, to_step=8)
        if rec.step == 14 and attempt == 1:
            lo, hi = seen["skip"] = (rec_range(ctl, 10, 0)[0], rec_range(ctl, 11, 0)[1])
            seen["rb2"] = q.push("rb", CommandKind.ROLLBACK, to_step=12, skip_ranges=[[lo, hi]])
        if rec.step == 16 and attempt == 2:
            seen["ids2"] = _ids_seen(ctl, 2)

    ranges = {}

    def rec_range(ctl, step, attempt):
        return ranges[(attempt, step)]

    def wrapped(ctl, rec, attempt, q):
        ranges[(attempt, rec.step)] = (rec.sample_lo, rec.sample_hi)
        on_step(ctl, rec, attempt, q)

    result, sink, q = _run(cfg, wrapped)
    assert result.attempts == [0, 1, 2] and result.final_step == 16 and result.restarts == 0
    a0, a1, a2 = ({r.step: r for r in sink.attempt("rb", a)} for a in (0, 1, 2))
    # Rollback 1 (to 8, no skip): steps 9..14 replay the same samples and the same losses, bit for bit.
    assert q.ack_for(seen["rb1"]).ok and q.ack_for(seen["rb1"]).step == 9
    assert sorted(a1) == list(range(9, 15)) and sorted(a2) == list(range(9, 17))
    for k in range(9, 15):
        assert (a1[k].sample_lo, a1[k].sample_hi) == (a0[k].sample_lo, a0[k].sample_hi)
        assert a1[k].values["loss"] == a0[k].values["loss"], k
        assert a1[k].values["grad_norm"] == a0[k].values["grad_norm"], k
    # Rollback 2 asks for step 12; the newest valid checkpoint <= 12 is step 8 (checkpoint
    # every 8 steps). It skips the samples of steps 10-11 (ids 72..88).
    ack2 = q.ack_for(seen["rb2"])
    assert ack2.ok and ack2.first_step == 9, ack2
    lo, hi = seen["skip"]
    assert (lo, hi) == (72, 88)
    ids2 = seen["ids2"]
    assert len(ids2) == 8 * 8 and not ((ids2 >= lo) & (ids2 < hi)).any()
    assert a2[9].values["loss"] == a0[9].values["loss"]  # step 9 is before the skipped range
    assert a2[10].sample_lo == hi and a2[10].values["loss"] != a0[10].values["loss"]
    # The ledger rides in the manifests saved after the rollback, and in the controller.
    assert result.checkpoints[-1].manifest["data"]["skip_ranges"] == [[lo, hi]]
    assert sink.series("rb", "loss")[9] == a2[9].values["loss"]  # later attempts win
    assert [info.start_step for info in sink.runs] == [0, 8, 8]


@pytest.mark.slow
def test_killed_worker_restarts_gang_from_last_checkpoint(ray_session, tmp_path):
    import ray

    cfg = tiny_config(tmp_path, run_id="kill", steps=14, checkpoint={"every": 5})

    def kill_rank_1(ctl, q):
        ray.kill(ctl.gang.workers[1], no_restart=True)

    result, sink, q = _run_acting(cfg, kill_rank_1, step=8)
    assert result.final_step == 14 and result.restarts == 1 and result.attempts == [0, 1]
    assert [(i.attempt, i.start_step) for i in sink.runs] == [(0, 0), (1, 5)]
    assert "restart after" in sink.runs[1].config["reason"]
    a0 = {r.step: r for r in sink.attempt("kill", 0)}
    a1 = {r.step: r for r in sink.attempt("kill", 1)}
    assert sorted(a0) == list(range(1, 9)) and sorted(a1) == list(range(6, 15))
    for k in (6, 7, 8):  # the new gang resumes exactly where the checkpoint left off
        assert a1[k].values["loss"] == a0[k].values["loss"]
    # The attempt counter survives on disk for a relaunched controller.
    assert json.loads((Path(cfg.checkpoint.dir) / "kill" / "attempt.json").read_text())["attempt"] == 1


@pytest.mark.slow
def test_stalled_rank_times_out_and_the_gang_restarts(ray_session, tmp_path):
    """SIGSTOP one rank: the other blocks in its all-reduce; the step timeout catches it."""
    import os
    import signal
    import time

    import ray

    cfg = tiny_config(tmp_path, run_id="stall", steps=8, step_timeout_s=10.0, checkpoint={"every": 3})
    stopped = {}

    def stop_rank_0(ctl, q):
        stopped["pid"] = ray.get(ctl.gang.workers[0].pid.remote())
        os.kill(stopped["pid"], signal.SIGSTOP)

    result, sink, q = _run_acting(cfg, stop_rank_0, step=4)
    assert result.restarts == 1 and result.attempts == [0, 1] and result.final_step == 8
    assert "GangTimeout" in sink.runs[1].config["reason"] and sink.runs[1].start_step == 3
    with pytest.raises(ProcessLookupError):  # the stalled process was killed with its gang
        for _ in range(50):
            os.kill(stopped["pid"], 0)
            time.sleep(0.1)


@pytest.mark.slow
def test_corrupt_checkpoint_is_passed_over(ray_session, tmp_path):
    cfg = tiny_config(tmp_path, run_id="bad", steps=14, checkpoint={"every": 4})

    def tear(ctl, newest):
        shard = sorted(newest.rglob("*optim_states.pt"))[0]
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2])  # a torn write
        # And a save that never committed: must never be read as a checkpoint.
        (ctl.store.root / "step_00000013.tmp").mkdir()

    ack = _rollback_onto_damaged_12(cfg, tear)
    assert "rolled back to checkpoint 8; asked <= 12; 12 is not intact" in ack.detail, ack.detail


@pytest.mark.slow
def test_a_planted_checkpoint_file_is_refused_and_the_rollback_falls_back(ray_session, tmp_path, caplog):
    """Issue 33: the newest checkpoint's model states (read by every rank) replaced by a pickle
    that runs a command, its manifest rewritten to vouch for it (whoever can plant the file can
    do that too): the load refuses it, nothing ran, and the rollback lands on the older one."""
    from tests.fixtures.planted import plant
    from thermowatch.monitors.manifest import MANIFEST, file_digest

    cfg = tiny_config(tmp_path, run_id="planted", steps=14, checkpoint={"every": 4})
    marker = tmp_path / "ran"

    def plant_vouched_for(ctl, newest):
        shard = next(newest.rglob("mp_rank_00_model_states.pt"))
        plant(shard, marker)
        body = json.loads((newest / MANIFEST).read_text())
        body["files"][shard.relative_to(newest).as_posix()] = file_digest(shard, body["checksum"])
        (newest / MANIFEST).write_text(json.dumps(body))
        assert ctl.store.problem(12) is None  # the store's checks vouch for it: only the load can tell

    with caplog.at_level("ERROR", logger="thermowatch.trainer.controller"):
        ack = _rollback_onto_damaged_12(cfg, plant_vouched_for)
    assert not marker.exists(), "loading the planted checkpoint ran its command"
    assert "passed over 12 (failed to load: " in ack.detail, ack.detail  # the ack says which and why
    refusal = [r.getMessage() for r in caplog.records if "checkpoint step 12 failed to load" in r.getMessage()]
    assert refusal and "refused the DeepSpeed checkpoint" in refusal[0] and "posix.system" in refusal[0], refusal


@pytest.mark.slow
def test_set_lr_skip_pause_profile_and_curriculum_take_effect_at_the_acked_step(ray_session, tmp_path):
    cfg = tiny_config(
        tmp_path,
        run_id="cmd",
        steps=14,
        data={"start_batch": 4, "start_seq_len": 32, "ramp_tokens": 2048, "batch_multiple": 4, "seq_multiple": 8},
    )
    cmds = {}
    prof = tmp_path / "prof"

    def on_step(ctl, rec, attempt, q):
        if rec.step == 3:
            cmds["lr"] = q.push("cmd", CommandKind.SET_LR, lr_multiplier=0.5, lr_steps=4)
            cmds["pause"] = q.push("cmd", CommandKind.PAUSE)
            cmds["resume"] = q.push("cmd", CommandKind.RESUME)
            cmds["prof"] = q.push("cmd", CommandKind.PROFILE, steps=2, out_dir=str(prof))
            cmds["skip"] = q.push("cmd", CommandKind.SKIP, skip_ranges=[[rec.sample_hi + 4, rec.sample_hi + 20]])
            # No multiplier: the contract refuses to build it, so it can never be delivered.
            with pytest.raises(ContractError, match="lr_multiplier"):
                q.push("cmd", CommandKind.SET_LR)
            # A restart without rank 1's node, on a one-node cluster: no spare capacity, so it is
            # refused loudly (never a plain rollback with the node still in; tests/faults has the
            # multi-node case that succeeds).
            cmds["exclude"] = q.push("cmd", CommandKind.ROLLBACK, to_step=2, exclude_rank=1)
        if rec.step == 14:
            cmds["ids"] = _ids_seen(ctl, 0)

    from thermowatch.trainer.local import ListSink

    class DownThenUp(ListSink):  # a supervisor that is unreachable for the first writes
        def write(self, run_id, attempt, records):
            self.failures = getattr(self, "failures", 0) + 1
            if self.failures <= 3:
                raise ConnectionError("supervisor down")
            super().write(run_id, attempt, records)

    result, sink, q = _run(cfg, on_step, sink=DownThenUp())
    recs = {r.step: r for r in sink.attempt("cmd", 0)}
    assert [r.step for r in sink.attempt("cmd", 0)] == list(range(1, 15)) and sink.failures > 3  # none lost
    sched = cfg.lr_schedule()
    lr_ack = q.ack_for(cmds["lr"])
    assert lr_ack.ok and lr_ack.first_step == 4
    for k, r in recs.items():
        want = sched.at(k) * (0.5 if 4 <= k < 8 else 1.0)
        assert r.values["lr"] == pytest.approx(want, rel=1e-6), k
        # The forecast the attention detectors read: the schedule's peak still ahead (warm-up of
        # 5 steps in tiny_config), under the multiplier in force at the step.
        ahead = sched.peak_from(k) * (0.5 if 4 <= k < 8 else 1.0)
        assert r.values["lr_peak_ahead"] == pytest.approx(ahead, rel=1e-12), k
    assert all(q.ack_for(cmds[c]).ok and q.ack_for(cmds[c]).step == 4 for c in ("pause", "resume", "prof", "skip"))
    exclude = q.ack_for(cmds["exclude"])
    assert not exclude.ok and "rank 1" in exclude.detail and "fewer than world_size=2" in exclude.detail
    # Skip: the ids never reach any rank, and the step ranges jump over them.
    lo, hi = recs[3].sample_hi + 4, recs[3].sample_hi + 20
    ids = cmds["ids"]
    assert not ((ids >= lo) & (ids < hi)).any() and len(np.unique(ids)) == len(ids)
    # Curriculum: (batch, seq_len) follows tokens consumed, from (4, 32) to (8, 64).
    from thermowatch.trainer.data import Curriculum

    cur = Curriculum(8, 64, start_batch=4, start_seq_len=32, ramp_tokens=2048, batch_multiple=4, seq_multiple=8)
    consumed = 0
    for k in sorted(recs):
        b, t = cur.at(consumed)
        assert recs[k].tokens == b * t, k
        consumed += b * t
    assert recs[1].tokens == 4 * 32 and recs[14].tokens == 8 * 64
    # Profile: one chrome trace per rank.
    assert sorted(p.name for p in prof.iterdir()) == ["rank0.json", "rank1.json"]


@pytest.mark.slow
def test_stop_saves_a_resume_point_and_relaunch_skips_abandoned_checkpoints(ray_session, tmp_path):
    cfg = tiny_config(tmp_path, run_id="st", steps=12, checkpoint={"every": 4})

    def rollback_then_stop(ctl, rec, attempt, q):
        if rec.step == 9 and attempt == 0:
            q.push("st", CommandKind.ROLLBACK, to_step=4, skip_ranges=[[40, 48]])
        if rec.step == 6 and attempt == 1:
            q.push("st", CommandKind.STOP)

    first, sink1, _ = _run(cfg, rollback_then_stop)
    assert first.stopped and first.final_step == 6 and first.checkpoints[-1].step == 6
    # Step 8 of attempt 0 is still on disk (forensics) but marked abandoned by the rollback.
    from thermowatch.trainer.checkpoint import CheckpointStore

    store = CheckpointStore(Path(cfg.checkpoint.dir) / "st")
    assert store.latest_valid().step == 8 and not store.latest_valid().healthy
    second, sink2, _ = _run(cfg, lambda *a: None)
    assert second.attempts == [2] and sink2.runs[0].start_step == 6 and second.final_step == 12
    recs = sorted(sink2.attempt("st", 2), key=lambda r: r.step)
    assert [r.step for r in recs] == list(range(7, 13))
    # The skip ledger came back from the manifest: ids 40..48 are passed over after a relaunch too.
    assert all(r.sample_hi <= 40 or r.sample_lo >= 48 for r in recs)
    assert any(r.sample_lo == 48 for r in sink1.attempt("st", 1) + recs)
