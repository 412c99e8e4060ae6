"""Auth at the HTTP edge: one FastAPI dependency per scope, used by every route but /healthz.

    guard.require("read")                     Authorization: Bearer <token> (scheme in any case)
    guard.require("read", cookie=True)        ... or the web page's sign-in cookie (supervisor.web.login)

401: no token, an unknown or a revoked one. 403: a valid token without the scope. Each message
names the scope the route needs and how to get a token. Only the web routes accept the cookie,
and they are all GETs; the API takes bearer tokens only, so a browser's ambient credentials can
never drive a command (no cross-site request forgery on the API by construction).
"""

from __future__ import annotations

from typing import Callable
from urllib.parse import urlparse

from fastapi import HTTPException, Request

from supervisor.auth import ANONYMOUS_LOCAL, Authenticator, Principal

COOKIE = "thermowatch_token"
PUBLIC_READER = Principal("public-read", frozenset({"read"}))
HOWTO = "create one with `thermowatch token create NAME --scope {scope}`"


class SignInRequired(HTTPException):
    """A 401 on a web route: answered with the sign-in page instead of JSON (supervisor.web.login)."""


class Guard:
    """Turns a request into a Principal for a scope, or refuses it. `authn=None` is `auth: false`
    (serve allows that on loopback only: supervisor.auth.check_bind)."""

    def __init__(self, authn: Authenticator | None, *, public_read: bool = False) -> None:
        self.authn = authn
        self.public_read = public_read

    def require(self, scope: str, *, cookie: bool = False) -> Callable[[Request], Principal]:
        # A plain `def`: FastAPI runs it in its threadpool (it may query the token table).
        def dependency(request: Request) -> Principal:
            return self.check(request, scope, cookie=cookie)

        dependency.__name__ = f"require_{scope}"
        return dependency

    def check(self, request: Request, scope: str, *, cookie: bool = False) -> Principal:
        if self.authn is None:
            return ANONYMOUS_LOCAL
        refuse = SignInRequired if cookie else HTTPException
        secret = bearer(request)
        if secret is None and cookie:
            secret = request.cookies.get(COOKIE) or None
        if secret is None:
            if scope == "read" and self.public_read:
                return PUBLIC_READER
            raise refuse(401, f"this needs a token with the `{scope}` scope (Authorization: Bearer <token>); "
                              f"{HOWTO.format(scope=scope)}", headers={"WWW-Authenticate": "Bearer"})
        principal = self.authn.authenticate(secret)
        if principal is None:
            raise refuse(401, f"unknown or revoked token; this needs a token with the `{scope}` scope: "
                              f"{HOWTO.format(scope=scope)}",
                         headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})
        if not principal.allows(scope):
            raise HTTPException(403, f"token {principal.name!r} lacks the `{scope}` scope this needs (it has: "
                                     f"{', '.join(sorted(principal.scopes))}); use a token with `{scope}` or "
                                     f"{HOWTO.format(scope=scope)}")
        return principal


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
