"""The run controller's side of the supervisor's HTTP API.

HttpSink implements contract.RecordSink. When the supervisor (or its database) is unreachable
-- connect error, timeout, 5xx -- the message is appended to a spool file (JSONL, fsync'd) and
training goes on; spooled messages are replayed in order once the supervisor answers again.
While anything is spooled, new messages queue behind it, so the supervisor always sees them in
the order they were produced. Ingest is idempotent, so a message replayed twice (a crash
between send and spool deletion) stores nothing twice.

HttpCommandChannel implements contract.CommandChannel:
    GET  /api/runs/{run_id}/commands -> {"commands": [Command.to_json(), ...]}
    POST /api/runs/{run_id}/acks     <- Ack.to_json()
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import quote

import httpx

from monitors.contract import INT32_MAX, Ack, CheckpointInfo, Command, ContractError, RunInfo, StepRecord, dumps, loads

log = logging.getLogger(__name__)


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
    """contract.RecordSink over HTTP, with an on-disk spool for supervisor outages."""

    def __init__(self, base_url: str, spool_dir: str | os.PathLike, token: str | None = None, *,
                 timeout: float = 30.0, connect_timeout: float = 2.0, retry_interval: float = 1.0,
                 max_retry_interval: float = 60.0) -> None:
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        # While the supervisor is unreachable, writes go straight to the spool and one replay is
        # tried per retry interval, which doubles up to max_retry_interval: a blackholed host
        # (connect timeout, 2 s) stalls the training loop ~15 times in a ten-minute outage, not
        # on every step. A refused connection (supervisor process down) fails at once.
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(token),
                                    timeout=httpx.Timeout(timeout, connect=connect_timeout))
        self.retry_interval = retry_interval
        self.max_retry_interval = max_retry_interval
        self._backoff = retry_interval
        self._lock = threading.Lock()
        self._next_retry = 0.0
        self._file: Any = None  # the spool file being appended to
        self._seq = max((self._file_seq(p) for p in self._spool_files()), default=0)

    # --- RecordSink ----------------------------------------------------------------------------

    def open_run(self, info: RunInfo) -> None:
        self._send("/api/runs", info.to_json())

    def write(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> None:
        if records:
            self._send(f"{_run_path(run_id)}/attempts/{attempt}/steps", {"records": [r.to_json() for r in records]})

    def checkpoint_saved(self, run_id: str, attempt: int, ckpt: CheckpointInfo) -> None:
        self._send(f"{_run_path(run_id)}/attempts/{attempt}/checkpoints", ckpt.to_json())

    def checkpoints_deleted(self, run_id: str, attempt: int, steps: Sequence[int], reason: str) -> None:
        self._send(f"{_run_path(run_id)}/attempts/{attempt}/checkpoints/deleted",
                   {"steps": [int(x) for x in steps], "reason": reason})

    def close(self) -> None:
        try:
            self.flush(force=True)
        except Exception:  # close() must survive an outage; the spool stays for next time
            log.exception("could not replay the spool at close; it stays in %s", self.spool_dir)
        finally:
            self._close_file()
            self._client.close()

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
        """Replay the spool now; True when it is empty afterwards."""
        with self._lock:
            return self._replay(force)

    def _send(self, path: str, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()  # NaN/Infinity literals: the ingest parser accepts them
        with self._lock:
            if self._spool_files() and not self._replay(force=False):
                self._spool(path, data)  # keep order: queue behind what is already spooled
                return
            try:
                self._post(path, data)
            except _Unreachable as exc:
                log.warning("supervisor unreachable (%s); spooling to %s", exc, self.spool_dir)
                self._failed()
                self._spool(path, data)

    def _post(self, path: str, data: bytes) -> None:
        try:
            r = self._client.post(path, content=data)
        except httpx.TransportError as exc:  # connect refused/timeout, reset, read timeout
            raise _Unreachable(f"{type(exc).__name__}: {exc}") from exc
        if r.status_code >= 500:
            raise _Unreachable(f"HTTP {r.status_code}: {r.text[:200]}")
        if r.status_code >= 400:
            raise SinkRejected(f"supervisor refused POST {path}: HTTP {r.status_code} {r.text[:500]}")

    def _spool_files(self) -> list[Path]:
        return sorted(self.spool_dir.glob("spool-*.jsonl"), key=self._file_seq)

    @staticmethod
    def _file_seq(p: Path) -> int:
        return int(p.stem.split("-")[1])

    def _spool(self, path: str, data: bytes) -> None:
        if self._file is None:
            self._seq += 1
            self._file = open(self.spool_dir / f"spool-{self._seq:08d}.jsonl", "ab")
            dir_fd = os.open(self.spool_dir, os.O_RDONLY)  # make the new file's name durable too
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        line = b'{"path": ' + json.dumps(path).encode() + b', "body": ' + data + b"}\n"
        self._file.write(line)
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
        if not force and time.monotonic() < self._next_retry:
            return False
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
                    self._post(msg["path"], json.dumps(msg["body"]).encode())
                except _Unreachable as exc:
                    self._failed()
                    if i:  # keep only what is left; atomically, so a crash leaves old or new
                        tmp = p.with_suffix(".tmp")
                        with open(tmp, "wb") as out:
                            out.writelines(lines[i:])
                            out.flush()
                            os.fsync(out.fileno())
                        os.replace(tmp, p)
                    log.info("supervisor still unreachable (%s); %d messages stay spooled", exc, len(lines) - i)
                    return False
                except SinkRejected as exc:
                    # Never let one bad message block the queue forever: set it aside and go on.
                    self._reject(line, str(exc))
            p.unlink()
        self._backoff = self.retry_interval
        log.info("spool replayed")
        return True

    def _reject(self, line: bytes, why: str) -> None:
        with open(self.spool_dir / "rejected.jsonl", "ab") as rej:
            rej.write(line if line.endswith(b"\n") else line + b"\n")
        log.error("spooled message moved to rejected.jsonl: %s", why)

    def _failed(self) -> None:
        self._next_retry = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, self.max_retry_interval)


class _Unreachable(Exception):
    pass


class HttpCommandChannel:
    """contract.CommandChannel over HTTP. Acks are sent in order; one the supervisor cannot reach
    (connection error, 5xx) is kept and re-sent before the next poll, while one it refuses (4xx:
    it failed the command and says why) is dropped with a log line, so one bad ack never holds
    back the ones behind it. A poll that fails returns no commands; training goes on."""

    def __init__(self, base_url: str, token: str | None = None, *, timeout: float = 10.0,
                 max_unsent: int = 10_000) -> None:
        self._client = httpx.Client(base_url=base_url.rstrip("/"), headers=_headers(token), timeout=timeout)
        self._unsent: list[tuple[str, Ack]] = []
        self._max_unsent = max_unsent
        self.refused: list[tuple[Ack, str]] = []  # (ack, the supervisor's reason), newest last

    def poll(self, run_id: str) -> list[Command]:
        self._resend_acks()
        try:
            r = self._client.get(f"{_run_path(run_id)}/commands")
        except httpx.TransportError as exc:
            log.warning("cannot poll commands (%s); training goes on", exc)
            return []
        if r.status_code >= 400:
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
                    self.ack(run_id, Ack(command_id=cid, ok=False, step=0, detail=f"unreadable command: {exc}"))
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
                r = self._client.post(f"{_run_path(run_id)}/acks", content=dumps(ack.to_json()),
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
        self._client.close()
