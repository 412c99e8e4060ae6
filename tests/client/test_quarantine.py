"""Which samples did it (issue 24, item 5), end to end: a user's loop under thermowatch.watch
(embedded supervisor) trains on data with a poisoned stretch (uniformly random tokens); the loss
spikes, the policy rolls back and skips the window; with precise skip on, the client first
re-trains the window from the checkpoint in halves and skips only the offenders it finds; the
re-trained path runs clean past the old detection, and the skipped ids become the run's
quarantine, read through the daemon's API and `thermowatch quarantine`.
"""

from __future__ import annotations

import httpx
import pytest
import torch

import thermowatch
from tests.client.faults import Faults
from tests.client.user_loop import train_step, user_model
from tests.live_server import running
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH
from thermowatch.checkpoint_io import load_as_data
from thermowatch.cli import main
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.act.outcome import outcome
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import quarantine as quarantine_store

B = 16
# The samples of steps 171-172 on the first pass: 32 ids. Late enough that the checkpoint the
# policy picks (step 50, for onset 171 - margin 100) is one retention would have deleted by the
# time the command arrives, had it kept only the newest 5 (checkpoint_every 25, keep 5 saves
# step 175 around then): the rollback failed so in bench/precise_skip.py.
POISON = range(170 * B, 172 * B)
STEPS = 280
DATASET = 4000  # the loop's data: one pass and a bit; the quarantine names its data indices too


def batch(ids: torch.Tensor, poison: range = POISON) -> tuple[torch.Tensor, torch.Tensor]:
    """A corrupt shard: the poisoned ids' data is uniformly random bytes (tests/client/faults.py)."""
    return Faults(poison=poison).batch(ids)


def train(db, tmp_path, run: str, precise: bool = True, poison: range = POISON, trained: list | None = None,
          policy: dict | None = None):
    """`trained`: filled with (attempt, step, probe, ids, loss) of every step the loop trained."""
    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url, api_token=ADMIN_TOKEN, policy=policy or {})
    tw = thermowatch.watch(model, opt, run=run, steps=STEPS, global_batch=B, checkpoint_dir=tmp_path / "ckpt",
                           checkpoint_every=25, scheduler=sched, supervisor_config=cfg, poll_interval_s=0.05,
                           precise_skip=precise, dataset_size=DATASET)
    poisoned_steps = 0
    for step in tw.steps():
        ids = torch.as_tensor(tw.batch_ids(step))
        poisoned_steps += any(int(i) in poison for i in ids) and not tw.probing  # probes are thrown away
        loss = train_step(model, opt, *batch(ids, poison))
        if trained is not None:
            trained.append((tw.attempt, step, tw.probing, ids.tolist(), loss.item()))
        tw.record(loss)
        sched.step()
    tw.close()
    return tw.run.supervisor, poisoned_steps


# SQLite only (CI time): the quarantine's queries run on both databases in
# tests/supervisor/store/test_quarantine_store.py; this is the seam, client to CLI.
@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_skip_that_held_becomes_the_quarantine(db, tmp_path, capsys):
    sup, poisoned_steps = train(db, tmp_path, "poisoned")
    with sup.sessions() as s:
        found = quarantine_store.verdicts(s, "poisoned")
    assert found, "the poisoned stretch must have been rolled back and skipped"
    first = found[0]
    assert first.signal == "loss_spike" and 170 <= first.detect_step <= 180, first
    assert first.checkpoint_step == 50, first  # the policy's target, kept by retention (KEEP_BEHIND)
    assert first.status == "quarantine", first.why
    quarantined = quarantine_store.quarantined(found)
    ids = {i for lo, hi in quarantined for i in range(lo, hi)}
    assert set(POISON) <= ids  # every poisoned sample is in it ...
    assert poisoned_steps == 2  # ... and the re-trained path never saw one again
    # A blunt skip would have taken every sample from the onset margin to the detection (51x the
    # poison here): those are the suspects; the search skipped the poison and little else.
    b = first.bisected
    # the suspects: the window (onset 171 - margin 100 to the detection, and skip_ahead_steps 16
    # past it) and what the abandoned path trained after it, before the rollback arrived
    window = (first.detect_step - (171 - 100) + 1 + 16) * B
    suspects = sum(hi - lo for lo, hi in b["suspects"])
    assert b["suspects"][0][0] == (171 - 100 - 1) * B and window <= suspects <= window + 10 * B
    assert b["outcome"] == "narrowed" and b["probes"] >= 2 and b["steps"] > 0
    assert first.samples == len(ids) <= len(POISON) + B  # at most one step's batch beside the poison
    with sup.sessions() as s:
        done = [outcome(a) for a in actions_store.actions(s, "poisoned") if a.kind == "rollback"]
    assert done[0]["bisected"] == b and done[0]["skip_ranges"] == [list(r) for r in first.ranges]

    # the same through the daemon's API and the CLI, as the data team reads it
    with running(build_app(sup)) as url:
        flags = ["--server", url, "--token", ADMIN_TOKEN]
        got = httpx.get(f"{url}/api/runs/poisoned/quarantine", headers=AUTH).json()
        assert got["quarantine"] == [list(r) for r in quarantined] and got["samples"] == len(ids)
        assert [v["status"] for v in got["verdicts"]] == [v.status for v in found]
        assert httpx.get(f"{url}/api/runs/nope/quarantine", headers=AUTH).status_code == 404
        assert httpx.get(f"{url}/api/runs/poisoned/quarantine?horizon=0", headers=AUTH).status_code == 422
        capsys.readouterr()
        assert main(["quarantine", "poisoned", *flags]) == 0
        text = capsys.readouterr().out
        assert f"quarantine: {len(ids):,} samples" in text and "loss_spike detected at step" in text
        assert f"precise skip: {len(ids):,} of {suspects:,} suspect" in text
        assert main(["quarantine", "poisoned", "--ids", *flags]) == 0
        assert [int(x) for x in capsys.readouterr().out.split()] == sorted(ids)
        # the data team's names: data indices (id % dataset_size), here the ids themselves
        assert got["dataset_size"] == DATASET and got["data_indices"] == [[lo % DATASET, hi % DATASET] for lo, hi in quarantined]
        assert main(["quarantine", "poisoned", "--data", *flags]) == 0
        assert [int(x) for x in capsys.readouterr().out.split()] == sorted(i % DATASET for i in ids)
        assert main(["quarantine", "nope", *flags]) != 0


# Issue 35's stretch: 15 steps' worth (first-pass steps 151-165, 240 samples). The loss spikes at
# its first step and the rollback's window (onset - margin to the detection, and what the
# abandoned path trained before the command) ends a few steps into it: the search follows the
# stretch past the window's end, block by block, until a block runs clean. The policy's own
# skip_ahead_steps (16 past the detection) would cover this stretch; it is off here, as for a
# stretch longer than it.
STRETCH = range(150 * B, 165 * B)


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_stretch_running_past_the_window_is_skipped_whole(db, tmp_path):
    trained: list = []
    sup, _ = train(db, tmp_path, "stretch", poison=STRETCH, trained=trained, policy={"skip_ahead_steps": 0})
    with sup.sessions() as s:
        found = quarantine_store.verdicts(s, "stretch")
    with sup.sessions() as s:
        details = [outcome(a).get("detail") for a in actions_store.actions(s, "stretch")]
    assert len(found) == 1, ([(v.status, v.why) for v in found], details)  # one rollback: no recurrence
    first = found[0]
    assert first.bisected["outcome"] == "narrowed", details
    ids = {i for lo, hi in quarantine_store.quarantined(found) for i in range(lo, hi)}
    assert set(STRETCH) <= ids, f"{len(set(STRETCH) - ids)} poisoned ids not skipped"
    assert len(ids - set(STRETCH)) <= B, f"{len(ids - set(STRETCH))} clean ids quarantined"
    b = first.bisected
    assert b["outcome"] == "narrowed"
    window_end = max(hi for lo, hi in b["suspects"])
    assert window_end > STRETCH.stop, b["suspects"]  # it searched past the stretch's end
    # no poisoned sample trained after the first rollback, but by its probes (thrown away)
    first_attempt = trained[0][0]
    again = [(a, st) for a, st, probe, batch_ids, _ in trained
             if a > first_attempt and not probe and set(batch_ids) & set(STRETCH)]
    assert again == [], again
    # the probes' spike bar starts from the checkpoint's own newest losses (kept in it), the
    # path's: the newest checkpoint holds those of the steps the loop kept, not of an abandoned path
    last = max(int(p.name[5:13]) for p in (tmp_path / "ckpt").glob("step_*.pt"))
    kept = {st: loss for a, st, probe, _, loss in trained if not probe}  # the newest attempt's, step by step
    held = load_as_data(tmp_path / "ckpt" / f"step_{last:08d}.pt")["losses"]
    assert held == pytest.approx([kept[st] for st in range(last - len(held) + 1, last + 1)], rel=1e-5)
