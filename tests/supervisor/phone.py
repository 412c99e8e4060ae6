"""The pages on a phone (issue 37, item 6): a daemon with demo-like runs, and what a 390 x 844
screen shows of each page, in real headless Chromium. Shared by test_web_phone.py and
bench/phone_screens.py (which writes docs/screenshots/phone-*.png).

Runs: `jump-qkln`, the recorded trace of a tiny GPT whose loss jumps at step 301 through the real
Supervisor in advise-only mode (an open incident, a rollback awaiting approval); `demo-like`, the
shape of `thermowatch demo`'s run (9 incidents, 2 rollbacks, 3 attempts, 15 modules with long
names, 40 checkpoints, 60 audit rows: the page that was 20-26k px tall on a phone); and
test_runs_api's seeded rollback run.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from pathlib import Path

from thermowatch.monitors.contract import CheckpointInfo, Finding, RunInfo, Severity, Signal, StepRecord
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.db import upgrade
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit, checkpoints, findings, incidents, lr_changes, runs, skips, thermometers
from thermowatch.supervisor.store import steps as steps_store
from tests.fixtures import traces
from tests.supervisor.auth_helpers import ADMIN_TOKEN
from tests.supervisor.serve.test_runs_api import seed

JUMP, DEMO = "jump-qkln", "demo-like"
WIDTH, HEIGHT = 390, 844  # an iPhone 12-15's CSS pixels
# long module names, as a Hugging Face model spells them: the heatmap's labels must stay whole
MODULES = [f"model.layers.{i}.self_attn.q_proj" for i in range(12)] + ["model.embed_tokens", "model.norm", "lm_head"]


@dataclass
class PhoneRuns:
    sup: Supervisor
    approval: int  # the action awaiting approval on JUMP


def _demo_like(sup: Supervisor) -> None:
    """The demo's story, written through the store: a divergence caught 9 times across 4 layers
    in two attempts, two rollbacks (a skip, an LR cut), the third attempt trained to the end."""
    reason = ("attn_logit_ceiling on blocks.0.attn: onset step 18, detected at step 68 of attempt 0 (detector level "
              "critical, outcome act); rung 1: attn_logit_ceiling is a rollback signal; roll back to the checkpoint "
              "at step 10, the newest healthy one at or before onset 18 - margin 8; skipping the samples of steps "
              "11-68 and 16 steps' worth past them")
    with sup.sessions.begin() as s:
        for attempt, (lo, hi) in enumerate(((1, 69), (11, 85), (11, 201))):
            runs.open_attempt(s, RunInfo(DEMO, attempt, world_size=1, start_step=lo - 1, config={"steps": 200}))
            recs = []
            for st in range(lo, hi):
                hot = attempt < 2 and st > 15
                v = {"loss": 3.0 + 2.5 * math.exp(-st / 20) + (0.02 * (st - 15) if hot else 0.0),
                     "grad_norm": 0.8 + 0.1 * math.sin(st), "lr": 3e-3 * min(1.0, st / 100)}
                for i, m in enumerate(MODULES):
                    v[f"attn_logit_max/{m}"] = 20.0 + i + (1.12 ** (st - 15) if hot else 0.0)
                    v[f"act_max/{m}"] = 5.0 + i / 3 + 0.01 * st
                recs.append(StepRecord(step=st, values=v, sample_lo=16 * st, sample_hi=16 * st + 16))
            thermometers.append(s, DEMO, attempt, recs)
            steps_store.record_steps(s, DEMO, attempt, recs)
        for k in range(1, 41):  # every 5 steps; retention deleted all but the newest few
            checkpoints.record_checkpoint(s, DEMO, 2, CheckpointInfo(5 * k, f"/data/demo/ckpt/step_{5 * k}", 80 * k, True))
        checkpoints.mark_deleted(s, DEMO, [5 * k for k in range(1, 36)])
        rollbacks = []
        for n in range(9):
            layer = MODULES[n % 4]
            inc = incidents.open_incident(s, DEMO, "attn_logit_ceiling", layer, 17 + 5 * n, 52 + 4 * n, severity="critical")
            for extra in range(1 + n % 2):
                findings.add_finding(s, DEMO, Finding(Signal.ATTN_LOGIT_CEILING, layer, Severity.CRITICAL, 17 + 5 * n,
                                                      52 + 4 * n, metric=f"attn_logit_max/{layer}",
                                                      evidence={"threshold": 150, "value": 326.8 + extra,
                                                                "recent": [113.3, 171.3, 211.7, 206.6, 218.8, 234.5],
                                                                "outcome_why": "logit 327 >= extreme=300: too large to "
                                                                               "wait for a witness"}), inc)
            if n in (4, 8):
                rb = actions_store.enqueue_action(s, DEMO, "rollback", {"to_step": 10, "skip_ranges": [[192, 1088]]},
                                                  reason, "auto", "policy", incident_id=inc)
                for state in ("sent", "acked", "done"):
                    actions_store.set_action_state(s, rb, state, ack_step=11 if state == "acked" else None)
                rollbacks.append(rb)
                incidents.resolve_incident(s, inc, "rollback done at step 11")
            else:
                incidents.resolve_incident(s, inc, f"alert: attn_logit_ceiling on {layer}: onset step {17 + 5 * n}, "
                                                   f"detected at step {52 + 4 * n} (detector level critical, outcome alert)")
        skips.add_skip_range(s, DEMO, 192, 1088, action_id=rollbacks[0])
        lr_changes.add_lr_change(s, DEMO, 0.2, 11, None, action_id=rollbacks[1])
        for k in range(60):
            audit.audit(s, DEMO, "policy" if k % 2 else "trainer", "enqueued" if k % 2 else "done",
                        {"action_id": rollbacks[k % 2], "step": k, "note": "the policy's decision, as it was logged"})


def jump_supervisor(data_dir: Path, db_url: str) -> Supervisor:
    """The real Supervisor in advise-only mode fed JUMP's recorded trace; the caller closes it."""
    sup = Supervisor(SupervisorConfig(data_dir=data_dir, db_url=db_url, api_token=ADMIN_TOKEN, advise_only=True),
                     notifier=ConsoleNotifier(io.StringIO()))
    recs = traces.load("jump_qkln")
    sup.open_run(RunInfo(JUMP, 0, world_size=1, config={"steps": 1000}))
    for i in range(0, len(recs), 25):  # the run controller's batches, a checkpoint after each
        batch = recs[i:i + 25]
        sup.write(JUMP, 0, batch)
        sup.checkpoint_saved(JUMP, 0, CheckpointInfo(batch[-1].step, f"/ckpt/{batch[-1].step}", batch[-1].sample_hi, True))
    return sup


def awaiting_approval(sup: Supervisor) -> list:
    """JUMP's actions the policy left pending for a person (advise-only: its rollback)."""
    with sup.sessions() as s:
        return [a for a in actions_store.actions(s, JUMP) if a.requires_approval and a.state == "pending"]


def phone_daemon(tmp: Path) -> PhoneRuns:
    """A Supervisor over a fresh SQLite database in `tmp` holding the three runs; the caller closes it."""
    url = f"sqlite:///{tmp / 'phone.db'}"
    upgrade(url)
    sup = jump_supervisor(tmp / "data", url)
    _demo_like(sup)
    seed(type("DB", (), {"sessions": sup.sessions})())
    waiting = awaiting_approval(sup)
    assert len(waiting) == 1, waiting
    return PhoneRuns(sup, waiting[0].id)


def sign_in(b, base: str) -> None:
    """The sign-in cookie, set directly (the sign-in form is another page's business)."""
    b.page("Network.enable")
    b.page("Network.setCookie", name="thermowatch_token", value=ADMIN_TOKEN, url=base)


def at_phone_size(b) -> None:
    b.page("Emulation.setDeviceMetricsOverride", width=WIDTH, height=HEIGHT, deviceScaleFactor=1, mobile=True)


# What a page says of its layout once its charts are drawn (or at once, where it has none).
READY = ("(() => { const t = window.thermowatch; if (!document.querySelector('h1')) return false;"
         "return !t || t.loads >= 1 || t.errors.length > 0; })()")
MEASURE = """(() => {
  const d = document.documentElement, top = (sel) => { const el = document.querySelector(sel);
    return el ? Math.round(el.getBoundingClientRect().top + scrollY) : null; };
  const wide = [...document.querySelectorAll('body *')].filter((el) => el.getBoundingClientRect().right > d.clientWidth + 1)
    .slice(0, 5).map((el) => `${el.tagName}.${el.className} ${Math.round(el.getBoundingClientRect().right)}`);
  const approval = document.querySelector('.card.approval');
  return {height: d.scrollHeight, scrollWidth: d.scrollWidth, wide,
          story: top('#story'), approval: approval ? Math.round(approval.getBoundingClientRect().bottom + scrollY) : null,
          approve: top('.card.approval button.approve'), chart: top('figure.chart'),
          plot: top('figure.chart .u-over'), errors: window.thermowatch ? window.thermowatch.errors : []};
})()"""


def open_page(b, url: str) -> dict:
    """Go to `url` at phone size, wait until drawn; what MEASURE says of it."""
    at_phone_size(b)
    b.goto(url)
    b.wait_for(READY, timeout=60)
    return b.js(MEASURE)
