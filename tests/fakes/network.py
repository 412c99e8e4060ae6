"""The network between a trainer and the daemon, misbehaving (the wire lies outside the machine):

- `LateProxy(upstream, delay_s)`: every request reaches the real daemon at once and its answer
  comes back `delay_s` late; `drop(pred)` makes the proxy swallow the answers `pred(method, path,
  body)` picks (the daemon did the work, e.g. marked a command `sent`, and the trainer never hears
  of it: the connection closes without a byte).
- `Silent()`: a host that accepts connections and never answers a byte.

Both are context managers with `.url`; they stop their threads and close every socket on exit.
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

import httpx

_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "content-encoding"}


class LateProxy:
    def __init__(self, upstream: str, delay_s: float = 0.0) -> None:
        self.upstream, self.delay_s = upstream.rstrip("/"), delay_s
        self._drop: Callable[[str, str, bytes], bool] = lambda method, path, body: False
        self.dropped: list[tuple[float, str, str, bytes]] = []  # (monotonic time, method, path, answer)
        self.answered: list[tuple[float, str, str, bytes]] = []  # the answers that went out, the same way
        self._http = httpx.Client(base_url=self.upstream, timeout=60)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a) -> None:  # quiet
                pass

            def _relay(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                r = proxy._http.request(self.command, self.path, content=body, headers=headers)
                time.sleep(proxy.delay_s)
                if proxy._drop(self.command, self.path, r.content):
                    proxy.dropped.append((time.monotonic(), self.command, self.path, r.content))
                    self.close_connection = True  # the answer is lost on the way: not a byte of it
                    return
                try:
                    self.send_response(r.status_code)
                    for k, v in r.headers.items():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    self.send_header("content-length", str(len(r.content)))
                    self.end_headers()
                    self.wfile.write(r.content)
                    proxy.answered.append((time.monotonic(), self.command, self.path, r.content))
                except (BrokenPipeError, ConnectionResetError):  # the client gave up waiting: its business
                    self.close_connection = True

            do_GET = do_POST = do_PUT = do_DELETE = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def drop(self, pred: Callable[[str, str, bytes], bool]) -> None:
        self._drop = pred

    def __enter__(self) -> "LateProxy":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._http.close()


class Silent:
    """Accepts every connection, reads nothing, answers nothing."""

    def __init__(self) -> None:
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.accepted = 0
        self._conns: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:  # the 0.2 s timeout: look at the stop flag
                continue
            self.accepted += 1
            self._conns.append(conn)

    def __enter__(self) -> "Silent":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)
        for c in self._conns:
            c.close()
        self._sock.close()
