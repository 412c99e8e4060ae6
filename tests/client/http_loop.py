"""A user's loop (tests/client/user_loop.py) watched through `thermowatch serve` over HTTP while an
operator acts on the run through the daemon's API, as the HTTP client tests run it."""

from __future__ import annotations

import httpx

from tests.client.user_loop import DATA, train_step, user_batch
from tests.live_server import wait_until


def operator(url: str, admin_token: str) -> tuple[httpx.Client, str]:
    """An admin's API client on the daemon at `url`, and the secret of an `ingest` token it made
    for the trainer."""
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {admin_token}"}, timeout=30)
    made = api.post("/api/tokens", json={"name": "my-trainer", "scopes": ["ingest"]})
    assert made.status_code == 201, made.text
    return api, made.json()["secret"]


def train_operated(tw, model, opt, api: httpx.Client, run: str, actions: dict[int, dict]) -> list[tuple[int, list]]:
    """Train every step `tw` gives; after step s the operator posts `actions[s]` for `run`, once
    the daemon knows the run (registering it is the client's I/O thread's job, which on a slow
    machine may still be in flight). Returns (step, sample ids) of each step trained, in order."""
    trained = []
    for step in tw.steps():
        ids = tw.batch_ids(step)
        trained.append((step, ids.tolist()))
        tw.record(train_step(model, opt, *user_batch(DATA, ids)))
        if step in actions:
            wait_until(lambda: api.get(f"/api/runs/{run}/status").status_code != 404, f"run {run} registered",
                       timeout_s=60, every_s=0.1)
            r = api.post(f"/api/runs/{run}/actions", json=actions[step])
            assert r.status_code == 201, r.text
    return trained
