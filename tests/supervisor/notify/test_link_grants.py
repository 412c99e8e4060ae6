"""Signed links in alerts (issue 37 item 6; supervisor.notify.link_grants): a link signs its
reader in to one run, read only, once, for a while. On real SQLite and PostgreSQL: the grant
itself (sign, verify, expiry, tampering, replay, replicas sharing the key), the real FastAPI app
(the session reads its run and nothing else, never acts), and the channels that carry the link."""

from __future__ import annotations

import base64
import contextlib
import http.server
import io
import json
import os
import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import delete, func, select

from thermowatch.monitors.contract import Severity
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor, build_notifier
from thermowatch.supervisor.notify import Alert, ConsoleNotifier
from thermowatch.supervisor.notify.link_grants import SESSION_PREFIX, LinkGrants, LinkRefused, Refusal
from thermowatch.supervisor.notify.pagerduty import PagerDutyNotifier
from thermowatch.supervisor.notify.slack import SlackNotifier
from thermowatch.supervisor.notify.webhook import WebhookNotifier
from thermowatch.supervisor.serve.guard import COOKIE, LINK_COOKIE
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import link_grants as link_store
from tests.fakes.slack_server import FakeSlack, fake_slack  # noqa: F401 - the fixture
from tests.supervisor.auth_helpers import ADMIN_TOKEN, make_token
from tests.supervisor.serve.test_runs_api import RUN, seed

PUBLIC = "https://tw.example.org"


class Clock:
    def __init__(self, t: float = 1_800_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def grants(db, clock=None, **kw) -> LinkGrants:
    return LinkGrants(PUBLIC, sessions=db.sessions, clock=clock or Clock(), **kw)


def token_of(url: str) -> str:
    assert url.startswith(f"{PUBLIC}/go/"), url
    return url[len(f"{PUBLIC}/go/"):]


def audited(db, run_id: str, event: str) -> list[audit_store.AuditRow]:
    with db.sessions() as s:
        return audit_store.events(s, run_id, event)


# --- the grant ----------------------------------------------------------------------------------


def test_a_grant_names_its_run_incident_channel_and_expiry(db):
    clock = Clock()
    links = grants(db, clock, ttl_s=600)
    url = links.url("run-7", 42, "slack:#alerts")
    g = links.verify(token_of(url))
    assert (g.run_id, g.incident_id, g.channel, g.expires_at) == ("run-7", "42", "slack:#alerts", clock.t + 600)
    assert g.landing("/tw") == "/tw/runs/run-7?incident=42"
    assert len(url) < 200  # a phone shows it whole enough; the run id is most of it
    # no incident: the run page itself; a run id with URL characters stays one path segment
    g = links.verify(token_of(links.url("a/b?c", None)))
    assert g.incident_id is None and g.landing() == "/runs/a%2Fb%3Fc"
    assert LinkGrants("", sessions=db.sessions).url("run-7") is None  # no public_url: no link at all


def test_a_grant_expires(db):
    clock = Clock()
    links = grants(db, clock, ttl_s=600)
    token = token_of(links.url("run-7"))
    clock.t += 599
    assert links.verify(token).run_id == "run-7"
    clock.t += 1
    with pytest.raises(LinkRefused) as exc:
        links.open(token)
    assert exc.value.why is Refusal.EXPIRED and exc.value.grant.run_id == "run-7"
    with db.sessions() as s:
        assert s.scalar(select(func.count()).select_from(link_store.LinkGrant)) == 0  # nothing spent


def _swap_body(token: str, **change) -> str:
    body, mac = token.rsplit(".", 1)
    obj = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    obj.update(change)
    new = base64.urlsafe_b64encode(json.dumps(obj, separators=(",", ":")).encode()).rstrip(b"=").decode()
    return f"{new}.{mac}"


def test_a_tampered_or_foreign_grant_is_refused(db):
    links = grants(db)
    token = token_of(links.url("run-7", 1))
    body, mac = token.rsplit(".", 1)
    flipped = mac[:-1] + ("A" if mac[-1] != "A" else "B")
    forged = [
        _swap_body(token, r="other-run"),  # the run changed, the signature kept
        _swap_body(token, e=4_000_000_000),  # a longer life
        _swap_body(token, i="9"),
        f"{body}.{flipped}",
        body, f"{body}.", f".{mac}", "", ".", "not-a-grant", "é.é", token + "x", "A" * 5000 + "." + mac,
    ]
    for bad in forged:
        with pytest.raises(LinkRefused) as exc:
            links.open(bad)
        assert exc.value.why is Refusal.INVALID and exc.value.grant is None, bad
    # a grant is not a session, nor a session a grant: they are signed under different labels
    _, session = links.open(token)
    assert links.session(SESSION_PREFIX + token) is None
    with pytest.raises(LinkRefused):
        links.verify(session[len(SESSION_PREFIX):])
    # another daemon's key (another database): its grants mean nothing here
    with db.sessions.begin() as s:
        s.execute(delete(link_store.LinkKey))
    other = grants(db)
    with pytest.raises(LinkRefused) as exc:
        other.verify(token_of(links.url("run-7")))
    assert exc.value.why is Refusal.INVALID


def test_a_grant_opens_once_and_both_opens_are_audited(db):
    links = grants(db)
    token = token_of(links.url("run-7", 3, "pagerduty"))
    grant, session = links.open(token, client="10.0.0.5", user_agent="Mobile Safari")
    assert links.session(session).run_id == "run-7"
    with pytest.raises(LinkRefused) as exc:
        links.open(token, client="10.9.9.9", user_agent="curl/8")
    assert exc.value.why is Refusal.SPENT
    (opened,) = audited(db, "run-7", "link_opened")
    assert opened.actor == grant.actor == f"link:{grant.grant_id}"
    assert opened.detail["channel"] == "pagerduty" and opened.detail["incident_id"] == "3"
    assert opened.detail["client"] == "10.0.0.5" and opened.detail["user_agent"] == "Mobile Safari"
    assert opened.detail["scope"] == "read"
    (refused,) = audited(db, "run-7", "link_refused")
    assert refused.detail["why"] == "spent" and refused.detail["client"] == "10.9.9.9"
    assert refused.detail["opened_at"]  # when it was spent: the reader can tell a replay from their own tap


def test_replicas_and_restarts_share_the_key_and_the_spent_list(db):
    clock = Clock()
    a, b = grants(db, clock), grants(db, clock)  # two daemons on one database (or one, restarted)
    token = token_of(a.url("run-7"))
    _, session = b.open(token)
    assert a.session(session) is not None  # b's session is good on a
    with pytest.raises(LinkRefused) as exc:
        a.open(token)
    assert exc.value.why is Refusal.SPENT
    with db.sessions() as s:
        assert s.scalar(select(func.count()).select_from(link_store.LinkKey)) == 1


def test_two_opens_at_once_spend_it_once(db):
    """Two replicas (or two taps) opening one grant at the same instant: one insert wins."""
    token = token_of(grants(db).url("run-7"))
    results: list[object] = []
    start = threading.Barrier(4)

    def open_it() -> None:
        start.wait()
        try:
            results.append(grants(db).open(token)[0])
        except LinkRefused as exc:
            results.append(exc.why)
        except Exception as exc:  # noqa: BLE001 - a database error would be a finding
            results.append(exc)

    threads = [threading.Thread(target=open_it) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(str(r) for r in results if isinstance(r, Refusal)) == ["Refusal.SPENT"] * 3, results
    assert len(audited(db, "run-7", "link_opened")) == 1 and len(audited(db, "run-7", "link_refused")) == 3


def test_the_key_is_made_once_when_replicas_start_together(db):
    keys: list[bytes] = []
    start = threading.Barrier(4)

    def key() -> None:
        start.wait()
        keys.append(grants(db)._signing_key())

    threads = [threading.Thread(target=key) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(keys) == 4 and len(set(keys)) == 1 and len(keys[0]) == 32


def test_a_session_ends_and_spent_grants_are_pruned_after_expiry(db):
    clock = Clock()
    links = grants(db, clock, ttl_s=60, session_s=3600)
    _, session = links.open(token_of(links.url("run-7")))
    clock.t += 3599
    assert links.session(session) is not None
    clock.t += 1
    assert links.session(session) is None
    assert links.session(session[:-2] + "AA") is None and links.session("tw_token") is None
    clock.t += 3600  # an hour past the first grant's expiry: the next open forgets it
    links.open(token_of(links.url("run-7")))
    with db.sessions() as s:
        assert s.scalar(select(func.count()).select_from(link_store.LinkGrant)) == 1


# --- the real app -------------------------------------------------------------------------------


@pytest.fixture
def daemon(db, tmp_path):
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN,
                                      public_url="http://testserver"), notifier=ConsoleNotifier(io.StringIO()))
    sup.seeded = seed(type("DB", (), {"sessions": sup.sessions})())
    yield sup
    sup.close()


def _path(url: str) -> str:
    assert url.startswith("http://testserver/go/"), url
    return url[len("http://testserver"):]


def test_a_link_signs_in_to_its_run_only_and_never_acts(daemon):
    sup = daemon
    other = sup.seeded.evil_run
    url = sup.link_grants.url(RUN, sup.seeded.incident, "slack:#alerts")
    with TestClient(build_app(sup), base_url="http://testserver") as c:
        r = c.get(_path(url), headers={"sec-fetch-site": "cross-site", "user-agent": "Phone"})
        assert r.status_code == 200, r.text
        cookie = r.headers["set-cookie"]
        assert cookie.startswith(f"{LINK_COOKIE}={SESSION_PREFIX}") and "HttpOnly" in cookie
        assert "SameSite=strict" in cookie or "SameSite=Strict" in cookie
        assert "Max-Age=43200" in cookie and COOKIE + "=" not in cookie
        landing = f"/runs/{RUN}?incident={sup.seeded.incident}"
        assert f"content='0;url={landing}'" in r.text and f"href='{landing}'" in r.text  # a page, not a redirect
        assert r.headers["cache-control"] == "no-store" and r.headers["referrer-policy"] == "no-referrer"

        # its run: the page and the page's reads
        page = c.get(landing)
        assert page.status_code == 200 and "id='token'" not in page.text
        for path in ("events", "status", "times", "incidents", "actions", "audit", "series"):
            assert c.get(f"/api/runs/{RUN}/{path}").status_code == 200, path
        assert c.get(f"/api/runs/{RUN}/chart", params={"metric": "loss"}).status_code == 200

        # another run, and what is about every run: 403 naming the rule
        r = c.get(f"/api/runs/{other}/events")
        assert r.status_code == 403 and f"reads run {RUN!r} only" in r.json()["detail"]
        for path in ("/", "/compare", f"/runs/{other}"):
            r = c.get(path, params={"run": [RUN, other]} if path == "/compare" else None)
            assert r.status_code == 403 and "signed in by a link" in r.text and "id='token'" in r.text, path
        for path in ("/api/runs", "/metrics", f"/api/actions/{sup.seeded.rollback}"):
            assert c.get(path).status_code == 403, path

        # never acts: the page's approve (same-origin, with the cookie) and the bearer-only routes
        same = {"sec-fetch-site": "same-origin"}
        assert c.post(f"/api/actions/{sup.seeded.set_lr}/approve", headers=same).status_code == 403
        assert c.post(f"/api/actions/{sup.seeded.set_lr}/cancel", headers=same).status_code == 403
        session = c.cookies.get(LINK_COOKIE)
        as_bearer = {"Authorization": f"Bearer {session}"}
        assert c.post(f"/api/runs/{RUN}/actions", json={"kind": "pause"}, headers=as_bearer).status_code == 403
        assert c.post(f"/api/actions/{sup.seeded.set_lr}/approve", headers=as_bearer).status_code == 403
        assert c.post(f"/api/runs/{RUN}/acknowledge", json={}, headers=as_bearer).status_code == 403
        assert c.post(f"/api/runs/{RUN}/silences", json={"signal": "*", "for_s": 60},
                      headers=as_bearer).status_code == 403
        assert c.get("/api/tokens", headers=as_bearer).status_code == 403
        with sup.sessions() as s:
            assert actions_store.get_action(s, sup.seeded.set_lr).state == "pending"

        # a second open of the same link: a clear page, 410, nothing new signed in
        c.cookies.clear()
        r = c.get(_path(url))
        assert r.status_code == 410 and "this link was already used" in r.text and "Traceback" not in r.text
        assert "set-cookie" not in r.headers and "id='token'" in r.text
        assert f"value='{landing}'" in r.text  # signing in with a token lands where the link meant to
    (opened,) = audited(type("DB", (), {"sessions": sup.sessions})(), RUN, "link_opened")
    assert opened.detail["user_agent"] == "Phone" and opened.detail["channel"] == "slack:#alerts"


def test_a_link_never_narrows_a_token_sign_in(daemon):
    """The token's cookie wins over a link's: an operator who opens a link keeps their own reach."""
    sup = daemon
    olga = make_token(sup.sessions, "olga", "operate")
    with TestClient(build_app(sup), base_url="http://testserver") as c:
        assert c.get(_path(sup.link_grants.url(RUN))).status_code == 200
        assert c.get("/").status_code == 403
        c.cookies.set(COOKIE, olga)
        assert c.get("/").status_code == 200
        assert c.get(f"/runs/{sup.seeded.evil_run}").status_code == 200
        r = c.post("/logout", headers={"sec-fetch-site": "same-origin"}, follow_redirects=False)
        assert r.status_code == 303
        gone = r.headers.get_list("set-cookie")
        assert any(h.startswith(f"{COOKIE}=") for h in gone) and any(h.startswith(f"{LINK_COOKIE}=") for h in gone)


def test_expired_tampered_and_unconfigured_links_get_a_page_not_a_traceback(daemon, tmp_path, db):
    sup = daemon
    clock = Clock(time.time())
    sup.link_grants._clock = clock
    url = sup.link_grants.url(RUN)
    clock.t += sup.cfg.link_ttl_s + 1
    with TestClient(build_app(sup), base_url="http://testserver", raise_server_exceptions=True) as c:
        r = c.get(_path(url))
        assert r.status_code == 410 and "this link has expired (links last 60 minutes)" in r.text
        assert "set-cookie" not in r.headers
        r = c.get(_path(url)[:-3] + "AAA")
        assert r.status_code == 403 and "not valid here" in r.text and "set-cookie" not in r.headers
        assert c.get("/go/%E2%9C%93.%00").status_code == 403
        # an expired session cookie: the sign-in page says what happened
        c.cookies.set(LINK_COOKIE, SESSION_PREFIX + "eyJ2IjoxfQ.AAAAAAAAAAAAAAAAAAAAAA")
        r = c.get(f"/runs/{RUN}")
        assert r.status_code == 401 and "from an alert&#x27;s link has ended" in r.text
    (refused,) = audited(db, RUN, "link_refused")
    assert refused.detail["why"] == "expired"
    # a daemon with auth off keeps its plain links; the route still answers with a page
    off = Supervisor(SupervisorConfig(data_dir=tmp_path / "off", db_url=db.url, auth=False,
                                      public_url="http://testserver"), notifier=ConsoleNotifier(io.StringIO()))
    try:
        with TestClient(build_app(off), base_url="http://testserver") as c:
            assert c.get("/go/anything").status_code == 403
    finally:
        off.close()


# --- the channels -------------------------------------------------------------------------------


def _alert(**kw) -> Alert:
    return Alert(**{"run_id": "run-7", "severity": Severity.CRITICAL, "title": "needs approval", "incident_id": 42,
                    **kw})


def test_slack_links_a_signed_link_and_asks_slack_not_to_unfurl_it(db, fake_slack: FakeSlack):
    links = grants(db)
    notifier = SlackNotifier(fake_slack.token, "#train-alerts", base_url=fake_slack.base_url, retries=0,
                             web_base_url=PUBLIC)
    notifier.links = links
    notifier.send(_alert())
    (req,) = fake_slack.calls("chat.postMessage")
    assert req.body["unfurl_links"] in (False, "false", "0") and req.body["unfurl_media"] in (False, "false", "0")
    blocks = json.dumps(req.body["blocks"] if not isinstance(req.body["blocks"], str) else json.loads(req.body["blocks"]))
    start = blocks.index(f"{PUBLIC}/go/")
    token = blocks[start + len(f"{PUBLIC}/go/"):].split("|", 1)[0]
    g = links.verify(token)
    assert (g.run_id, g.incident_id, g.channel) == ("run-7", "42", "slack:#train-alerts")
    # without links (or without public_url), the plain page, as before
    notifier.links = None
    assert notifier.plot_url(_alert()) == f"{PUBLIC}/runs/run-7?incident=42"


def test_the_pagers_carry_a_signed_link_made_at_delivery(db):
    clock = Clock()
    links = grants(db, clock)
    pd = PagerDutyNotifier("rk", web_base_url=PUBLIC)
    hook = WebhookNotifier("https://hooks.example.org/x", "s3cret", web_base_url=PUBLIC)
    pd.links = hook.links = links
    try:
        event = pd.event(_alert())
        clock.t += 100  # delivered later: the link's hour starts then
        body = hook.body(_alert())
    finally:
        pd.close()
        hook.close()
    g1 = links.verify(token_of(event["client_url"]))
    g2 = links.verify(token_of(body["links"][0]["href"]))
    assert (g1.channel, g2.channel) == ("pagerduty", "webhook") and g2.expires_at - g1.expires_at == 100
    assert event["links"][0]["href"] == event["client_url"] and g1.grant_id != g2.grant_id


def test_the_daemon_hands_its_links_to_the_channels_only_when_sign_in_is_needed(tmp_path):
    env = {"SLACK_BOT_TOKEN": "xoxb-test", "PD_KEY": "rk", "THERMOWATCH_WEBHOOK_SECRET": "s"}
    base = dict(data_dir=tmp_path, public_url=PUBLIC, slack={"channel": "#a"},
                pagerduty={"routing_key_env": "PD_KEY"}, webhook={"url": "https://hooks.example.org/x"})
    links = LinkGrants(PUBLIC)
    for extra, handed in (({}, True), ({"public_read": True}, False), ({"auth": False}, False)):
        fan = build_notifier(SupervisorConfig(**base, **extra), environ=env, links=links)
        try:
            parts = [p for p in fan.parts if hasattr(p, "links")]
            assert len(parts) == 3 and all((p.links is links) is handed for p in parts), extra
        finally:
            fan.close()


def test_link_ttl_s_is_checked_like_the_other_numbers(tmp_path):
    from thermowatch.supervisor.app.config import ConfigError

    assert SupervisorConfig(data_dir=tmp_path).link_ttl_s == 3600.0
    for bad in (0, -1, float("nan"), float("inf"), 86401, True, "1h"):
        with pytest.raises(ConfigError, match="link_ttl_s"):
            SupervisorConfig(data_dir=tmp_path, link_ttl_s=bad)
    assert SupervisorConfig(data_dir=tmp_path, link_ttl_s=86400).link_ttl_s == 86400


# --- a real browser -----------------------------------------------------------------------------


@contextlib.contextmanager
def _chat_page(link: str):
    """Another site holding the link (Slack, to the browser): a page on http://localhost, while the
    daemon is http://127.0.0.1; different hosts are different sites, so a click is cross-site."""
    page = f"<!doctype html><meta charset='utf-8'><a id='link' href='{link}'>open the run</a>".encode()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://localhost:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.timeout(180)
def test_a_link_from_another_site_lands_signed_in_in_chromium(db, tmp_path):
    """What the phone does: a tap in another site's page (Slack) on the alert's link. In headless
    Chromium, over real HTTP: the run page opens signed in (SameSite=Strict and all), with its
    charts loaded through the link's session; the same link again is the 410 page. A 390x844
    screenshot of the run page goes to $THERMOWATCH_SCREENSHOTS/phone-link.png when set."""
    import base64 as b64

    from tests.fixtures import traces
    from tests.live_server import running
    from tests.supervisor.cdp import Browser
    from tests.supervisor.serve.test_web_page import CHROMIUM, JUMP

    from thermowatch.monitors.contract import CheckpointInfo, RunInfo

    if not os.path.exists(CHROMIUM) and not os.environ.get("CI"):
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN,
                                      advise_only=True), notifier=ConsoleNotifier(io.StringIO()))
    try:
        recs = traces.load("jump_qkln")  # a real divergence: an incident and an approval waiting on the page
        sup.open_run(RunInfo(JUMP, 0, world_size=1, config={"steps": 1000}))
        for i in range(0, len(recs), 25):
            batch = recs[i:i + 25]
            sup.write(JUMP, 0, batch)
            sup.checkpoint_saved(JUMP, 0, CheckpointInfo(batch[-1].step, f"/ckpt/{batch[-1].step}",
                                                         batch[-1].sample_hi, True))
        with sup.sessions() as s:
            incident = incidents_store.incidents(s, JUMP)[0].id  # the alert's incident: the link lands on it
        with running(build_app(sup)) as base:
            sup.link_grants.public_url = base  # the daemon's address, as public_url would say
            link = sup.link_grants.url(JUMP, incident, "slack:#alerts")
            b = Browser(CHROMIUM, tmp_path / "profile", "--disable-quic", "--window-size=390,844")
            try:
                b.page("Runtime.enable")
                with _chat_page(link) as chat:
                    b.goto(chat)
                    b.js("document.getElementById('link').click()")
                    b.wait_for(f"location.origin === {json.dumps(base)} && location.pathname === '/runs/{JUMP}' "
                               "&& !!window.thermowatch && thermowatch.loads >= 1", timeout=60)
                    assert b.js("document.getElementById('token') === null")  # no sign-in form: signed in
                    assert b.js("document.getElementById('badge').textContent")
                    assert b.js("location.search") == f"?incident={incident}"
                    # the session reads only this run: the runs index is refused, saying why
                    b.goto(f"{base}/")
                    assert "signed in by a link" in b.js("document.body.textContent")

                    # a phone's first screen of the run page, opened through the link
                    b.page("Emulation.setDeviceMetricsOverride", width=390, height=844, deviceScaleFactor=1,
                           mobile=True)
                    b.goto(f"{base}/runs/{JUMP}?incident={incident}")
                    b.wait_for("!!window.thermowatch && thermowatch.loads >= 1", timeout=60)
                    png = b64.b64decode(b.page("Page.captureScreenshot", format="png")["data"])
                    assert png[:8] == b"\x89PNG\r\n\x1a\n"
                    (tmp_path / "phone-link.png").write_bytes(png)
                    out = os.environ.get("THERMOWATCH_SCREENSHOTS")
                    if out:
                        Path(out).mkdir(parents=True, exist_ok=True)
                        (Path(out) / "phone-link.png").write_bytes(png)

                    # the same link again (another tap, or someone else in the channel): refused, with a page
                    b.goto(chat)
                    b.js("document.getElementById('link').click()")
                    b.wait_for("!!document.getElementById('message')", timeout=30)
                    assert "this link was already used" in b.js("document.getElementById('message').textContent")
            finally:
                b.close()
        with sup.sessions() as s:
            (opened,) = audit_store.events(s, JUMP, "link_opened")
            (refused,) = audit_store.events(s, JUMP, "link_refused")
        assert "Chrome" in opened.detail["user_agent"] and opened.detail["channel"] == "slack:#alerts"
        assert refused.detail["why"] == "spent"
    finally:
        sup.close()
