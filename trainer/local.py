"""In-process implementations of the controller's seams, for tests, benchmarks and scripts:
`ListSink` keeps what the controller reports, `QueueCommands` is a thread-safe queue of typed
commands that records the acknowledgements, and `InProcessGang` runs one rank (world size 1,
real DeepSpeed on gloo) in this process instead of Ray actors. The supervisor provides the
real sink and channel (ingest into the database, its action queue)."""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Sequence

from thermowatch.monitors.contract import (
    Ack, CheckpointInfo, Command, CommandKind, LRChange, RunFinished, RunInfo, StepRecord, parse_command,
)


class ListSink:
    """RecordSink that keeps everything in memory."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: list[RunInfo] = []
        self.records: dict[tuple[str, int], list[StepRecord]] = defaultdict(list)
        self.checkpoints: list[tuple[int, CheckpointInfo]] = []  # (attempt, info)
        self.deleted: list[int] = []  # checkpoint steps the controller reported deleted
        self.finished: dict[tuple[str, int], RunFinished] = {}  # (run, attempt) -> what it said when it ended
        self.writes = 0
        self.closed = False

    def open_run(self, info: RunInfo) -> None:
        with self._lock:
            self.runs.append(info)

    def write(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> None:
        with self._lock:
            self.records[(run_id, attempt)].extend(records)
            self.writes += 1

    def checkpoint_saved(self, run_id: str, attempt: int, ckpt: CheckpointInfo) -> None:
        with self._lock:
            self.checkpoints.append((attempt, ckpt))

    def checkpoints_deleted(self, run_id: str, attempt: int, steps: Sequence[int], reason: str) -> None:
        with self._lock:
            self.deleted.extend(steps)

    def finish_run(self, run_id: str, attempt: int, finished: RunFinished) -> None:
        with self._lock:
            self.finished[(run_id, attempt)] = finished

    def drain(self, timeout: float | None = None) -> bool:
        return True  # kept as it is written

    def close(self) -> None:
        self.closed = True

    # --- views for tests ----------------------------------------------------------------------

    def attempt(self, run_id: str, attempt: int) -> list[StepRecord]:
        with self._lock:
            return list(self.records.get((run_id, attempt), []))

    def attempts(self, run_id: str) -> list[int]:
        with self._lock:
            return sorted({a for (r, a) in self.records if r == run_id})

    def series(self, run_id: str, key: str) -> dict[int, float]:
        """step -> value, later attempts winning (the supervisor's rule)."""
        out: dict[int, float] = {}
        for a in self.attempts(run_id):
            for rec in self.attempt(run_id, a):
                if key in rec.values:
                    out[rec.step] = rec.values[key]
        return out


class QueueCommands:
    """CommandChannel backed by a queue; `push` from any thread (e.g. a progress callback)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: dict[str, list[Command]] = defaultdict(list)
        self.acks: list[Ack] = []
        self._next_id = 1

    def push(self, run_id: str, kind: CommandKind | str, **args) -> Command:
        with self._lock:
            cmd = Command(id=self._next_id, body=parse_command(CommandKind(kind), args))
            self._next_id += 1
            self._queue[run_id].append(cmd)
        return cmd

    def poll(self, run_id: str) -> list[Command]:
        with self._lock:
            cmds, self._queue[run_id] = self._queue[run_id], []
        return cmds

    def ack(self, run_id: str, ack: Ack) -> None:
        with self._lock:
            self.acks.append(ack)

    def ack_for(self, command: Command | int) -> Ack | None:
        cid = command.id if isinstance(command, Command) else int(command)
        with self._lock:
            return next((a for a in self.acks if a.command_id == cid), None)


class InProcessGang:
    """The gang seam (call / names / hosts / kill) with one rank in this process: no Ray, so a
    test can drive a real RunController on a tiny model in seconds (RunController's
    `gang_factory`). The process group stays up across gangs (torch.distributed cannot be torn
    down and rebuilt cheaply in one process); kill() drops the engine, as a dead rank would."""

    def __init__(self, config: Any, attempt: int, data_state: dict[str, Any] | None,
                 lr_changes: list[LRChange]) -> None:
        from thermowatch.trainer.worker import TrainWorker, _free_port

        if config.world_size != 1:
            raise ValueError(f"InProcessGang runs one rank; set world_size=1 (got {config.world_size})")
        self.worker = TrainWorker(0, 1)
        info = self.worker.setup(config.to_dict(), attempt, data_state, lr_changes, "127.0.0.1", _free_port(), 0, 1)
        self.names: list[str] = info.names
        self.hosts = {0: info.host}
        self.workers = [self.worker]
        self.flops_per_token = info.flops_per_token

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list:
        if self.worker is None:
            from thermowatch.trainer.worker import GangTimeout

            raise GangTimeout("the in-process rank was killed")
        return [getattr(self.worker, method)(*args)]

    def kill(self) -> None:
        if self.worker is not None and self.worker._engine is not None:
            self.worker.thermo.detach()
            self.worker._engine = None
        self.worker = None
