"""The lifecycle the fakes of outside servers share: serve on a free 127.0.0.1 port in a daemon
thread, `start()` / `stop()`, and `with Fake() as fake:`. A fake says which request handler
answers (`_handler()`) and, when it is not HTTP, which socketserver serves it."""

from __future__ import annotations

import socketserver
import threading
from http.server import ThreadingHTTPServer
from typing import Any, TypeVar

F = TypeVar("F", bound="ServedFake")


class ServedFake:
    server_class: type[socketserver.TCPServer] = ThreadingHTTPServer
    thread_name: str | None = None  # None: threading's own
    _server: socketserver.TCPServer | None = None
    _thread: threading.Thread | None = None

    def _handler(self) -> type[socketserver.BaseRequestHandler]:
        """The request handler class; it reaches this fake through a closure."""
        raise NotImplementedError

    def start(self: F) -> F:
        self._server = self.server_class(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True  # type: ignore[attr-defined]  # both Threading* servers have it
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name=self.thread_name, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def __enter__(self: F) -> F:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
