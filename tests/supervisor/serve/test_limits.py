"""Every limit of supervisor.limits over HTTP (server.build_app) on real SQLite and PostgreSQL: one
case per cause of issue 11's 500s, each a 4xx naming the field and the limit, with the stored
baseline run unchanged; the budgets from the config; the net of exception handlers (input errors
4xx, internal errors still 500); and the OpenAPI document describing every POST body."""

from __future__ import annotations

import io
import json

import pytest
from fastapi.testclient import TestClient

from thermowatch.monitors.commands import CommandKind

from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from thermowatch.supervisor.limits import Limits, check_json
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from tests.supervisor.api_client import client  # noqa: F401  (client: the fixture)
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH
from thermowatch.supervisor.app.service import Supervisor

RUN = "base"
KEYS = ["loss", "grad_norm", "attn_logit_max/blocks.0.attn"]
LIMITS = {"max_config_keys": 50, "max_config_bytes": 4000, "max_manifest_keys": 50, "max_manifest_bytes": 4000,
          "max_keys_per_step": 40, "max_series_per_run": 12}


@pytest.fixture
def sup(db, tmp_path):
    """A daemon under LIMITS, with the baseline run: its config and 20 steps of KEYS."""
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, limits=dict(LIMITS), api_token=ADMIN_TOKEN)
    s = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    s.open_run(RunInfo(run_id=RUN, attempt=0, world_size=2, config={"lr": 3e-4, "layers": [1, 2]}))
    s.write(RUN, 0, [StepRecord(step=i, values={k: i + j / 10 for j, k in enumerate(KEYS)}, sample_lo=8 * i,
                                sample_hi=8 * i + 8, wall_time=0.5) for i in range(20)])
    yield s
    s.close()


def snapshot(c: TestClient) -> bytes:
    """What the read API says about every run: must be byte-identical across refused requests."""
    parts = [c.get("/api/runs").content]
    for run in c.get("/api/runs").json()["runs"]:
        rid = run["run_id"]
        parts += [c.get(f"/api/runs/{rid}").content, c.get(f"/api/runs/{rid}/actions").content]
        for key in c.get(f"/api/runs/{rid}/series").json()["keys"]:
            parts.append(c.get(f"/api/runs/{rid}/history", params={"key": key, "attempts": "all"}).content)
    return b"\n".join(parts)


def steps_body(*records: dict) -> bytes:
    return json.dumps({"records": list(records)}).encode()


def deep(n: int) -> str:
    return "[" * n + "]" * n


STEPS = f"/api/runs/{RUN}/attempts/0/steps"
CKPT = f"/api/runs/{RUN}/attempts/0/checkpoints"
RUNS = "/api/runs"
NEW_RUN = {"run_id": "new", "attempt": 0, "world_size": 1}


def raw(obj_text: str) -> bytes:
    return obj_text.encode()


# (cause, method, path, body (bytes) or None, status, a phrase the detail must hold)
CASES = [
    # deeply nested JSON: json.loads raises RecursionError (only ValueError was caught)
    ("deep steps body", "post", STEPS, raw(f'{{"records": {deep(100_000)}}}'), 400, "nested too deeply"),
    ("deep run body", "post", RUNS, raw(f'{{"run_id": "x", "config": {deep(100_000)}}}'), 400, "nested too deeply"),
    ("deep ack", "post", f"/api/runs/{RUN}/acks", raw(deep(5000)), 400, "nested too deeply"),
    ("deep action args", "post", f"/api/runs/{RUN}/actions",
     raw(f'{{"kind": "pause", "who": "a", "args": {{"x": {deep(200)}}}}}'), 422, "limit is 32"),
    ("deep config below the parser's limit", "post", RUNS,
     raw(json.dumps({**NEW_RUN, "config": {"a": json.loads(deep(60))}})), 422, "limit is 32"),
    # integers beyond the column's range: path, query and body
    ("action id 2**31 (Integer column)", "post", f"/api/actions/{2**31}/approve", raw('{"who": "a"}'), 422,
     "action_id must be an integer in [0, 2**31-1]"),
    ("action id 2**63", "post", f"/api/actions/{2**63}/cancel", raw('{"who": "a"}'), 422, "action_id"),
    ("attempt 2**31 in the path", "post", f"/api/runs/{RUN}/attempts/{2**31}/steps", steps_body(), 422, "attempt"),
    ("step_lo 2**63 in the query", "get", f"/api/runs/{RUN}/history?key=loss&step_lo={2**63}", None, 422, "step_lo"),
    ("step_hi -2**64 in the query", "get", f"/api/runs/{RUN}/history?key=loss&step_hi={-2**64}", None, 422,
     "step_hi"),
    ("incident 10**30 on the page", "get", f"/runs/{RUN}?incident={10**30}", None, 422, "incident"),
    ("attempt 2**31 in a run body", "post", RUNS, raw(json.dumps({**NEW_RUN, "attempt": 2**31})), 422, "attempt"),
    ("step 2**63 in a record", "post", STEPS, steps_body({"step": 2**63, "loss": 1.0}), 422, "step"),
    ("sample_hi 2**64 in a record", "post", STEPS, steps_body({"step": 50, "sample_hi": 2**64, "loss": 1.0}), 422,
     "sample_hi"),
    ("checkpoint step 2**63", "post", CKPT, raw(json.dumps({"step": 2**63, "path": "/c", "sample_cursor": 0,
                                                             "healthy": True})), 422, "step"),
    ("ack command_id 2**31", "post", f"/api/runs/{RUN}/acks", raw(json.dumps({"command_id": 2**31, "ok": True,
                                                                              "step": 1})), 422, "command_id"),
    ("deleted steps 2**63", "post", f"{CKPT}/deleted", raw(json.dumps({"steps": [2**63]})), 422, "steps"),
    ("rank 2**31", "post", STEPS, steps_body({"step": 50, "loss": 1.0, "ranks": {"loss": 2**31}}), 422, "rank"),
    ("metric value 10**400", "post", STEPS, raw('{"records": [{"step": 50, "loss": 1' + "0" * 400 + '}]}'), 422,
     "records[0]"),
    # NUL in any string (PostgreSQL text refuses it)
    ("NUL in a run id", "post", RUNS, raw(json.dumps({**NEW_RUN, "run_id": "a\x00b"})), 422, "run_id"),
    ("NUL in a run id in the path", "get", "/api/runs/a%00b", None, 422, "run_id"),
    ("NUL in a run id in an ingest path", "post", "/api/runs/a%00b/attempts/0/steps", steps_body(), 422, "run_id"),
    ("NUL in a query", "get", f"/api/runs/{RUN}/history?key=lo%00ss", None, 422, "'key'"),
    ("NUL in who", "post", f"/api/runs/{RUN}/actions", raw(json.dumps({"kind": "pause", "who": "a\x00"})), 422,
     "who"),
    ("NUL in a reason", "post", f"/api/runs/{RUN}/actions",
     raw(json.dumps({"kind": "pause", "who": "a", "reason": "x\x00"})), 422, "reason"),
    ("NUL in an ack's detail", "post", f"/api/runs/{RUN}/acks",
     raw(json.dumps({"command_id": 1, "ok": False, "step": 1, "detail": "\x00"})), 422, "ack.detail"),
    ("NUL in a checkpoint path", "post", CKPT, raw(json.dumps({"step": 1, "path": "/c\x00", "sample_cursor": 0,
                                                               "healthy": True})), 422, "path"),
    ("NUL in a config value", "post", RUNS, raw(json.dumps({**NEW_RUN, "config": {"a": "\x00"}})), 422, "config.a"),
    ("NUL in a config key", "post", RUNS, raw(json.dumps({**NEW_RUN, "config": {"\x00": 1}})), 422, "key in config"),
    ("NUL in a host", "post", RUNS, raw(json.dumps({**NEW_RUN, "hosts": {"0": "n\x00"}})), 422, "hosts"),
    ("NUL in a metric key", "post", STEPS, steps_body({"step": 50, "lo\x00ss": 1.0}), 422, "metric key"),
    ("NUL in a ledger digest", "post", STEPS, steps_body({"step": 50, "loss": 1.0, "ledger_digest": "\x00"}), 422,
     "ledger_digest"),
    ("NUL in a deleted reason", "post", f"{CKPT}/deleted", raw(json.dumps({"steps": [1], "reason": "\x00"})), 422,
     "reason"),
    # lone surrogates (neither database stores a str that is not valid Unicode)
    ("lone surrogate in a run id", "post", RUNS, raw('{"run_id": "a\\ud800", "attempt": 0, "world_size": 1}'), 422,
     "run_id"),
    ("lone surrogate in a metric key", "post", STEPS, raw('{"records": [{"step": 50, "loss\\udfff": 1.0}]}'), 422,
     "metric key"),
    ("lone surrogate in who", "post", f"/api/runs/{RUN}/actions", raw('{"kind": "pause", "who": "\\ud800"}'), 422,
     "who"),
    # metric-key shape, length and characters
    ("metric key a/", "post", STEPS, steps_body({"step": 50, "a/": 1.0}), 422, "non-empty module"),
    ("metric key /a", "post", STEPS, steps_body({"step": 50, "/a": 1.0}), 422, "non-empty metric"),
    ("metric name of 101 chars", "post", STEPS, steps_body({"step": 50, "m" * 101: 1.0}), 422, "at most 100"),
    ("module of 301 chars", "post", STEPS, steps_body({"step": 50, "m/" + "x" * 301: 1.0}), 422, "at most 300"),
    ("control char in a metric key", "post", STEPS, steps_body({"step": 50, "lo\nss": 1.0}), 422,
     "control characters"),
    # finite numbers where a column needs them
    ("wall_time NaN", "post", STEPS, raw('{"records": [{"step": 50, "wall_time": NaN, "loss": 1.0}]}'), 422,
     "wall_time"),
    ("wall_time Infinity", "post", STEPS, raw('{"records": [{"step": 50, "wall_time": Infinity}]}'), 422,
     "wall_time"),
    ("NaN in a config", "post", RUNS, raw('{"run_id": "new", "attempt": 0, "world_size": 1, "config": {"a": NaN}}'),
     422, "config.a"),
    ("Infinity deep in a config", "post", RUNS,
     raw('{"run_id": "new", "attempt": 0, "world_size": 1, "config": {"a": [1, {"b": -Infinity}]}}'), 422,
     "config.a[1].b"),
    ("NaN in a manifest", "post", CKPT,
     raw('{"step": 1, "path": "/c", "sample_cursor": 0, "healthy": true, "manifest": {"x": NaN}}'), 422, "manifest.x"),
    # sizes: config and manifest (bytes and keys), keys per step, series per run
    ("config of too many keys", "post", RUNS, raw(json.dumps({**NEW_RUN, "config": {f"k{i}": i for i in range(51)}})),
     413, "more than 50 keys"),
    ("config of too many nested keys", "post", RUNS,
     raw(json.dumps({**NEW_RUN, "config": {"a": {f"k{i}": i for i in range(60)}}})), 413, "more than 50 keys"),
    ("config of too many bytes", "post", RUNS, raw(json.dumps({**NEW_RUN, "config": {"a": "x" * 5000}})), 413,
     "limit is 4000"),
    ("manifest of too many keys", "post", CKPT, raw(json.dumps({"step": 1, "path": "/c", "sample_cursor": 0,
                                                                "healthy": True,
                                                                "manifest": {f"f{i}": 1 for i in range(51)}})),
     413, "manifest has more than 50 keys"),
    ("too many keys in one step", "post", STEPS, steps_body({"step": 50, **{f"m{i}": 1.0 for i in range(41)}}), 413,
     "limit is 40"),
    ("a batch of more series than a run may hold", "post", STEPS,
     steps_body({"step": 50, **{f"m{i}": 1.0 for i in range(13)}}), 413, "at most 12"),
    ("series past the run's budget", "post", STEPS, steps_body({"step": 50, **{f"m{i}": 1.0 for i in range(10)}}),
     413, "has 3 series and this batch adds 10"),
    ("who longer than its column", "post", "/api/actions/1/approve", raw(json.dumps({"who": "w" * 201})), 422, "who"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_limit_is_a_4xx_naming_it_and_nothing_changes(db, client, case):
    cause, method, path, body, status, needle = case
    before = snapshot(client)
    r = client.request(method, path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, (cause, r.status_code, r.text[:500])
    assert needle in r.json()["detail"], (cause, r.json()["detail"])
    assert snapshot(client) == before, cause
    assert client.get("/healthz").status_code == 200


def test_series_budget_counts_what_is_stored(db, sup, client):
    """Series the run already has are free; only new ones count, and a refused batch stores none."""
    assert client.post(STEPS, content=steps_body({"step": 20, **{f"m{i}": 1.0 for i in range(9)}})).status_code == 200
    assert client.post(STEPS, content=steps_body({"step": 21, **{k: 2.0 for k in KEYS}, "m0": 2.0})).status_code == 200
    before = snapshot(client)
    r = client.post(STEPS, content=steps_body({"step": 22, "m9": 1.0}))
    assert r.status_code == 413 and "has 12 series and this batch adds 1" in r.json()["detail"], r.text
    assert snapshot(client) == before
    # a daemon restart forgets its cache: the budget is counted from the database
    sup.ingestor._cache = type(sup.ingestor._cache)()
    assert client.post(STEPS, content=steps_body({"step": 22, "m9": 1.0})).status_code == 413
    assert client.post(STEPS, content=steps_body({"step": 22, "m8": 1.0})).status_code == 200


def test_a_million_metric_names_are_refused_fast(db, tmp_path):
    """Issue 11: 10^6 distinct names in one step spent 25 s and ended in a 500 (too many SQL
    variables). With the default limits the record is refused before it is parsed."""
    import time

    cfg = SupervisorConfig(data_dir=tmp_path / "d", db_url=db.url, api_token=ADMIN_TOKEN)
    sup = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    try:
        sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
        body = steps_body({"step": 0, **{f"m{i}/x": 1.0 for i in range(1_000_000)}})
        with TestClient(build_app(sup), raise_server_exceptions=False, headers=AUTH) as c:
            t = time.perf_counter()
            r = c.post(STEPS, content=body)
            took = time.perf_counter() - t
            assert r.status_code == 413 and "limit is 20000 metric keys per step" in r.json()["detail"], r.text
            assert took < 10, took  # parse only (~1-2 s on this machine); 25 s and a 500 before
            assert c.get("/api/runs").status_code == 200
    finally:
        sup.close()


def test_limits_from_the_config():
    assert Limits.from_dict({"max_series_per_run": 5}).max_series_per_run == 5
    with pytest.raises(ConfigError, match="limits.max_serie_per_run: unknown key; did you mean 'max_series_per_run'"):
        SupervisorConfig(limits={"max_serie_per_run": 5})
    with pytest.raises(ConfigError, match="positive integer"):
        SupervisorConfig(limits={"max_json_depth": 0})


def test_check_json_is_iterative_and_names_the_path():
    deep_list: list = []
    for _ in range(100_000):
        deep_list = [deep_list]
    with pytest.raises(ValueError, match="limit is 32"):
        check_json("config", deep_list, max_depth=32)
    check_json("config", {"a": [1, 2.5, "ok", {"b": None}]}, max_depth=32)
    with pytest.raises(ValueError, match=r"config\.a\[1\]"):
        check_json("config", {"a": [1, float("nan")]}, max_depth=32)


def test_input_errors_left_to_the_net_are_4xx_and_internal_errors_stay_500(db, sup, client, monkeypatch):
    """The exception handlers: a driver's DataError or an OverflowError that a check upstream
    missed is the client's 4xx; any other exception is still our 500, and the daemon answers."""
    import sqlalchemy.exc

    def data_error(*a, **k):
        raise sqlalchemy.exc.DataError("INSERT ...", {}, Exception("integer out of range"))

    monkeypatch.setattr(sup.executor, "submit", data_error)
    r = client.post(f"/api/runs/{RUN}/actions", json={"kind": "pause", "who": "a"})
    assert r.status_code == 422 and "does not fit its column" in r.json()["detail"], r.text

    def overflow(*a, **k):
        raise OverflowError("Python int too large to convert to SQLite INTEGER")

    monkeypatch.setattr(sup.executor, "submit", overflow)
    assert client.post(f"/api/runs/{RUN}/actions", json={"kind": "pause", "who": "a"}).status_code == 422

    def bug(*a, **k):
        raise KeyError("a bug of ours")

    monkeypatch.setattr(sup.executor, "submit", bug)
    r = client.post(f"/api/runs/{RUN}/actions", json={"kind": "pause", "who": "a"})
    assert r.status_code == 500 and "internal error" in r.json()["detail"]
    assert client.get("/healthz").status_code == 200


def test_openapi_describes_every_post_body(client):
    doc = client.get("/openapi.json").json()
    posts = {path: ops["post"] for path, ops in doc["paths"].items() if "post" in ops}
    assert len(posts) == 15, sorted(posts)  # 5 ingest, 4 commands, 2 silences, a page's acknowledge, 2 tokens, Slack's callback
    assert "requestBody" not in posts.pop("/api/tokens/{name}/revoke")  # the only POST with no body
    slack = posts.pop("/api/slack/interactions")["requestBody"]["content"]["application/x-www-form-urlencoded"]
    assert slack["schema"]["required"] == ["payload"]  # Slack posts a form, signed, not JSON
    action = posts.pop("/api/runs/{run_id}/actions")["requestBody"]["content"]["application/json"]["schema"]
    # one shape per kind, so the args a kind takes are stated (issue 21)
    kinds = {b["properties"]["kind"]["const"]: b for b in action["oneOf"]}
    assert sorted(kinds) == sorted(k.value for k in CommandKind)
    assert kinds["skip"]["properties"]["args"]["properties"]["skip_ranges"]["minItems"] == 1
    for path, op in posts.items():
        schema = op["requestBody"]["content"]["application/json"]["schema"]
        assert schema["type"] == "object" and schema["properties"], path
    steps = posts["/api/runs/{run_id}/attempts/{attempt}/steps"]["requestBody"]["content"]["application/json"]
    record = steps["schema"]["properties"]["records"]["items"]
    assert record["properties"]["step"]["maximum"] == 2**63 - 1 and "additionalProperties" in record
    assert "#/$defs/" not in json.dumps(posts)  # inlined: complete in whichever app includes the router


def _http(sock, method: str, path: str, body: bytes = b"") -> tuple[int, dict[str, str]]:
    """One request on an open socket (HTTP/1.1 keep-alive); the status and headers of its answer."""
    sock.sendall(f"{method} {path} HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                 f"Authorization: Bearer {ADMIN_TOKEN}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {method} {path}"
        buf += chunk
    head, rest = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:])}
    while len(rest) < int(headers.get("content-length", 0)):
        rest += sock.recv(65536)
    return int(lines[0].split()[1]), headers


def test_refusals_keep_the_connection(sup):
    """Issue 11: each 500 also closed the keep-alive connection. Every refusal is an ordinary 4xx
    answer now, and the next request on the same connection is served."""
    import socket
    from urllib.parse import urlsplit

    from tests.live_server import running

    with running(build_app(sup)) as url:
        with socket.create_connection(("127.0.0.1", urlsplit(url).port), timeout=30) as sock:
            for method, path, body, status in [
                ("POST", STEPS, raw(f'{{"records": {deep(100_000)}}}'), 400),
                ("POST", f"/api/actions/{2**31}/approve", raw('{"who": "a"}'), 422),
                ("GET", "/api/runs/a%00b", b"", 422),
                ("POST", STEPS, raw('{"records": [{"step": 50, "wall_time": NaN}]}'), 422),
                ("POST", RUNS, raw('{"run_id": "n", "attempt": 0, "world_size": 1, "config": {"a": NaN}}'), 422),
                ("GET", "/healthz", b"", 200),
            ]:
                got, headers = _http(sock, method, path, body)
                assert got == status, (method, path, got)
                assert headers.get("connection", "").lower() != "close", (method, path, headers)
