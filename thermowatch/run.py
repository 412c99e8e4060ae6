"""The lower-level client: one run's conversation with the supervisor, for trainers that keep
their own checkpoints and want typed commands (docs/any-trainer.md, "Your own checkpointing").

    run = thermowatch.Run("my-run", steps=10_000, global_batch=512)   # server/token: see below
    run.start(start_step=0)                    # registers the run (a new attempt each time)
    run.send(record)                           # a StepRecord; queued, never blocks
    run.checkpoint_saved(step, path, sample_cursor)
    for cmd in run.commands():                 # typed commands (Rollback, Skip, SetLR, ...)
        ...carry it out...
        run.ack(Ack(command_id=cmd.id, ok=True, first_step=first_step_trained_after, ...))
    run.finish(final_step=step, final_loss=loss, reason="completed")   # the run reads finished

Where it sends: `server=`/`token=`, else `THERMOWATCH_SERVER`/`THERMOWATCH_TOKEN`, else the file
`thermowatch login` wrote; with none of them an embedded supervisor (SQLite under `.thermowatch/`)
runs in this process, as `thermowatch train` does without `--supervisor`. Several daemon replicas
(issue 40): a list, or one comma-separated string; it fails over between them (thermowatch.transport).

Nothing here runs on the caller's thread but a queue append: one background thread registers
the run, sends records, checkpoints and acks in the order they were made (records before the
ack of a command that came after them), and polls commands only once the run is registered.
Commands are remembered with their acks (`state_dir/commands.json`), so a command delivered
again (a lost ack, a restart) is answered with the same ack and never carried out twice; one
delivered again while it is still being carried out (the daemon re-sends what it has not heard
back about: a poll answer may have been lost) is not handed out a second time.

`finish()` is bounded by `close_timeout_s` (10 s): what the daemon has not taken by then stays in
`state_dir/spool`, named in one log line with the command that sends it (`thermowatch flush`);
the next Run on the same `state_dir` sends it first.
"""

from __future__ import annotations

import collections
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from thermowatch.monitors.contract import (Ack, CheckpointInfo, Command, LRChange, RecordSink, Rollback, RunFinished,
                                          RunInfo, SampleRange, SetLR, Skip, StepRecord, ledger_digest, merge_ranges,
                                          multiplier_at)
from thermowatch.monitors.names import check_run_id
from thermowatch.monitors.settings import check_number
from thermowatch import carried_out
from thermowatch.paused import say
from thermowatch.protocol import CheckpointRef, CommandBook, Outcome, ack_for, next_attempt

log = logging.getLogger(__name__)
IO_RESERVE_S = 0.5  # finish(): the I/O thread's waits end this long before close_timeout_s (see _stop)


def resolve_server(server: str | Sequence[str] | None, token: str | None) -> tuple[str | None, str | None]:
    """The daemon's address and token, resolved as the command line resolves them (arguments, then
    THERMOWATCH_SERVER / THERMOWATCH_TOKEN, then `thermowatch login`'s file); no server named
    anywhere is None (the embedded supervisor), not the command line's default address. Several
    addresses come back as one comma-separated string."""
    from thermowatch.supervisor.operate.client import FROM_DEFAULT, resolve  # httpx and stdlib only

    found = resolve(server, token)
    return (None if found.server_from == FROM_DEFAULT else found.server), found.token


class Run:
    """One run's records, checkpoints, commands and acks, sent and polled off the caller's thread."""

    def __init__(self, run_id: str, *, steps: int | None = None, global_batch: int | None = None,
                 config: dict[str, Any] | None = None, server: str | Sequence[str] | None = None,
                 token: str | None = None,
                 state_dir: str | os.PathLike | None = None, world_size: int = 1, poll_interval_s: float = 1.0,
                 send_interval_s: float = 0.5, supervisor_config: Any = None, close_timeout_s: float = 10.0,
                 dataset_size: int | None = None) -> None:
        # Before anything is made or sent: the daemon's own run-id rule (monitors.names; `..` once
        # trained with every request refused and its checkpoints in the working directory), and
        # the numbers, finite and in range (monitors.settings).
        check_run_id(run_id)
        check_number("world_size", world_size, lo=1, integer=True)
        check_number("poll_interval_s", poll_interval_s, lo=0, lo_open=True)
        check_number("send_interval_s", send_interval_s, lo=0)
        check_number("close_timeout_s", close_timeout_s, lo=0)
        # finish() waits this long at most for the daemon (a slow, silent or absent one); the rest
        # stays in the spool, named in the log (issue 34: 60 s and 122 s, then a stranded tail).
        self.close_timeout_s = close_timeout_s
        self._deadline: float | None = None  # finish()'s: nothing this session does waits past it
        self.run_id, self.world_size = run_id, world_size
        self.config = dict(config or {})
        if steps is not None:
            self.config["steps"] = int(steps)
        if global_batch is not None:
            self.config.setdefault("data", {})["global_batch"] = int(global_batch)
        if dataset_size is not None:  # skips stand for data indices, id % dataset_size, in every pass
            check_number("dataset_size", dataset_size, lo=1, integer=True)
            self.config.setdefault("data", {})["dataset_size"] = int(dataset_size)
        self.state_dir = Path(state_dir or Path(".thermowatch") / "runs" / run_id)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.poll_interval_s = poll_interval_s
        self.attempt = 0
        self.last_step: int | None = None  # the newest step sent (finish()'s default final_step)
        self.server, token = resolve_server(server, token)
        if self.server:
            from thermowatch.transport import HttpCommandChannel, HttpSink

            http = HttpSink(self.server, self.state_dir / "spool", token=token, batch_s=send_interval_s,
                            close_timeout=close_timeout_s)
            self._sink: RecordSink = http
            self._channel: Any = HttpCommandChannel(self.server, token=token)
            self._closers: list[Callable[[], None]] = [lambda: http.close(self._time_left() + IO_RESERVE_S),
                                                       self._channel.close]
        else:
            from thermowatch.supervisor.app.config import SupervisorConfig
            from thermowatch.supervisor.app.service import Supervisor

            sup = Supervisor(supervisor_config or SupervisorConfig.load())
            self._sink = self._channel = self.supervisor = sup
            self._closers = [sup.close]
        # The acks given (answered again on a re-delivery), with the LR changes and skip ranges the
        # loop keeps beside them: thermowatch.protocol, the bundled controller's book too.
        self.book = CommandBook(self.state_dir)
        self._handed: dict[int, dict[str, Any]] = {}  # commands handed out and not yet acked: id -> JSON
        self._out: collections.deque[Callable[[], None]] = collections.deque()
        self._inbox: collections.deque[Command] = collections.deque()
        self._cv = threading.Condition()
        self._registered = False
        self._closing = False
        self._taken_over = False  # finish() hands the queue over itself: the I/O thread outlived the deadline
        self._idle = True
        # Records wait up to this long for more to join their batch: one request or transaction
        # every half second instead of one a step (a 10 steps/s loop paid ~5% of its CPU in
        # requests, bench/client_overhead.py). Anything else queued (an ack, a checkpoint, the
        # finish), flush() and close() send them at once, in order. Over HTTP the sink batches
        # them itself (HttpSink's queue, the one place they wait): here they only change threads.
        self.send_interval_s = send_interval_s
        self._sink_batches = bool(getattr(self._sink, "batches_records", False))
        self._records_since: float | None = None  # when the oldest unsent record was queued
        self._flushing = 0
        self.errors = 0  # sends or polls that raised (logged; training goes on)
        self._thread = threading.Thread(target=self._io, name=f"thermowatch-{run_id}", daemon=True)
        self._thread.start()

    # --- the caller's side: queue appends only -------------------------------------------------

    def start(self, start_step: int = 0, hosts: dict[int, str] | None = None) -> int:
        """Register a new attempt of the run starting after `start_step` (0 = from scratch; a
        checkpoint's step after a resume or a rollback). Returns the attempt number, never reused."""
        self.attempt = next_attempt(self.state_dir, self.attempt)
        info = RunInfo(self.run_id, self.attempt, self.world_size, dict(self.config), start_step, dict(hosts or {}))
        self._submit(_SinkCall(lambda: self._sink.open_run(info)))
        self._submit(self._confirm_registered)
        return self.attempt

    def send(self, record: StepRecord | Sequence[StepRecord]) -> None:
        records = [record] if isinstance(record, StepRecord) else list(record)
        if records:
            self.last_step = max(self.last_step or 0, max(r.step for r in records))
        self._submit(_Records(self.attempt, records))

    def checkpoint_saved(self, step: int, path: str | os.PathLike, sample_cursor: int, healthy: bool = True,
                         manifest: dict[str, Any] | None = None) -> None:
        info = CheckpointInfo(step, str(path), sample_cursor, healthy, dict(manifest or {}))
        attempt = self.attempt
        self._submit(_SinkCall(lambda: self._sink.checkpoint_saved(self.run_id, attempt, info)))

    def checkpoints_deleted(self, steps: Sequence[int], reason: str) -> None:
        steps, attempt = [int(s) for s in steps], self.attempt
        if steps:
            self._submit(_SinkCall(lambda: self._sink.checkpoints_deleted(self.run_id, attempt, steps, reason)))

    def commands(self) -> list[Command]:
        """Commands received since the last call, oldest first; a command already answered is
        answered again with its ack here and not returned (it was carried out once), and one
        handed out before and not answered yet (being carried out) is not returned again."""
        out = []
        with self._cv:
            while self._inbox:
                out.append(self._inbox.popleft())
        fresh = []
        for cmd in out:
            done = self.book.answered(cmd)
            if done is not None:
                self._submit(lambda a=done: self._send_ack(a))
            elif self._handed.get(cmd.id) == cmd.to_json():
                log.debug("command %d delivered again while it is carried out; handed out once", cmd.id)
            else:
                self._handed[cmd.id] = cmd.to_json()
                fresh.append(cmd)
        return fresh

    def ack(self, ack: Ack, command: Command | None = None, *, lr_changes: Iterable[LRChange] | None = None,
            skip_ranges: Iterable[Any] | None = None) -> None:
        """Say what was really done. Remembered on disk before it leaves (with the LR changes and
        skip ranges as they now are, when given), so a restarted trainer answers a re-delivered
        command with it instead of carrying the command out again."""
        self.book.record(ack, command, lr_changes=lr_changes, skip_ranges=skip_ranges)
        self._handed.pop(ack.command_id, None)  # the book answers it from now on
        self._submit(lambda: self._send_ack(ack))
        told = carried_out.line(self.run_id, ack, command)  # the trainer's own output says it (issue 35)
        if told is not None:
            say(told, carried_out.log)

    # --- carrying commands out: the ack built from what the command was (issue 35) ---------------
    # A loop with its own checkpointing built its Acks by hand: the docs did not say what the ledger
    # digest or lr_seq are, and an on-call's `thermowatch lr` crashed one with "ack: lr_change and
    # lr_seq go together". `done` and `refuse` build every field from the command and the run's
    # book of LR changes and skip ranges, which they keep: never an exception in the user's loop.

    @property
    def lr_changes(self) -> list[LRChange]:
        """The LR changes carried out so far (absolute multipliers from a step), oldest first."""
        return list(self.book.lr_changes)

    @property
    def skip_ranges(self) -> tuple[SampleRange, ...]:
        """The sample ranges skipped so far, merged: pass over these ids when you index your data."""
        return tuple(self.book.skip_ranges)

    @property
    def ledger_digest(self) -> str:
        """The digest of `skip_ranges` a StepRecord carries (`ledger_digest=`): the supervisor compares
        it with its own record of the skips it ordered, and a disagreement pages."""
        return ledger_digest(self.book.skip_ranges)

    def lr_multiplier(self, step: int) -> float:
        """The multiplier on your schedule's LR at `step` (1.0 until a SetLR or a rollback changes it)."""
        return multiplier_at(step, self.book.lr_changes)

    def done(self, cmd: Command, first_step: int, *, checkpoint_step: int | None = None,
             checkpoint_path: str | os.PathLike | None = None) -> Ack:
        """Say `cmd` was carried out, `first_step` being the first step trained under it (after a
        rollback to checkpoint T: T + 1). A Skip's ranges and a SetLR's (or a Rollback's) LR change
        join this run's book (`skip_ranges`, `lr_changes`, `lr_multiplier`); a Rollback names the
        checkpoint it loaded. Returns the Ack it sent."""
        body = cmd.body
        changes, skips = list(self.book.lr_changes), list(self.book.skip_ranges)
        change = seq = None
        lr = body if isinstance(body, SetLR) else getattr(body, "lr", None) if isinstance(body, Rollback) else None
        if lr is not None:
            change = lr.change(first_step)
            changes.append(change)
            seq = len(changes) - 1
        ranges = body.ranges if isinstance(body, Skip) else body.skip if isinstance(body, Rollback) else ()
        skips.extend(ranges)
        if isinstance(body, Rollback) and checkpoint_step is None:
            return self.refuse(cmd, first_step, "the loop did not say which checkpoint it loaded "
                                                "(Run.done(cmd, first_step, checkpoint_step=..., checkpoint_path=...))")
        ref = CheckpointRef(int(checkpoint_step), str(checkpoint_path or "")) if checkpoint_step is not None else None
        out = Outcome(f"{cmd.kind.value} carried out", checkpoint=ref, lr_change=change, lr_seq=seq,
                      skip_ranges=tuple(ranges))
        merged = merge_ranges(skips)
        ack = ack_for(cmd, out, None, first_step=first_step, lr_changes=changes, skip_ranges=merged)
        self.ack(ack, cmd, lr_changes=changes, skip_ranges=merged)
        return ack

    def refuse(self, cmd: Command, first_step: int, why: str) -> Ack:
        """Say `cmd` was not carried out, and why (the supervisor fails its action and pages). The
        run's book is unchanged. Returns the Ack it sent."""
        changes, skips = list(self.book.lr_changes), list(self.book.skip_ranges)
        ack = ack_for(cmd, None, why or f"{cmd.kind.value} refused", first_step=first_step, lr_changes=changes,
                      skip_ranges=skips)
        self.ack(ack, cmd, lr_changes=changes, skip_ranges=skips)
        return ack

    def flush(self, timeout: float | None = 60.0) -> bool:
        """Wait until everything queued so far has been handed over (tests, shutdown)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            self._flushing += 1
            self._cv.notify_all()
            try:
                while self._out or not self._idle:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._cv.wait(left)
            finally:
                self._flushing -= 1
        return self._sink.drain(timeout)

    def finish(self, timeout: float | None = None, *, final_step: int | None = None,
               final_loss: float | None = None, reason: str | None = None) -> None:
        """Send everything still queued, then stop the background thread and close the sink, in
        `timeout` seconds at most (default `close_timeout_s`): what the daemon has not taken by
        then is in `state_dir/spool`, and one log line says so and how to send it.
        With any of `final_step` (default: the last step sent), `final_loss` (None: none measured;
        NaN is data) or `reason` ("completed", "stopped", default "closed"), first tell the daemon
        this attempt finished (contract.RunFinished): the run then reads "finished" with that loss.
        Without them nothing is said: a run closed for a restart is not finished."""
        finished = None
        if self.attempt and (final_step is not None or final_loss is not None or reason is not None):
            try:
                finished = RunFinished(step=(self.last_step or 0) if final_step is None else final_step,
                                       final_loss=final_loss, reason=reason or "closed")
            except Exception:
                self._stop(timeout)  # a bad argument still closes the session, then says what was wrong
                raise
            attempt = self.attempt
            self._submit(_SinkCall(lambda: self._sink.finish_run(self.run_id, attempt, finished)))
        self._stop(timeout)

    close = finish

    def _stop(self, timeout: float | None) -> None:
        timeout = self.close_timeout_s if timeout is None else max(0.0, timeout)
        end = time.monotonic() + timeout
        # The sink's requests end by `end` (less a moment to spool what is left); this thread's
        # waits, a poll or an ack still to go a moment before, so that it hands the rest to the
        # sink in time.
        self._deadline = end - IO_RESERVE_S
        for part in (self._sink, self._channel):
            close_by = getattr(part, "close_by", None)
            if close_by is not None:
                close_by(self._deadline if part is self._channel else end)
        with self._cv:  # the I/O thread hands everything queued to the sink, in order, polls no more, ends
            self._closing = True
            self._cv.notify_all()
        self._thread.join(self._time_left() + IO_RESERVE_S / 2)
        if self._thread.is_alive() and self.server:
            self._take_over()
        elif self._thread.is_alive():  # the embedded supervisor: local writes in this process, no network
            log.warning("thermowatch: still writing to the embedded supervisor after %g s; waiting for it",
                        self.close_timeout_s)
            self._thread.join()
        for close in self._closers:
            try:
                close()
            except Exception:  # noqa: BLE001 - closing must not raise over the caller's result
                log.exception("closing the run's sink")
        unsent = getattr(self._channel, "unsent", 0)
        if unsent:
            log.warning("thermowatch: %d acknowledgement%s not delivered to %s; the next start from %s answers "
                        "its command again from commands.json, without carrying it out twice", unsent,
                        "s" * (unsent != 1), self.server, self.state_dir)

    def _time_left(self) -> float:
        return math.inf if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def _take_over(self) -> None:
        """The I/O thread is still in a request at the deadline (a poll or an ack begun before
        finish()): hand what it has not reached to the sink from here, in order (records and
        the sink's messages: the finish report among them); acks stay in the book."""
        with self._cv:
            self._taken_over = True
            items = list(self._out)
            self._out.clear()
        dropped = 0
        for item in items:
            if isinstance(item, _Records):
                self._guard(lambda r=item: self._sink.write(self.run_id, r.attempt, r.records))
            elif isinstance(item, _SinkCall):
                self._guard(item)
            else:
                dropped += 1
        log.warning("thermowatch: the I/O thread was still in a request after close_timeout_s %g s; %d messages "
                    "handed to the sink directly%s", self.close_timeout_s, len(items) - dropped,
                    f", {dropped} acks or checks left (acks stay in commands.json)" if dropped else "")

    # --- the background thread ----------------------------------------------------------------

    def _submit(self, item: "Callable[[], None] | _Records") -> None:
        with self._cv:
            if isinstance(item, _Records) and self._records_since is None:
                self._records_since = time.monotonic()
            self._out.append(item)
            self._cv.notify_all()

    def _due(self) -> float | None:
        """Seconds until what is queued must go (0: now), or None with nothing queued. Records
        alone may wait for their batch to fill; anything else goes at once."""
        if not self._out:
            return None
        if self._flushing or self._closing or self._sink_batches or not all(isinstance(i, _Records) for i in self._out):
            return 0.0
        return max(0.0, (self._records_since or 0.0) + self.send_interval_s - time.monotonic())

    def _io(self) -> None:
        next_poll = 0.0
        while True:
            with self._cv:
                while not self._closing and time.monotonic() < next_poll:
                    due = self._due()
                    if due == 0.0:
                        break
                    self._idle = not self._out
                    self._cv.notify_all()
                    self._cv.wait(max(0.0, min(next_poll - time.monotonic(), due if due is not None else math.inf)))
                if self._closing and not self._out:
                    self._idle = True
                    self._cv.notify_all()
                    return
                n = len(self._out)
                self._records_since = None
                self._idle = False
            # Everything queued since the last turn goes out in order, consecutive steps of one
            # attempt as one batch (one request, one transaction), however fast the loop runs.
            # Taken one at a time, so that what this thread has not reached stays in the queue for
            # finish() to hand over should this thread be stuck in a request at its deadline.
            while n > 0:
                with self._cv:
                    if self._taken_over:
                        return
                    item, k = self._pop(n)
                n -= k
                if isinstance(item, _Records):
                    self._guard(lambda r=item: self._sink.write(self.run_id, r.attempt, r.records))
                else:
                    self._guard(item)
            # Polls are due on their own clock, never starved by a busy queue; none once closing.
            if self._registered and not self._closing and time.monotonic() >= next_poll:
                next_poll = time.monotonic() + self.poll_interval_s
                cmds = self._guard(lambda: self._channel.poll(self.run_id)) or []
                if cmds:
                    with self._cv:
                        known = {c.id for c in self._inbox}
                        self._inbox.extend(c for c in cmds if c.id not in known)
            elif not self._registered:
                next_poll = time.monotonic() + self.poll_interval_s

    def _pop(self, n: int) -> tuple[Any, int]:
        """The queue's head, with the records right behind it for the same attempt (among the
        first `n` items) merged into one batch; and how many items it took. Holding the condition."""
        item, k = self._out.popleft(), 1
        if isinstance(item, _Records):
            records = list(item.records)
            while k < n and isinstance(self._out[0], _Records) and self._out[0].attempt == item.attempt:
                records += self._out.popleft().records
                k += 1
            item = _Records(item.attempt, records)
        return item, k

    def _guard(self, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception:  # noqa: BLE001 - the daemon's problems never stop training
            self.errors += 1
            log.exception("thermowatch: a send or poll failed; training goes on")
            return None

    def _confirm_registered(self, pause_s: float = 0.0) -> None:
        """Poll only once the daemon has the run (a poll before it answers 404): over HTTP the
        registration is sent by the sink's own thread, so wait for it here, off the caller's;
        while it sits in the spool (the daemon away), look again a poll interval later (not
        once closing: nothing is polled then)."""
        if self._closing:
            return
        time.sleep(pause_s)
        if self._drain_sink(30.0) and getattr(self._sink, "spooled", 0) == 0:
            self._registered = True
        elif not self._closing:
            self._submit(lambda: self._confirm_registered(self.poll_interval_s))

    def _drain_sink(self, timeout: float) -> bool:
        """The sink's drain(timeout), ended early by finish()'s deadline (in slices: a drain begun
        before finish() does not know of it)."""
        end = time.monotonic() + timeout
        while True:
            left = min(end - time.monotonic(), self._time_left())
            if self._sink.drain(max(0.0, min(left, 0.05))):
                return True
            if left <= 0.05:
                return False

    def _send_ack(self, ack: Ack) -> None:
        self._drain_sink(30.0)  # the steps trained before the command reach the daemon before its ack
        self._channel.ack(self.run_id, ack)


class _Records:
    __slots__ = ("attempt", "records")

    def __init__(self, attempt: int, records: list[StepRecord]) -> None:
        self.attempt, self.records = attempt, records


class _SinkCall:
    """A message for the sink (a checkpoint, a deletion, the finish report): a queue append over
    HTTP, so finish() may make it itself when the I/O thread is stuck past the deadline."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn

    def __call__(self) -> None:
        self.fn()
