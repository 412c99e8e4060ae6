"""Signed links in alerts (issue 37 item 6): a link in a Slack message or a page signs its reader
in to one run's page, once, for a while, instead of asking a phone for a 46-character token.

    <public_url>/go/<grant>      grant = body "." mac; body = base64url(JSON), mac = HMAC-SHA256

A grant says: this run (and the incident to show), the `read` scope, the channel it was sent to,
a random id, and when it expires (`link_ttl_s`, an hour by default). It is made when the alert is
sent (the outbox's sender asks the notifier, supervisor.notify.paging.run_url), not when it is
written, so a message held back by an outage still carries a whole hour.

Opening it (supervisor.serve.web.login, GET /go/...) checks the signature, then the expiry, then
spends its id (supervisor.store.link_grants: a row per opened grant, so a second open, on any
replica, is refused) and writes the audit row, all in one transaction, and answers with a link
session: a second signed value, held in its own cookie, that reads that run only, for
SESSION_S. The key signing both lives in the database (store.link_grants), so a restart keeps
links valid and replicas share them. Grants and sessions are signed under different labels, so
one can never pass for the other.

Plain Python (no FastAPI): the notifiers call `url`, supervisor.serve.auth calls `session`.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import enum
import hashlib
import hmac
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable
from urllib.parse import quote

from sqlalchemy.orm import sessionmaker

from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import link_grants as link_store

log = logging.getLogger(__name__)

LINK_TTL_S = 3600.0  # see SupervisorConfig.link_ttl_s
# A link session lasts an on-call shift: long enough to follow an incident through the night from
# one tap, short enough that a phone left signed in is not signed in for good. It reads one run.
SESSION_S = 12 * 3600.0
SESSION_PREFIX = "twl_"  # a link session's cookie value; a token is "tw_..." (store.tokens)
GRANT_PATH = "/go/"
SCOPE = "read"  # the only scope a link gives: it can never act, approve or write
_GRANT_LABEL = b"thermowatch link grant v1\0"
_SESSION_LABEL = b"thermowatch link session v1\0"
_MAC_BYTES = 16  # 128 bits: forging one takes 2^128 tries; the URL stays short for a phone
_MAX_LEN = 2048  # a run id is at most 200 characters: anything longer was not made here


class Refusal(str, enum.Enum):
    """Why a link does not open; the page says what to do instead (supervisor.serve.web.login)."""

    INVALID = "invalid"  # not signed by this daemon's key: damaged, cut short, or made up
    EXPIRED = "expired"
    SPENT = "spent"  # opened before


class LinkRefused(Exception):
    def __init__(self, why: Refusal, grant: "Grant | None" = None) -> None:
        super().__init__(why.value)
        self.why = why
        self.grant = grant


@dataclass(frozen=True, slots=True)
class Grant:
    """What a link lets its first opener do: read `run_id`, landing on `incident_id`."""

    grant_id: str
    run_id: str
    incident_id: str | None
    channel: str  # where it was sent ("slack:#training-alerts", "pagerduty"): for the audit trail
    expires_at: int  # unix seconds

    @property
    def actor(self) -> str:
        """The name its opener reads under (the session's principal) and is audited as."""
        return f"link:{self.grant_id}"

    def landing(self, base: str = "") -> str:
        """The run page (the incident's place on it), a path under `base`."""
        path = f"{base}/runs/{quote(self.run_id, safe='')}"
        return path + (f"?incident={quote(self.incident_id)}" if self.incident_id is not None else "")


@dataclass(frozen=True, slots=True)
class LinkSession:
    """A signed-in link: reads `run_id` until `expires_at` (unix seconds)."""

    grant_id: str
    run_id: str
    expires_at: int

    @property
    def actor(self) -> str:
        return f"link:{self.grant_id}"


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class LinkGrants:
    """Makes and opens the signed links of one daemon. `sessions` may come after construction
    (`use`): the notifiers are built, and their secrets checked, before the database is opened."""

    def __init__(self, public_url: str = "", *, ttl_s: float = LINK_TTL_S, session_s: float = SESSION_S,
                 sessions: sessionmaker | None = None, clock: Callable[[], float] = time.time) -> None:
        self.public_url = public_url.rstrip("/")
        self.ttl_s = ttl_s
        self.session_s = session_s
        self.sessions = sessions
        self._clock = clock
        self._key: bytes | None = None
        self._lock = threading.Lock()

    def use(self, sessions: sessionmaker) -> "LinkGrants":
        self.sessions = sessions
        return self

    # --- making ---------------------------------------------------------------------------------

    def url(self, run_id: str, incident_id: Any = None, channel: str = "") -> str | None:
        """`<public_url>/go/<grant>` for the run (None without `public_url`). The key cannot be
        read (the database is down): None, and the caller links the plain run page instead,
        where a reader signs in with a token; an alert is never held back for its link."""
        if not self.public_url:
            return None
        try:
            return f"{self.public_url}{GRANT_PATH}{self.issue(run_id, incident_id, channel)}"
        except Exception as exc:  # noqa: BLE001 - a link is never worth failing a page for
            log.warning("no signed link for run %r (%s: %s); the alert links the plain run page", run_id,
                        type(exc).__name__, exc)
            return None

    def issue(self, run_id: str, incident_id: Any = None, channel: str = "") -> str:
        """A new grant for `run_id`, valid for `ttl_s` from now."""
        body = {"v": 1, "g": _b64(secrets.token_bytes(12)), "r": run_id,
                "i": None if incident_id is None else str(incident_id), "c": channel,
                "e": int(self._clock() + self.ttl_s)}
        return self._sign(_GRANT_LABEL, body)

    # --- opening --------------------------------------------------------------------------------

    def verify(self, token: str) -> Grant:
        """The grant `token` holds; LinkRefused INVALID (not ours, altered) or EXPIRED (with the
        grant). Spends nothing."""
        body = self._unsign(_GRANT_LABEL, token)
        try:
            grant = Grant(str(body["g"]), str(body["r"]), body["i"] if body["i"] is None else str(body["i"]),
                          str(body["c"]), int(body["e"]))
        except (KeyError, TypeError, ValueError):
            raise LinkRefused(Refusal.INVALID) from None
        if self._clock() >= grant.expires_at:
            raise LinkRefused(Refusal.EXPIRED, grant)
        return grant

    def open(self, token: str, *, client: str = "", user_agent: str = "") -> tuple[Grant, str]:
        """Spend the grant and start its session: (grant, the session's cookie value). Refused:
        LinkRefused (an expired or spent one audited as `link_refused`, with who tried)."""
        grant = self.verify(token)
        now = self._clock()
        session_until = int(now + self.session_s)
        who = {"client": client[:100], "user_agent": user_agent[:300]}
        expires = dt.datetime.fromtimestamp(grant.expires_at, dt.timezone.utc)
        with self._db().begin() as s:
            if not link_store.spend(s, grant.grant_id, grant.run_id, grant.incident_id, grant.channel, expires):
                first = link_store.spent(s, grant.grant_id)
                audit_store.audit(s, grant.run_id, grant.actor, "link_refused", {
                    "why": Refusal.SPENT.value, "grant": grant.grant_id, "channel": grant.channel,
                    "opened_at": first.spent_at.isoformat() if first is not None else None, **who})
                refused = True
            else:
                audit_store.audit(s, grant.run_id, grant.actor, "link_opened", {
                    "grant": grant.grant_id, "incident_id": grant.incident_id, "channel": grant.channel,
                    "scope": SCOPE, "expires_at": expires.isoformat(),
                    "session_until": dt.datetime.fromtimestamp(session_until, dt.timezone.utc).isoformat(), **who})
                # An hour's margin past expiry: a replica whose clock runs behind still finds the row.
                link_store.prune(s, dt.datetime.fromtimestamp(now - 3600, dt.timezone.utc))
                refused = False
        if refused:
            raise LinkRefused(Refusal.SPENT, grant)
        value = SESSION_PREFIX + self._sign(_SESSION_LABEL, {"v": 1, "g": grant.grant_id, "r": grant.run_id,
                                                             "e": session_until})
        log.info("link %s opened for run %r (sent to %s) from %s", grant.grant_id, grant.run_id,
                 grant.channel or "?", client or "?")
        return grant, value

    def refused(self, exc: LinkRefused, *, client: str = "", user_agent: str = "") -> None:
        """Audit an expired grant's open (a spent one is audited by `open`); an invalid one names
        no run we can trust, so it is only logged."""
        if exc.why is Refusal.EXPIRED and exc.grant is not None:
            with self._db().begin() as s:
                audit_store.audit(s, exc.grant.run_id, exc.grant.actor, "link_refused", {
                    "why": exc.why.value, "grant": exc.grant.grant_id, "channel": exc.grant.channel,
                    "client": client[:100], "user_agent": user_agent[:300]})
        log.warning("refused a link (%s) from %s", exc.why.value, client or "?")

    def session(self, value: str) -> LinkSession | None:
        """The link session a cookie holds, or None (not one, altered, or expired)."""
        if not value.startswith(SESSION_PREFIX):
            return None
        try:
            body = self._unsign(_SESSION_LABEL, value[len(SESSION_PREFIX):])
            sess = LinkSession(str(body["g"]), str(body["r"]), int(body["e"]))
        except (LinkRefused, KeyError, TypeError, ValueError):
            return None
        return sess if self._clock() < sess.expires_at else None

    # --- the signature --------------------------------------------------------------------------

    def _db(self) -> sessionmaker:
        if self.sessions is None:
            raise RuntimeError("LinkGrants has no database yet (LinkGrants.use(sessions))")
        return self.sessions

    def _signing_key(self) -> bytes:
        """Read once, then kept: the key changes only when an operator deletes its row (and restarts)."""
        with self._lock:
            if self._key is None:
                with self._db().begin() as s:
                    self._key = link_store.signing_key(s)
            return self._key

    def _mac(self, label: bytes, body: str) -> str:
        return _b64(hmac.new(self._signing_key(), label + body.encode(), hashlib.sha256).digest()[:_MAC_BYTES])

    def _sign(self, label: bytes, body: dict[str, Any]) -> str:
        text = _b64(json.dumps(body, separators=(",", ":")).encode())
        return f"{text}.{self._mac(label, text)}"

    def _unsign(self, label: bytes, token: str) -> dict[str, Any]:
        text, dot, mac = token.rpartition(".")
        if not dot or not text or len(token) > _MAX_LEN:
            raise LinkRefused(Refusal.INVALID)
        if not hmac.compare_digest(mac.encode("utf-8", "replace"), self._mac(label, text).encode()):
            raise LinkRefused(Refusal.INVALID)
        try:
            body = json.loads(_unb64(text))
        except (binascii.Error, ValueError):
            raise LinkRefused(Refusal.INVALID) from None
        if not isinstance(body, dict) or body.get("v") != 1:
            raise LinkRefused(Refusal.INVALID)
        return body
