"""`thermowatch serve`: the daemon. FastAPI + uvicorn for ingest, commands, the read API and
the web page; APScheduler for the periodic jobs; the same Supervisor object the embedded
mode uses underneath.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from supervisor import db
from supervisor.config import SupervisorConfig
from supervisor.service import Supervisor

if TYPE_CHECKING:
    from supervisor.api.auth import Guard

log = logging.getLogger(__name__)


def build_guard(sup: Supervisor) -> "Guard":
    from supervisor.api.auth import Guard
    from supervisor.auth import Authenticator

    if not sup.cfg.auth:
        return Guard(None)
    return Guard(Authenticator(sup.sessions, config_token=sup.cfg.api_token), public_read=sup.cfg.public_read)


def mount_routes(app: FastAPI, sup: Supervisor, guard: "Guard", *, public_url: str = "") -> None:
    """Every router, each behind its scope (supervisor.api.auth); /healthz is added by build_app."""
    from supervisor.api import commands, ingest, runs, tokens
    from supervisor.web import login, pages

    app.include_router(ingest.make_router(sup, guard=guard, max_body_bytes=sup.cfg.max_body_bytes))
    app.include_router(commands.make_router(sup, guard=guard))
    app.include_router(tokens.make_router(sup, guard=guard))
    app.include_router(runs.make_router(sup, guard=guard))
    app.include_router(pages.make_router(sup, guard=guard, public_url=public_url))
    login.install(app, guard, public_url=public_url)


def build_app(sup: Supervisor, guard: "Guard | None" = None) -> FastAPI:
    app = FastAPI(title="thermowatch", version="0.1.0")
    mount_routes(app, sup, guard or build_guard(sup), public_url=sup.cfg.public_url)

    @app.get("/healthz")
    def healthz() -> dict:
        # Open on purpose: the liveness probe (systemd, Kubernetes) holds no token, and the answer
        # says nothing about any run. judge_backlog: ingested batches not judged yet.
        return {"ok": True, "judge_backlog": sup.judge.backlog}

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        # The daemon stays up; the client learns it was our fault, not theirs.
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"detail": f"internal error: {type(exc).__name__}; see the supervisor log"}, 500)

    from supervisor.api import install_input_limits  # every path/query bounded; input errors are 4xx (issue 11)

    install_input_limits(app)
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


def serve(cfg: SupervisorConfig, *, auto_upgrade: bool = True) -> int:
    import uvicorn

    from supervisor.scheduler import Scheduler

    from supervisor.auth import bootstrap_admin, check_bind

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    check_bind(cfg)  # before anything is opened: an open daemon on a network never starts
    sup = Supervisor(cfg, auto_upgrade=auto_upgrade, judge_inline=False)  # answer, then judge
    try:
        bootstrap_admin(cfg, sup.sessions)
    except BaseException:
        sup.close()
        raise
    if not cfg.auth:
        log.warning("auth: false -- every route is open to anyone who can reach %s (loopback only)", cfg.host)
    scheduler = Scheduler(sup.jobs())
    scheduler.start()
    server = uvicorn.Server(uvicorn.Config(build_app(sup), host=cfg.host, port=cfg.port, log_level="info"))
    log.info("thermowatch supervising at http://%s:%d (db %s)", cfg.host, cfg.port, db.redact(cfg.db_url))
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    try:
        server.run()
    finally:
        scheduler.shutdown()
        sup.close()
    return 0

