"""The command channel over HTTP, and manual actions (thin routers over supervisor.executor).

    GET  /api/runs/{run_id}/commands            -> {"commands": [Command...]}   (pending -> sent)
    POST /api/runs/{run_id}/acks                {Ack}                          -> {"ok": true}
         (an ack that cannot be accepted: 422 with the reason, and its action goes `failed`)
    POST /api/runs/{run_id}/actions             {"kind", "args", "who", "reason"} -> 201 {"action_id"}
    POST /api/actions/{action_id}/approve       {"who"}                        -> {"ok": true}
    POST /api/actions/{action_id}/cancel        {"who"}                        -> {"ok": true}
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException, Request
from pydantic import BaseModel

from monitors.contract import INT32_MAX, Ack, ContractError
from supervisor.api import call
from supervisor.api.ingest import _check_token, read_json
from supervisor.api.schemas import AckBody, Approval, ManualAction, body_doc, validate_body
from supervisor.limits import Limits, check_json

def _check_small(obj: Any, limits: Limits, where: str = "body") -> None:
    """Any small body: bounded nesting, and no string a column cannot hold (NUL on PostgreSQL,
    lone surrogates anywhere), wherever in the body it sits (who, reason, args, an ack's detail).
    Raises ContractError."""
    check_json(where, obj, max_depth=limits.max_json_depth, finite=False)


async def _parse(request: Request, model: type[BaseModel], limits: Limits) -> BaseModel:
    """The body as `model`, read only after the token check: unreadable JSON is a 400 and a field
    of the wrong shape a 422, each one sentence naming the problem (like ingest's answers)."""
    obj = await read_json(request, limits.max_small_body_bytes)
    try:
        _check_small(obj, limits)
    except ContractError as exc:
        raise HTTPException(422, str(exc)) from None
    return validate_body(model, obj)


def make_router(sup, *, token: str | None = None) -> APIRouter:
    router = APIRouter(prefix="/api", tags=["commands"])
    limits = getattr(sup, "limits", None) or Limits()  # the Supervisor's (config `limits:`)

    @router.get("/runs/{run_id}/commands")
    async def poll(run_id: str, request: Request) -> dict:
        _check_token(request, token)
        cmds = await call(sup.poll, run_id)
        return {"commands": [c.to_json() for c in cmds]}

    @router.post("/runs/{run_id}/acks", openapi_extra=body_doc(AckBody, "validated by monitors.commands.Ack"))
    async def ack(run_id: str, request: Request) -> dict:
        _check_token(request, token)
        obj = await read_json(request, limits.max_small_body_bytes)
        try:
            _check_small(obj, limits, "ack")
            a = Ack.from_json(obj)
        except ContractError as exc:
            # The trainer will not send it differently: fail its action now (with an alert)
            # rather than leave it `sent` until the ack watchdog gives up.
            cid = obj.get("command_id") if isinstance(obj, dict) else None
            if isinstance(cid, int) and not isinstance(cid, bool) and 0 <= cid <= INT32_MAX:
                await call(sup.executor.fail, run_id, cid, f"unacceptable acknowledgement: {exc}")
            raise HTTPException(422, str(exc)) from None
        await call(sup.ack, run_id, a)
        return {"ok": True}

    @router.post("/runs/{run_id}/actions", status_code=201, openapi_extra=body_doc(ManualAction))
    async def submit(run_id: str, request: Request) -> dict:
        _check_token(request, token)
        body = await _parse(request, ManualAction, limits)
        # The contract's constructors and the run's limits (supervisor.feasibility) decide: 422.
        action_id = await call(sup.executor.submit, run_id, body.kind, body.args, body.who, body.reason)
        return {"action_id": action_id}

    @router.post("/actions/{action_id}/approve", openapi_extra=body_doc(Approval))
    async def approve(action_id: int, request: Request) -> dict:
        _check_token(request, token)
        body = await _parse(request, Approval, limits)
        await call(sup.executor.approve, action_id, body.who)
        return {"ok": True}

    @router.post("/actions/{action_id}/cancel", openapi_extra=body_doc(Approval))
    async def cancel(action_id: int, request: Request) -> dict:
        _check_token(request, token)
        body = await _parse(request, Approval, limits)
        await call(sup.executor.cancel, action_id, body.who)
        return {"ok": True}

    return router
