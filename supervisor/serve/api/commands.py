"""The command channel over HTTP, and manual actions (thin routers over supervisor.act.executor).

    GET  /api/runs/{run_id}/commands            -> {"commands": [Command...]}   (pending -> sent)
    POST /api/runs/{run_id}/acks                {Ack}                          -> {"ok": true}
         (an ack that cannot be accepted: 422 with the reason, and its action goes `failed`)
    POST /api/runs/{run_id}/actions             {"kind", "args", "who"?, "reason"} -> 201 {"action_id"}
    POST /api/actions/{action_id}/approve       {"who"?}                       -> {"ok": true}
    POST /api/actions/{action_id}/cancel        {"who"?}                       -> {"ok": true}
    POST /api/runs/{run_id}/silences            {"signal", "for_s", "who"?, "reason"?} -> 201 the silence
    GET  /api/runs/{run_id}/silences            -> {"silences": [...]} (newest first, "active" or not)
    POST /api/silences/{silence_id}/end         {"who"?}                       -> the silence, ended
    POST /api/runs/{run_id}/acknowledge         {"incident" | "action", "who"?, "reason"?} -> who has the page
         (a person takes a page: the pagers stop escalating it; nothing about the run changes)

Scopes (supervisor.serve.guard): polling and acknowledging are the trainer's (`ingest`); submitting,
approving and cancelling are a person's (`operate`). The actor recorded in the action and audit
rows is the token's name; an optional `who` is kept beside it as a claim ("ci-bot (alice)").
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from thermowatch.monitors.commands import CommandKind
from thermowatch.monitors.contract import INT32_MAX, Ack, ContractError
from thermowatch.supervisor.serve.api import call
from thermowatch.supervisor.serve.guard import Guard, actor
from thermowatch.supervisor.serve.daemon import Daemon
from thermowatch.supervisor.serve.body import read_json
from thermowatch.supervisor.serve.api.openapi import explain
from thermowatch.supervisor.serve.auth import Principal
from thermowatch.supervisor.limits import check_small_body
from thermowatch.supervisor.errors import NotFound


class ManualAction(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a key nobody reads is a typo: 422 naming it
    # str, not CommandKind: the executor names an unknown kind with the list of manual ones
    kind: str = Field(description="pause, resume, rollback, skip, set_lr, stop or profile",
                      json_schema_extra={"enum": [k.value for k in CommandKind]})
    args: dict[str, Any] = Field(default_factory=dict)
    who: str = Field("", max_length=90, description="optional: the person behind the token, recorded beside the token's name")
    reason: str = ""


class SilenceBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    signal: str = Field(description="the signal to silence (attn_logit_growth, loss_spike, stall, ...) or * for all")
    for_s: float = Field(description="seconds, more than 0 and at most a week")
    who: str = Field("", max_length=90, description="optional: the person behind the token, recorded beside the token's name")
    reason: str = Field("", max_length=2000)


class PageAck(BaseModel):
    model_config = ConfigDict(extra="forbid")
    incident: int | None = Field(None, ge=1, le=INT32_MAX, description="the incident whose page you take")
    action: int | None = Field(None, ge=1, le=INT32_MAX, description="or the manual action whose page you take")
    who: str = Field("", max_length=90, description="optional: the person behind the token, recorded beside the token's name")
    reason: str = Field("", max_length=2000)


class Approval(BaseModel):
    model_config = ConfigDict(extra="forbid")
    who: str = Field("", max_length=90, description="optional: the person behind the token, recorded beside the token's name")


async def _parse(request: Request, model: type[BaseModel]) -> BaseModel:
    """The body as `model`, read only after the token check: unreadable JSON is a 400 and a field
    of the wrong shape a 422, each one sentence naming the problem (like ingest's answers)."""
    obj = await read_json(request)
    try:
        check_small_body(obj)
        return model.model_validate(obj)
    except ContractError as exc:
        raise HTTPException(422, str(exc)) from None
    except ValidationError as exc:
        raise HTTPException(422, explain(exc.errors(), "request body")) from None


def make_router(sup: Daemon, *, guard: Guard) -> APIRouter:
    router = APIRouter(prefix="/api", tags=["commands"])
    trainer = Depends(guard.require_run("ingest"))  # the run's own trainer (supervisor.serve.auth)
    operator = Depends(guard.require("operate"))
    # The run page's Approve / Cancel buttons call these two with the sign-in cookie, same-origin
    # only (supervisor.serve.guard); every other command route takes bearer tokens only.
    page_operator = Depends(guard.require("operate", browser=True))

    @router.get("/runs/{run_id}/commands")
    async def poll(run_id: str, request: Request, _: Principal = trainer) -> dict:
        cmds = await call(sup.poll, run_id)
        return {"commands": [c.to_json() for c in cmds]}

    @router.post("/runs/{run_id}/acks")
    async def ack(run_id: str, request: Request, who: Principal = trainer) -> dict:
        obj = await read_json(request)
        try:
            check_small_body(obj, "ack")
            a = Ack.from_json(obj)
        except ContractError as exc:
            # The trainer will not send it differently: fail its action now (with an alert)
            # rather than leave it `sent` until the ack watchdog gives up.
            cid = obj.get("command_id") if isinstance(obj, dict) else None
            if isinstance(cid, int) and not isinstance(cid, bool) and 0 <= cid <= INT32_MAX:
                await call(sup.executor.fail, run_id, cid, f"unacceptable acknowledgement: {exc}")
            raise HTTPException(422, str(exc)) from None
        await call(sup.ack, run_id, a, who.name)
        return {"ok": True}

    @router.post("/runs/{run_id}/actions", status_code=201)
    async def submit(run_id: str, request: Request, who: Principal = operator) -> dict:
        body = await _parse(request, ManualAction)
        # The contract's constructors and the run's limits (supervisor.decide.feasibility) decide: 422.
        action_id = await call(sup.executor.submit, run_id, body.kind, body.args,
                               actor(who, body.who), body.reason)
        return {"action_id": action_id}

    @router.post("/actions/{action_id}/approve")
    async def approve(action_id: int, request: Request, who: Principal = page_operator) -> dict:
        body = await _parse(request, Approval)
        await call(sup.executor.approve, action_id, actor(who, body.who))
        return {"ok": True}

    @router.post("/actions/{action_id}/cancel")
    async def cancel(action_id: int, request: Request, who: Principal = page_operator) -> dict:
        body = await _parse(request, Approval)
        await call(sup.executor.cancel, action_id, actor(who, body.who))
        return {"ok": True}

    @router.post("/runs/{run_id}/silences", status_code=201)
    async def silence(run_id: str, request: Request, who: Principal = operator) -> dict:
        """Silence a signal of the run for a while: its alerts stop paging; its findings still act."""
        body = await _parse(request, SilenceBody)
        return await call(sup.executor.silence, run_id, body.signal, body.for_s, actor(who, body.who), body.reason)

    @router.get("/runs/{run_id}/silences")
    async def silences(run_id: str, request: Request, _: Principal = Depends(guard.require("read"))) -> dict:
        from thermowatch.supervisor.store import runs as runs_store
        from thermowatch.supervisor.store import silences as silences_store

        def read() -> list[dict]:
            with sup.sessions() as s:
                if runs_store.get_run(s, run_id) is None:
                    raise NotFound(f"no run {run_id!r}")
                now = silences_store.utcnow()
                return [{**x.to_json(), "active": x.ended_at is None and x.until > now}
                        for x in silences_store.listed(s, run_id)]

        return {"silences": await call(read)}

    @router.post("/silences/{silence_id}/end")
    async def unsilence(silence_id: int, request: Request, who: Principal = operator) -> dict:
        body = await _parse(request, Approval)
        return await call(sup.executor.unsilence, silence_id, actor(who, body.who))

    @router.post("/runs/{run_id}/acknowledge")
    async def acknowledge(run_id: str, request: Request, who: Principal = operator) -> dict:
        """Take a page: its escalation stops; an approval it asks for still waits for its answer."""
        body = await _parse(request, PageAck)
        return await call(lambda: sup.executor.acknowledge_page(run_id, actor(who, body.who), incident_id=body.incident,
                                                                action_id=body.action, reason=body.reason))

    from thermowatch.supervisor.serve.api import document_bodies
    from thermowatch.supervisor.serve.api.schemas import AckBody, ManualActionBody

    document_bodies(router, {("POST", "/api/runs/{run_id}/acks"): AckBody,
                             ("POST", "/api/runs/{run_id}/actions"): ManualActionBody,
                             ("POST", "/api/actions/{action_id}/approve"): Approval,
                             ("POST", "/api/actions/{action_id}/cancel"): Approval,
                             ("POST", "/api/runs/{run_id}/silences"): SilenceBody,
                             ("POST", "/api/silences/{silence_id}/end"): Approval,
                             ("POST", "/api/runs/{run_id}/acknowledge"): PageAck})
    return router
