"""A run of many attempts reads like a run of few (issue 34: one token opened 10^4 attempts of a
run, and its page then took 3.4-4.0 s on SQLite and 8.2-9.4 s on PostgreSQL).

One run grows from 30 to 600 attempts, every 20th training a few steps from just before where the
one before it stopped (a rollback each time), through the store functions and Supervisor.write as
ingest calls them, on both databases. At each size every read of the run goes through the
daemon's app, and a listener on the real engine counts the SQL statements it sends: the counts
must be the same at 600 as at 30. The listings are paged (the page's 20 newest attempts and a link
to older ones; the run API's attempts_limit / next_attempts_before) and the pages together hold
every attempt once. Times are bench/attempts.py's (BENCHMARKS.md), not a test's."""

from __future__ import annotations

import io
import re
import threading

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import event

from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.serve.web.run_page import ATTEMPTS_SHOWN
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import runs as runs_store
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH

RUN = "many"
EVERY = 20  # every 20th attempt trains steps
STEPS = 4  # steps each of those trains
FEW, MANY = 30, 600

READS = {
    "page": f"/runs/{RUN}",
    "run": f"/api/runs/{RUN}",
    "status": f"/api/runs/{RUN}/status",
    "events": f"/api/runs/{RUN}/events",
    "times": f"/api/runs/{RUN}/times",
    "chart": f"/api/runs/{RUN}/chart?metric=loss",
    "list": "/api/runs",
}


class Grower:
    """Opens attempts as ingest does, trains some, and keeps what the story must say."""

    def __init__(self, sup: Supervisor) -> None:
        self.sup, self.n, self.reached, self.retrained = sup, 0, None, 0

    def to(self, n: int) -> None:
        with self.sup.sessions.begin() as s:
            for a in range(self.n, n):
                start = (a // EVERY) * (STEPS - 2)  # the checkpoint it loads: 2 steps short of the last end
                runs_store.open_attempt(s, RunInfo(RUN, a, world_size=8, start_step=start), created_by="trainer")
                audit_store.audit(s, RUN, "trainer", "attempt_opened", {"attempt": a, "start_step": start})
                if self.reached is not None and start < self.reached:
                    self.retrained += self.reached - start
                if a % EVERY == 0:
                    self.reached = start + STEPS
        for a in range(self.n, n):
            if a % EVERY == 0:
                start = (a // EVERY) * (STEPS - 2)
                self.sup.write(RUN, a, [StepRecord(st, {"loss": 3.0 - 0.001 * st + 0.01 * (a % 3), "grad_norm": 0.5},
                                                   sample_lo=st * 8, sample_hi=st * 8 + 8, wall_time=1.79e9 + a + st)
                                        for st in range(start + 1, start + STEPS + 1)])
        self.sup.judge.wait(timeout=60)
        self.n = n


@pytest.fixture
def sup(db, tmp_path):
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN)
    s = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    yield s
    s.close()


def statements(sup: Supervisor, c: TestClient) -> dict[str, int]:
    """Each read once to warm it, then again counting the statements its request sends."""
    sent, lock = [0], threading.Lock()

    def count(*_):
        with lock:
            sent[0] += 1

    out = {}
    for name, path in READS.items():
        assert c.get(path).status_code == 200, (name, c.get(path).text[:300])
        event.listen(sup.engine, "before_cursor_execute", count)
        try:
            sent[0] = 0
            r = c.get(path)
            out[name] = sent[0]
        finally:
            event.remove(sup.engine, "before_cursor_execute", count)
        assert r.status_code == 200, (name, r.text[:300])
    return out


def attempts_listed(html: str) -> list[int]:
    table = html.split("<h2 id='attempts'>", 1)[1].split("</table>", 1)[0]
    return [int(m) for m in re.findall(r"<tr><td>(\d+)</td>", table)]


def test_every_read_of_a_run_sends_as_many_statements_at_600_attempts_as_at_30(sup):
    sup.open_run(RunInfo(RUN, 0, world_size=8, config={"model": "350m"}), "trainer")
    grow = Grower(sup)
    grow.n = 1
    grow.reached = STEPS  # attempt 0 trains 1..4 (below)
    sup.write(RUN, 0, [StepRecord(st, {"loss": 3.0, "grad_norm": 0.5}, sample_lo=st * 8, sample_hi=st * 8 + 8,
                                  wall_time=1.79e9 + st) for st in range(1, STEPS + 1)])
    with TestClient(build_app(sup), headers=AUTH) as c:
        grow.to(FEW)
        few = statements(sup, c)
        grow.to(MANY)
        many = statements(sup, c)
        assert many == few, f"statements per read at {FEW} attempts {few}, at {MANY} {many}"

        # The page: the newest 20, newest first, the story counted over all of them, a link to older.
        page = c.get(f"/runs/{RUN}").text
        assert attempts_listed(page) == list(range(MANY - 1, MANY - 1 - ATTEMPTS_SHOWN, -1))
        assert f"{MANY} attempt(s)" in page and f"{MANY} attempts" in page
        assert f"{grow.retrained:,} steps re-trained" in page, page.split("id='story'")[1][:300]
        assert f"(the newest {ATTEMPTS_SHOWN} of {MANY})" in page
        older = re.search(r"id='older-attempts' href='([^']+)'", page).group(1).replace("&amp;", "&")
        assert older == f"/runs/{RUN}?attempts_before={MANY - ATTEMPTS_SHOWN}#attempts"
        second = c.get(older.split("#")[0]).text
        assert attempts_listed(second) == list(range(MANY - 1 - ATTEMPTS_SHOWN, MANY - 1 - 2 * ATTEMPTS_SHOWN, -1))
        assert "id='newest-attempts'" in second and f"below attempt {MANY - ATTEMPTS_SHOWN}:" in second
        last = c.get(f"/runs/{RUN}?attempts_before={ATTEMPTS_SHOWN // 2}").text
        assert attempts_listed(last) == list(range(ATTEMPTS_SHOWN // 2 - 1, -1, -1))
        assert "id='older-attempts'" not in last  # the oldest page links no further

        # The run API: pages of attempts_limit, oldest first within a page, every attempt once.
        seen, before = [], None
        while True:
            body = c.get(f"/api/runs/{RUN}", params={"attempts_limit": 250, **(
                {"attempts_before": before} if before is not None else {})}).json()
            got = [a["attempt"] for a in body["attempts"]]
            assert got == sorted(got) and len(got) <= 250 and body["attempts_total"] == MANY
            seen = got + seen
            before = body["next_attempts_before"]
            if before is None:
                break
        assert seen == list(range(MANY))
        assert len(c.get(f"/api/runs/{RUN}").json()["attempts"]) == 100  # the default page
        assert c.get(f"/api/runs/{RUN}", params={"attempts_before": -1}).status_code == 422

        # /events draws the newest 200 restarts and says how many there are.
        ev = c.get(f"/api/runs/{RUN}/events").json()
        assert [a["attempt"] for a in ev["attempts"]] == list(range(MANY - 200, MANY)) and ev["attempts_total"] == MANY
        # /status, the list and the chart still see the whole run.
        st = c.get(f"/api/runs/{RUN}/status").json()
        assert st["attempt"] == MANY - 1 and st["last_step"] == grow.reached
        assert next(r for r in c.get("/api/runs").json()["runs"] if r["run_id"] == RUN)["attempts"] == MANY
        chart = c.get(f"/api/runs/{RUN}/chart", params={"metric": "loss"}).json()
        assert {s["attempt"] for s in chart["series"]} == set(range(0, MANY, EVERY))
        times = c.get(f"/api/runs/{RUN}/times").json()
        assert times["step"][-1] == grow.reached
