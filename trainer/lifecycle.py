"""The run controller's states and its failure policy, as data (shaped like Ray Train v2's
`_internal/execution/controller/state.py` and `failure_handling/`): the controller carries out
what `make_decision` returns and records each state it enters, so a test or a log line can ask
"where is it" without reading flags spread over the controller.

    Initializing -> Running <-> Paused
                    Running -> Restarting -> Running           (a rank died or hung)
                    Running -> Finished (steps done, or a STOP)
                    Restarting -> Errored (restarts exhausted: RunFailed)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from thermowatch.monitors.contract import LRChange


@dataclass(frozen=True)
class Initializing:
    pass


@dataclass(frozen=True)
class _AtStep:
    """Where the run stands: the attempt and the last step it trained."""

    attempt: int
    step: int


@dataclass(frozen=True)
class Running(_AtStep):
    """Training."""


@dataclass(frozen=True)
class Paused(_AtStep):
    """Held by a PAUSE command until a RESUME."""


@dataclass(frozen=True)
class Restarting(_AtStep):  # `attempt` is the one that failed
    error: str
    failures: int


@dataclass(frozen=True)
class Finished:
    step: int
    stopped: bool  # by a STOP command


@dataclass(frozen=True)
class Errored:
    error: str


ControllerState = Initializing | Running | Paused | Restarting | Finished | Errored


class FailureDecision(str, enum.Enum):
    RESTART = "restart"  # kill the gang, resume a new attempt from the newest valid checkpoint
    RAISE = "raise"  # give up: RunFailed, with how to fix it


@dataclass(frozen=True)
class FailureStatus:
    failures: int  # gang failures so far in this controller, this one included
    max_restarts: int
    error: BaseException


def make_decision(status: FailureStatus) -> FailureDecision:
    """Pure: a gang failure is retried until the run has used up `max_restarts` (a bring-up that
    fails too counts as one more; the node may still be down)."""
    return FailureDecision.RESTART if status.failures <= status.max_restarts else FailureDecision.RAISE


class GangLike(Protocol):
    """The seam between the controller and its ranks: trainer.worker.Gang (Ray actors, one per
    rank) and trainer.local.InProcessGang (one rank in this process, for tests) both fit it."""

    names: list[str]  # the thermometer keys of a step's vector, in order
    hosts: dict[int, str]  # rank -> host

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list: ...

    def kill(self) -> None: ...


# Builds a gang: (the TrainConfig, attempt, data_state, lr_changes) -> a gang.
GangFactory = Callable[[Any, int, dict[str, Any], list[LRChange]], GangLike]
