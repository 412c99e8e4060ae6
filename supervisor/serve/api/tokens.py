"""Token administration over HTTP (`admin` scope). The same store functions serve
`thermowatch token ...` (thermowatch.cli), which talks to the database directly.

    GET  /api/tokens                    -> {"tokens": [{name, scopes, run_prefix, created_at, revoked_at}]}
    POST /api/tokens                    {"name", "scopes": [...], "run_prefix"?} -> 201 {"name", "scopes", "run_prefix", "secret"}
         (the secret is in this answer and nowhere else: only its digest is stored)
    POST /api/tokens/{name}/revoke      -> {"name", "revoked_at"}
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import ConfigDict, BaseModel, Field

from thermowatch.supervisor.serve.api import call
from thermowatch.supervisor.serve.guard import Guard
from thermowatch.supervisor.serve.daemon import Daemon
from thermowatch.supervisor.serve.api.commands import _parse
from thermowatch.supervisor.serve.auth import Principal
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import tokens as tokens_store


class NewToken(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=100, pattern=tokens_store.NAME_RE.pattern,
                      description="who or what holds it: trainer-run42, alice")
    scopes: list[Literal["ingest", "read", "operate", "admin"]] = Field(min_length=1)
    run_prefix: str = Field("", max_length=200, description="an ingest token opens only runs whose id starts "
                                                             "with this; it writes only the runs it opened either way")


def create(sessions, name: str, scopes, actor: str, run_prefix: str = "") -> tuple[tokens_store.TokenRow, str]:
    with sessions.begin() as s:
        row, secret = tokens_store.create_token(s, name, scopes, run_prefix=run_prefix)
        audit_store.audit(s, None, actor, "token_created", {"name": row.name, "scopes": list(row.scopes),
                                                            **({"run_prefix": row.run_prefix} if row.run_prefix else {})})
    return row, secret


def revoke(sessions, name: str, actor: str) -> tokens_store.TokenRow:
    with sessions.begin() as s:
        row = tokens_store.revoke(s, name)
        audit_store.audit(s, None, actor, "token_revoked", {"name": name})
    return row


def listing(sessions) -> list[dict]:
    with sessions() as s:
        return [{"name": t.name, "scopes": list(t.scopes), "run_prefix": t.run_prefix,
                 "created_at": t.created_at.isoformat(),
                 "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None}
                for t in tokens_store.list_tokens(s)]


def make_router(sup: Daemon, *, guard: Guard) -> APIRouter:
    router = APIRouter(prefix="/api", tags=["tokens"])
    admin = Depends(guard.require("admin"))

    @router.get("/tokens")
    async def list_tokens(_: Principal = admin) -> dict:
        return {"tokens": await call(listing, sup.sessions)}

    @router.post("/tokens", status_code=201)
    async def create_token(request: Request, who: Principal = admin) -> dict:
        body = await _parse(request, NewToken)
        row, secret = await call(create, sup.sessions, body.name, body.scopes, who.name, body.run_prefix)
        return {"name": row.name, "scopes": list(row.scopes), "run_prefix": row.run_prefix, "secret": secret}

    @router.post("/tokens/{name}/revoke")
    async def revoke_token(name: str, who: Principal = admin) -> dict:
        row = await call(revoke, sup.sessions, name, who.name)
        return {"name": row.name, "revoked_at": row.revoked_at.isoformat() if row.revoked_at else None}

    from thermowatch.supervisor.serve.api import document_bodies

    document_bodies(router, {("POST", "/api/tokens"): NewToken})  # read by _parse after the token check
    return router
