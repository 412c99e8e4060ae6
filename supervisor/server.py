"""`thermowatch serve`: the daemon. FastAPI + uvicorn for ingest, commands, the read API and
the web page; APScheduler for the periodic jobs; the same Supervisor object the embedded
mode uses underneath.
"""

from __future__ import annotations

import logging
import signal
import threading

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from supervisor import db
from supervisor.config import SupervisorConfig
from supervisor.service import Supervisor

log = logging.getLogger(__name__)


def build_app(sup: Supervisor) -> FastAPI:
    from supervisor.api import commands, ingest, runs
    from supervisor.web import pages

    token = sup.cfg.api_token or None
    app = FastAPI(title="thermowatch", version="0.1.0")
    app.include_router(ingest.make_router(sup, token=token, max_body_bytes=sup.cfg.max_body_bytes))
    app.include_router(commands.make_router(sup, token=token))
    app.include_router(runs.make_router(sup))
    app.include_router(pages.make_router(sup, public_url=sup.cfg.public_url))

    @app.get("/healthz")
    def healthz() -> dict:
        # judge_backlog: ingested batches not judged yet (commit, answer, then judge).
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

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sup = Supervisor(cfg, auto_upgrade=auto_upgrade, judge_inline=False)  # answer, then judge
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

