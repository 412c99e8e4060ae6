"""The trainer's side of the command protocol, once, for every trainer (issue 22, item 7):
thermowatch.Run / thermowatch.watch and the bundled trainer's controller use this module, not
copies of it.

- `next_attempt(state_dir, current)`: attempt numbers never repeat across relaunches (the last
  is kept on disk, written durably before it is used).
- `CommandBook(state_dir)`: what the commands carried out left behind, in `commands.json`: each
  ack with the command it answered (a command delivered again, after a lost ack or a restart,
  is answered with its first ack and not carried out twice; the same id with another body is a
  new queue, a reset database, and is carried out), and the absolute state the commands built,
  the LR changes and the skip ranges, which outlive every rollback.
- `Outcome` and `ack_for`: what carrying a command out did, and the ack that says so.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, NamedTuple

from thermowatch.monitors.contract import (
    Ack, Bisected, Command, ContractError, LRChange, Pause, Resume, SampleRange, Stop, ledger_digest, merge_ranges,
    multiplier_at,
)
from thermowatch.monitors.durable import fsync_dir

log = logging.getLogger(__name__)

KEEP_ACKS = 10_000  # acks remembered for duplicate deliveries (commands are rare: hours of them)


def write_json(path: Path, obj: Any) -> None:
    """Atomically and durably: a crash leaves the old file or the new one, never a torn one."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def next_attempt(state_dir: str | os.PathLike, current: int = 0) -> int:
    """The next attempt number: one past the larger of `current` and the last one kept in
    `state_dir/attempt.json`, which is updated before the number is returned."""
    path = Path(state_dir) / "attempt.json"
    last = current
    try:
        last = max(last, int(json.loads(path.read_text())["attempt"]))
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, OSError, TypeError):
        log.warning("unreadable %s; numbering attempts from this process's memory", path)
    write_json(path, {"attempt": last + 1, "time": time.time()})
    return last + 1


class CommandBook:
    """See the module docstring. `loaded`: a book was read from disk (a relaunch)."""

    FILE = "commands.json"

    def __init__(self, state_dir: str | os.PathLike) -> None:
        self.path = Path(state_dir) / self.FILE
        self.acks: dict[int, Ack] = {}
        self.commands: dict[int, dict[str, Any]] = {}  # id -> the command as carried out (JSON)
        self.lr_changes: list[LRChange] = []
        self.skip_ranges: tuple[SampleRange, ...] = ()
        self.loaded = False
        try:
            obj = json.loads(self.path.read_text())
            self.acks = {int(a["command_id"]): Ack.from_json(a) for a in obj.get("acks", [])}
            self.commands = {int(c["id"]): c for c in obj.get("commands", [])}
            self.lr_changes = [LRChange.from_json(c) for c in obj.get("lr_changes", [])]
            self.skip_ranges = merge_ranges(tuple(r) for r in obj.get("skip_ranges", []))
            self.loaded = True
        except FileNotFoundError:
            pass
        except (OSError, ValueError, KeyError, TypeError, ContractError) as exc:
            log.error("unreadable %s (%s): commands acknowledged before may be carried out again, and the "
                      "supervisor will page on the difference", self.path, exc)

    def answered(self, cmd: Command) -> Ack | None:
        """The ack this very command was answered with, or None: carry it out."""
        done = self.acks.get(cmd.id)
        if done is None:
            return None
        if self.commands.get(cmd.id) == cmd.to_json():
            log.info("command %d delivered again; answering with its ack (not carried out twice)", cmd.id)
            return done
        log.warning("command id %d was %s, now %s: carrying out the new one", cmd.id, self.commands.get(cmd.id),
                    cmd.to_json())
        return None

    def record(self, ack: Ack, cmd: Command | None = None, *, lr_changes: Iterable[LRChange] | None = None,
               skip_ranges: Iterable[Any] | None = None) -> None:
        """Remember an ack (with its command, and the LR changes and skip ranges as they now
        are) on disk, before the ack leaves: a crash after acking must not forget what was done."""
        self.acks[ack.command_id] = ack
        if cmd is not None:
            self.commands[cmd.id] = cmd.to_json()
        self.save(lr_changes, skip_ranges)

    def save(self, lr_changes: Iterable[LRChange] | None = None, skip_ranges: Iterable[Any] | None = None) -> None:
        if lr_changes is not None:
            self.lr_changes = list(lr_changes)
        if skip_ranges is not None:
            self.skip_ranges = merge_ranges(skip_ranges)
        if len(self.acks) > KEEP_ACKS:
            for cid in sorted(self.acks)[: len(self.acks) - KEEP_ACKS]:
                del self.acks[cid]
                self.commands.pop(cid, None)
        write_json(self.path, {"acks": [a.to_json() for a in self.acks.values()],
                               "commands": list(self.commands.values()),
                               "lr_changes": [c.to_json() for c in self.lr_changes],
                               "skip_ranges": [r.to_json() for r in self.skip_ranges], "time": time.time()})


class CheckpointRef(NamedTuple):
    step: int
    path: str


class Directive(str, enum.Enum):
    """What the operator's commands ask of a loop between two steps: train on, wait, or end. The
    one piece of loop state the pause / resume / stop handlers change, and only by returning it
    (Outcome.directive): the loop (thermowatch.loop.Watch, trainer.controller.RunController)
    applies it in one place and reads `paused` / `stopped` from it."""

    RUN = "run"
    PAUSE = "pause"
    STOP = "stop"


class Directed:
    """A loop that carries a Directive (thermowatch.loop.Watch, trainer.controller.RunController):
    `paused` and `stopped` are read from it, never set."""

    directive: Directive = Directive.RUN

    @property
    def paused(self) -> bool:
        """An operator paused the run (`thermowatch pause`): the loop waits until a resume."""
        return self.directive is Directive.PAUSE

    @property
    def stopped(self) -> bool:
        """An operator stopped the run (`thermowatch stop`): the loop ends after this step."""
        return self.directive is Directive.STOP


def directed(current: Directive, body: Any, step: int) -> Outcome:
    """The pure transition for Pause / Resume / Stop after `step`, with the ack's words. A stopped
    loop stays stopped (a resume after a stop does not restart it)."""
    if isinstance(body, Stop) or current is Directive.STOP:
        return Outcome(f"stopping after step {step}", directive=Directive.STOP)
    if isinstance(body, Pause):
        return Outcome(f"paused before step {step + 1}", directive=Directive.PAUSE)
    if isinstance(body, Resume):
        return Outcome("resumed" if current is Directive.PAUSE else "was not paused", directive=Directive.RUN)
    raise TypeError(f"not a pause, resume or stop: {type(body).__name__}")


def resumed_by_rollback(current: Directive) -> Directive | None:
    """The Directive after a rollback carried out: a rollback ends a pause (training goes on from
    the checkpoint it loaded: docs/any-trainer.md; issue 35, an acked manual rollback left the loop
    paused until a resume); a stopped loop stays stopped, a running one runs. None: unchanged."""
    return Directive.RUN if current is Directive.PAUSE else None


@dataclass
class Outcome:
    """What carrying a command out did: `detail` for people, the rest for the ack's fields, and
    `directive`, the loop's next Directive where the command changes it."""

    detail: str
    checkpoint: CheckpointRef | None = None  # the checkpoint a rollback loaded
    lr_change: LRChange | None = None
    lr_seq: int | None = None
    skip_ranges: tuple[SampleRange, ...] = ()  # what it added to the skip ledger
    bisected: Bisected | None = None  # a precise skip's search (thermowatch/precise_skip.py)
    directive: Directive | None = None  # pause / resume / stop: what the loop does next


def ack_for(cmd: Command, out: Outcome | None, error: str | None, *, first_step: int,
            lr_changes: list[LRChange], skip_ranges: Iterable[Any]) -> Ack:
    """The ack of `cmd`: carried out (`out`) or refused (`error`, why), the first step trained
    under it, the LR multiplier then, and the ledger's digest."""
    return Ack(command_id=cmd.id, ok=error is None, first_step=first_step, detail=out.detail if error is None else error,
               checkpoint_step=out.checkpoint.step if out and out.checkpoint else None,
               checkpoint_path=out.checkpoint.path if out and out.checkpoint else None,
               lr_multiplier=multiplier_at(first_step, lr_changes), lr_change=out.lr_change if out else None,
               lr_seq=out.lr_seq if out else None, skip_ranges=out.skip_ranges if out else (),
               ledger_digest=ledger_digest(skip_ranges), bisected=out.bisected if out else None)
