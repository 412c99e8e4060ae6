"""A real uvicorn server for an ASGI app on a free loopback port, in a thread, for tests that
need the daemon over real HTTP (the CLI, the trainer's channels, a browser)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
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


@contextlib.contextmanager
def served(db_url: str, data_dir: Path, admin_token: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """`thermowatch serve` as its own process on a free port with `admin_token` as the API's
    admin token, its log in data_dir/../serve.log; yields (base URL, process) once it answers
    /healthz, and stops it on exit."""
    port = free_port()
    log = Path(data_dir).parent / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "thermowatch", "serve", "--data-dir", str(data_dir),
                             "--db", db_url, "--port", str(port)],
                            env={**os.environ, "THERMOWATCH_API_TOKEN": admin_token},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, log)
        yield url, proc
    finally:
        proc.terminate()
        proc.wait(30)


def wait_healthy(url: str, proc: subprocess.Popen | None = None, log: str | Path | None = None,
                 timeout_s: float = 60.0) -> None:
    """Wait until a daemon started as a process (`thermowatch serve`) answers /healthz with 200;
    AssertionError with the end of its log if it exits first or never does."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        gone = proc is not None and proc.poll() is not None
        if gone or time.monotonic() > deadline:
            tail = Path(log).read_text()[-3000:] if log is not None and Path(log).exists() else ""
            raise AssertionError(f"{url}: the daemon {'exited' if gone else 'never answered /healthz'}:\n{tail}")
        time.sleep(0.1)


def wait_until(pred, what: str, timeout_s: float = 30.0, every_s: float = 0.05):
    """pred()'s first truthy answer, polled every `every_s`; AssertionError naming `what` when none
    comes within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = pred()
        if got:
            return got
        assert time.monotonic() < deadline, f"no {what} in {timeout_s} s"
        time.sleep(every_s)
