"""Replay triage and precise skip in the bundled trainer (issue 39 item 1), end to end: the run
controller on real DeepSpeed, the embedded Supervisor as sink and command channel, checkpoints
on disk, `precise_skip: {triage: true}`, and each of the three causes made real by a fault
drill (TrainConfig.faults):

- data: a sample range of uniformly random tokens. The replay of the same samples spikes where
  the run did (bit for bit: the data is a pure function of the state), the replay without the
  suspects runs clean, the search narrows the skip to the poisoned samples, and the re-trained
  path never trains them;
- hardware: one activation element of rank 1's forward goes NaN once (2 Ray ranks). The replay
  runs clean: nothing is skipped, rank 1 is named (only its figures broke) and a person is paged;
- optimizer: the LR x300 from a step on, every pass. Both replays spike: nothing is skipped and
  the supervisor cuts the LR at once, in the rollback's incident.
"""

from __future__ import annotations

import io
import math

import pytest

from tests.trainer.conftest import ray_session, tiny_config  # noqa: F401 - ray_session is a fixture
from thermowatch.monitors.commands import ActionState, CommandKind
from thermowatch.monitors.contract import LOSS, Ack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

AT, STEPS, B = 61, 75, 8  # the fault's step, past the spike detectors' warm-up (40 here)
# checkpoints every 10 and a 20-step margin: the rollback goes to 40, and each replay is ~21 steps
POLICY = {"rollback_margin_steps": 20, "cooldown_steps": 15, "skip_ahead_steps": 2}
# a 32-step window: the baseline is the last 32 steps, not the steep fall of the first 60
DETECTORS = {"loss": {"warmup": 40, "window": 32}, "grad": {"warmup": 40, "window": 32}, "disabled": ["outlier_rank"]}


def train(db, tmp_path, run: str, faults: dict, world_size: int = 1, policy: dict | None = None,
          lose_rank_at_probe: int | None = None):
    """`lose_rank_at_probe`: the in-process rank dies at that probe step (a lost node mid-search)."""
    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.app.service import Supervisor
    from thermowatch.supervisor.notify.console import ConsoleNotifier
    from thermowatch.supervisor.store import actions as actions_store
    from thermowatch.supervisor.store import audit as audit_store
    from thermowatch.supervisor.store import skips as skips_store
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import InProcessGang
    from thermowatch.trainer.worker import GangTimeout

    cfg = tiny_config(tmp_path, run_id=run, world_size=world_size, steps=STEPS, optim={"warmup_steps": 10},
                      checkpoint={"every": 10, "keep_last": 8, "keep_every": 0},
                      precise_skip={"triage": True}, faults=faults)
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "d", db_url=db.url, policy={**POLICY, **(policy or {})},
                                      detectors=DETECTORS), notifier=ConsoleNotifier(io.StringIO()))
    losses: dict[int, dict[int, float]] = {}
    gangs = []

    def on_step(rec, attempt):
        losses.setdefault(attempt, {})[rec.step] = rec.values.get(LOSS, math.nan)

    probes = []

    class Lost(InProcessGang):
        def call(self, method, *args, timeout_s=None):
            if method == "probe_step":
                probes.append(args[0])
                if len(probes) == lose_rank_at_probe:
                    self.kill()
                    raise GangTimeout("1 rank(s) did not answer within 600s (the node was lost mid-probe)")
            return super().call(method, *args, timeout_s=timeout_s)

    def in_process(*args):
        g = Lost(*args)
        gangs.append(g.worker)  # the rank, still readable once the run has killed its gang
        return g

    ctl = RunController(cfg, sup, sup, progress=on_step, gang_factory=in_process if world_size == 1 else None)
    try:
        result = ctl.run()
        seen = gangs[-1].sample_ids_seen(attempt=result.attempt) if gangs else None
        with sup.sessions() as s:
            acts = sorted(actions_store.actions(s, run), key=lambda a: a.id)
            skips = [tuple(r) for r in skips_store.skip_ranges(s, run)]
            decisions = [e.detail for e in audit_store.events(s, run, "decision")]
    finally:
        sup.close()
    return result, acts, skips, decisions, losses, seen


def first_rollback(acts):
    rb = next(a for a in acts if a.kind is CommandKind.ROLLBACK)
    assert rb.state is ActionState.DONE, (rb.state, rb.error)
    b = Ack.from_json(rb.result).bisected
    assert b is not None and b.cause is not None, rb.result
    return rb, b


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_poisoned_samples_are_data_and_the_re_trained_path_never_meets_them(db, tmp_path):
    poison = ((AT - 1) * B, (AT + 1) * B)  # steps AT and AT + 1 of the first pass
    result, acts, skips, _, losses, seen = train(db, tmp_path, "tri-data", {"poison": list(poison)})
    rb, b = first_rollback(acts)
    c = b.cause
    assert c.label == "data" and b.outcome == "narrowed", rb.result
    same, without = c.replays
    # the replay reproduced the run's spike exactly: same samples, same state, same loss
    assert same.spiked and same.step == c.recorded_step and same.loss == pytest.approx(c.recorded_loss, rel=1e-6)
    assert c.recorded_loss == pytest.approx(losses[0][c.recorded_step], rel=1e-6)
    assert without.suspects_skipped and not without.spiked and without.step == same.step
    assert c.steps == same.steps + without.steps == 2 * (same.step - rb.result["checkpoint_step"])
    assert b.steps > c.steps and b.seconds >= c.seconds > 0
    skipped = {i for lo, hi in rb.result["skip_ranges"] for i in range(lo, hi)}
    assert set(range(*poison)) <= skipped and len(skipped) <= poison[1] - poison[0] + B, rb.result["skip_ranges"]
    assert skips == [tuple(r) for r in rb.result["skip_ranges"]]  # what the supervisor booked: exactly that
    assert not any(a.kind is CommandKind.SET_LR for a in acts)
    # the path after the rollback never trained a poisoned sample, and trained on to the end, finite
    assert result.final_step == STEPS and result.attempt == rb.result["command_id"] and math.isfinite(result.final_loss)
    assert seen is not None and not ((seen >= poison[0]) & (seen < poison[1])).any()
    assert max(losses[result.attempt].values()) < min(v for s, v in losses[0].items() if s in range(AT, AT + 2))


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_flipped_bit_on_rank_1_is_hardware_on_that_rank_skips_nothing_and_pages(db, tmp_path, ray_session):
    # the team lets the supervisor restart without a suspect node: on this one-node Ray there is no
    # room to, and the trainer refuses, saying so, before anything changes
    result, acts, skips, decisions, losses, _ = train(db, tmp_path, "tri-hw", {"flip_step": AT, "flip_rank": 1},
                                                      world_size=2, policy={"restart_without_outlier": True})
    assert not math.isfinite(losses[0][AT])  # the flip broke the step it was made in
    rb, b = first_rollback(acts)
    c = b.cause
    assert c.label == "hardware" and b.outcome == "cleared" and c.rank == 1, rb.result
    assert c.recorded_step == AT and c.recorded_loss is None
    (replay,) = c.replays
    assert not replay.spiked and replay.step == AT and math.isfinite(replay.loss)
    assert b.probes == 1 and b.steps == c.steps == AT - rb.result["checkpoint_step"]
    assert rb.result["skip_ranges"] == [] and skips == []  # the window asked for is dropped
    assert "only rank 1's figures non-finite" in rb.result["detail"]
    paged = [d for d in decisions if d["incident_id"] == rb.incident_id
             and any("suspect rank 1's device" in r for r in d["reasons"])]
    assert [d["decision"] for d in paged] == ["rollback"], decisions  # the policy's test: page=True with it
    # ... and asked for a restart from the checkpoint just loaded without rank 1's node, nothing skipped
    (without,) = [a for a in acts if a.id > rb.id and a.kind is CommandKind.ROLLBACK]
    assert without.incident_id == rb.incident_id and without.args["exclude_rank"] == 1, without.args
    assert without.args["to_step"] == rb.result["checkpoint_step"] and not without.args.get("skip")
    assert without.state is ActionState.FAILED and "restarting without rank 1" in without.error, without.error
    # the replay did not repeat the fault, and neither did the re-trained path
    assert result.final_step == STEPS and all(math.isfinite(v) for v in losses[result.attempt].values())


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_an_lr_blow_up_is_the_optimizer_skips_nothing_and_the_lr_is_cut(db, tmp_path):
    # x300 every pass from AT; the cut brings it back near the LR this model trains at (x3)
    result, acts, skips, _, losses, _ = train(db, tmp_path, "tri-lr", {"lr_step": AT, "lr_factor": 300.0},
                                              policy={"lr_factor": 0.01, "min_lr_multiplier": 0.001})
    rb, b = first_rollback(acts)
    c = b.cause
    assert c.label == "optimizer" and b.outcome == "cleared", rb.result
    same, without = c.replays
    assert same.spiked and without.spiked and without.suspects_skipped
    assert rb.result["skip_ranges"] == [] and skips == []
    cut = next(a for a in acts if a.kind is CommandKind.SET_LR)
    assert cut.id > rb.id and cut.incident_id == rb.incident_id and cut.state is ActionState.DONE, cut
    assert cut.args["lr_multiplier"] == pytest.approx(0.01) and "replay triage" in cut.reason
    assert result.final_step == STEPS and math.isfinite(result.final_loss)


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_rank_lost_during_the_probes_skips_every_suspect_and_the_run_trains_on(db, tmp_path):
    """The gang dies in the middle of the search: no verdict, so the rollback is answered with the
    blunt skip the policy asked for (every suspect), the gang is restarted from the rollback's
    checkpoint, and the run trains to its end without meeting the poison."""
    poison = ((AT - 1) * B, (AT + 1) * B)
    result, acts, skips, _, _, seen = train(db, tmp_path, "tri-lost", {"poison": list(poison)}, lose_rank_at_probe=3)
    rb = next(a for a in acts if a.kind is CommandKind.ROLLBACK)
    assert rb.state is ActionState.DONE and "precise skip cut short" in rb.result["detail"], rb.result
    assert Ack.from_json(rb.result).bisected is None  # no search result to report
    asked = [tuple(r) for r in rb.args["skip_ranges"]]
    assert [tuple(r) for r in rb.result["skip_ranges"]] == asked and skips == asked  # the policy's whole window
    assert set(range(*poison)) <= {i for lo, hi in asked for i in range(lo, hi)}, asked
    assert result.restarts == 1 and result.final_step == STEPS and math.isfinite(result.final_loss)
    assert seen is not None and not ((seen >= poison[0]) & (seen < poison[1])).any()
