"""A real uvicorn server for an ASGI app on a free loopback port, in a thread, for tests that
need the daemon over real HTTP (the CLI, the trainer's channels, a browser)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(app, timeout_s: float = 20.0) -> Iterator[str]:
    """Serve `app`; yields its base URL; stops the server on exit."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)
