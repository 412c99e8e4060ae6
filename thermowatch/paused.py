"""What a paused loop says while it waits (issue 35, item 3: paused HF, Lightning, `Run` and
torchrun processes printed nothing and blocked until someone happened to look, one for 9 minutes
until it was killed).

    notice = PauseNotice("my-run")
    notice.paused(72, reason, checkpoints=[10, 20, 30])  # the pause begins: why, and what ends it
    notice.tick()           # between polls while it waits: a short line every `every_s` seconds
    notice.ended("resumed")  # the pause is over: how, and after how long

thermowatch.watch and the bundled trainer's controller use it; a loop of its own on
thermowatch.Run (which carries out its commands itself) can make the same three calls.

Each line goes to the `thermowatch` logger at WARNING, which HF's and Lightning's users see with
their own logs, and to stderr once: written there directly only when logging would not put it
there itself (no handler on the way up writes to stderr; with no handler at all, logging's last
resort does).
"""

from __future__ import annotations

import logging
import shlex
import sys
import time
from typing import Callable, Iterable

from thermowatch.monitors.names import printable

log = logging.getLogger(__name__)

REPEAT_S = 300.0  # a log tail shows the loop alive and waiting, without a line per poll


class PauseNotice:
    """The lines of one run's pauses. `emit` (tests): where a line goes instead of say()."""

    def __init__(self, run_id: str, *, every_s: float = REPEAT_S, clock: Callable[[], float] = time.monotonic,
                 emit: Callable[[str], None] | None = None) -> None:
        self.run_id, self.every_s, self.clock = run_id, every_s, clock
        self.emit = emit or say
        self.since: float | None = None  # when the pause began (None: not paused)
        self.step = 0  # the step it waits before
        self._next = 0.0

    @property
    def active(self) -> bool:
        return self.since is not None

    def paused(self, step: int, reason: str, checkpoints: Iterable[int] = ()) -> None:
        """The pause began before `step`: the reason the supervisor (or a person) gave, and the
        exact commands that end it."""
        self.since, self.step = self.clock(), step
        self._next = self.since + self.every_s
        run = shlex.quote(self.run_id)
        on_disk = sorted(set(checkpoints))
        self.emit(f"thermowatch: run {run} is PAUSED before step {step}: "
                  f"{printable(reason) if reason else '(no reason given)'}. Training waits here until one of: "
                  f"`thermowatch resume {run}` (train on from here), `thermowatch rollback {run} --to-step N` "
                  f"(train on from the newest checkpoint at or before step N; "
                  f"{'on disk: ' + _steps(on_disk) if on_disk else 'none on disk yet'}), "
                  f"`thermowatch stop {run}` (end the run)")

    def tick(self) -> None:
        """While paused, between two polls: a short line once every `every_s` seconds."""
        if self.since is None:
            return
        now = self.clock()
        if now < self._next:
            return
        self._next = now + self.every_s
        run = shlex.quote(self.run_id)
        self.emit(f"thermowatch: run {run} still paused before step {self.step} ({_took(now - self.since)}); "
                  f"`thermowatch resume {run}` trains on")

    def ended(self, how: str) -> None:
        """The pause is over (`how`: the command's words: resumed, rolled back to ..., stopping ...)."""
        if self.since is None:
            return
        took = _took(self.clock() - self.since)
        self.since = None
        self.emit(f"thermowatch: run {shlex.quote(self.run_id)} no longer paused after {took}: {printable(how)}")


def say(line: str, logger: logging.Logger = log) -> None:
    """`line` to `logger` at WARNING, and to stderr when logging does not put it there itself."""
    logger.warning("%s", line)
    if not _logged_to_stderr(logger, logging.WARNING):
        print(line, file=sys.stderr, flush=True)


def _logged_to_stderr(logger: logging.Logger, level: int) -> bool:
    """Whether logging writes a record of `level` from `logger` to stderr: a stream handler on the
    way up writes there, or there is no handler at all (logging.lastResort, stderr, WARNING)."""
    if not logger.isEnabledFor(level):
        return False
    seen = False
    node: logging.Logger | None = logger
    while node is not None:
        for h in node.handlers:
            seen = True
            if (level >= h.level and isinstance(h, logging.StreamHandler)
                    and getattr(h, "stream", None) in (sys.stderr, sys.__stderr__)):
                return True
        node = node.parent if node.propagate else None
    last = logging.lastResort
    return not seen and last is not None and level >= last.level


def _steps(steps: list[int]) -> str:
    if len(steps) <= 6:
        return ", ".join(map(str, steps))
    return f"{steps[0]}, {steps[1]}, ..., {', '.join(map(str, steps[-3:]))} ({len(steps)} in all)"


def _took(seconds: float) -> str:
    s = int(max(0.0, seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min" + (f" {s % 60} s" if s % 60 else "")
    return f"{s // 3600} h {s % 3600 // 60} min"
