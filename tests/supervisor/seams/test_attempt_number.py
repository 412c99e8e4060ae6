"""One attempt number everywhere (issue 35: `status` gave a trainer's run the attempt one below
the real one, `runs` and GET /api/runs one above). A run whose trainer opened attempts 1, 2 and 3
(thermowatch.watch and the bundled trainer number from 1: a launch, a rollback, a relaunch) is
read through every place that shows its attempt, over the daemon's real HTTP app, on SQLite and
PostgreSQL: each says 3."""

from __future__ import annotations

import io
import json
import re

import httpx
import pytest

from thermowatch.cli import main
from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import runs as runs_store
from tests.live_server import running
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH

RUN = "three-attempts"


@pytest.fixture
def url(db, tmp_path):
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "daemon", db_url=db.url, api_token=ADMIN_TOKEN),
                     notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    try:
        # attempt 1 trains 1-8; a rollback opens attempt 2 from step 5, which trains 6-10; a relaunch
        # opens attempt 3 from checkpoint 10, which trains 11-12
        for attempt, start, end in ((1, 0, 8), (2, 5, 10), (3, 10, 12)):
            sup.open_run(RunInfo(RUN, attempt, world_size=1, start_step=start, config={"steps": 100}), "trainer")
            sup.write(RUN, attempt, [StepRecord(st, {"loss": 3.0}, sample_lo=8 * st, sample_hi=8 * st + 8)
                                     for st in range(start + 1, end + 1)])
        with running(build_app(sup)) as u:
            yield u
    finally:
        sup.close()


def test_every_place_shows_the_newest_attempts_number(db, url, capsys):
    with db.sessions() as s:
        assert runs_store.newest_attempt(s, RUN) == 3 and runs_store.attempt_count(s, RUN) == 3
    api = httpx.Client(base_url=url, headers=AUTH)
    (listed,) = [r for r in api.get("/api/runs").json()["runs"] if r["run_id"] == RUN]
    assert (listed["attempt"], listed["attempts"], listed["last_step"]) == (3, 3, 12)
    assert api.get(f"/api/runs/{RUN}").json()["attempt"] == 3
    assert api.get(f"/api/runs/{RUN}/status").json()["attempt"] == 3

    flags = ["--server", url, "--token", ADMIN_TOKEN]
    assert main(["status", RUN, *flags, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["attempt"] == 3
    assert main(["status", RUN, *flags]) == 0
    assert "step 12 of 100, attempt 3," in capsys.readouterr().out
    assert main(["runs", *flags, "--json"]) == 0
    assert [r["attempt"] for r in json.loads(capsys.readouterr().out) if r["run_id"] == RUN] == [3]
    assert main(["runs", *flags]) == 0
    assert f"{RUN}  last step 12  attempt 3  open incidents 0" in capsys.readouterr().out

    page = api.get(f"/runs/{RUN}").text
    assert "attempt <b id='attempt'>3</b>" in page and "3 attempt(s) opened" in page
    index = api.get("/").text
    row = re.search(rf"<tr class='run-row' data-run='{RUN}'>(.*?)</tr>", index).group(1)
    cells = re.findall(r"<td>(.*?)</td>", row)
    assert cells[6] == "3", cells  # the "attempt" column
    assert "<th>attempt</th>" in index
