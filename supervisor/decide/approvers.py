"""Who may answer an approval question from Slack (issue 21): an allow-list, closed by default.

Slack's signature (supervisor.serve.api.slack) proves that a click came from the workspace, not that
the person who clicked may roll a run back: anyone who can see the channel could. A click is
accepted only from a Slack user id listed in `slack.approvers`, or from a member of a Slack user
group listed in `slack.approver_groups`. The id is what is checked, never the name: an id is
stable and unique, a display name is its owner's to change.

Groups are read with `usergroups.users.list` (a `GroupMembers` callable; slack-sdk's WebClient
in supervisor.notify.slack), each kept for `ttl_s` so a burst of clicks costs one call, and a
member removed from the group loses the right within `ttl_s`. A group that cannot be read admits
nobody (closed on failure): a clicker in no list that was read is refused with 503 (try again;
Slack may be down) rather than 403, and someone in `slack.approvers` never depends on Slack.

Plain Python: the decision is a `Verdict`; the route logs, audits and answers it.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import Callable, Collection, Iterable, Protocol

from thermowatch.supervisor.errors import UserError

log = logging.getLogger(__name__)

# Slack's ids (api.slack.com/changelog/2016-08-11-user-id-format-changes): users are U... or, on
# Enterprise Grid, W...; user groups ("subteams") are S.... Upper-case ASCII letters and digits.
USER_ID = re.compile(r"[UW][A-Z0-9]{2,30}")
GROUP_ID = re.compile(r"S[A-Z0-9]{2,30}")

HOW_TO_CONFIGURE = ("list Slack member ids (U...; a profile's \u22ee menu, 'Copy member ID') in slack.approvers, "
                    "or Slack user-group ids (S...) in slack.approver_groups")


class GroupMembers(Protocol):
    """The user ids in a Slack user group now. Raises on any failure (the group is then unknown);
    a UserError means Slack refused the question itself (no such group, a missing scope)."""

    def __call__(self, group_id: str) -> Collection[str]: ...


@dataclass(frozen=True, slots=True)
class Verdict:
    allowed: bool
    status: int  # 200 allowed; 403 not an approver; 503 a group that might admit them could not be read
    why: str  # for the clicker, the log and the audit trail; names the config key to change


class Approvers:
    def __init__(self, users: Iterable[str] = (), groups: Iterable[str] = (), members: GroupMembers | None = None,
                 *, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        self.users = frozenset(users)
        self.groups = tuple(groups)
        if self.groups and members is None:
            raise ValueError("approver groups need a GroupMembers lookup")
        self._members = members
        self.ttl_s = ttl_s
        self._clock = clock
        self._cache: dict[str, tuple[float, frozenset[str]]] = {}  # group -> (read at, its members)
        self._lock = threading.Lock()  # clicks are answered on a thread pool

    @property
    def configured(self) -> bool:
        """False: nobody may approve from Slack, so alerts carry no buttons."""
        return bool(self.users or self.groups)

    def decide(self, user_id: str) -> Verdict:
        if not self.configured:
            return Verdict(False, 403, "nobody may approve from Slack until approvers are configured (closed by "
                                       f"default): {HOW_TO_CONFIGURE}")
        if user_id in self.users:
            return Verdict(True, 200, f"{user_id} is in slack.approvers")
        unread = []
        for group in self.groups:
            try:
                members = self._read(group)
            except Exception as exc:  # any failure: this group admits nobody this time
                log.warning("Slack user group %s could not be read: %s", group, exc)
                unread.append(f"{group} ({exc})")
                continue
            if user_id in members:
                return Verdict(True, 200, f"{user_id} is in the Slack user group {group} (slack.approver_groups)")
        if unread:
            return Verdict(False, 503, f"{user_id} is not in slack.approvers, and the Slack user groups in "
                                       f"slack.approver_groups could not all be read, so nobody else may approve now: "
                                       f"{'; '.join(unread)}. Try again; check the bot token's usergroups:read scope")
        return Verdict(False, 403, f"{user_id} is not an approver: add that id to slack.approvers, or the user to "
                                   f"one of the Slack user groups in slack.approver_groups "
                                   f"({', '.join(self.groups) or 'none configured'})")

    def check(self) -> None:
        """Read every group once, at start-up: a group Slack refuses to list (a wrong id, the bot
        lacking usergroups:read) raises UserError, so `serve` stops naming it instead of the first
        click failing during an incident. Slack unreachable is logged: clicks wait for it."""
        for group in self.groups:
            try:
                self._read(group, fresh=True)
            except UserError as exc:
                raise UserError(f"slack.approver_groups: {exc}") from None
            except Exception as exc:
                log.critical("Slack user group %s could not be read at start-up (%s); clicks by anyone not in "
                             "slack.approvers are refused until it can be", group, exc)

    def _read(self, group: str, *, fresh: bool = False) -> frozenset[str]:
        with self._lock:  # one lookup at a time: a burst of clicks makes one call per group
            now = self._clock()
            hit = self._cache.get(group)
            if hit is not None and not fresh and now - hit[0] < self.ttl_s:
                return hit[1]
            assert self._members is not None
            members = frozenset(self._members(group))
            self._cache[group] = (now, members)
            return members
