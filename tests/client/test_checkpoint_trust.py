"""thermowatch.watch's checkpoints prove themselves (issue 39, item 2), on a user's own loop (a
real nanoGPT on CPU, real files, the real supervisor on both databases):

- a byte flipped in the newest checkpoint's tensors (torch.load reads it without a word, as other
  weights) is caught by its manifest's checksum: the rollback loads the older one, the ack says
  which it passed over and why, and the run trains on to the end;
- a checkpoint whose weights are NaN (saved right after the parameters were poisoned, so it is
  marked healthy): the rollback to it goes non-finite at the first re-trained step, the
  supervisor distrusts it and falls back one checkpoint further by itself, once, and the run
  finishes;
- a run of NaN checkpoints under keep_checkpoints=2 never deletes the newest healthy one
  (pocket-tts #262)."""

from __future__ import annotations

import json
import math
import time

import torch

from tests.client.user_loop import DATA, calm, train_step, user_batch
from tests.waits import action_final, action_handed
from thermowatch.checkpoint_io import load_as_data
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import checkpoints as ckpt_store


def _train(tw, model, opt, before=None, after=None) -> list[tuple[int, int, float]]:
    """The user's loop (docs/any-trainer.md); (attempt, step, loss) of every step trained."""
    trained = []
    for step in tw.steps():
        if before is not None:
            before(step)
        loss = train_step(model, opt, *user_batch(DATA, tw.batch_ids(step)))
        tw.record(loss)
        trained.append((tw.attempt, step, float(loss.detach())))
        if after is not None:
            after(step)
    tw.close()
    return trained


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def _wait_sent(sup, run: str, timeout: float = 20.0) -> None:
    """Until the supervisor's own action for `run` is in the loop's hands (polled, or done)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sup.sessions() as s:
            if any(a.origin == "auto" and a.state in ("sent", "acked", "done") for a in actions_store.actions(s, run)):
                return
        time.sleep(0.02)


def test_a_corrupt_newest_checkpoint_is_passed_over_and_the_run_goes_on(db, tmp_path):
    tw, model, opt = calm(db, tmp_path, "flipped", steps=30)
    ckpt, asked = tmp_path / "ckpt", {}

    def after(step: int) -> None:
        if step == 22 and not asked:
            newest = ckpt / "step_00000020.pt"
            body = json.loads((ckpt / "step_00000020.json").read_text())
            assert body["healthy"] and body["files"]["step_00000020.pt"]["size"] == newest.stat().st_size
            _flip(newest, newest.stat().st_size // 2)  # bit rot inside the weights, same size
            load_as_data(newest)  # torch.load takes it as it is: only the checksum can tell
            asked["rb"] = tw.run.supervisor.executor.submit("flipped", "rollback", {"to_step": 20}, "ana", "spike")
            action_handed(tw.run.supervisor, asked["rb"])  # a toy step is ms: 8 left could outrun the poll

    trained = _train(tw, model, opt, after=after)
    row = action_final(tw.run.supervisor, asked["rb"])
    res = row.result
    assert res["ok"] and res["checkpoint_step"] == 15 and res["first_step"] == 16, res
    assert "passed over 20 (step_00000020.pt crc32" in res["detail"] and "(corrupted)" in res["detail"], res
    # the run went on from 16 to the end, every loss finite; the corrupt file went with its trajectory
    assert [s for a, s, _ in trained if a == tw.attempt][:1] == [16] and trained[-1][1] == 30
    assert all(math.isfinite(v) for *_, v in trained)
    assert not (ckpt / "step_00000020.pt.refused").exists()


def test_a_nan_after_load_checkpoint_falls_back_once_and_the_run_finishes(db, tmp_path):
    tw, model, opt = calm(db, tmp_path, "nanload", steps=40)
    sup, ckpt, kept, asked = tw.run.supervisor, tmp_path / "ckpt", {}, {}

    def after(step: int) -> None:
        if step == 20 and tw.attempt == 1:  # checkpoint 20 is saved next, from these poisoned weights
            kept["weights"] = {k: v.clone() for k, v in model.state_dict().items()}
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(math.nan)
        if step == 25 and not asked:
            asked["rb"] = sup.executor.submit("nanload", "rollback", {"to_step": 20}, "ana", "a spike at 24")

    def before(step: int) -> None:
        if step == 21 and "weights" in kept and tw.attempt == 1:  # the run itself trains on healthy
            model.load_state_dict(kept.pop("weights"))
        if step == 23 and tw.attempt == 2:  # a real step takes longer than this toy's: let the fallback arrive
            _wait_sent(sup, "nanload")

    trained = _train(tw, model, opt, before=before, after=after)
    with sup.sessions() as s:
        acts = sorted(actions_store.actions(s, "nanload"), key=lambda a: a.id)
        ckpts = {c.step: c for c in ckpt_store.checkpoints(s, "nanload", include_deleted=True) if c.attempt == 1}
    manual, *auto = acts
    assert manual.result["checkpoint_step"] == 20 and manual.state == "done", manual.result
    # The rollback to 20 went non-finite at once; the supervisor fell back past it, once.
    assert [(a.kind, a.origin, a.args["to_step"]) for a in auto] == [("rollback", "auto", 15)], \
        [(a.kind, a.origin, a.args, a.reason) for a in auto]
    (fb,) = auto
    assert fb.state == "done" and fb.result["checkpoint_step"] == 15 and fb.result["first_step"] == 16, fb.result
    assert "checkpoint 20 is distrusted" in fb.reason and "weights it loaded are bad" in fb.reason, fb.reason
    assert not ckpts[20].healthy  # never a target again
    # Attempt 2 (from 20) trained NaN; attempt 3 (from 15) trained to the end, every loss finite.
    assert trained[-1][:2] == (3, 40) and tw.attempt == 3
    assert math.isnan(next(v for a, s, v in trained if a == 2))
    assert all(math.isfinite(v) for a, _, v in trained if a == 3)


def test_retention_after_a_run_of_nan_checkpoints_keeps_the_healthy_one(db, tmp_path):
    # Advise-only and never paused for the wait: nothing rolls the NaN run back, it only saves.
    tw, model, opt = calm(db, tmp_path, "keep", steps=60, keep_checkpoints=2,
                            sup={"policy": {"advise_only": True, "approval_pause_after_steps": None}})

    def after(step: int) -> None:
        if step == 12:
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(math.nan)

    _train(tw, model, opt, after=after)
    ckpt = tmp_path / "ckpt"
    on_disk = sorted(int(p.stem[5:]) for p in ckpt.glob("step_*.pt"))
    health = {s: json.loads((ckpt / f"step_{s:08d}.json").read_text())["healthy"] for s in on_disk}
    assert 10 in on_disk and health[10], health  # the newest healthy one, 10 checkpoints of NaN later
    assert [s for s, ok in health.items() if ok] == [s for s in on_disk if s <= 10]
    assert not any(health[s] for s in on_disk if s > 10)
    assert on_disk[-2:] == [55, 60]  # keep_checkpoints=2: the newest two, whatever they hold
