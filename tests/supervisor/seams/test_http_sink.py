"""thermowatch.transport against a real uvicorn server on a real port, stopped and restarted:
nothing is lost while the supervisor (or its database) is down, and order is kept."""

from __future__ import annotations

import contextlib

import json
import socket
import threading
import time

import numpy as np
import sqlalchemy as sa
import pytest
import uvicorn
from fastapi import FastAPI, Request

from thermowatch.monitors.columns import COLUMNS_CONTENT_TYPE
from thermowatch.monitors.contract import Ack, CheckpointInfo, Command, RunInfo, Rollback, SampleRange, StepRecord
from thermowatch.supervisor.serve.api.ingest import make_router
from thermowatch.supervisor.db import make_engine, make_sessionmaker
from thermowatch.supervisor.ingest.ingestor import Ingestor
from thermowatch.supervisor.store import checkpoints, runs, thermometers
from thermowatch.transport import HttpCommandChannel, HttpSink
from tests.supervisor.auth_helpers import guard
from thermowatch.supervisor.store import tokens as tokens_store

INGEST_TOKEN = "tw_test-trainer-ingest-token-0123456789"  # the trainer's token: `ingest` scope only


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """uvicorn in a thread; stop() and start() again on the same port."""

    def __init__(self, app: FastAPI, port: int):
        self.app, self.port = app, port
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, app: FastAPI | None = None) -> "Server":
        cfg = uvicorn.Config(app or self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(20)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _app(ingestor: Ingestor) -> FastAPI:
    """The ingest routes behind their real auth; the sinks below send the trainer's token."""
    sessions = ingestor._sessions
    try:
        with sessions.begin() as s:
            if not tokens_store.find(s, INGEST_TOKEN):
                tokens_store.create_token(s, "trainer", ["ingest"], secret=INGEST_TOKEN)
    except sa.exc.OperationalError:
        pass  # the test of a supervisor whose database is down: every request is a 500
    app = FastAPI()
    app.include_router(make_router(ingestor, guard=guard(sessions)))
    return app


@pytest.fixture
def server(db):
    ing = Ingestor(db.sessions)
    srv = Server(_app(ing), _free_port()).start()
    yield srv
    if srv._thread.is_alive():
        srv.stop()


def _batch(lo, n=10):
    return [StepRecord(step=s, values={"loss": float(s), "z/head": float(-s)}, sample_lo=s, sample_hi=s + 1)
            for s in range(lo, lo + n)]


def _loss(db, run_id="r"):
    with db.sessions() as s:
        return thermometers.history(s, run_id, "loss")


def _spooled_while_down(server, spool_dir):
    """Stop the server, then open run r and write steps 0-9 through a sink that does not retry
    for an hour, and close it: all of it lies in the spool file returned."""
    server.stop()
    sink = HttpSink(server.url, spool_dir, INGEST_TOKEN, retry_interval=3600)
    sink.open_run(RunInfo("r", 0, world_size=1))
    sink.write("r", 0, _batch(0))
    sink.close()
    return next(spool_dir.glob("spool-*.jsonl"))


def test_outage_loses_no_step_and_keeps_order(db, server, tmp_path):
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, retry_interval=0.0, batch_steps=100)
    sink.open_run(RunInfo("r", 0, world_size=2))
    for lo in range(0, 100, 10):
        sink.write("r", 0, _batch(lo))
    assert sink.drain(30) and sink.spooled == 0
    server.stop()  # the supervisor goes down; training goes on
    sink.checkpoint_saved("r", 0, CheckpointInfo(100, "/ck/100", 100, True))
    for lo in range(100, 600, 10):
        sink.write("r", 0, _batch(lo))
    # the checkpoint, then the 50 writes queued behind it as 5 batches of 100 steps (batch_steps)
    assert sink.drain(30) and sink.spooled == 6
    assert len(_loss(db)[0]) == 100
    server.start()  # back on the same port
    sink.write("r", 0, _batch(600))  # replays the spool first, then sends this batch
    assert sink.drain(30) and sink.spooled == 0
    steps, vals = _loss(db)
    np.testing.assert_array_equal(steps, np.arange(610))
    np.testing.assert_array_equal(vals, np.arange(610.0))
    with db.sessions() as s:
        assert [c.step for c in checkpoints.checkpoints(s, "r")] == [100]
    assert list((tmp_path / "spool").glob("spool-*.jsonl")) == []
    sink.close()


def test_spool_survives_a_controller_restart(db, server, tmp_path):
    server.stop()
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, retry_interval=3600)
    sink.open_run(RunInfo("r", 0, world_size=1))  # spooled: the run does not exist yet on the server
    for lo in range(0, 50, 10):
        sink.write("r", 0, _batch(lo))
    sink.close()  # controller exits while the supervisor is down; the spool stays on disk
    assert len(list((tmp_path / "spool").glob("spool-*.jsonl"))) == 1
    server.start()
    sink2 = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, retry_interval=3600)
    sink2.write("r", 0, _batch(50))  # a fresh process replays first (open_run comes first: no 404)
    assert sink2.drain(30) and sink2.spooled == 0
    np.testing.assert_array_equal(_loss(db)[0], np.arange(60))
    sink2.close()


def test_database_down_is_spooled_then_replayed(db, server, tmp_path):
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, retry_interval=0.0)
    sink.open_run(RunInfo("r", 0, world_size=1))
    sink.write("r", 0, _batch(0))
    assert sink.drain(30) and sink.spooled == 0
    server.stop()
    dead = make_engine("postgresql+psycopg://postgres@127.0.0.1:1/nothing", connect_args={"connect_timeout": 1})
    server.start(_app(Ingestor(make_sessionmaker(dead))))  # supervisor up, its database not: HTTP 500
    sink.write("r", 0, _batch(10))
    assert sink.drain(30) and sink.spooled == 1
    server.stop()
    server.start()  # database back
    sink.write("r", 0, _batch(20))
    assert sink.drain(30) and sink.spooled == 0
    np.testing.assert_array_equal(_loss(db)[0], np.arange(30))
    sink.close()
    dead.dispose()


def test_rejected_message_is_set_aside_and_does_not_block_the_spool(db, server, tmp_path):
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, retry_interval=0.0)
    sink.write("never-opened", 0, _batch(0))  # 404: a bug in what was sent, not an outage
    assert sink.drain(30) and sink.spooled == 0 and sink.rejected == 1
    server.stop()
    sink.write("never-opened", 0, _batch(0))  # spooled while down, refused on replay
    sink.open_run(RunInfo("r", 0, world_size=1))
    sink.write("r", 0, _batch(0))
    assert sink.drain(30) and sink.spooled == 3
    server.start()
    assert sink.flush()
    np.testing.assert_array_equal(_loss(db)[0], np.arange(10))
    assert (tmp_path / "spool" / "rejected.jsonl").read_text().count("\n") == 2
    assert sink.rejected == 2
    sink.close()


def test_nan_and_inf_travel_over_http(db, server, tmp_path):
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN)
    sink.open_run(RunInfo("r", 0, world_size=1))
    sink.write("r", 0, [StepRecord(step=i, values={"loss": v}) for i, v in enumerate([np.nan, np.inf, -np.inf])])
    assert sink.drain(30)
    _, vals = _loss(db)
    assert np.isnan(vals[0]) and vals[1] == np.inf and vals[2] == -np.inf
    with db.sessions() as s:
        assert runs.get_run(s, "r") is not None
    sink.close()


def test_command_channel(tmp_path):
    """Client side only: the shapes are Command.to_json() / Ack.to_json(); the server here is a
    stand-in for the supervisor's command routes (owned elsewhere)."""
    queue = [Command(7, Rollback(to_step=1100, skip=(SampleRange(10, 20),)))]
    acks: list[dict] = []
    app = FastAPI()

    @app.get("/api/runs/{run_id}/commands")
    def commands(run_id: str):
        return {"commands": [c.to_json() for c in queue]} if run_id == "run 1#x" else {"commands": []}

    @app.post("/api/runs/{run_id}/acks")
    async def ack(run_id: str, request: Request):
        acks.append({"run_id": run_id, **(await request.json())})
        return {"ok": True}

    srv = Server(app, _free_port()).start()
    ch = HttpCommandChannel(srv.url)
    assert ch.poll("run 1#x") == queue  # run ids are URL-quoted
    ch.ack("run 1#x", Ack(7, True, 1101, "rolled back"))
    assert acks == [{"run_id": "run 1#x", **Ack(7, True, 1101, "rolled back").to_json()}]
    srv.stop()
    assert ch.poll("run 1#x") == []  # down: training goes on
    ch.ack("run 1#x", Ack(8, False, 1200, "no checkpoint"))  # kept for later
    srv.start()
    ch.poll("run 1#x")
    assert [a["command_id"] for a in acks] == [7, 8]
    ch.close()
    srv.stop()


def test_no_retry_inside_the_backoff_interval(db, server, tmp_path):
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, retry_interval=30.0)
    sink.open_run(RunInfo("r", 0, world_size=1))
    assert sink.drain(30) and sink.spooled == 0
    server.stop()
    sink.write("r", 0, _batch(0))  # fails once, backs off 30 s
    assert sink.drain(30)
    server.start()
    for lo in range(10, 50, 10):
        sink.write("r", 0, _batch(lo))  # inside the interval: straight to the spool, no request
    # the first batch, then the four writes queued together, sent (spooled) as one batch
    assert sink.drain(30) and sink.spooled == 2 and len(_loss(db)[0]) == 0
    assert sink.flush(force=True)
    np.testing.assert_array_equal(_loss(db)[0], np.arange(50))
    sink.close()


def test_torn_spool_line_from_a_crash_is_set_aside(db, server, tmp_path):
    spool = _spooled_while_down(server, tmp_path / "spool")
    with open(spool, "ab") as f:
        f.write(b'{"path": "/api/runs/r/attempts/0/steps", "body": {"records": [{"st')  # killed mid-append
    server.start()
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN)
    assert sink.flush(force=True)
    np.testing.assert_array_equal(_loss(db)[0], np.arange(10))
    assert (tmp_path / "spool" / "rejected.jsonl").read_bytes().count(b"\n") == 1
    sink.close()


def test_write_never_waits_for_a_stuck_supervisor(db, tmp_path):
    """The supervisor accepts connections but answers nothing until released (a daemon stuck on a
    slow database or a Slack call). The training loop's writes must all return anyway, past the
    queue's bound (the overflow spill), and everything arrives in order once it answers again."""
    import anyio

    gate = threading.Event()
    app = _app(Ingestor(db.sessions))

    @app.middleware("http")
    async def stuck(request, call_next):
        await anyio.to_thread.run_sync(gate.wait)
        return await call_next(request)

    srv = Server(app, _free_port()).start()
    sink = HttpSink(srv.url, tmp_path / "spool", INGEST_TOKEN, queue_size=8, timeout=60.0)
    trainer = threading.Thread(target=lambda: [sink.open_run(RunInfo("r", 0, world_size=1)),
                                               *(sink.write("r", 0, _batch(lo, 2)) for lo in range(0, 100, 2))])
    trainer.start()
    trainer.join(20)
    assert not trainer.is_alive(), "write() blocked on a supervisor that does not answer"
    assert len(_loss(db)[0]) == 0 and (tmp_path / "spool" / "overflow.jsonl").exists()
    gate.set()
    assert sink.drain(60)
    assert sink.flush()
    np.testing.assert_array_equal(_loss(db)[0], np.arange(100))
    assert sink.rejected == 0 and not (tmp_path / "spool" / "overflow.jsonl").exists()
    sink.close()
    srv.stop()


def test_spool_is_replayed_by_the_sender_on_its_own(db, server, tmp_path):
    """After an outage the spool drains without another write (a run that is paused, or between
    batches, still catches the supervisor up)."""
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, retry_interval=0.0)
    sink.open_run(RunInfo("r", 0, world_size=1))
    assert sink.drain(30) and sink.spooled == 0
    server.stop()
    sink.write("r", 0, _batch(0))
    assert sink.drain(30) and sink.spooled == 1
    server.start()
    deadline = time.monotonic() + 30
    while len(_loss(db)[0]) < 10:
        assert time.monotonic() < deadline, "the spool was not replayed without a new write"
        time.sleep(0.05)
    np.testing.assert_array_equal(_loss(db)[0], np.arange(10))
    sink.close()  # its sender thread would outlive the test


def test_checkpoint_deletions_reach_the_supervisor(db, server, tmp_path):
    """Retention deletes are reported as they happen, so the list never offers a gone checkpoint."""
    from thermowatch.supervisor.store import checkpoints as ckpt_store

    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN)
    sink.open_run(RunInfo("r", 0, world_size=1))
    for step in (10, 20, 30):
        sink.checkpoint_saved("r", 0, CheckpointInfo(step=step, path=f"/c/step_{step}", sample_cursor=step, healthy=True))
    sink.checkpoints_deleted("r", 0, [10, 20], "retention")
    assert sink.drain(30)
    with db.sessions() as s:
        assert [c.step for c in ckpt_store.checkpoints(s, "r")] == [30]
        assert [c.step for c in ckpt_store.checkpoints(s, "r", include_deleted=True) if c.deleted] == [10, 20]
    assert sink.spooled == 0
    sink.close()


def test_batches_travel_as_columns_and_an_older_json_spool_still_replays(db, server, tmp_path):
    """The sink posts steps as columns (monitors.columns); a spool written by an older sink (JSON
    bodies) replays in order beside the new lines (base64 of the columns body)."""
    spool = _spooled_while_down(server, tmp_path / "spool")
    lines = [json.loads(x) for x in spool.read_bytes().splitlines()]
    assert lines[1]["content_type"] == COLUMNS_CONTENT_TYPE and "body_b64" in lines[1]
    old = {"path": "/api/runs/r/attempts/0/steps", "body": {"records": [r.to_json() for r in _batch(10)]}}
    with open(spool, "ab") as f:
        f.write(json.dumps(old).encode() + b"\n")
    server.start()
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN)
    sink.write("r", 0, _batch(20))
    assert sink.drain(30) and sink.flush(force=True)
    np.testing.assert_array_equal(_loss(db)[0], np.arange(30))
    assert sink.rejected == 0
    sink.close()


@contextlib.contextmanager
def _poison_step(db, step: int):
    """A real fault in the daemon's database for one step: a trigger that fails its insert (the
    daemon answers 500: not the client's fault, and not an outage). Dropped afterwards: the
    database is shared with the worker's next tests (truncated, not rebuilt)."""
    with db.engine.begin() as conn:
        if db.dialect == "postgresql":
            conn.execute(sa.text(f"""CREATE FUNCTION poison() RETURNS trigger AS $$ BEGIN
                IF NEW.step = {step} THEN RAISE EXCEPTION 'poisoned step'; END IF; RETURN NEW; END $$
                LANGUAGE plpgsql"""))
            conn.execute(sa.text("CREATE TRIGGER poison BEFORE INSERT ON steps FOR EACH ROW EXECUTE FUNCTION poison()"))
        else:
            conn.execute(sa.text(f"CREATE TRIGGER poison BEFORE INSERT ON steps WHEN NEW.step = {step} "
                                 "BEGIN SELECT RAISE(ABORT, 'poisoned step'); END"))
    try:
        yield
    finally:
        with db.engine.begin() as conn:
            conn.execute(sa.text("DROP TRIGGER poison" + (" ON steps" if db.dialect == "postgresql" else "")))
            if db.dialect == "postgresql":
                conn.execute(sa.text("DROP FUNCTION poison()"))


def test_a_batch_answered_500_again_and_again_is_set_aside_and_the_rest_goes_on(db, server, tmp_path):
    """Issue 21: one body the daemon failed on (500) was retried forever and the 76 steps after
    it were never stored. Now a message answered 500 max_server_errors times in a row goes to
    rejected.jsonl with the reason, and everything behind it is stored."""
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, retry_interval=0.0, max_server_errors=3)
    with _poison_step(db, 1023):
        sink.open_run(RunInfo("r", 0, world_size=1))
        # each write sent on its own (drained), as batches a second apart are: queued together,
        # the sink would merge them into one batch and the poisoned step would take the rest along
        for batch in (_batch(0), [StepRecord(step=1023, values={"loss": 1.0})], _batch(10), _batch(20), _batch(30)):
            sink.write("r", 0, batch)
            assert sink.drain(30)
        deadline = time.monotonic() + 30
        while not sink.flush(force=True):  # each replay meets the poisoned batch first, until it is set aside
            assert time.monotonic() < deadline, (sink.spooled, sink.rejected)
    assert sink.rejected == 1 and sink.spooled == 0
    np.testing.assert_array_equal(_loss(db)[0], np.arange(40))
    rejected = (tmp_path / "spool" / "rejected.jsonl").read_text().splitlines()
    assert len(rejected) == 1 and "/api/runs/r/attempts/0/steps" in rejected[0]
    sink.close()


def test_steps_handed_over_one_by_one_go_as_batches_and_none_waits_past_batch_s(db, server, tmp_path):
    """The loops hand HttpSink each step as it is trained (RunController, Run): the sink is the
    one place they wait. A lone step goes after batch_s without a drain; steps queued together
    go as batches of at most batch_steps."""
    sink = HttpSink(server.url, tmp_path / "spool", INGEST_TOKEN, batch_s=0.2, batch_steps=50)
    sink.open_run(RunInfo("r", 0, world_size=1))
    sink.write("r", 0, _batch(0)[:1])
    deadline = time.monotonic() + 10
    while len(_loss(db)[0]) < 1:  # no drain: the batch timer sends it
        assert time.monotonic() < deadline, "a lone step never left the sink"
        time.sleep(0.05)
    assert sink.drain(30)
    server.stop()  # queued now, they are spooled as the batches they went out as
    for r in _batch(1, 120):
        sink.write("r", 0, [r])
    assert sink.drain(30) and sink.spooled == 3  # 120 steps: 50 + 50 + 20
    server.start()
    assert sink.flush(force=True)
    np.testing.assert_array_equal(_loss(db)[0], np.arange(121))
    sink.close()
