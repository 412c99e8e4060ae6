"""The detectors in a process of their own (DESIGN.md, "Nothing blocks training").

The daemon's request threads and its judge share one interpreter lock. The detectors are the
judge's CPU work: in the daemon's process they halve what the ingest path can store. Here they
run in a child process, on a core of their own: the judge thread sends a batch's columns down a
pipe and waits for the findings (waiting holds no lock), while the request threads go on
storing. Nothing else moves: the judge, its durable marker, the policy, the executor and every
database write stay in the daemon (supervisor.judge.judge, supervisor.act.respond).

- `BankProcess` owns the child: started on first use (spawn, never fork: the daemon has
  threads), one per daemon, holding one DetectorBank per run.
- `RemoteBank` is a DetectorBank's face in the daemon: the methods the banks call, each a
  call to the child with the same arguments and the same result (or the same exception).
- **A child that dies** (killed, out of memory) loses only what a daemon SIGKILL loses: the
  in-memory bank since its last state save. The call that saw it raises `BankLost`; the judge
  catches up from its marker; the banks reload each run's bank from its saved state in a
  new child (`RemoteBank.lost`).
- **A daemon that dies** ends its child: the child reads end-of-file on the pipe and exits, so a
  SIGKILLed daemon leaves no orphan. The child ignores SIGINT and SIGTERM (a Ctrl-C reaches the
  whole process group; systemd's stop sends SIGTERM to the whole cgroup): the daemon's close()
  still saves every bank's state through it, then closes the pipe, and the child exits.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import threading
from typing import Any

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.detectors import BankConfig, DetectorBank

log = logging.getLogger(__name__)

# What the daemon may ask of a bank in the child: DetectorBank's methods that the banks call.
_CALLS = frozenset({"observe", "observe_many", "check", "reset", "release_latches", "state_parts", "mark_saved",
                    "load_state_parts"})


class BankLost(RuntimeError):
    """The detectors' process died during a call: its banks are gone; reload them from their
    saved state (Banks.bank does: supervisor.judge.banks) and judge again from the marker (Judge does)."""


def _serve(conn, config: BankConfig) -> None:
    """The child: one DetectorBank per run, one call at a time, until the daemon closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the daemon stops it, by closing the pipe
    banks: dict[str, DetectorBank] = {}
    while True:
        try:
            op, run_id, args = conn.recv()
        except (EOFError, OSError):  # the daemon closed the pipe, or died
            return
        try:
            if op == "new":
                banks[run_id] = DetectorBank(config)
                result: Any = None
            elif op == "drop":
                banks.pop(run_id, None)
                result = None
            elif op in _CALLS:
                result = getattr(banks[run_id], op)(*args)
            else:
                raise ValueError(f"no such call to a detector bank: {op!r}")
        except Exception as exc:  # noqa: BLE001 - the daemon gets it, as a local call would raise it
            conn.send(("err", _sendable(exc)))
        else:
            conn.send(("ok", result))


def _sendable(exc: Exception) -> Exception:
    """The exception itself when it pickles (ValueError: the banks' 'older state' fallback
    depends on its type), else a RuntimeError with its text."""
    import pickle

    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class BankProcess:
    """The child process and its pipe. Thread-safe: one call at a time."""

    def __init__(self, config: BankConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._conn = None
        self.generation = 0  # +1 per child started: a RemoteBank of an older one is lost
        self.closed = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def restarts(self) -> int:
        """Children started after the first (each one after a child died)."""
        return max(self.generation - 1, 0)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive()

    def bank(self, run_id: str) -> "RemoteBank":
        """A fresh DetectorBank for the run in the child (replacing any it held), started if needed."""
        with self._lock:
            if self.closed:
                raise BankLost("the detectors' process is closed")
            if not self.alive:
                self._start()
            gen = self.generation
        bank = RemoteBank(self, run_id, gen)
        self.call(gen, "new", run_id)
        return bank

    def _start(self) -> None:
        self._stop()
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_serve, args=(child, self.config), name="thermowatch-detectors", daemon=True)
        proc.start()
        child.close()  # the child holds its end: the daemon sees EOF if the child dies
        self._proc, self._conn = proc, parent
        self.generation += 1
        log.info("detectors: process %d started (generation %d)", proc.pid, self.generation)

    def call(self, generation: int, op: str, run_id: str, *args: Any) -> Any:
        with self._lock:
            if generation != self.generation or self._conn is None:
                raise BankLost(f"run {run_id}: the detectors' process that held this bank is gone")
            try:
                self._conn.send((op, run_id, args))
                status, result = self._conn.recv()
            except (EOFError, OSError) as exc:
                code = self._proc.exitcode if self._proc is not None else None
                self._stop()
                raise BankLost(f"run {run_id}: the detectors' process died during {op} "
                               f"(exit code {code}): {exc or type(exc).__name__}") from None
        if status == "err":
            raise result
        return result

    def _stop(self) -> None:
        conn, proc, self._conn, self._proc = self._conn, self._proc, None, None
        if conn is not None:
            conn.close()  # the child reads EOF and exits
        if proc is not None:
            proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._stop()


class RemoteBank:
    """A DetectorBank held by the detectors' process; the banks' calls, one round trip each."""

    def __init__(self, host: BankProcess, run_id: str, generation: int) -> None:
        self._host = host
        self.run_id = run_id
        self._generation = generation

    @property
    def lost(self) -> bool:
        """The child that held this bank died or was replaced: reload from the saved state."""
        return self._generation != self._host.generation or not self._host.alive

    def _call(self, op: str, *args: Any) -> Any:
        return self._host.call(self._generation, op, self.run_id, *args)

    def observe(self, record, attempt=None):
        return self._call("observe", record, attempt)

    def observe_many(self, batch, attempt=None):
        return self._call("observe_many", batch if isinstance(batch, (StepColumns, list, tuple)) else list(batch), attempt)

    def check(self, now):
        return self._call("check", now)

    def reset(self, to_step=None):
        return self._call("reset", to_step)

    def release_latches(self):
        return self._call("release_latches")

    def state_parts(self, dirty_only=False):
        return self._call("state_parts", dirty_only)

    def mark_saved(self):
        return self._call("mark_saved")

    def load_state_parts(self, parts):
        return self._call("load_state_parts", parts)
