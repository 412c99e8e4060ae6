"""Who may answer from Slack (supervisor.decide.approvers, issue 21): the allow-list's decisions, with
user groups read by the real slack-sdk client (supervisor.notify.slack.SlackGroupMembers) from
the fake Slack Web API, and a hand-turned clock for the cache. The route that acts on them:
test_slack_api.py."""

from __future__ import annotations

import logging

import pytest

from thermowatch.supervisor.decide.approvers import Approvers
from thermowatch.supervisor.errors import UserError
from thermowatch.supervisor.notify.slack import SlackGroupMembers
from tests.fakes.slack_server import FakeSlack, fake_slack  # noqa: F401 - the fixture


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def approvers(fake: FakeSlack, clock: Clock, users=("U0ALICE",), groups=("S0ONCALL",)) -> Approvers:
    return Approvers(users, groups, SlackGroupMembers(fake.token, base_url=fake.base_url), ttl_s=60, clock=clock)


def reads(fake: FakeSlack) -> int:
    return len(fake.calls("usergroups.users.list"))


def test_nobody_is_an_approver_until_one_is_configured():
    verdict = Approvers().decide("U0ALICE")
    assert (verdict.allowed, verdict.status) == (False, 403)
    assert "closed by default" in verdict.why and "slack.approvers" in verdict.why
    assert not Approvers().configured and Approvers(["U0ALICE"]).configured


def test_listed_ids_and_group_members_are_approvers_and_a_group_is_read_once_per_ttl(fake_slack):
    fake_slack.usergroups["S0ONCALL"] = ["U0CAROL"]
    clock = Clock()
    a = approvers(fake_slack, clock)
    assert a.decide("U0ALICE").allowed and reads(fake_slack) == 0  # a listed id never asks Slack
    assert a.decide("U0CAROL").allowed and reads(fake_slack) == 1
    dave = a.decide("U0DAVE")
    assert (dave.allowed, dave.status, reads(fake_slack)) == (False, 403, 1)  # the cached list
    assert "add that id to slack.approvers" in dave.why and "slack.approver_groups (S0ONCALL)" in dave.why
    assert a.decide("U0ALICE ").status == 403  # ids match exactly
    # carol leaves on-call: she may still approve until the cached list expires, not after
    fake_slack.usergroups["S0ONCALL"] = []
    clock.now = 59.0
    assert a.decide("U0CAROL").allowed and reads(fake_slack) == 1
    clock.now = 61.0
    assert a.decide("U0CAROL").status == 403 and reads(fake_slack) == 2


def test_a_group_that_cannot_be_read_admits_nobody_but_listed_ids(fake_slack):
    fake_slack.usergroups["S0ONCALL"] = ["U0CAROL"]
    clock = Clock()
    a = approvers(fake_slack, clock)
    assert a.decide("U0CAROL").allowed
    clock.now = 120.0  # the cached list has expired: it is never used past its ttl
    fake_slack.server_error(1, "usergroups.users.list")
    down = a.decide("U0CAROL")
    assert (down.allowed, down.status) == (False, 503)
    assert "S0ONCALL (Slack usergroups.users.list S0ONCALL: HTTP 500, error internal_error)" in down.why
    fake_slack.server_error(1, "usergroups.users.list")
    before = reads(fake_slack)
    assert a.decide("U0ALICE").allowed and reads(fake_slack) == before  # slack.approvers never asks Slack
    fake_slack.server_error(0)
    fake_slack.fail_next("missing_scope")  # Slack answers, but will not list the group
    scope = a.decide("U0CAROL")
    assert scope.status == 503 and "(missing_scope); check the id (S...) and that the bot has the usergroups:read" \
                                   in scope.why
    assert a.decide("U0CAROL").allowed  # Slack is back: read again at once (failures are not cached)


def test_a_member_of_any_readable_group_is_enough(fake_slack):
    fake_slack.usergroups["S0ONCALL"] = ["U0CAROL"]
    a = approvers(fake_slack, Clock(), users=(), groups=("S0GONE", "S0ONCALL"))
    assert a.decide("U0CAROL").allowed  # S0GONE (no_such_subteam) could not say yes; S0ONCALL does
    assert a.decide("U0DAVE").status == 503  # not in S0ONCALL, and S0GONE might have had him


def test_the_start_up_check_stops_on_a_group_slack_refuses_and_only_logs_an_outage(fake_slack, caplog):
    fake_slack.usergroups["S0ONCALL"] = ["U0CAROL"]
    approvers(fake_slack, Clock()).check()
    with pytest.raises(UserError, match=r"^slack\.approver_groups: Slack refused to list the user group S0NOPE "
                                        r"\(no_such_subteam\)"):
        approvers(fake_slack, Clock(), groups=("S0ONCALL", "S0NOPE")).check()
    fake_slack.server_error(1, "usergroups.users.list")
    with caplog.at_level(logging.CRITICAL, logger="thermowatch.supervisor.decide.approvers"):
        approvers(fake_slack, Clock()).check()  # Slack down at start: the daemon still starts
    assert [m for m in caplog.messages if "S0ONCALL could not be read at start-up" in m]
