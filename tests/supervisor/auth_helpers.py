"""Tokens for tests that talk to the daemon's HTTP API. Auth stays on in every test: apps get
the config-provided admin token below (as THERMOWATCH_API_TOKEN would give them), or a scoped
token made in the real token table."""

from __future__ import annotations

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
