"""Alerts as plain text lines on a stream: the embedded default (DESIGN.md, "Real parts")."""

from __future__ import annotations

import sys
import threading
from typing import TextIO

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
        lines = [f"[{alert.severity.value.upper()}] {alert.title}"]
        if alert.text:
            lines.append(f"  {alert.text}")
        lines += [f"  - {reason}" for reason in alert.reasons]
        if alert.fields:
            lines.append("  " + ", ".join(f"{k}: {v}" for k, v in alert.fields.items()))
        lines += [f"  $ {command}" for command in alert.commands]
        if alert.incident_id is not None:
            lines.append(f"  run {alert.run_id}, incident {alert.incident_id}")
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
