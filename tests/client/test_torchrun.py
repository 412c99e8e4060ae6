"""thermowatch.watch under torchrun (issue 22, item 3): a 2-rank DDP loop on CPU (gloo) is rolled
back and skips, every rank together, with one rank talking to the supervisor and the
thermometers reduced across ranks on the device. The loop is tests/client/torchrun_loop.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.client.user_loop import REPO
from tests.live_server import free_port
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import thermometers


def _check(db, tmp_path, wrap: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                        str(REPO / "tests/client/torchrun_loop.py"), db.url, str(tmp_path / "data"), str(tmp_path), wrap],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    seq = [[(t["attempt"], t["step"]) for t in rk["trained"]] for rk in ranks]
    # every rank trained the same steps in the same attempts: the commands met both at one boundary
    assert seq[0] == seq[1]
    assert ranks[0]["params"] == ranks[1]["params"]  # one model: DDP's replicas, FSDP's shards gathered
    first = {t["step"]: t for t in ranks[0]["trained"] if t["attempt"] == 1}
    again = [(s, a) for a, s in seq[0] if a == 2]
    assert again[0][0] == 11  # rolled back to checkpoint 10: step 11 trained again
    assert max(first) >= 15 and ranks[0]["step"] == seq[0][-1][1] < 400  # stopped early
    # each rank trained its own half of the global batch, rank 0 the first
    assert all(len(t["ids"]) == 4 for rk in ranks for t in rk["trained"])
    step11 = [rk["trained"][seq[0].index((2, 11))]["ids"] for rk in ranks]
    assert step11[0] + step11[1] == list(range(80, 88))  # re-trained from the checkpoint's cursor
    # the skip: samples 96-119 never trained again, on any rank, and nothing else was passed over
    retrained = sorted(i for rk in ranks for t in rk["trained"] if t["attempt"] == 2 for i in t["ids"])
    assert not any(96 <= i < 120 for i in retrained)
    assert retrained[:16] == list(range(80, 96)) and retrained[16:24] == list(range(120, 128))

    with db.sessions() as s:
        acts = {a.kind: a for a in actions_store.actions(s, wrap)}
        by_attempt = thermometers.history_by_attempt(s, wrap, "loss")
    assert acts["rollback"].state == "done" and acts["stop"].state == "done", acts
    assert acts["rollback"].result["checkpoint_step"] == 10 and acts["rollback"].result["skip_ranges"] == [[96, 120]]
    # one record a step, from rank 0 only, with the loss averaged over both ranks' halves
    steps, values = by_attempt[2]
    losses = dict(zip(steps.tolist(), values.tolist()))
    mine = {t["step"]: t["loss"] for t in ranks[0]["trained"] if t["attempt"] == 2}
    theirs = {t["step"]: t["loss"] for t in ranks[1]["trained"] if t["attempt"] == 2}
    assert sorted(losses) == sorted(mine)
    for st in mine:
        assert losses[st] == pytest.approx((mine[st] + theirs[st]) / 2, rel=1e-6)
    assert not np.isclose(mine[11], theirs[11])  # the two halves differ: a mean, not rank 0's
    # the gradient norm was measured (FSDP2's shards are read from .grad and their squares summed
    # over the ranks: its hooks never see a gradient), so no step looked non-finite
    with db.sessions() as s:
        gsteps, gnorm = thermometers.history(s, wrap, "grad_norm")
    assert len(gnorm) == len({s for _, s in seq[0]}) and np.isfinite(gnorm).all() and (gnorm > 0).all()


# The operator's rollback, skip and stop on FSDP2 (PostgreSQL); the precise-skip runs below
# (SQLite) roll back FSDP2 and DDP by themselves and check the same agreement (CI time: one run each). The
# broadcast, the rollback and the skip do not depend on the database; the store is tested on both.
@pytest.mark.parametrize("db", ["postgres"], indirect=True)
def test_a_two_rank_fsdp2_loop_rolls_back_skips_and_stops_on_every_rank_at_once(db, tmp_path):
    _check(db, tmp_path, "fsdp")


def _torchrun(db, tmp_path, mode: str):
    """tests/client/torchrun_loop.py in `mode` on 2 ranks: each rank's record, every rank having
    trained the same steps (probes and replays included) to the same weights."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                        "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
                        str(REPO / "tests/client/torchrun_loop.py"), db.url, str(tmp_path / "data"), str(tmp_path),
                        mode], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-6000:]
    ranks = [json.loads((tmp_path / f"rank{i}.json").read_text()) for i in range(2)]
    seq = [[(t["attempt"], t["step"], t["probing"]) for t in rk["trained"]] for rk in ranks]
    assert seq[0] == seq[1] and ranks[0]["params"] == ranks[1]["params"]
    with db.sessions() as s:
        (rb,) = [a for a in actions_store.actions(s, mode) if a.kind == "rollback"]
    return ranks, rb


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_precise_skip_probes_on_every_rank_at_once(db, tmp_path):
    """Issue 39 item 3: precise skip under torchrun, FSDP2 (a probe's gradient check reads each
    rank's own shards). Sample 50's loss is NaN on the rank that trains it; the supervisor rolls back and asks to skip the window; both ranks train the same
    probes (the verdicts agreed: the loss averaged, one rank's NaN gradient or timeout every rank's),
    triage names the data, and the search narrows the skip to that sample's step."""
    ranks, rb = _torchrun(db, tmp_path, "precise")
    assert rb.state == "done" and rb.result["bisected"]["outcome"] == "narrowed", rb.result
    assert rb.result["bisected"]["cause"]["label"] == "data", rb.result
    skipped = {i for lo, hi in rb.result["skip_ranges"] for i in range(lo, hi)}
    assert 50 in skipped and len(skipped) <= 8, rb.result["skip_ranges"]
    probes = [t for t in ranks[0]["trained"] if t["probing"]]
    assert len(probes) >= 2 and any(50 in t["ids"] for rk in ranks for t in rk["trained"] if t["probing"])
    kept = [(t["step"], t["ids"]) for rk in ranks for t in rk["trained"] if t["attempt"] == 2 and not t["probing"]]
    assert not any(i in skipped for _, ids in kept for i in ids)
    assert ranks[0]["step"] == 40 and all(np.isfinite(t["loss"]) for t in ranks[0]["trained"][-5:])


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_gradient_fault_on_one_rank_is_hardware_on_that_rank_and_pages(db, tmp_path):
    """Issue 39: rank 1's gradient is corrupted once, after DDP's all-reduce; its weights break
    first, so the next step's NaN activations are pinned on rank 1 alone by the reduction. The
    replay from the checkpoint, on both ranks, runs clean: hardware, on rank 1; nothing skipped,
    and a person is paged to look at rank 1's device."""
    ranks, rb = _torchrun(db, tmp_path, "hardware")
    assert rb.state == "done", rb
    cause = rb.result["bisected"]["cause"]
    assert cause["label"] == "hardware" and cause["rank"] == 1 and cause["recorded_step"] == 12, cause
    assert rb.result["skip_ranges"] == [] and rb.result["bisected"]["outcome"] == "cleared"
    replays = [t for t in ranks[0]["trained"] if t["probing"]]
    assert [t["step"] for t in replays] == list(range(rb.result["checkpoint_step"] + 1, 13))  # one replay
    assert all(np.isfinite(t["loss"]) for t in replays)
    assert ranks[0]["step"] == 40 and np.isfinite(ranks[1]["trained"][-1]["loss"])
    with db.sessions() as s:
        decisions = [e.detail for e in audit_store.events(s, "hardware", "decision")]
    paged = [d for d in decisions if d["decision"] == "alert" and d["incident_id"] == rb.incident_id]
    assert len(paged) == 1 and any("suspect rank 1's device" in r for r in paged[0]["reasons"]), decisions
