"""Slack's interactivity callbacks: the Approve / Cancel buttons on an approval alert, and the
Acknowledge button on a page (issue 37: it stops the page's escalation, Executor.acknowledge_page).

    POST /api/slack/interactions   form body `payload=<JSON>` (Slack's block_actions), signed
                                   -> 200 {"ok": true, "action_id", "event"}
                                      (Acknowledge: {"ok": true, "story", "event", "already"})

Slack holds no thermowatch token, so this route is outside the token scopes (supervisor.serve.guard)
and trusts only Slack's request signature: HMAC-SHA256 of `v0:<timestamp>:<body>` with the app's
signing secret (slack_sdk.signature.SignatureVerifier), and a timestamp within 5 minutes, so a
captured request cannot be replayed later. Without a signing secret configured the route is a
404 (and the alerts carry no buttons).

A signature proves the click came from the workspace, not that the clicker may decide: only a
Slack user in `slack.approvers` or a member of a group in `slack.approver_groups` may
(supervisor.decide.approvers; closed by default, issue 21). Anyone else is answered 403 (503 when a
group could not be read), and the refusal is logged, audited ("refused") and said in the
action's thread; the action is left as it is.

A click approves or cancels as the Slack user, recorded as `slack:<handle> (<user id>)`, e.g.
"slack:alice (U0ALICE)": the id is who they are (stable, unique, ASCII; what the allow-list
checks), the handle is for people reading the thread, cut down to word characters, '.' and '-'
so no control character, NUL or look-alike "(U...)" reaches a log line or the database (the
same `who` on SQLite and PostgreSQL). The executor's reply goes into the incident's thread like
any other approval. Every refusal is a 4xx (or the 503 above) that changes nothing about the
action; hostile input (bytes that are not UTF-8, Unicode digits where ASCII ones belong, a
signature that is not hex) is a 4xx naming what was wrong, never a 500 (issue 21).

https://api.slack.com/authentication/verifying-requests-from-slack
https://api.slack.com/reference/interaction-payloads/block-actions
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, NoReturn
from urllib.parse import parse_qs

from fastapi import APIRouter, HTTPException, Request
from starlette.concurrency import run_in_threadpool

from thermowatch.supervisor.serve.api import call
from thermowatch.supervisor.serve.body import max_body, read_body
from thermowatch.supervisor.serve.daemon import Daemon
from thermowatch.supervisor.decide.approvers import USER_ID, Approvers
from thermowatch.supervisor.notify.slack import ACK, APPROVE, CANCEL, STORY

log = logging.getLogger(__name__)

MAX_BODY = 64 << 10  # a block_actions payload with the whole message in it is a few KB

# ASCII digits only (issue 21): str.isdigit() also takes '²', which int() refuses (a 500), and
# '٣', which int() reads as 3 (another action than the one the button names).
_STAMP = re.compile(r"[0-9]{1,12}")
_ACTION_ID = re.compile(r"[0-9]{1,9}")
# Slack's signature is "v0=" and a hex SHA-256; hmac.compare_digest raises on a non-ASCII str.
_SIGNATURE = re.compile(r"v0=[0-9a-f]{64}")
# What of a Slack handle goes into `who`: word characters, '.', '-' (Slack's own handle rules).
_NOT_HANDLE = re.compile(r"[^\w.\-]")
_VERB = {APPROVE: "approve", CANCEL: "cancel", ACK: "acknowledge"}


@dataclass(frozen=True, slots=True)
class Click:
    """One Approve / Cancel / Acknowledge click, from a signed block_actions payload."""

    action_id: int  # Approve / Cancel: the action; Acknowledge: the story's id
    button: str  # APPROVE, CANCEL or ACK
    user_id: str  # Slack's member id, U... or W...: what the allow-list checks
    who: str  # for the action row, the audit trail and the thread: "slack:alice (U0ALICE)"
    story: str = ""  # Acknowledge: "incident" or "action", the kind of story `action_id` names


def make_router(sup: Daemon, *, signing_secret: str | None, clock: Callable[[], float] | None = None,
                approvers: Approvers | None = None) -> APIRouter:
    """`approvers`: who may click (supervisor.decide.approvers); None or empty: nobody (closed)."""
    approvers = approvers if approvers is not None else Approvers()
    router = APIRouter(prefix="/api/slack", tags=["slack"])
    verifier = None
    if signing_secret:
        from slack_sdk.signature import Clock, SignatureVerifier

        class _Clock(Clock):
            def now(self) -> float:
                return clock() if clock is not None else super().now()

        verifier = SignatureVerifier(signing_secret, clock=_Clock())

    @router.post("/interactions", responses={400: {"description": "not Slack's block_actions payload for a button"},
                                             401: {"description": "bad signature or a timestamp over 5 min old"},
                                             403: {"description": "the Slack user is not in slack.approvers or "
                                                                  "slack.approver_groups"},
                                             404: {"description": "interactivity is not configured"},
                                             503: {"description": "an approver group could not be read from Slack"}},
                 openapi_extra={**max_body(MAX_BODY), "requestBody": {"required": True, "content": {"application/x-www-form-urlencoded": {
                     "schema": {"type": "object", "required": ["payload"], "properties": {"payload": {
                         "type": "string", "description": "Slack's block_actions JSON, signed by "
                                                          "X-Slack-Signature and X-Slack-Request-Timestamp"}}}}}}})
    async def interactions(request: Request) -> dict:
        if verifier is None:
            raise HTTPException(404, "Slack interactivity is not configured: set slack.signing_secret_env or "
                                     "slack.signing_secret_file to the Slack app's signing secret")
        body = bytes(await read_body(request))  # at most MAX_BODY bytes (supervisor.serve.body), streamed
        stamp = request.headers.get("X-Slack-Request-Timestamp", "")
        signature = request.headers.get("X-Slack-Signature", "")
        # Shapes first: is_valid() raises (a 500) on a timestamp int() refuses and on a non-ASCII signature.
        if not (_STAMP.fullmatch(stamp) and _SIGNATURE.fullmatch(signature)):
            _refuse_signature(request, "no Slack signature, or its headers are malformed "
                                       "(X-Slack-Request-Timestamp: ASCII digits; X-Slack-Signature: v0=<64 hex>)")
        text = _text(body)
        if not verifier.is_valid(text, stamp, signature):
            _refuse_signature(request, "Slack signature invalid, or its timestamp is more than 5 minutes off; "
                                       "check slack.signing_secret and the clocks")
        click = _click(_payload(text))
        verb = _VERB[click.button]
        verdict = await run_in_threadpool(approvers.decide, click.user_id)
        if not verdict.allowed and click.button == ACK:
            log.warning("Slack acknowledge of %s %d by %s refused (%d): %s", click.story, click.action_id, click.who,
                        verdict.status, verdict.why)
            raise HTTPException(verdict.status, f"{click.who} may not acknowledge pages from Slack: {verdict.why}")
        if not verdict.allowed:
            log.warning("Slack %s of action %d by %s refused (%d): %s", verb, click.action_id, click.who,
                        verdict.status, verdict.why)
            await call(sup.executor.refuse, click.action_id, click.who, verb, verdict.why)
            raise HTTPException(verdict.status, f"{click.who} may not {verb} action {click.action_id} from Slack: "
                                                f"{verdict.why}")
        if click.button == ACK:
            ident = {f"{click.story}_id": click.action_id}
            got = await call(lambda: sup.executor.acknowledge_page(None, click.who, **ident))
            return {"ok": True, "story": f"{click.story}:{click.action_id}", "event": "acknowledged",
                    "already": got["already"], "who": got["who"]}
        if click.button == APPROVE:
            await call(sup.executor.approve, click.action_id, click.who)
            event = "approved"
        else:
            # only the question the button asked: an approved action is cancelled from the CLI
            await call(lambda: sup.executor.cancel(click.action_id, click.who, only_awaiting_approval=True))
            event = "cancelled"
        return {"ok": True, "action_id": click.action_id, "event": event, "who": click.who}

    return router


def _refuse_signature(request: Request, why: str) -> NoReturn:
    log.warning("Slack interaction refused: %s (from %s)", why, request.client.host if request.client else "?")
    raise HTTPException(401, why)


def _text(body: bytes) -> str:
    """Slack's body is URL-encoded ASCII; bytes that are not UTF-8 come from no Slack."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise HTTPException(400, f"the body is not UTF-8 text (byte {body[exc.start]:#04x} at {exc.start}); "
                                 "expected Slack's URL-encoded form body `payload=<JSON>`") from None


def _payload(text: str) -> dict[str, Any]:
    try:
        form = parse_qs(text, strict_parsing=True)
        obj = json.loads(form["payload"][0])
    except (ValueError, KeyError, IndexError, RecursionError):
        raise HTTPException(400, "expected Slack's form body `payload=<JSON>`") from None
    if not isinstance(obj, dict):
        raise HTTPException(400, "the Slack payload must be a JSON object")
    return obj


def _click(payload: dict[str, Any]) -> Click:
    """Which button, on which action, by whom, from a block_actions payload."""
    if payload.get("type") != "block_actions":
        raise HTTPException(400, f"unsupported Slack interaction type {_show(payload.get('type'))}; only the "
                                 "Approve / Cancel buttons (block_actions) are handled")
    actions = payload.get("actions")
    if not isinstance(actions, list) or len(actions) != 1 or not isinstance(actions[0], dict):
        raise HTTPException(400, "expected exactly one action in the Slack payload")
    button, value = actions[0].get("action_id"), actions[0].get("value")
    if button not in (APPROVE, CANCEL, ACK):
        raise HTTPException(400, f"unknown Slack action {_show(button)}; expected {APPROVE!r}, {CANCEL!r} or {ACK!r}")
    story = ""
    if button == ACK:
        if not isinstance(value, str) or not STORY.fullmatch(value):
            raise HTTPException(400, "the Acknowledge button's value must be incident:<id> or action:<id> (1 to 9 "
                                     f"ASCII digits), got {_show(value)}")
        story, value = value.split(":")
    elif not isinstance(value, str) or not _ACTION_ID.fullmatch(value):
        raise HTTPException(400, f"the button's value must be an action id (1 to 9 ASCII digits), got {_show(value)}")
    user = payload.get("user")
    user_id = user.get("id") if isinstance(user, dict) else None
    if not isinstance(user_id, str) or not USER_ID.fullmatch(user_id):
        raise HTTPException(400, f"the Slack payload's user.id is {_show(user_id)}, not a Slack member id (U... or "
                                 "W...); an approval must name who gave it")
    handle = user.get("username") or user.get("name")
    handle = _NOT_HANDLE.sub("", handle)[:60] if isinstance(handle, str) else ""
    who = f"slack:{handle} ({user_id})" if handle else f"slack:{user_id}"
    return Click(int(value), button, user_id, who, story)


def _show(v: Any) -> str:
    """A value from the payload, for a message: ASCII (no control character, no lone surrogate) and short."""
    text = ascii(v)
    return text if len(text) <= 60 else text[:57] + "..."
