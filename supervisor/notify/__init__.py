"""Notifiers: how the supervisor tells humans. Slack lives in `thermowatch.supervisor.notify.slack`, imported
only where it is used (STYLE.md 6), so this package does not pull slack_sdk in."""

from thermowatch.supervisor.notify.base import Alert, FanOut, Notifier, NotifyConfigError, NotifyError, NullNotifier
from thermowatch.supervisor.notify.console import ConsoleNotifier

__all__ = ["Alert", "ConsoleNotifier", "FanOut", "Notifier", "NotifyConfigError", "NotifyError", "NullNotifier"]
