"""The CLI's side of the daemon's HTTP API (DESIGN.md, "Trust": the CLI is a client of the API).

An on-call laptop holds an address and a token, never database credentials. Where they come
from, first found wins:

1. flags: `--server URL`, `--token TOKEN`;
2. the environment: `THERMOWATCH_SERVER`, `THERMOWATCH_TOKEN`;
3. the per-user file `thermowatch login` writes (`$THERMOWATCH_CLIENT_CONFIG`, else
   `$XDG_CONFIG_HOME/thermowatch/client.json`, else `~/.config/thermowatch/client.json`;
   mode 0600, like kubectl's and ray's own);
4. the address alone defaults to http://127.0.0.1:8765 (`thermowatch serve`'s default).

The address may name several replicas of the daemon, comma-separated (`--server
http://a:8765,http://b:8765`): a request goes to the one that answered last, else the next
(supervisor.operate.servers), so the leader's loss or a standby's 503 costs a retry, not an
error. A request that must not happen twice (a manual command) moves on only when nothing
reached the daemon it tried.

Every failure is one sentence: an unreachable daemon names the address tried and how to point
elsewhere (exit 3), a refused token says which scope was missing and where the token came from
(exit 2), a refused request carries the daemon's own message naming the field (exit 2).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import time
from typing import Sequence

import httpx

from thermowatch.monitors.commands import ContractError
from thermowatch.monitors.names import check_run_id
from thermowatch.supervisor.errors import DaemonUnreachable, UserError
from thermowatch.supervisor.operate.servers import Servers, joined, parse_servers

DEFAULT_SERVER = "http://127.0.0.1:8765"
FROM_DEFAULT = "the default"  # Endpoint.server_from when nothing named a server
SERVER_ENV, TOKEN_ENV, CONFIG_ENV = "THERMOWATCH_SERVER", "THERMOWATCH_TOKEN", "THERMOWATCH_CLIENT_CONFIG"


class Refused(UserError):
    """The daemon answered 4xx: a bad value, an unknown run or action, a refused token."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def config_path() -> Path:
    if os.environ.get(CONFIG_ENV):
        return Path(os.environ[CONFIG_ENV])
    base = Path(os.environ["XDG_CONFIG_HOME"]) if os.environ.get("XDG_CONFIG_HOME") else Path.home() / ".config"
    return base / "thermowatch" / "client.json"


def read_login() -> dict[str, str]:
    path = config_path()
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} ({exc}); run `thermowatch login` again or delete it") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} is not a JSON object; run `thermowatch login` again or delete it")
    return {k: v for k, v in obj.items() if k in ("server", "token") and isinstance(v, str)}


def save_login(server: str, token: str | None) -> Path:
    """Write the per-user file, readable by its owner only (it holds a token)."""
    from thermowatch.supervisor.operate.files import write_file

    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_file(path, json.dumps({"server": server, **({"token": token} if token else {})}), flag="saving the login to",
               mode=0o600)
    return path


@dataclass(frozen=True)
class Endpoint:
    server: str  # one URL, or several replicas' comma-separated (`servers` splits them)
    token: str | None
    server_from: str  # where each came from, for error messages
    token_from: str

    @property
    def servers(self) -> tuple[str, ...]:
        return parse_servers(self.server)


def resolve(server: str | Sequence[str] | None = None, token: str | None = None) -> Endpoint:
    """`server`: one URL, several comma-separated, or a list of them (Python's `server=`)."""
    saved = read_login() if not (server and token) else {}
    s, s_from = next(((v, w) for v, w in ((server, "--server"), (os.environ.get(SERVER_ENV), SERVER_ENV),
                                         (saved.get("server"), str(config_path())))
                      if v), (DEFAULT_SERVER, FROM_DEFAULT))
    t, t_from = next(((v, w) for v, w in ((token, "--token"), (os.environ.get(TOKEN_ENV), TOKEN_ENV),
                                         (saved.get("token"), str(config_path())))
                      if v), (None, "nowhere"))
    try:
        urls = parse_servers(s, f"the server address (from {s_from})")
    except ValueError as exc:
        raise UserError(str(exc)) from None
    return Endpoint(joined(urls), t, s_from, t_from)


class Client:
    def __init__(self, endpoint: Endpoint, timeout: float = 30.0) -> None:
        self.endpoint = endpoint
        headers = {"Authorization": f"Bearer {endpoint.token}"} if endpoint.token else {}
        self._http = Servers(endpoint.server, headers=headers, timeout=timeout)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get(self, path: str, **params: Any) -> Any:
        return self._call("GET", path, params={k: v for k, v in params.items() if v is not None})

    def post(self, path: str, body: dict[str, Any]) -> Any:
        return self._call("POST", path, json=body)

    def get_bytes(self, path: str, **params: Any) -> bytes:
        """A GET whose answer is not JSON (a PNG); errors as for get()."""
        return self._call("GET", path, params={k: v for k, v in params.items() if v is not None}, raw=True)

    def _call(self, method: str, path: str, raw: bool = False, **kw: Any) -> Any:
        ep = self.endpoint
        # A GET may go to the next replica whatever happened; a POST (a command, an approval) only
        # when it cannot have been carried out: never twice (supervisor.operate.servers).
        resend = method == "GET"
        try:
            r = self._http.request(method, path, resend=resend, **kw)
            if r.status_code == 503 and self._http.retry_after_s is not None:
                # Every replica said "not now" (a standby, a takeover under way): once more after
                # the wait they asked for, capped at a few seconds.
                time.sleep(self._http.retry_after_s)
                r = self._http.request(method, path, resend=resend, **kw)
        except httpx.TransportError as exc:
            where = f"at {ep.server}" if len(self._http.urls) == 1 else f"at any of {', '.join(self._http.urls)}"
            raise DaemonUnreachable(
                f"no thermowatch daemon answered {where} (from {ep.server_from}): {exc or type(exc).__name__}. "
                f"Point the CLI elsewhere with --server URL (several: comma-separated), {SERVER_ENV}=URL, "
                "or `thermowatch login --server URL`"
            ) from None
        if r.status_code < 400:
            return r.content if raw else r.json()
        detail, server = _detail(r), self._http.answered
        if r.status_code in (401, 403):
            where = f"the token from {ep.token_from}" if ep.token else "no token"
            raise Refused(r.status_code, f"{server} refused the request with {where} ({r.status_code}: {detail}). "
                                         f"Pass --token, set {TOKEN_ENV}, or run `thermowatch login`")
        if r.status_code < 500:
            raise Refused(r.status_code, detail)
        raise RuntimeError(f"{server} failed on {method} {path} ({r.status_code}: {detail}); see the daemon's log")


def run_path(run_id: str) -> str:
    """The API path of a run, its id checked first with the daemon's own rule (monitors.names):
    `..` would be resolved away by the URL and ask another route, never the run."""
    try:
        check_run_id(run_id, "RUN")
    except ContractError as exc:
        raise UserError(str(exc)) from None
    return f"/api/runs/{quote(run_id, safe='')}"


def _detail(r: httpx.Response) -> str:
    try:
        d = r.json().get("detail")
    except (ValueError, AttributeError):
        d = None
    if isinstance(d, list):  # FastAPI's validation errors
        d = "; ".join(f"{'.'.join(str(x) for x in e.get('loc', ()))}: {e.get('msg')}" for e in d if isinstance(e, dict))
    return str(d) if d else (r.text[:200] or r.reason_phrase)
