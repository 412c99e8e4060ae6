"""Alerts as plain text lines on a stream: the embedded default (DESIGN.md, "Real parts")."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

from thermowatch.monitors.names import printable
from thermowatch.supervisor.notify.base import Alert, NotifyError


class ConsoleNotifier:
    """Writes each alert as a few readable lines. Thread-safe: scheduler jobs share it."""

    def __init__(self, stream: TextIO | None = None):
        self._stream = stream  # None: sys.stderr at send time (pytest's capsys swaps it)
        self._lock = threading.Lock()
        self.closed = False

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def send(self, alert: Alert) -> str | None:
        if self.closed:
            raise NotifyError("ConsoleNotifier is closed; build a new one to send more alerts")
        # Every part through printable (monitors.names): a reason or an ack's detail is free text
        # from a client, and a newline or an escape sequence in it must not forge a line or move
        # the terminal's cursor (issue 34). The text's own lines stay lines, each indented.
        p = printable
        lines = [f"[{alert.severity.value.upper()}] {p(alert.title)}"]
        lines += [f"  {p(line)}" for line in (alert.text or "").splitlines()]
        lines += [f"  - {p(reason)}" for reason in alert.reasons]
        if alert.fields:
            lines.append("  " + ", ".join(f"{p(k)}: {p(v)}" for k, v in alert.fields.items()))
        lines += [f"  $ {p(command)}" for command in alert.commands]
        if alert.incident_id is not None:
            lines.append(f"  run {p(alert.run_id)}, incident {alert.incident_id}")
        with self._lock:
            self.stream.write("\n".join(lines) + "\n")
            self.stream.flush()
        return None

    def check(self) -> dict:
        return {}  # a stream is always there

    def close(self) -> None:
        self.closed = True
        with self._lock:
            self.stream.flush()
