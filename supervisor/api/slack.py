"""Slack's interactivity callbacks: the Approve / Cancel buttons on an approval alert.

    POST /api/slack/interactions   form body `payload=<JSON>` (Slack's block_actions), signed
                                   -> 200 {"ok": true, "action_id", "event"}

Slack holds no thermowatch token, so this route is outside the token scopes (supervisor.api.auth)
and trusts only Slack's request signature: HMAC-SHA256 of `v0:<timestamp>:<body>` with the app's
signing secret (slack_sdk.signature.SignatureVerifier), and a timestamp within 5 minutes, so a
captured request cannot be replayed later. Without a signing secret configured the route is a
404 (and the alerts carry no buttons). A click approves or cancels as the Slack user: the action
row and the audit trail name them ("slack:alice"), and the executor's reply goes into the
incident's thread like any other approval. Every refusal is a 4xx that changes nothing.

https://api.slack.com/authentication/verifying-requests-from-slack
https://api.slack.com/reference/interaction-payloads/block-actions
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable
from urllib.parse import parse_qs

from fastapi import APIRouter, HTTPException, Request

from supervisor.api import call
from supervisor.notify.slack import APPROVE, CANCEL

log = logging.getLogger(__name__)

MAX_BODY = 64 << 10  # a block_actions payload with the whole message in it is a few KB


def make_router(sup, *, signing_secret: str | None, clock: Callable[[], float] | None = None) -> APIRouter:
    router = APIRouter(prefix="/api/slack", tags=["slack"])
    verifier = None
    if signing_secret:
        from slack_sdk.signature import Clock, SignatureVerifier

        class _Clock(Clock):
            def now(self) -> float:
                return clock() if clock is not None else super().now()

        verifier = SignatureVerifier(signing_secret, clock=_Clock())

    @router.post("/interactions", responses={401: {"description": "bad signature or a timestamp over 5 min old"},
                                             404: {"description": "interactivity is not configured"}},
                 openapi_extra={"requestBody": {"required": True, "content": {"application/x-www-form-urlencoded": {
                     "schema": {"type": "object", "required": ["payload"], "properties": {"payload": {
                         "type": "string", "description": "Slack's block_actions JSON, signed by "
                                                          "X-Slack-Signature and X-Slack-Request-Timestamp"}}}}}}})
    async def interactions(request: Request) -> dict:
        if verifier is None:
            raise HTTPException(404, "Slack interactivity is not configured: set slack.signing_secret_env or "
                                     "slack.signing_secret_file to the Slack app's signing secret")
        body = await request.body()
        if len(body) > MAX_BODY:
            raise HTTPException(413, f"a Slack interaction payload is at most {MAX_BODY} bytes; got {len(body)}")
        stamp, signature = request.headers.get("X-Slack-Request-Timestamp", ""), request.headers.get("X-Slack-Signature")
        # is_valid() would raise on a timestamp that is not a number (a 500): refuse it here.
        if not (stamp.isdigit() and len(stamp) <= 12 and signature) or not verifier.is_valid(body, stamp, signature):
            log.warning("Slack interaction refused: bad signature or stale timestamp (from %s)",
                        request.client.host if request.client else "?")
            raise HTTPException(401, "Slack signature invalid, or its timestamp is more than 5 minutes off; "
                                     "check slack.signing_secret and the clocks")
        payload = _payload(body)
        action_id, button, who = _click(payload)
        if button == APPROVE:
            await call(sup.executor.approve, action_id, who)
            event = "approved"
        else:
            # only the question the button asked: an approved action is cancelled from the CLI
            await call(lambda: sup.executor.cancel(action_id, who, only_awaiting_approval=True))
            event = "cancelled"
        return {"ok": True, "action_id": action_id, "event": event, "who": who}

    return router


def _payload(body: bytes) -> dict[str, Any]:
    try:
        form = parse_qs(body.decode("utf-8"), strict_parsing=True)
        obj = json.loads(form["payload"][0])
    except (UnicodeDecodeError, ValueError, KeyError, IndexError):
        raise HTTPException(400, "expected Slack's form body `payload=<JSON>`") from None
    if not isinstance(obj, dict):
        raise HTTPException(400, "the Slack payload must be a JSON object")
    return obj


def _click(payload: dict[str, Any]) -> tuple[int, str, str]:
    """(action id, which button, who) from a block_actions payload."""
    if payload.get("type") != "block_actions":
        raise HTTPException(400, f"unsupported Slack interaction type {payload.get('type')!r}; only the "
                                 "Approve / Cancel buttons (block_actions) are handled")
    actions = payload.get("actions")
    if not isinstance(actions, list) or len(actions) != 1 or not isinstance(actions[0], dict):
        raise HTTPException(400, "expected exactly one action in the Slack payload")
    button, value = actions[0].get("action_id"), actions[0].get("value")
    if button not in (APPROVE, CANCEL):
        raise HTTPException(400, f"unknown Slack action {button!r}; expected {APPROVE!r} or {CANCEL!r}")
    if not isinstance(value, str) or not value.isdigit() or len(value) > 9:
        raise HTTPException(400, f"the button's value must be an action id, got {value!r}")
    user = payload.get("user")
    name = (user.get("username") or user.get("name") or user.get("id")) if isinstance(user, dict) else None
    if not isinstance(name, str) or not name.strip():
        raise HTTPException(400, "the Slack payload names no user; an approval must name who gave it")
    return int(value), button, f"slack:{name.strip()[:60]}"
