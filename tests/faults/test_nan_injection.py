"""NaN injected into one layer's output (issue 13, the fault matrix): a forward hook on one block's
MLP of a real training rank (DeepSpeed ZeRO, in this process: trainer.local.InProcessGang) turns
its output into NaN for one step, as a bad kernel or a flipped bit would. The NaN then reaches
the loss and, through the update, the weights: every later step is NaN until something acts.
(The forward hook runs after the thermometers' own hook on that MLP, so the first activation
thermometer to read NaN is the block's output, `blocks.1`.)

The whole loop is real: the RunController, the embedded Supervisor (detectors, policy, executor)
as sink and command channel, checkpoints on disk. What must survive: the non-finite findings at
the injected step point at the injected layer; the policy rolls back on its own to a checkpoint saved
before it and skips the step's samples; the run finishes with finite losses; every step of the
live path is stored once, and the action ends `done`. The step's findings locate the layer.
(The incident's headline is the loss, its first finding; every non-finite finding of the step, and
the action's reason, name the first module whose output broke.)"""

from __future__ import annotations

import io
import math

import pytest

from tests.fixtures.diverging import DETECTORS, POLICY
from tests.trainer.conftest import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
RUN, BAD_STEP, LAYER = "naninject", 9, "blocks.1"


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_nan_in_one_layers_output_is_named_rolled_back_and_skipped(db, tmp_path):
    import torch

    from thermowatch.monitors.contract import LOSS
    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.notify.console import ConsoleNotifier
    from thermowatch.supervisor.app.service import Supervisor
    from thermowatch.supervisor.store import actions as actions_store
    from thermowatch.supervisor.store import findings as findings_store
    from thermowatch.supervisor.store import incidents as incidents_store
    from thermowatch.supervisor.store import thermometers as thermo_store
    from thermowatch.supervisor.store.orm import Step
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import InProcessGang

    cfg = tiny_config(tmp_path, run_id=RUN, world_size=1, steps=24, optim={"warmup_steps": 2},
                      checkpoint={"every": 2, "keep_last": 8, "keep_every": 0})
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "d", db_url=db.url, policy=dict(POLICY),
                                      detectors=dict(DETECTORS)), notifier=ConsoleNotifier(io.StringIO()))
    armed, fired, gangs = {"on": False}, [], []

    def nan_out(module, inputs, output):
        if armed["on"]:
            armed["on"] = False
            fired.append(True)
            return torch.full_like(output, math.nan)
        return None

    def gang_factory(*args):
        g = InProcessGang(*args)
        module = g.worker._engine.engine.module
        dict(module.named_modules())[f"{LAYER}.mlp"].register_forward_hook(nan_out)
        gangs.append(g)
        return g

    def on_step(rec, attempt):
        if attempt == 0 and rec.step == BAD_STEP - 1:
            armed["on"] = True  # the next forward, step BAD_STEP's, gets a NaN from the layer

    ctl = RunController(cfg, sup, sup, progress=on_step, gang_factory=gang_factory)
    try:
        result = ctl.run()
        with sup.sessions() as s:
            incs = incidents_store.incidents(s, RUN)
            acts = actions_store.actions(s, RUN)
            rows = s.query(Step.attempt, Step.step).filter(Step.run_id == RUN).all()
            live, loss = thermo_store.history(s, RUN, LOSS)
            found = [f.finding for f in findings_store.findings(s, RUN)]
    finally:
        sup.close()

    assert fired == [True]  # injected once, at step BAD_STEP of attempt 0
    first = incs[0]
    assert first.signal == "non_finite" and first.onset_step == BAD_STEP  # the loss, at once
    # Located by the findings of that step: the activations of the injected block and everything
    # after it in the forward pass are non-finite, nothing before it (the gradients are NaN
    # everywhere: the backward pass carries the NaN to every layer, so they cannot locate it).
    acts_nan = {f.module for f in found if f.signal.value == "non_finite" and f.detect_step == BAD_STEP
                and f.metric.split("/")[0] in ("act_max", "act_min")}
    assert LAYER in acts_nan and not acts_nan & {"embed_norm", "blocks.0", "blocks.0.attn", "blocks.0.mlp"}, acts_nan
    # Every non-finite finding of the step names where it began, and so does the action's reason:
    # the injected block, not the loss. (Its MLP's own thermometer hook ran before the injecting
    # hook, so the first broken output the thermometers saw is the block's.)
    origins = {f.evidence.get("origin") for f in found if f.signal.value == "non_finite" and f.detect_step == BAD_STEP}
    assert origins == {f"act_max/{LAYER}"}, origins
    (rb,) = [a for a in acts if a.kind == "rollback" and a.incident_id == first.id]
    assert f"it began in act_max/{LAYER}," in rb.reason, rb.reason
    assert rb.origin == "auto" and rb.state == "done"
    assert rb.args["to_step"] < BAD_STEP and rb.args["to_step"] % 2 == 0
    lo, hi = rb.args["skip_ranges"][0]
    assert lo < hi and ctl.ledger.ranges  # the step's samples are never trained again
    assert result.final_step == cfg.steps and len(result.attempts) >= 2
    assert len(rows) == len(set(rows)) and live.tolist() == list(range(1, cfg.steps + 1))
    # The live path is finite again after the rollback (the NaN steps were abandoned).
    assert all(math.isfinite(x) for x in loss.tolist()), loss
