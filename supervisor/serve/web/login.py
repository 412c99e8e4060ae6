"""Signing in to the web page with a token.

    GET  /login?next=/runs/x     the form (one password field)
    POST /login                  token=...&next=...   -> 303 to `next`, sets the cookie
    POST /logout                                      -> 303 to /login, clears it

The cookie holds the token itself, HttpOnly (no script reads it), SameSite=Strict (no other
site's page sends it) and Secure when the request came over https (directly or via an ingress
that says so in X-Forwarded-Proto). Both forms change state (login CSRF would sign a victim in
as the attacker), so they also need a same-origin Origin/Sec-Fetch-Site (supervisor.serve.guard).

SameSite=Strict has one cost: a link followed from Slack is a cross-site navigation, so its
first request arrives without the cookie. The sign-in page that answers it says so and links
to the same address, which a click then opens with the cookie.

    GET  /go/<grant>             an alert's signed link (supervisor.notify.link_grants): spends it,
                                 sets the link cookie (that run, read only) and lands on the run page

The landing is a small page of our own that navigates on (meta refresh, and a link), not a
redirect: Chromium does not send a SameSite=Strict cookie on a redirect within a navigation that
began on another site, even one set by that navigation's own response, so a 303 to the run page
would arrive without it. The page's own navigation is same-site, and carries it.
"""

from __future__ import annotations

from urllib.parse import parse_qs, quote, urlparse

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from thermowatch.supervisor.notify.link_grants import LinkGrants, LinkRefused, Refusal
from thermowatch.supervisor.serve.guard import COOKIE, LINK_COOKIE, Guard, SignInRequired, same_origin
from thermowatch.supervisor.serve.body import max_body, read_body
from thermowatch.supervisor.serve.web.pages import _page, e

MAX_FORM_BYTES = 4096


def _safe_next(target: str, base: str) -> str:
    """Only a path on this site: never `//evil.example` or `https://evil.example` (open redirect)."""
    if not target.startswith("/") or target.startswith("//") or "\\" in target:
        return base or "/"
    return target


def sign_in_page(base: str, target: str, message: str = "", status: int = 200) -> HTMLResponse:
    again = (f"<p class='muted'>Signed in already? A link from another site (Slack) arrives without the "
             f"sign-in cookie: <a id='continue' href='{e(target)}'>open {e(target)}</a>.</p>"
             if status == 401 and not message.startswith("unknown") else "")
    resp = _page("thermowatch: sign in", (
        "<h1>thermowatch: sign in</h1>"
        + (f"<p class='bad' id='message'>{e(message)}</p>" if message else "")
        + f"<form method='post' action='{e(base)}/login'>"
        f"<input type='hidden' name='next' value='{e(target)}'>"
        "<label>token <input type='password' name='token' id='token' autocomplete='off' size='50' autofocus></label> "
        "<button type='submit' id='sign-in'>sign in</button></form>"
        "<p class='muted'>A token with the <code>read</code> scope: "
        "<code>thermowatch token create NAME --scope read</code>. The daemon's first admin token is in "
        "<code>admin-token</code> in its data dir.</p>" + again))
    resp.status_code = status
    return resp


def _secure(request: Request) -> bool:
    return request.url.scheme == "https" or request.headers.get("x-forwarded-proto", "").lower() == "https"


def _refused_message(exc: LinkRefused, links: LinkGrants) -> tuple[str, int]:
    if exc.why is Refusal.SPENT:
        return ("this link was already used (each opens once); sign in with a token, or open the newest "
                "alert's link", 410)
    if exc.why is Refusal.EXPIRED:
        return (f"this link has expired (links last {links.ttl_s / 60:g} minutes); sign in with a token, or open "
                f"the newest alert's link", 410)
    return ("this link is not valid here (damaged, cut short, or made by another thermowatch); sign in with a "
            "token", 403)


def landing_page(target: str, run_id: str, session_h: float) -> HTMLResponse:
    """Signed in by a link: on to the run page by a navigation of this page (see the docstring)."""
    resp = _page("thermowatch: signed in", f"<meta http-equiv='refresh' content='0;url={e(target)}'>",
                 f"<h1>Signed in to run {e(run_id)}</h1>"
                 f"<p><a id='continue' href='{e(target)}'>Open run {e(run_id)}</a></p>"
                 f"<p class='muted'>This sign-in came from a link in an alert: it reads this run only, for "
                 f"{session_h:g} hours on this browser. Other runs need a token.</p>")
    resp.headers["Cache-Control"] = "no-store"
    resp.headers["Referrer-Policy"] = "no-referrer"  # this page's address holds the grant
    return resp


def install(app: FastAPI, guard: Guard, *, public_url: str = "", links: LinkGrants | None = None) -> None:
    """Add /login, /logout and /go/<grant>, and answer a web route's 401 with the sign-in page."""
    base = urlparse(public_url).path.rstrip("/") if public_url else ""
    router = APIRouter(tags=["web"], include_in_schema=False)

    @router.get("/login", response_class=HTMLResponse)
    def login_form(next: str = "") -> HTMLResponse:
        return sign_in_page(base, _safe_next(next, base))

    @router.post("/login", openapi_extra=max_body(MAX_FORM_BYTES))
    async def login(request: Request) -> Response:
        if not same_origin(request, public_url):
            return sign_in_page(base, base or "/", "refused: the sign-in form was posted from another site", 403)
        body = await read_body(request)  # at most MAX_FORM_BYTES (supervisor.serve.body), streamed
        form = parse_qs(body.decode("utf-8", "replace"))
        token = (form.get("token") or [""])[0].strip()
        target = _safe_next((form.get("next") or [""])[0], base)
        principal = None
        if token and guard.authn is not None:
            principal = await run_in_threadpool(guard.authn.authenticate, token)
        if principal is None:
            return sign_in_page(base, target, "unknown or revoked token" if token else "enter a token", 401)
        if not principal.allows("read"):
            return sign_in_page(base, target, f"token {principal.name!r} lacks the `read` scope the web page needs", 403)
        resp = RedirectResponse(target, status_code=303)
        resp.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=_secure(request), path=base or "/")
        return resp

    @router.post("/logout")
    def logout(request: Request) -> Response:
        if not same_origin(request, public_url):
            return sign_in_page(base, base or "/", "refused: the sign-out form was posted from another site", 403)
        resp = RedirectResponse(f"{base}/login", status_code=303)
        for name in (COOKIE, LINK_COOKIE):
            resp.delete_cookie(name, path=base or "/", httponly=True, samesite="strict", secure=_secure(request))
        return resp

    @router.get("/go/{grant}", response_class=HTMLResponse)
    def open_link(grant: str, request: Request) -> Response:
        """An alert's signed link (supervisor.notify.link_grants). Open on purpose: the grant is the
        credential, checked here (signature, expiry, spent once), and the audit trail says who opened
        it. A plain `def`: it writes to the database in FastAPI's threadpool."""
        if links is None:
            return sign_in_page(base, base or "/", "this daemon makes no signed links; sign in with a token", 404)
        client = request.client.host if request.client else ""
        forwarded = request.headers.get("x-forwarded-for", "")
        who = {"client": f"{client} (for {forwarded})" if forwarded else client,
               "user_agent": request.headers.get("user-agent", "")}
        try:
            opened, session = links.open(grant, **who)
        except LinkRefused as exc:
            if exc.why is not Refusal.SPENT:  # `open` audited a spent one
                links.refused(exc, **who)
            message, status = _refused_message(exc, links)
            target = exc.grant.landing(base) if exc.grant is not None else base or "/"
            resp = sign_in_page(base, target, message, status)
            resp.headers["Cache-Control"] = "no-store"
            return resp
        resp = landing_page(opened.landing(base), opened.run_id, links.session_s / 3600)
        # Its lifetime is the session's own expiry too (signed inside it): the cookie goes when it is void.
        resp.set_cookie(LINK_COOKIE, session, max_age=int(links.session_s), httponly=True, samesite="strict",
                        secure=_secure(request), path=base or "/")
        return resp

    @app.exception_handler(SignInRequired)
    async def sign_in_required(request: Request, exc: SignInRequired) -> Response:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        if base and not target.startswith(base):
            target = base + target
        resp = sign_in_page(base, _safe_next(quote(target, safe="/?=&%:"), base), str(exc.detail), exc.status_code)
        for k, v in (exc.headers or {}).items():
            resp.headers[k] = v
        return resp

    app.include_router(router)
