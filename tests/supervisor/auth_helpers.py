"""Tokens for tests that talk to the daemon's HTTP API. Auth stays on in every test: apps get
the config-provided admin token below (as THERMOWATCH_API_TOKEN would give them), or a scoped
token made in the real token table."""

from __future__ import annotations

import io

import pytest

from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.guard import Guard
from thermowatch.supervisor.serve.auth import CONFIG_TOKEN_NAME, Authenticator
from thermowatch.supervisor.store import tokens as tokens_store

ADMIN_TOKEN = "tw_test-suite-admin-token-0123456789abcdef"
ADMIN = CONFIG_TOKEN_NAME  # the actor name its requests are recorded under
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def guard(sessions, **kw) -> Guard:
    return Guard(Authenticator(sessions, config_token=ADMIN_TOKEN), **kw)


def make_token(sessions, name: str, *scopes: str) -> str:
    with sessions.begin() as s:
        return tokens_store.create_token(s, name, scopes)[1]


@pytest.fixture
def sup(db, tmp_path):
    """The daemon's Supervisor as `thermowatch serve` runs it: auth on (ADMIN_TOKEN), the judge off
    the request thread (judge_inline=False), alerts to a console nobody reads. A test module
    imports it to use it."""
    s = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN),
                   notifier=ConsoleNotifier(io.StringIO()), judge_inline=False)
    yield s
    s.close()
