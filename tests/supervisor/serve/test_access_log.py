"""The daemon's access log leaves out the trainers' command polls and /metrics counts them
(issue 35: one line per poll, 3,733 of a daemon's 8,265 lines). The daemon's app on the uvicorn
server `thermowatch serve` makes (server.make_server), over real HTTP, on both databases."""

from __future__ import annotations

import io
import logging
import re
import threading
import time

import httpx
import pytest

from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.access_log import ACCESS_LOGGER, QuietPolls
from thermowatch.supervisor.serve.server import build_app, make_server
from tests.live_server import free_port
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH

RUN = "polled"
POLL_COUNT = 'thermowatch_http_requests_total{method="GET",route="/api/runs/{run_id}/commands",status="2xx"}'


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def daemon(db, tmp_path):
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN),
                     notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    sup.open_run(RunInfo(RUN, 1, world_size=1), "trainer")
    port = free_port()
    server = make_server(build_app(sup), "127.0.0.1", port)
    access = logging.getLogger(ACCESS_LOGGER)
    lines = Lines()
    access.addHandler(lines)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}", lines
    finally:
        server.should_exit = True
        thread.join(20)
        access.removeHandler(lines)
        for f in [f for f in access.filters if isinstance(f, QuietPolls)]:
            access.removeFilter(f)
        sup.close()


def test_polls_are_counted_not_logged(daemon):
    url, lines = daemon
    with httpx.Client(base_url=url, headers=AUTH, timeout=10) as c:
        for _ in range(5):
            assert c.get(f"/api/runs/{RUN}/commands").json() == {"commands": []}
        assert c.get(f"/api/runs/{RUN}/commands", headers={"Authorization": "Bearer tw_wrong"}).status_code == 401
        assert c.get(f"/api/runs/{RUN}/status").status_code == 200
        deadline = time.monotonic() + 5  # uvicorn logs a request once its response has gone
        while not any("/status" in line for line in lines.lines):
            assert time.monotonic() < deadline, lines.lines
            time.sleep(0.02)
        metrics = c.get("/metrics").text
    polls = [line for line in lines.lines if "/commands" in line]
    assert len(polls) == 1 and '"GET /api/runs/polled/commands HTTP/1.1" 401' in polls[0], lines.lines
    assert any(f'"GET /api/runs/{RUN}/status HTTP/1.1" 200' in line for line in lines.lines), lines.lines
    assert float(re.search(re.escape(POLL_COUNT) + r" (\S+)", metrics).group(1)) == 5.0


@pytest.mark.parametrize("path, status, kept", [
    ("/api/runs/r/commands", 200, False),
    ("/prefix/api/runs/r/commands", 200, False),  # behind a root path
    ("/api/runs/r/commands?x=1", 200, False),
    ("/api/runs/r/commands", 401, True),
    ("/api/runs/r/commands/extra", 200, True),
    ("/api/runs/commands", 200, True),
    ("/api/runs/r/status", 200, True),
])
def test_only_a_poll_answered_200_is_left_out(path, status, kept):
    record = logging.LogRecord(ACCESS_LOGGER, logging.INFO, __file__, 0, '%s - "%s %s HTTP/%s" %d',
                               ("127.0.0.1:5000", "GET", path, "1.1", status), None)
    assert QuietPolls().filter(record) is kept
    record.args = ("127.0.0.1:5000", "POST", path, "1.1", status)
    assert QuietPolls().filter(record) is True
