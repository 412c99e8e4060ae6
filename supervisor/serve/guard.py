"""Auth at the HTTP edge: one FastAPI dependency per scope, used by every route but /healthz.

    guard.require("read")                     Authorization: Bearer <token> (scheme in any case)
    guard.require("read", cookie=True)        ... or the web page's sign-in cookie (supervisor.serve.web.login)
    guard.require("operate", browser=True)    ... or the cookie on a same-origin browser request

401: no token, an unknown or a revoked one. 403: a valid token without the scope. Each message
names the scope the route needs and how to get a token.

Where the sign-in cookie (SameSite=Strict, HttpOnly) opens what (issue 12, the interactive page):
  - the web pages (GETs; a 401 answers with the sign-in page);
  - the API's `read` routes, for GET and HEAD only: the page's own scripts fetch its JSON. Reads
    change nothing, no other site's request carries the cookie, and no CORS header lets another
    site read an answer;
  - the routes marked `browser=True` (approve / cancel an action): only when the request is
    same-origin (Sec-Fetch-Site, else Origin against Host; same_origin below), so another site
    can never drive them (no cross-site request forgery), and only with the scope the cookie's
    token holds (a `read`-only sign-in gets a 403).
Every other route takes bearer tokens only.

A link from an alert (supervisor.notify.link_grants, opened at GET /go/...) sets a second cookie,
LINK_COOKIE, holding a signed link session: it opens the same routes, but only those of its own
run (`run_id` in the path) and only for reading; a route about another run or about no one run
(the index, compare, /metrics) is a 403 saying so. The token cookie wins when both are present,
so opening a link never narrows a sign-in the browser already has.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from urllib.parse import urlparse

from fastapi import HTTPException, Request

from thermowatch.supervisor.errors import Forbidden
from thermowatch.supervisor.notify.link_grants import SESSION_PREFIX
from thermowatch.supervisor.serve.auth import ANONYMOUS_LOCAL, Authenticator, Principal

log = logging.getLogger(__name__)
COOKIE = "thermowatch_token"
LINK_COOKIE = "thermowatch_link"  # a link session (supervisor.notify.link_grants): one run, read only
PUBLIC_READER = Principal("public-read", frozenset({"read"}))
HOWTO = "create one with `thermowatch token create NAME --scope {scope}`"


class SignInRequired(HTTPException):
    """A 401 on a web route: answered with the sign-in page instead of JSON (supervisor.serve.web.login)."""


class Guard:
    """Turns a request into a Principal for a scope, or refuses it. `authn=None` is `auth: false`
    (serve allows that on loopback only: supervisor.serve.auth.check_bind)."""

    def __init__(self, authn: Authenticator | None, *, public_read: bool = False, public_url: str = "") -> None:
        self.authn = authn
        self.public_read = public_read
        self.public_url = public_url  # the page's origin behind an ingress, for same_origin()

    def require(self, scope: str, *, cookie: bool = False, browser: bool = False) -> Callable[[Request], Principal]:
        """cookie: a web page (the cookie opens it; a 401 is the sign-in page). browser: an API
        route a same-origin page script may call with the cookie (see the module docstring)."""
        # A plain `def`: FastAPI runs it in its threadpool (it may query the token table).
        def dependency(request: Request) -> Principal:
            return self.check(request, scope, cookie=cookie, browser=browser)

        dependency.__name__ = f"require_{scope}"
        return dependency

    def require_run(self, scope: str) -> Callable[..., Principal]:
        """`require(scope)` on a route with `{run_id}` in its path, and the run is the token's to
        write (supervisor.serve.auth: an ingest token writes only the runs it opened): 403 naming
        the rule otherwise, before the body is read."""
        def dependency(request: Request, run_id: str) -> Principal:
            principal = self.check(request, scope)
            if self.authn is not None:
                try:
                    self.authn.check_writes(principal, run_id)
                except Forbidden as exc:
                    log.warning("refused %s %s: %s", request.method, request.url.path[:200], exc)
                    raise HTTPException(403, str(exc)) from None
            return principal

        dependency.__name__ = f"require_{scope}_run"
        return dependency

    def check(self, request: Request, scope: str, *, cookie: bool = False, browser: bool = False) -> Principal:
        if self.authn is None:
            return ANONYMOUS_LOCAL
        refuse = SignInRequired if cookie else HTTPException
        secret = bearer(request)
        if secret is None and (cookie or (scope == "read" and request.method in ("GET", "HEAD"))):
            secret = signed_in(request)
        elif secret is None and browser and signed_in(request):
            if not same_origin(request, self.public_url):
                raise HTTPException(403, "refused: a request with the sign-in cookie from another site (or without "
                                         "Origin/Sec-Fetch-Site); send Authorization: Bearer <token> instead")
            secret = signed_in(request)
        if secret is None:
            if scope == "read" and self.public_read:
                return PUBLIC_READER
            raise refuse(401, f"this needs a token with the `{scope}` scope (Authorization: Bearer <token>); "
                              f"{HOWTO.format(scope=scope)}", headers={"WWW-Authenticate": "Bearer"})
        principal = self.authn.authenticate(secret)
        if principal is None:
            said = ("the sign-in from an alert's link has ended; open the newest alert's link, or sign in with a "
                    "token" if secret.startswith(SESSION_PREFIX) else "unknown or revoked token")
            raise refuse(401, f"{said}; this needs a token with the `{scope}` scope: {HOWTO.format(scope=scope)}",
                         headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        if not principal.allows(scope):
            raise HTTPException(403, f"token {principal.name!r} lacks the `{scope}` scope this needs (it has: "
                                     f"{', '.join(sorted(principal.scopes))}); use a token with `{scope}` or "
                                     f"{HOWTO.format(scope=scope)}")
        run_id = request.path_params.get("run_id")
        if not principal.reaches(run_id):
            if scope == "read" and self.public_read:
                return PUBLIC_READER
            what = f"run {run_id!r}" if run_id is not None else "this page (it is about every run)"
            log.warning("refused %s %s: link session %s reads run %r only", request.method,
                        request.url.path[:200], principal.name, principal.run_id)
            raise refuse(403, f"signed in by a link from an alert, which reads run {principal.run_id!r} only; to "
                              f"read {what}, sign in with a token: {HOWTO.format(scope=scope)}")
        return principal


def signed_in(request: Request) -> str | None:
    """The web page's sign-in cookie: the token's, else a link session's (see the module docstring)."""
    return request.cookies.get(COOKIE) or request.cookies.get(LINK_COOKIE) or None


def bearer(request: Request) -> str | None:
    """The token of `Authorization: Bearer <token>`; the scheme is case-insensitive (RFC 7235)."""
    header = request.headers.get("authorization")
    if header is None:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise HTTPException(401, "the Authorization header must be `Bearer <token>`",
                            headers={"WWW-Authenticate": "Bearer"})
    return value.strip()


def actor(principal: Principal, claimed: str | None) -> str:
    """The name recorded in action and audit rows: the token's (authenticated). A `who` the client
    sends is kept beside it, marked as a claim: "ci-bot (alice)"."""
    claimed = (claimed or "").strip()
    return principal.name if not claimed or claimed == principal.name else f"{principal.name} ({claimed})"


def same_origin(request: Request, public_url: str = "") -> bool:
    """A state-changing browser request (the sign-in and sign-out forms) comes from our own page:
    Sec-Fetch-Site where the browser sends it, else Origin against Host (or the public URL behind
    an ingress). Neither header: not a browser form post from any site we serve; refused."""
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")  # "none": typed into the address bar
    origin = request.headers.get("origin")
    if not origin or origin == "null":
        return False
    allowed = {request.headers.get("host", "")}
    if public_url:
        allowed.add(urlparse(public_url).netloc)
    return urlparse(origin).netloc in allowed
