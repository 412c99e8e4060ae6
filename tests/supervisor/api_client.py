"""The daemon's HTTP API in this process (FastAPI's TestClient, sending the admin token): one API
module's router mounted as the daemon mounts it, or the whole app as a fixture that answers a
server error with a 500 instead of raising it (for tests asserting no request ends in a 500)."""

from __future__ import annotations

import contextlib
from typing import Iterator

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from thermowatch.supervisor.serve.api import install_error_handlers
from thermowatch.supervisor.serve.server import build_app
from tests.supervisor.auth_helpers import AUTH, guard


@contextlib.contextmanager
def router_client(api, sup) -> Iterator[TestClient]:
    """`api.make_router(sup)` alone, behind the daemon's error handlers (the store's NotFound ->
    404) and its auth guard."""
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(api.make_router(sup, guard=guard(sup.sessions)))
    with TestClient(app, headers=AUTH) as c:
        yield c


@pytest.fixture
def client(sup):
    """The whole app over the module's `sup` fixture. A test module imports it to use it."""
    with TestClient(build_app(sup), raise_server_exceptions=False, headers=AUTH) as c:
        yield c
