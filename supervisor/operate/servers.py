"""The daemon's addresses: several replicas on one PostgreSQL, one of them leading (issue 40).

A client names them all, as a comma-separated list in the one setting it already has
(`--server`, `THERMOWATCH_SERVER`, `thermowatch login`, `server=` in Python, `thermowatch train
--supervisor`), or a list in Python. `Servers.request` sends to the replica that answered last,
and moves on to the next one when that one cannot answer: a connection failure, or 502/503/504
(a standby answers 503 with Retry-After for what only the leader does: command polls, acks,
checkpoint reports, a run's finish, manual commands). Every address is tried once before the
caller backs off; `retry_after_s` then says how long the servers asked it to wait, capped at
RETRY_AFTER_CAP_S so a client never sleeps long on a standby's word while a takeover runs.

One address is one httpx.Client, as before; after a 502/503/504 it opens a new connection, so an
address that is a load balancer over the replicas (deploy/k8s's `thermowatch` Service) reaches
another one on the next try. Nothing else changes for a single daemon. The
trainer's sink and command channel (thermowatch.transport) and the CLI (supervisor.operate.client)
share this, as they share `resolve`; httpx and the standard library only.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

import httpx

log = logging.getLogger(__name__)

# A standby says 2 s (supervisor.errors.NotLeader); a proxy may say minutes. Past this a client
# tries again anyway: a standby leads within ~10 s of the leader's loss.
RETRY_AFTER_CAP_S = 5.0
FAIL_OVER = frozenset({502, 503, 504})  # this replica cannot answer now; another may
CONNECT_FAILURES = (httpx.ConnectError, httpx.ConnectTimeout)  # nothing was sent


def parse_servers(servers: str | Sequence[str], where: str = "the server address") -> tuple[str, ...]:
    """'http://a:8765, http://b:8765/' or a list of them -> each URL without its trailing slash,
    in order, once each. ValueError naming the bad one."""
    items = servers.split(",") if isinstance(servers, str) else list(servers)
    out: list[str] = []
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"{where}: {item!r} is not a URL; give URLs as strings")
        url = item.strip().rstrip("/")
        if not url:
            continue
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{where}: {url!r} must start with http:// or https:// "
                             "(several daemons: a comma-separated list of URLs)")
        if url not in out:
            out.append(url)
    if not out:
        raise ValueError(f"{where}: no URL in {servers!r}")
    return tuple(out)


def joined(servers: Sequence[str]) -> str:
    """The one string that names them all (a setting, a log line, `--server` for `thermowatch flush`)."""
    return ",".join(servers)


def retry_after(r: httpx.Response) -> float | None:
    """Retry-After in seconds, capped; None when absent or an HTTP date (rare; backing off does)."""
    value = r.headers.get("retry-after", "").strip()
    try:
        secs = float(value)
    except ValueError:
        return None
    return min(max(secs, 0.0), RETRY_AFTER_CAP_S)


class Servers:
    """One httpx.Client per daemon address; `request` fails over between them."""

    def __init__(self, servers: str | Sequence[str], **client_kw: Any) -> None:
        self.urls = parse_servers(servers)
        self._client_kw = client_kw
        self._clients = [httpx.Client(base_url=u, **client_kw) for u in self.urls]
        self.current = 0  # the one that answered last: tried first
        # After a request that no address answered: the shortest Retry-After any gave (capped);
        # None when none gave one (the caller's own backoff then).
        self.retry_after_s: float | None = None
        self.answered = self.urls[0]  # the address whose answer request() returned last (error messages)

    @property
    def url(self) -> str:
        return self.urls[self.current]

    @property
    def all(self) -> str:
        return joined(self.urls)

    def request(self, method: str, path: str, *, resend: bool = True,
                timeout: Callable[[], Any] | None = None, **kw: Any) -> httpx.Response:
        """Send to `url`, then to each other address in turn, until one answers with anything
        but 502/503/504; that answer (and that address is `url` from now on). When none did: the
        last 502/503/504 answer, else the last connection error is raised.

        resend=False: a request that must not be carried out twice (a manual command) moves on
        only when nothing reached the last address (it refused the connection, or answered
        502/503/504); a timeout while it waited for the answer is raised as it is. `timeout()`
        gives each try's timeout (a deadline shrinks it) and may raise to stop trying."""
        self.retry_after_s = None
        answer: httpx.Response | None = None
        error: httpx.TransportError | None = None
        n = len(self.urls)
        for k in range(n):
            i = (self.current + k) % n
            if timeout is not None:
                kw["timeout"] = timeout()  # outside the try: a deadline past stops the round
            try:
                r = self._clients[i].request(method, path, **kw)
            except httpx.TransportError as exc:
                if not resend and not isinstance(exc, CONNECT_FAILURES):
                    raise
                error = exc
                if n > 1:
                    log.info("%s %s: %s did not answer (%s: %s)", method, path, self.urls[i], type(exc).__name__, exc)
                continue
            if r.status_code in FAIL_OVER:
                answer, self.answered = r, self.urls[i]
                # A new connection next time: behind one address (a Kubernetes Service over both
                # replicas) it may reach another replica, where a kept-alive one would reach this again.
                self._clients[i].close()
                self._clients[i] = httpx.Client(base_url=self.urls[i], **self._client_kw)
                wait = retry_after(r)
                if wait is not None:
                    self.retry_after_s = wait if self.retry_after_s is None else min(self.retry_after_s, wait)
                if n > 1:
                    log.info("%s %s: %s answered %d; trying the next address", method, path, self.urls[i],
                             r.status_code)
                continue
            if i != self.current:
                log.warning("thermowatch: now talking to %s (%s could not take %s %s)", self.urls[i], self.url,
                            method, path)
                self.current = i
            self.retry_after_s, self.answered = None, self.urls[i]
            return r
        if answer is not None:
            return answer
        assert error is not None
        raise error

    def close(self) -> None:
        for c in self._clients:
            c.close()
