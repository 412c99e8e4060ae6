"""Files the browser loads from the daemon itself, never from a CDN: the page must work where
the cluster has no internet (issue 12). Vendored, unmodified, each beside its licence:

    static/uplot/       uPlot 1.6.32 (MIT): the run page's charts
    static/swagger-ui/  swagger-ui-dist 5.35.0 (Apache-2.0): the interactive API docs at /docs
    static/run.js, run.css   the run page's own script and style

    GET /static/...                 open, like /docs: library code and our script, no run data
    GET /docs                       Swagger UI over /openapi.json, from static/swagger-ui
    GET /docs/oauth2-redirect       Swagger UI's OAuth2 helper page (FastAPI's own)

ReDoc (FastAPI's /redoc) is left out: it too loads from a CDN, and /docs covers the need.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from fastapi import FastAPI
from fastapi.openapi.docs import (
    get_swagger_ui_html,
    get_swagger_ui_oauth2_redirect_html,
)
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent / "static"


def install(app: FastAPI, *, public_url: str = "") -> None:
    """Mount /static and serve /docs from it. The app must be built with docs_url=None and
    redoc_url=None (FastAPI's defaults point at cdn.jsdelivr.net)."""
    base = urlparse(public_url).path.rstrip("/") if public_url else ""
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=f"{base}{app.openapi_url}", title=f"{app.title}: API",
            swagger_js_url=f"{base}/static/swagger-ui/swagger-ui-bundle.js",
            swagger_css_url=f"{base}/static/swagger-ui/swagger-ui.css",
            swagger_favicon_url=f"{base}/static/swagger-ui/favicon-32x32.png",
            oauth2_redirect_url=f"{base}/docs/oauth2-redirect")

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def oauth2_redirect() -> HTMLResponse:
        return get_swagger_ui_oauth2_redirect_html()
