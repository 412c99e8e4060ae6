"""What the HTTP routers and the web pages use of the Supervisor (supervisor.app.service): the
seam between serve/ and the rest, as a Protocol listing exactly that, so a router says what it
needs and nothing else of the Supervisor leaks into serve/ unnoticed.
tests/supervisor/serve/test_daemon.py holds the Supervisor to it and the routers to its list."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from sqlalchemy.orm import sessionmaker

    from thermowatch.monitors.contract import Ack, Command
    from thermowatch.supervisor.act.executor import Executor
    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.app.service import Progress


@runtime_checkable
class Daemon(Protocol):
    """The Supervisor as the routers see it."""

    cfg: SupervisorConfig  # the detector bank's and the envelope's settings (stall timeout, thresholds)
    sessions: sessionmaker  # one transaction per request: `with sup.sessions() as s`
    executor: Executor  # submit, approve, cancel, refuse, fail, silence, unsilence, acknowledge_page
    progress: Progress  # the newest loss, step time and tokens/s per run (the index page)

    def poll(self, run_id: str) -> list[Command]:
        """The commands to deliver to the run's trainer now (contract.CommandChannel)."""
        ...

    def ack(self, run_id: str, ack: Ack, actor: str = "trainer") -> None:
        """The trainer's acknowledgement of one command, booked as from `actor`."""
        ...
