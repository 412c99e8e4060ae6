"""What the run page draws over its charts (issue 12): one read of everything that happened on the
step axis.

    GET /api/runs/{run_id}/events   (scope read)
    -> {"run_id",
        "incidents":  [{id, signal, module, severity, state, onset_step, detect_step, resolution,
                        outcome, findings: [{signal, metric, severity, onset_step, detect_step, evidence}]}],
        "actions":    [{id, kind, state, origin, who, reason, incident_id, awaiting_approval,
                        from_step, to_step, ack_step, created_at}],   # oldest first
        "lr_changes": [{start_step, multiplier, steps, action_id}],
        "skips":      [{sample_lo, sample_hi, step_lo, step_hi}],      # steps null if unknown
        "attempts":   [{attempt, start_step, started_at}],   # the newest 200, oldest first
        "attempts_total": n,                                  # opened; GET /api/runs/{run_id} pages them all
        "thresholds": [{metric, value, label}]}

    GET /api/runs/{run_id}/envelope (scope read): the loss envelope of the run's comparable runs
    (issue 24, item 1), drawn on the loss chart with the band a run must stay under.

`from_step`/`to_step` of a rollback: its incident's detection step and the checkpoint training
resumed from (the one the trainer's ack says it loaded, else the one asked for); `ack_step` is
the first step trained again, the checkpoint's + 1. `outcome`: the incident's resolution when
closed, else the state of its newest action. Thresholds come from the daemon's detector config
(the attention ceiling, on the logits and on their log-sum-exp bound). Non-finite evidence is the
strings "NaN"/"Infinity" (supervisor.serve.api.runs).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from sqlalchemy.orm import Session

from thermowatch.supervisor.serve.guard import Guard
from thermowatch.supervisor.serve.daemon import Daemon
from thermowatch.supervisor.serve.api.runs import json_response
from thermowatch.supervisor.store.views import incidents_with_findings, to_wire, require_run
from thermowatch.monitors.detectors import BankConfig
from thermowatch.monitors.commands import ActionState, CommandKind
from thermowatch.supervisor.app.config import judged_with
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import peers as peers_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import skips as skips_store
from thermowatch.supervisor.store import steps as steps_store

MAX_ACTIONS = 2000  # a run with more has bigger problems than a crowded chart
# Restarts drawn on the chart: the newest this many. One token opened 10^4 attempts of a run and
# this read sent every one, 0.7-1.0 s and 0.8 MB (issue 34); the run API pages the rest.
MAX_ATTEMPTS = 200
ENVELOPE_TTL_S = 30.0


def thresholds(s: Session, run_id: str, bank: BankConfig) -> list[dict[str, Any]]:
    """The ceilings the run was judged at: those its newest attempt was opened under (the
    daemon that judged it wrote them into the attempt_opened audit row), else this daemon's."""
    opened = audit_store.events(s, run_id, "attempt_opened", limit=1)
    judged = opened[0].detail.get("judged_with") if opened else None
    if not isinstance(judged, dict) or not {"attn_ceiling", "attn_lse_ceiling"} <= set(judged):
        judged = judged_with(bank)
    return [{"metric": "attn_logit_max", "value": judged["attn_ceiling"], "label": "attention ceiling"},
            {"metric": "attn_logit_lse", "value": judged["attn_lse_ceiling"], "label": "attention ceiling (lse bound)"}]


def _rollback_steps(a: actions_store.ActionRow, detect: dict[int, int]) -> tuple[int | None, int | None]:
    if a.kind is not CommandKind.ROLLBACK:
        return None, None
    return detect.get(a.incident_id) if a.incident_id is not None else None, a.checkpoint_step


def run_events(s: Session, run_id: str, bank: BankConfig) -> dict[str, Any]:
    require_run(s, run_id)
    acts = list(reversed(actions_store.actions(s, run_id, MAX_ACTIONS)))  # oldest first
    newest_action: dict[int, actions_store.ActionRow] = {a.incident_id: a for a in acts if a.incident_id is not None}
    incidents = []
    for i in incidents_with_findings(s, run_id):
        act = newest_action.get(i["id"])
        outcome = i["resolution"] if i["state"] != "open" else (f"{act.kind} {act.state}" if act else "open, no action")
        incidents.append({
            **{k: i[k] for k in ("id", "signal", "module", "severity", "state", "onset_step", "detect_step",
                                 "resolution")},
            "outcome": outcome,
            "findings": [{"signal": f["signal"], "metric": f.get("metric") or f.get("module"),
                          "severity": f["severity"], "onset_step": f["onset_step"], "detect_step": f["detect_step"],
                          "evidence": f.get("evidence") or {}} for f in i["findings"]],
        })
    detect = {i["id"]: i["detect_step"] for i in incidents}
    actions = []
    for a in acts:
        frm, to = _rollback_steps(a, detect)
        actions.append({"id": a.id, "kind": a.kind, "state": a.state, "origin": a.origin, "who": a.who,
                        "reason": a.reason, "incident_id": a.incident_id,
                        "awaiting_approval": a.requires_approval and a.state is ActionState.PENDING,
                        "from_step": frm, "to_step": to, "ack_step": a.ack_step,
                        "created_at": a.created_at.isoformat()})
    skips = []
    for lo, hi in skips_store.skip_ranges(s, run_id):
        st = steps_store.steps_of_samples(s, run_id, lo, hi)
        skips.append({"sample_lo": lo, "sample_hi": hi, "step_lo": st[0] if st else None,
                      "step_hi": st[1] if st else None})
    return {
        "run_id": run_id, "incidents": incidents, "actions": actions,
        "lr_changes": [{"start_step": c.start_step, "multiplier": c.multiplier, "steps": c.steps,
                        "action_id": c.action_id} for c in lr_store.lr_changes(s, run_id)],
        "skips": skips,
        "attempts": [{"attempt": a.attempt, "start_step": a.start_step, "started_at": a.started_at.isoformat()}
                     for a in reversed(runs_store.attempts_page(s, run_id, MAX_ATTEMPTS)[0])],
        "attempts_total": runs_store.attempt_count(s, run_id),
        "thresholds": thresholds(s, run_id, bank),
    }


def make_router(sup: Daemon, *, guard: Guard) -> APIRouter:
    router = APIRouter(prefix="/api", tags=["runs"], dependencies=[Depends(guard.require("read"))])

    @router.get("/runs/{run_id}/events")
    def events(run_id: str) -> Response:
        with sup.sessions() as s:
            return json_response(to_wire(run_events(s, run_id, sup.cfg.detectors)))

    cache: dict[str, tuple[float, dict[str, Any]]] = {}

    @router.get("/runs/{run_id}/envelope")
    def peer_envelope(run_id: str) -> Response:
        """The loss envelope of the run's comparable runs (supervisor/store/peers.py), drawn on
        the run page's loss chart: {run_id, peers, gap_nats, start, confirm, steps, envelope,
        peer (an index into peers, per point)}; no peers: empty arrays. Read at most every
        ENVELOPE_TTL_S per run: the page asks on every refresh, and it reads every peer's loss."""
        now = time.monotonic()
        hit = cache.get(run_id)
        if hit is None or now - hit[0] > ENVELOPE_TTL_S:
            with sup.sessions() as s:
                require_run(s, run_id)
                hit = (now, peers_store.envelope_view(s, run_id, sup.cfg.envelope))
            if len(cache) > 1000:
                cache.clear()
            cache[run_id] = hit
        return json_response(to_wire(hit[1]))

    return router
