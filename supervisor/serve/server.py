"""`thermowatch serve`: the daemon. FastAPI + uvicorn for ingest, commands, the read API and
the web page; APScheduler for the periodic jobs; the same Supervisor object the embedded
mode uses underneath.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import threading
from typing import TYPE_CHECKING

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from thermowatch.supervisor import db
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.lease import Coordinator, Lease
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.errors import UserError

if TYPE_CHECKING:
    from thermowatch.supervisor.serve.guard import Guard
    from thermowatch.supervisor.serve.metrics import Counters
    from thermowatch.supervisor.app.scheduler import Scheduler

log = logging.getLogger(__name__)


def build_guard(sup: Supervisor) -> "Guard":
    from thermowatch.supervisor.serve.guard import Guard
    from thermowatch.supervisor.serve.auth import Authenticator

    if not sup.cfg.auth:
        return Guard(None)
    return Guard(Authenticator(sup.sessions, config_token=sup.cfg.api_token, links=getattr(sup, "link_grants", None)),
                 public_read=sup.cfg.public_read,
                 public_url=sup.cfg.public_url)


def mount_routes(app: FastAPI, sup: Supervisor, guard: "Guard", *, public_url: str = "",
                 counters: "Counters | None" = None) -> None:
    """Every router, each behind its scope (supervisor.serve.guard); /healthz and /metrics are added
    by build_app."""
    from thermowatch.supervisor.serve.api import chart, commands, events, ingest, runs, slack, tokens
    from thermowatch.supervisor.serve.web import assets, login, pages

    app.include_router(ingest.make_router(sup, guard=guard, max_body_bytes=sup.cfg.max_body_bytes,
                                          counters=counters))
    app.include_router(commands.make_router(sup, guard=guard))
    app.include_router(tokens.make_router(sup, guard=guard))
    # Signed by Slack instead of a token (supervisor.serve.api.slack); a 404 without a signing secret, and
    # only a click by someone in slack.approvers / approver_groups is acted on.
    app.include_router(slack.make_router(sup, signing_secret=getattr(sup, "slack_signing_secret", None),
                                         approvers=getattr(sup, "slack_approvers", None)))
    app.include_router(runs.make_router(sup, guard=guard))
    app.include_router(chart.make_router(sup, guard=guard))
    app.include_router(events.make_router(sup, guard=guard))
    app.include_router(pages.make_router(sup, guard=guard, public_url=public_url))
    login.install(app, guard, public_url=public_url, links=getattr(sup, "link_grants", None))
    assets.install(app, public_url=public_url)  # /static and an offline /docs


def build_app(sup: Supervisor, guard: "Guard | None" = None, *, scheduler: "Scheduler | None" = None) -> FastAPI:
    """The daemon's app. `scheduler`: the one serve() runs, for /healthz and /metrics (an app
    built without one, as tests and benchmarks do, reports that it has none)."""
    from thermowatch.supervisor.serve import metrics
    from thermowatch.supervisor import version
    from thermowatch.supervisor.serve.health import Health

    guard = guard or build_guard(sup)
    counters = metrics.Counters()
    app = FastAPI(title="thermowatch", version=version(), docs_url=None, redoc_url=None)  # /docs: web.assets
    mount_routes(app, sup, guard, public_url=sup.cfg.public_url, counters=counters)
    health = Health(sup, scheduler)
    registry = metrics.build_registry(sup, counters, scheduler)

    @app.get("/healthz", responses={503: {"description": "a part cannot do its job; `checks` says which and why"}})
    def healthz() -> JSONResponse:
        # Open on purpose: the liveness probe (systemd, Kubernetes) holds no token, and the answer
        # says nothing about any run (supervisor.serve.health). 503 when a part cannot do its job.
        report = health.report()
        return JSONResponse(report, 200 if report["ok"] else 503)

    @app.get("/readyz", responses={503: {"description": "not ready: `checks` says which part and why"}})
    def readyz() -> JSONResponse:
        # Readiness (a load balancer's or Kubernetes' readinessProbe): /healthz's checks plus the
        # schema revision. Open for the same reason; nothing about any run.
        report = health.readiness()
        return JSONResponse(report, 200 if report["ok"] else 503)

    @app.get("/readyz/leader", responses={503: {"description": "this replica is a standby (or not ready)"}})
    def readyz_leader() -> JSONResponse:
        # For a Service that routes commands to the leader only (deploy/k8s: several replicas on
        # one PostgreSQL, supervisor.app.lease): ready when ready and leading.
        report = health.readiness()
        return JSONResponse(report, 200 if report["ok"] and report["role"] == "leader" else 503)

    @app.get("/metrics", dependencies=[Depends(guard.require("read"))], response_class=PlainTextResponse)
    def prometheus() -> Response:
        # The read scope (a scrape config sends `authorization: {credentials: ...}`), or none
        # with public_read; supervisor.serve.metrics says what is in it.
        return Response(metrics.render(registry), media_type=metrics.CONTENT_TYPE)

    from sqlalchemy.exc import InterfaceError, OperationalError

    async def database_unavailable(request: Request, exc: Exception) -> JSONResponse:
        # The database is down or restarting (connection refused or dropped, SQLite locked):
        # nothing was stored, and the same request will work later. 503 with Retry-After, so
        # the trainer's sink spools and replays, and a probe or a person reads "unavailable".
        log.error("database unavailable on %s %s: %s", request.method, request.url.path, str(exc).splitlines()[0][:300])
        return JSONResponse({"detail": f"database unavailable ({type(exc).__name__}); nothing was stored, retry "
                                       "later"}, 503, headers={"Retry-After": "5"})

    app.add_exception_handler(OperationalError, database_unavailable)
    app.add_exception_handler(InterfaceError, database_unavailable)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The daemon stays up; the client learns it was our fault, not theirs.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}; see the supervisor log"}, 500)

    from thermowatch.supervisor.serve.api import install_error_handlers, install_input_limits
    from thermowatch.supervisor.serve.body import InFlight

    app.state.body_in_flight = InFlight(sup.limits.max_body_bytes_in_flight)  # read by tests and probes
    install_input_limits(app, sup.limits, app.state.body_in_flight)  # every input bounded: 4xx
    install_error_handlers(app)  # the store's NotFound / UserError / Conflict as 404 / 422 / 409
    from thermowatch.supervisor.serve.api import openapi

    openapi.install(app)  # the document says what the routes answer; 422s are one sentence
    from starlette.middleware.gzip import GZipMiddleware

    # The run page's per-layer charts are ~6 MB of JSON at 100 layers x 1000 buckets; gzip makes that
    # ~1/5 (a phone on a mobile network at 3 a.m.). Small answers (command polls) are left alone.
    # Level 1, not Starlette's default 9: on a 100-layer chart (7 MB) 9 took 875 ms for x2.45,
    # 1 takes 71 ms for x2.32 (bench/plot.py; floats' digits barely compress at any level).
    app.add_middleware(GZipMiddleware, minimum_size=64 * 1024, compresslevel=1)
    app.add_middleware(metrics.HttpMetrics, counters=counters)  # outermost: it sees every answer
    return _KeepAlive500(app)


class _KeepAlive500:
    """Answer an unhandled error with a 500 and *keep the connection*. Starlette's outer error
    middleware re-raises after sending its 500, and uvicorn then closes the keep-alive
    connection; a client (the trainer's command channel) saw every later request on it fail."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def __getattr__(self, name: str):  # routes, state, dependency_overrides ... of the FastAPI app
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def tracked(message) -> None:
            nonlocal started
            started |= message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception:  # noqa: BLE001 - already logged and answered by the handler above
            if not started:
                await JSONResponse({"detail": "internal error; see the supervisor log"}, 500)(scope, receive, send)


def settle_heap() -> None:
    """Once the daemon is built: what exists now (modules, the app, its config) lives as long as
    the process, so move it out of the cycle collector's reach (gc.freeze, the practice of long-
    running CPython servers). A full collection then scans only what came later: ~13 ms instead
    of ~60 ms after each chart (supervisor/charts/plots.py collects the figure it drew)."""
    gc.collect()
    gc.freeze()


def make_server(app, host: str, port: int):
    """uvicorn serving the daemon's app, its access log without the trainers' command polls
    (supervisor/serve/access_log.py: counted in /metrics instead)."""
    import uvicorn

    from thermowatch.supervisor.serve.access_log import quiet_polls

    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="info"))
    quiet_polls()  # after Config, which configures uvicorn's loggers
    return server


def serve(cfg: SupervisorConfig, *, auto_upgrade: bool = True) -> int:
    from thermowatch.supervisor.app.scheduler import Scheduler

    from thermowatch.supervisor.serve.auth import bootstrap_admin, check_bind

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Start-up was 41 lines, 22 of them Alembic's per-revision notes and 11 APScheduler's job
    # registrations (issue 23): their warnings and errors still show; -v style detail does not.
    for noisy in ("alembic", "apscheduler"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    check_bind(cfg)  # before anything is opened: an open daemon on a network never starts
    # One leader per database (supervisor.app.lease, issue 40): this replica starts as a standby
    # and leads once it holds the lease, at once when nobody else does.
    lease = Lease(ttl_s=cfg.lease_ttl_s)
    sup = Supervisor(cfg, auto_upgrade=auto_upgrade, judge_inline=False, lease=lease, standby=True)
    scheduler = Scheduler(sup.jobs())

    def on_lead(token: int) -> None:
        sup.lead()
        scheduler.start()

    def on_lost(why: str) -> None:
        # Deposed, or unsure it still leads: stop acting at once. Writes are fenced anyway; the
        # service manager (systemd Restart=, a Kubernetes pod) starts this replica again as a standby.
        log.critical("stepping down (%s): exiting so this replica restarts as a standby", why)
        logging.shutdown()
        os._exit(75)  # EX_TEMPFAIL

    coordinator = sup.coordinator = Coordinator(lease, on_lead, on_lost, renew_s=cfg.lease_ttl_s / 4)
    try:
        coordinator.step()  # a lone daemon leads before it answers anything
        if not coordinator.leading and not lease.shared:
            holder = sup.leader_name()
            raise UserError(f"another daemon ({holder}) leads this SQLite database ({db.redact(cfg.db_url)}): SQLite "
                            "is single-replica; stop that one first, or share a PostgreSQL database between "
                            "replicas for a standby (docs/operations.md, 'Two daemons')")
        bootstrap_admin(cfg, sup.sessions)
    except BaseException:
        coordinator.stop()
        sup.close()
        raise
    if not coordinator.leading:
        log.info("standby: %s leads; this replica serves reads and ingest and takes over if it stops renewing",
                 sup.leader_name())
    coordinator.start()
    if not cfg.auth:
        log.warning("auth: false -- every route is open to anyone who can reach %s (loopback only)", cfg.host)
    server = make_server(build_app(sup, scheduler=scheduler), cfg.host, cfg.port)
    settle_heap()
    log.info("thermowatch supervising at http://%s:%d (db %s)", cfg.host, cfg.port, db.redact(cfg.db_url))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        if scheduler.running:
            scheduler.shutdown()
        sup.close()
        coordinator.stop(release=True)  # a standby leads at its next poll, not after the ttl
    return 0

