"""The daemon's access log without a line per command poll (issue 35: a trainer polls its
commands every second, and those 200s were 3,733 of a daemon's 8,265 log lines, burying the
requests a person reads the log for).

A poll answered 200 is left out of uvicorn's access log; every other request is logged as before,
a poll that failed (401, 404, 5xx) included. The polls are still counted, in `/metrics`:
`thermowatch_http_requests_total{method="GET",route="/api/runs/{run_id}/commands",status="2xx"}`
(supervisor/serve/metrics.py counts every request by route template and status class).
"""

from __future__ import annotations

import logging
import re

ACCESS_LOGGER = "uvicorn.access"
# The poll route's path (GET /api/runs/{run_id}/commands), after any root path, before any query.
POLL_PATH = re.compile(r"/api/runs/[^/?]+/commands(?:\?|$)")


class QuietPolls(logging.Filter):
    """Drops the access record of a command poll answered 200. uvicorn logs each request as
    `'%s - "%s %s HTTP/%s" %d'` with args (client, method, path with query, version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5:
            _, method, path, _, status = args
            if method == "GET" and status == 200 and isinstance(path, str) and POLL_PATH.search(path):
                return False
        return True


def quiet_polls(logger: logging.Logger | None = None) -> None:
    """Install QuietPolls on uvicorn's access logger (once; after uvicorn.Config, which configures
    that logger: a filter on the logger itself outlives the configuration of its handlers)."""
    logger = logger or logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, QuietPolls) for f in logger.filters):
        logger.addFilter(QuietPolls())
