"""The run controller's side of the supervisor's HTTP API.

HttpSink implements contract.RecordSink without ever blocking the training loop (DESIGN.md,
"Nothing blocks training"): `write()` appends to a bounded in-memory queue and returns; one
background thread serialises, posts, and spools. When the supervisor (or its database) is
unreachable -- connect error, timeout, 502/503/504, 429 -- the message is appended to a spool file (JSONL,
fsync'd by the sender thread) and training goes on; spooled messages are replayed in order once
the supervisor answers again. While anything is spooled, new messages queue behind it, so the
supervisor always sees them in the order they were produced. If the queue is full (the sender
is stuck in a slow request), the caller spills to an overflow file (one buffered write, no
fsync) that the sender promotes into the spool once it has caught up: a slow or absent daemon
only grows the spool. Ingest is idempotent, so a message replayed twice (a crash between send
and spool deletion) stores nothing twice.

`close()` is bounded: it waits at most `close_timeout` seconds (10 by default) for the daemon,
every request it still makes ends by then, and what is not sent by then -- a slow or silent daemon,
one that is down -- is in the spool, named in one log line with the command that sends it
(`thermowatch flush DIR`, thermowatch.spool). A sink opened on the same directory sends it first.

A message the supervisor refuses (4xx but 401/408/429: malformed, too large, a conflicting re-send)
will never be accepted as it is: it is set aside in `rejected.jsonl` with the reason and the
messages behind it go on. So is one answered 500 (a fault of the daemon's on this message, not an
outage) `max_server_errors` times in a row: one poisoned batch never stalls the run's history
(issue 21: a body the daemon failed on with 500 was retried forever, and the 76 steps after it
were never stored).

HttpCommandChannel implements contract.CommandChannel:
    GET  /api/runs/{run_id}/commands -> {"commands": [Command.to_json(), ...]}
    POST /api/runs/{run_id}/acks     <- Ack.to_json()

Both take several daemon addresses (replicas on one PostgreSQL, one leading: issue 40), a list or
one comma-separated string, and fail over between them (supervisor.operate.servers): a message
goes to the replica that answered last, else to the next one, before anything is spooled; a
standby's 503 for what only the leader takes (checkpoint reports, a finish, polls, acks) moves it
to the leader at once. Retry-After (capped) sets the next try once every address has failed.
"""

from __future__ import annotations

import base64
import collections
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Sequence
from urllib.parse import quote

import httpx

from thermowatch.monitors.columns import COLUMNS_CONTENT_TYPE, StepColumns
from thermowatch.monitors.contract import (
    INT32_MAX, Ack, CheckpointInfo, Command, ContractError, RecordSink, RunFinished, RunInfo, StepRecord, dumps,
    loads,
)
from thermowatch.monitors.durable import fsync_dir
from thermowatch.spool import Tail
from thermowatch.supervisor.operate.servers import Servers

log = logging.getLogger(__name__)
JSON = "application/json"
# Closing, a request ends this long before the deadline: the sender then spools what is left
# (an fsync or two) and ends within it, rather than close() taking what it holds from it.
SPOOL_RESERVE_S = 0.25


class SinkRejected(RuntimeError):
    """The supervisor refused a message (4xx): a bug in what was sent, not an outage."""


def _headers(token: str | None) -> dict[str, str]:
    h = {"content-type": "application/json"}
    if token:
        h["authorization"] = f"Bearer {token}"
    return h


def _run_path(run_id: str) -> str:
    return f"/api/runs/{quote(run_id, safe='')}"


class HttpSink:
    """contract.RecordSink over HTTP, sent from a background thread, with an on-disk spool for
    supervisor outages: the one place records wait between a loop and the daemon (a loop hands
    over each step as it is trained). Consecutive steps of one attempt go as one batch (one
    request, one transaction): the sender holds steps up to `batch_s` for more to join, up to
    `batch_steps` of them; anything else queued, `drain()` and `close()` send them at once. Call
    `drain()` to wait until everything written so far has been posted or spooled (tests, a
    checkpoint's durability barrier, shutdown); `close()` drains, replays the spool once more and
    stops, all within `close_timeout`, and says where what is left waits."""

    batches_records = True  # callers hand it steps one by one (RunController, Run): it batches

    def __init__(self, base_url: str | Sequence[str], spool_dir: str | os.PathLike, token: str | None = None, *,
                 timeout: float = 30.0, connect_timeout: float = 2.0, retry_interval: float = 1.0,
                 max_retry_interval: float = 60.0, queue_size: int = 256, close_timeout: float = 10.0,
                 max_server_errors: int = 3, batch_s: float = 0.5, batch_steps: int = 256,
                 batch_values: int = 1_000_000) -> None:
        # A batch stays well inside the daemon's limits (supervisor/limits.py: 10,000 steps and
        # 5,000,000 values a batch) however long the daemon was away.
        self.batch_s, self.batch_steps, self.batch_values = batch_s, batch_steps, batch_values
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        # While the supervisor is unreachable, messages go straight to the spool and one replay is
        # tried per retry interval, which doubles up to max_retry_interval: a blackholed host
        # (connect timeout, 2 s) costs the sender thread ~15 stalls in a ten-minute outage.
        # Every address it may send to (several replicas: the one that answered last first).
        self._servers = Servers(base_url, headers=_headers(token),
                                timeout=httpx.Timeout(timeout, connect=connect_timeout))
        self.base_url = self._servers.all  # one address: exactly as given, less a trailing slash
        self._timeout, self._connect_timeout = timeout, connect_timeout
        self.retry_interval = retry_interval
        self.max_retry_interval = max_retry_interval
        self.close_timeout = close_timeout
        self._backoff = retry_interval
        self._lock = threading.Lock()  # sending and replaying (sender thread, flush()): held across requests
        self._disk = threading.Lock()  # the spool's file names and appends: held for disk work only
        # close()'s: no request ends later. A request the sender began before close() may (its own
        # timeout): close() then spools what the sender holds itself (_abandon) and returns.
        self._deadline: float | None = None
        self._abandoned = False
        self._closed = False
        self.last_error: str | None = None  # why the last message could not be sent (flush's answer)
        self._next_retry = 0.0
        self._file: Any = None  # the spool file being appended to
        self._seq = max((self._file_seq(p) for p in self._spool_files()), default=0)
        self._adopt_overflow()
        self.rejected = 0  # messages the supervisor refused (4xx), set aside in rejected.jsonl
        self.max_server_errors = max_server_errors
        self._head_errors = 0  # 500s in a row for the oldest spooled message
        # The caller's side: a bounded queue of (path, body factory); serialising happens on the
        # sender thread, so write() costs one append.
        self._queue_size = queue_size
        self._queue: collections.deque[tuple[str, Any]] = collections.deque()  # body: factory or _Steps
        self._queued_since: float | None = None  # when the oldest queued step arrived
        self._push = False  # drain() asked: send what is queued now, without waiting for a batch
        self._cv = threading.Condition()
        self._busy = False  # the sender holds a message it has not finished with
        self._holding: tuple[str, Any] | None = None  # that message (close() spools it if it must)
        self._overflow: Any = None  # spill file while the queue is full; the sender promotes it
        self._closing = False
        self._thread = threading.Thread(target=self._sender, name="thermowatch-sink", daemon=True)
        self._thread.start()

    # --- RecordSink (called from the training loop: never blocks on the network) -------------------

    def open_run(self, info: RunInfo) -> None:
        self._submit("/api/runs", info.to_json)

    def write(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> None:
        if records:
            records = list(records)  # the caller may reuse its list; the records themselves are not mutated
            self._submit(f"{_run_path(run_id)}/attempts/{attempt}/steps", _Steps(records))

    def checkpoint_saved(self, run_id: str, attempt: int, ckpt: CheckpointInfo) -> None:
        self._submit(f"{_run_path(run_id)}/attempts/{attempt}/checkpoints", ckpt.to_json)

    def checkpoints_deleted(self, run_id: str, attempt: int, steps: Sequence[int], reason: str) -> None:
        steps = [int(x) for x in steps]
        self._submit(f"{_run_path(run_id)}/attempts/{attempt}/checkpoints/deleted",
                     lambda: {"steps": steps, "reason": reason})

    def finish_run(self, run_id: str, attempt: int, finished: RunFinished) -> None:
        # Queued behind the steps it ends (and spooled with them in an outage): the daemon reads
        # the run finished only once the history before it is stored.
        self._submit(f"{_run_path(run_id)}/attempts/{attempt}/finished", finished.to_json)

    def close_by(self, deadline: float) -> None:
        """Make every request from now on end by `deadline` (time.monotonic()), less a moment to
        spool what is left: a caller that closes several things (thermowatch.Run) says when it
        began, before close() is called."""
        with self._cv:
            self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def close(self, timeout: float | None = None, *, say: bool = True) -> Tail:
        """Send what is queued and replay the spool once more, for at most `timeout` seconds
        (default `close_timeout`), then stop. Returns what stays in the spool (thermowatch.spool.Tail),
        which `say` names in one log line with the command that sends it."""
        if self._closed:
            return Tail.of(self.spool_dir)
        self._closed = True
        self.close_by(time.monotonic() + max(0.0, self.close_timeout if timeout is None else timeout))
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        # At least a moment: an idle sender spools what it holds in that time, past the deadline
        # without a request, instead of close() abandoning it.
        self._thread.join(max(0.1, self._deadline - time.monotonic()))
        try:
            if self._thread.is_alive():
                self._abandon()
            else:
                self._promote_overflow()
                if time.monotonic() < self._deadline - SPOOL_RESERVE_S:
                    with self._lock:
                        self._replay(force=True)
        except Exception:  # close() must survive an outage; the spool stays for next time
            log.exception("could not replay the spool at close; it stays in %s", self.spool_dir)
        finally:
            with self._disk:
                self._close_file()
            if not self._thread.is_alive():  # else it is still in a request: it ends with the process
                self._servers.close()
        tail = Tail.of(self.spool_dir)
        if tail and say:
            why = f" ({self.last_error})" if self.last_error else ""
            log.warning("thermowatch: %s not sent to %s within close_timeout %g s%s; they wait in %s: `%s` "
                        "sends them, and so does the next run started on this directory",
                        tail.words(), self.base_url, self.close_timeout, why, self.spool_dir,
                        tail.flush_command(self.base_url))
        return tail

    def _abandon(self) -> None:
        """The sender is still in a request begun before close() (its own timeout is longer than
        what was left): spool, in order, the message it holds, the queue behind it and the spill
        file, and let it go. Should its request succeed after all, the spooled copy is sent again
        later: ingest is idempotent."""
        with self._cv:
            held = ([self._holding] if self._holding is not None else []) + list(self._queue)
            self._queue.clear()
            self._queued_since = None
            overflow, self._overflow = self._overflow, None
            self._cv.notify_all()
        with self._disk:
            self._abandoned = True  # the sender spools nothing from here on: its message is here
            self._close_file()
            if held:
                self._seq += 1
                with open(self.spool_dir / f"spool-{self._seq:08d}.jsonl", "ab") as f:
                    for path, body in held:
                        f.write(_spool_line(path, *_encode(body)))
                    f.flush()
                    os.fsync(f.fileno())
            if overflow is not None:
                overflow.flush()
                os.fsync(overflow.fileno())
                overflow.close()
                self._seq += 1
                os.replace(self.spool_dir / "overflow.jsonl", self.spool_dir / f"spool-{self._seq:08d}.jsonl")
            fsync_dir(self.spool_dir)
        log.warning("sink sender still in a request at close; the %d messages it held are spooled", len(held))

    def _adopt_overflow(self) -> None:
        """A spill file left by a process that ended before promoting it is newer than every spool
        file it left: it becomes the newest, so it is replayed too, in order."""
        left = self.spool_dir / "overflow.jsonl"
        if left.exists():
            self._seq += 1
            os.replace(left, self.spool_dir / f"spool-{self._seq:08d}.jsonl")
            fsync_dir(self.spool_dir)

    def drain(self, timeout: float | None = None) -> bool:
        """Send everything written so far now (no batch waits for more steps) and wait until it
        is posted or spooled; False on timeout (0: start sending, do not wait)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._push = True
            self._cv.notify_all()
            while self._queue or self._busy or self._overflow is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def _submit(self, path: str, body: Callable[[], Any]) -> None:
        with self._cv:
            if self._closing:
                raise RuntimeError("HttpSink is closed")
            if self._overflow is None and len(self._queue) < self._queue_size:
                if isinstance(body, _Steps) and self._queued_since is None:
                    self._queued_since = time.monotonic()
                self._queue.append((path, body))
                self._cv.notify_all()
                return
            # The sender is stuck (a slow supervisor): spill, in order, behind everything queued.
            if self._overflow is None:
                self._overflow = open(self.spool_dir / "overflow.jsonl", "ab")
            self._overflow.write(_spool_line(path, *_encode(body)))

    # --- the sender thread ---------------------------------------------------------------------

    def _batch_due_in(self) -> float:
        """Seconds the queue may still wait for more steps to join its batch (0: send now)."""
        if self._push or self._closing or self._overflow is not None or self._queued_since is None:
            return 0.0
        steps = 0
        for _, body in self._queue:
            if not isinstance(body, _Steps):
                return 0.0  # a checkpoint, a registration, a finish: never held back
            steps += len(body.records)
        if steps >= self.batch_steps:
            return 0.0
        return max(0.0, self._queued_since + self.batch_s - time.monotonic())

    def _sender(self) -> None:
        while True:
            with self._cv:
                while True:
                    if self._queue:
                        wait = self._batch_due_in()
                        if wait <= 0:
                            break
                        self._cv.wait(wait)
                        continue
                    if self._closing or self._overflow is not None:
                        break
                    self._push = False  # everything drain() asked for has gone
                    wait = self._replay_due_in()
                    if wait == 0 or (not self._cv.wait(wait) and wait is not None):
                        break  # the spool is due for a replay
                item = self._take() if self._queue else None
                if item is None and self._closing and self._overflow is None:
                    return
                self._busy = True
                self._holding = item
            try:
                if item is not None:
                    path, body = item
                    self._send(path, *_encode(body))
                else:
                    self._promote_overflow()
                    with self._lock:
                        self._replay(force=False)
            except Exception:  # the sender must outlive any one message
                log.exception("sink sender: unexpected error; going on")
            finally:
                with self._cv:
                    self._busy = False
                    self._holding = None
                    self._cv.notify_all()

    def _take(self) -> tuple[str, Any]:
        """The queue's head, with the steps queued right behind it for the same attempt merged
        into one batch of at most ~batch_steps steps / batch_values values (called holding the
        condition)."""
        path, body = self._queue.popleft()
        if isinstance(body, _Steps):
            records = list(body.records)
            values = sum(len(r.values) for r in records)
            while (self._queue and self._queue[0][0] == path and isinstance(self._queue[0][1], _Steps)
                   and len(records) < self.batch_steps and values < self.batch_values):
                more = self._queue.popleft()[1].records
                records += more
                values += sum(len(r.values) for r in more)
            body = _Steps(records)
        if not any(isinstance(b, _Steps) for _, b in self._queue):
            self._queued_since = None
        return path, body

    def _replay_due_in(self) -> float | None:
        """Seconds until the spool should be retried on its own (None: nothing spooled)."""
        if self._file is None and not self._spool_files():
            return None
        if not self._next_retry:
            return 0.0  # a spool left by an earlier process: try it at once
        # At least 50 ms between tries even with retry_interval=0, so an outage is not a busy loop.
        return max(0.05, self._next_retry - time.monotonic())

    def _promote_overflow(self) -> None:
        """Turn the caller's spill file into the newest spool file, once the queue ahead of it is
        empty, so that it is replayed after everything queued before it and before anything after."""
        with self._cv:
            if self._overflow is None or self._queue:
                return
            f, self._overflow = self._overflow, None
            with self._disk:
                f.flush()
                os.fsync(f.fileno())
                f.close()
                self._close_file()
                self._seq += 1
                os.replace(self.spool_dir / "overflow.jsonl", self.spool_dir / f"spool-{self._seq:08d}.jsonl")
                fsync_dir(self.spool_dir)
            self._cv.notify_all()

    # --- spool -----------------------------------------------------------------------------------

    @property
    def spooled(self) -> int:
        """Messages waiting in the spool."""
        n = 0
        for p in self._spool_files():
            with open(p, "rb") as f:
                n += sum(1 for line in f if line.strip())
        return n

    def flush(self, force: bool = False) -> bool:
        """Wait for the queue, then replay the spool now; True when it is empty afterwards."""
        self.drain()
        self._promote_overflow()
        with self._lock:
            return self._replay(force)

    def _send(self, path: str, data: bytes, content_type: str = JSON) -> None:
        with self._lock:
            if self._spool_files() and not self._replay(force=False):
                self._spool(path, data, content_type)  # keep order: queue behind what is already spooled
                return
            try:
                self._post(path, data, content_type)
            except _Unreachable as exc:
                log.warning("supervisor unreachable (%s); spooling to %s", exc, self.spool_dir)
                self._failed()
                if isinstance(exc, _ServerError):
                    self._head_errors = 1  # it heads the spool now: its replays count on from here
                self._spool(path, data, content_type)
            except SinkRejected as exc:
                self.last_error = str(exc)
                self._reject(_spool_line(path, data, content_type), str(exc))

    def _time_left(self) -> Any:
        """A request's timeout: the client's, or what is left before close()'s deadline."""
        if self._deadline is None:
            return httpx.USE_CLIENT_DEFAULT
        left = self._deadline - SPOOL_RESERVE_S - time.monotonic()  # closing: no request outlives close_timeout
        if left <= 0:
            raise _Unreachable(self.last_error or "close_timeout reached")
        return httpx.Timeout(min(self._timeout, left), connect=min(self._connect_timeout, left))

    def _post(self, path: str, data: bytes, content_type: str = JSON) -> None:
        # Every address in turn (supervisor.operate.servers); ingest is idempotent, so a message
        # whose answer was lost may go to the next replica as well.
        try:
            r = self._servers.request("POST", path, content=data, headers={"content-type": content_type},
                                      timeout=self._time_left)
        except httpx.TransportError as exc:  # connect refused/timeout, reset, read timeout
            self.last_error = f"{type(exc).__name__}: {exc}"
            raise _Unreachable(self.last_error) from exc
        if r.status_code == 500:
            self.last_error = f"HTTP 500: {r.text[:300]}"
            raise _ServerError(self.last_error)
        if r.status_code >= 500 or r.status_code in (408, 429):  # an outage, an overload, a quota: later
            self.last_error = f"HTTP {r.status_code}: {r.text[:200]}"
            raise _Unreachable(self.last_error)
        if r.status_code == 401:  # the token, not the message: every message would be refused alike,
            # so they stay spooled for a good token (`thermowatch flush DIR --token ...`)
            self.last_error = f"HTTP 401: {r.text[:300]}"
            raise _Unreachable(self.last_error)
        if r.status_code >= 400:
            raise SinkRejected(f"supervisor refused POST {path}: HTTP {r.status_code} {r.text[:500]}")

    def _spool_files(self) -> list[Path]:
        return sorted(self.spool_dir.glob("spool-*.jsonl"), key=self._file_seq)

    @staticmethod
    def _file_seq(p: Path) -> int:
        return int(p.stem.split("-")[1])

    def _spool(self, path: str, data: bytes, content_type: str = JSON) -> None:
        with self._disk:
            if self._abandoned:  # close() has spooled this message itself (_abandon)
                return
            if self._file is None:
                self._seq += 1
                self._file = open(self.spool_dir / f"spool-{self._seq:08d}.jsonl", "ab")
                fsync_dir(self.spool_dir)  # make the new file's name durable too
            self._file.write(_spool_line(path, data, content_type))
            self._file.flush()
            os.fsync(self._file.fileno())  # a crash of the controller must not lose spooled steps

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _replay(self, force: bool) -> bool:
        files = self._spool_files()
        if not files:
            return True
        if self._abandoned or (not force and time.monotonic() < self._next_retry):
            return False
        with self._disk:
            self._close_file()  # new messages go to a new file while this one drains
        for p in files:
            with open(p, "rb") as f:
                lines = [ln for ln in f if ln.strip()]
            for i, line in enumerate(lines):
                try:
                    msg = json.loads(line)
                except ValueError:  # torn last line of a crash mid-append: set aside, go on
                    self._reject(line, "unreadable spool line")
                    continue
                try:
                    self._post(msg["path"], *_spooled_body(msg))
                    self._head_errors = 0
                except _ServerError as exc:
                    self._head_errors += 1
                    if self._head_errors >= self.max_server_errors:
                        self._head_errors = 0
                        self._reject(line, f"{exc} ({self.max_server_errors} times in a row)")
                        continue
                    self._keep(p, lines, i)
                    self._failed()
                    log.warning("supervisor failed on a spooled message (%s); %d messages stay spooled", exc,
                                len(lines) - i)
                    return False
                except _Unreachable as exc:
                    self._failed()
                    self._keep(p, lines, i)
                    log.info("supervisor still unreachable (%s); %d messages stay spooled", exc, len(lines) - i)
                    return False
                except SinkRejected as exc:
                    # Never let one bad message block the queue forever: set it aside and go on.
                    self.last_error = str(exc)
                    self._reject(line, str(exc))
            p.unlink()
        self._backoff = self.retry_interval
        log.info("spool replayed")
        return True

    @staticmethod
    def _keep(p: Path, lines: list[bytes], i: int) -> None:
        """Keep only lines[i:] of spool file p; atomically, so a crash leaves old or new."""
        if i:
            tmp = p.with_suffix(".tmp")
            with open(tmp, "wb") as out:
                out.writelines(lines[i:])
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, p)

    def _reject(self, line: bytes, why: str) -> None:
        self.rejected += 1
        with open(self.spool_dir / "rejected.jsonl", "ab") as rej:
            rej.write(line if line.endswith(b"\n") else line + b"\n")
        log.error("spooled message moved to rejected.jsonl: %s", why)

    def _failed(self) -> None:
        # The servers' Retry-After when they gave one (capped: a standby leads within seconds),
        # else the doubling backoff.
        wait = self._servers.retry_after_s
        self._next_retry = time.monotonic() + (self._backoff if wait is None else wait)
        self._backoff = min(self._backoff * 2, self.max_retry_interval)


class Batched:
    """contract.RecordSink in front of an in-process one (the embedded Supervisor, a test's
    ListSink) for a loop that hands over each step as it is trained: the one place records wait
    on that path, as HttpSink's queue is over HTTP. Steps go on as one write (one transaction, one
    judge pass: ~0.5 ms a step against ~3.4 ms one by one on SQLite, bench/batched_sink.py) every
    `every_steps` steps or `every_s`
    seconds, whichever comes first; anything else (a registration, a checkpoint, a deletion, the
    finish) and `drain()` send what waits first, so the order is kept. Steps the inner sink fails
    to take wait for the next try, up to `max_held` (then the oldest go). On the caller's thread."""

    batches_records = True

    def __init__(self, sink: RecordSink, every_steps: int = 10, every_s: float = 1.0, max_held: int = 100_000) -> None:
        self.sink, self.every_steps, self.every_s, self.max_held = sink, every_steps, every_s, max_held
        self._held: list[tuple[str, int, StepRecord]] = []  # (run, attempt, step): a retry keeps its attempt
        self._since = time.monotonic()

    def write(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> None:
        self._held.extend((run_id, attempt, r) for r in records)
        if len(self._held) >= self.every_steps or time.monotonic() - self._since >= self.every_s:
            self.drain()

    def drain(self, timeout: float | None = None) -> bool:
        """Write what waits now; False when the inner sink failed (the steps wait for the next try)."""
        while self._held:
            run_id, attempt = self._held[0][:2]
            n = next((i for i, (r, a, _) in enumerate(self._held) if (r, a) != (run_id, attempt)), len(self._held))
            try:
                self.sink.write(run_id, attempt, [rec for _, _, rec in self._held[:n]])
            except Exception as exc:  # noqa: BLE001 - the daemon's problems never stop training
                log.error("sink.write failed (%r); keeping %d steps for the next try", exc, len(self._held))
                if len(self._held) > self.max_held:
                    log.error("dropping the oldest %d steps", len(self._held) - self.max_held)
                    del self._held[: len(self._held) - self.max_held]
                return False
            del self._held[:n]
        self._since = time.monotonic()
        return True

    def open_run(self, info: RunInfo) -> None:
        self.drain()
        self.sink.open_run(info)

    def checkpoint_saved(self, run_id: str, attempt: int, ckpt: CheckpointInfo) -> None:
        self.drain()
        self.sink.checkpoint_saved(run_id, attempt, ckpt)

    def checkpoints_deleted(self, run_id: str, attempt: int, steps: Sequence[int], reason: str) -> None:
        self.drain()
        self.sink.checkpoints_deleted(run_id, attempt, steps, reason)

    def finish_run(self, run_id: str, attempt: int, finished: RunFinished) -> None:
        self.drain()
        self.sink.finish_run(run_id, attempt, finished)

    def close(self) -> None:
        """Write what waits. The inner sink stays open: whoever made it closes it (the embedded
        Supervisor serves more than this loop)."""
        self.drain()


class _Unreachable(Exception):
    pass


class _ServerError(_Unreachable):
    """HTTP 500: the daemon failed on this message. Retried like an outage, a few times."""


class _Steps:
    """Queued steps of one attempt: one array per series per batch on the wire (monitors.columns),
    not one JSON key per value per step; the daemon decodes it with np.frombuffer, and NaN/+-Inf
    travel bit-exact."""

    __slots__ = ("records",)

    def __init__(self, records: list[StepRecord]) -> None:
        self.records = records


def _encode(body: Any) -> tuple[bytes, str]:
    """A queued body as (bytes, content type): steps as columns, a factory's JSON otherwise."""
    if isinstance(body, _Steps):
        return StepColumns.from_records(body.records).encode(), COLUMNS_CONTENT_TYPE
    if callable(body):
        body = body()
    return json.dumps(body).encode(), JSON  # NaN/Infinity literals: ingest accepts them


def _spool_line(path: str, data: bytes, content_type: str = JSON) -> bytes:
    """One JSONL line per message. A JSON body is kept as it is (readable, and what an older
    spool holds); any other body as base64 beside its content type."""
    if content_type == JSON:
        return b'{"path": ' + json.dumps(path).encode() + b', "body": ' + data + b"}\n"
    return json.dumps({"path": path, "content_type": content_type,
                       "body_b64": base64.b64encode(data).decode()}).encode() + b"\n"


def _spooled_body(msg: dict) -> tuple[bytes, str]:
    if "body_b64" in msg:
        return base64.b64decode(msg["body_b64"]), msg["content_type"]
    return json.dumps(msg["body"]).encode(), JSON


class HttpCommandChannel:
    """contract.CommandChannel over HTTP. Acks are sent in order; one the supervisor cannot reach
    (connection error, 5xx) is kept and re-sent before the next poll, while one it refuses (4xx:
    it failed the command and says why) is dropped with a log line, so one bad ack never holds
    back the ones behind it. A poll that fails returns no commands; training goes on. After
    `close_by(deadline)` no request outlives the deadline (the run's close_timeout_s). Several
    addresses: each poll and ack goes to the one that answered last, else the next (a standby
    answers both 503: only the leader sends commands); when none answered, their Retry-After
    (capped) passes before the next try."""

    def __init__(self, base_url: str | Sequence[str], token: str | None = None, *, timeout: float = 10.0,
                 max_unsent: int = 10_000) -> None:
        self._servers = Servers(base_url, headers=_headers(token), timeout=timeout)
        self._timeout = timeout
        self._quiet_until = 0.0  # monotonic: every address asked us to wait (Retry-After) until then
        self._deadline: float | None = None
        self._unsent: list[tuple[str, Ack]] = []
        self._max_unsent = max_unsent
        self.refused: list[tuple[Ack, str]] = []  # (ack, the supervisor's reason), newest last

    def close_by(self, deadline: float) -> None:
        """Make every request from now on end by `deadline` (time.monotonic()); none after it."""
        self._deadline = deadline

    @property
    def unsent(self) -> int:
        """Acks not delivered yet (kept, re-sent before the next poll)."""
        return len(self._unsent)

    def _time_left(self) -> Any:
        if self._deadline is None:
            return httpx.USE_CLIENT_DEFAULT
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise httpx.TimeoutException("the run's close_timeout_s has passed")
        return min(self._timeout, left)

    def _request(self, method: str, path: str, **kw: Any) -> httpx.Response:
        r = self._servers.request(method, path, timeout=self._time_left, **kw)
        if self._servers.retry_after_s is not None:  # no address could answer; they said when to come back
            self._quiet_until = time.monotonic() + self._servers.retry_after_s
        return r

    def poll(self, run_id: str) -> list[Command]:
        if time.monotonic() < self._quiet_until:
            return []  # a takeover under way: the acks wait with the poll
        self._resend_acks()
        try:
            r = self._request("GET", f"{_run_path(run_id)}/commands")
        except httpx.TransportError as exc:
            log.warning("cannot poll commands (%s); training goes on", exc)
            return []
        if r.status_code >= 400:
            # Never fatal: a 404 means the daemon has not stored this run yet (open_run is sent
            # by HttpSink's background thread and may still be on its way); training goes on.
            log.warning("command poll failed: HTTP %s %s", r.status_code, r.text[:300])
            return []
        try:
            obj = loads(r.content)
            items = obj.get("commands", []) if isinstance(obj, dict) else obj
        except ContractError as exc:
            log.error("unreadable command poll answer (%s)", exc)
            return []
        out = []
        for c in items:  # one command this trainer cannot read must not hide the others
            try:
                out.append(Command.from_json(c))
            except ContractError as exc:
                log.error("command %r refused: %s", c, exc)
                cid = c.get("id") if isinstance(c, dict) else None
                if isinstance(cid, int) and not isinstance(cid, bool) and 0 <= cid <= INT32_MAX:
                    self.ack(run_id, Ack(command_id=cid, ok=False, first_step=0, detail=f"unreadable command: {exc}"))
        return out

    def ack(self, run_id: str, ack: Ack) -> None:
        self._unsent.append((run_id, ack))
        if len(self._unsent) > self._max_unsent:
            log.error("dropping the oldest unsent ack (command %s)", self._unsent[0][1].command_id)
            del self._unsent[0]
        self._resend_acks()

    def _resend_acks(self) -> None:
        while self._unsent:
            run_id, ack = self._unsent[0]
            try:
                r = self._request("POST", f"{_run_path(run_id)}/acks", content=dumps(ack.to_json()),
                                  headers={"content-type": "application/json"})
            except httpx.TransportError as exc:
                log.warning("cannot deliver ack for command %s (%s); will retry", ack.command_id, exc)
                return
            if r.status_code >= 500:
                log.warning("ack for command %s: HTTP %s; will retry", ack.command_id, r.status_code)
                return
            if r.status_code >= 400:
                log.error("ack for command %s refused: HTTP %s %s", ack.command_id, r.status_code, r.text[:300])
                self.refused.append((ack, r.text[:300]))
            self._unsent.pop(0)

    def close(self) -> None:
        self._servers.close()
