"""A few lines of the Chrome DevTools Protocol over `--remote-debugging-pipe` (no websocket
library needed): enough for a test to type into a form, click, and read the page, in real
headless Chromium. Messages are JSON objects separated by NUL bytes on fds 3 (in) and 4 (out)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from pathlib import Path


class Browser:
    def __init__(self, chromium: str, profile: Path, *flags: str) -> None:
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        # Chromium reads commands from fd 3 and writes answers to fd 4 (via high numbers first, so
        # neither dup2 overwrites the other pipe's end). close_fds=False keeps them: pass_fds would
        # need fds 3 and 4 to exist in this process too. os.pipe()'s own fds close on exec.
        def _fds() -> None:
            os.dup2(to_chrome_r, 200)
            os.dup2(from_chrome_w, 201)
            os.dup2(200, 3)
            os.dup2(201, 4)

        self.proc = subprocess.Popen(
            [chromium, "--headless", "--remote-debugging-pipe", "--no-sandbox", "--disable-gpu", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             "--disable-dev-shm-usage", f"--user-data-dir={profile}", *flags, "about:blank"],
            preexec_fn=_fds, close_fds=False, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf = b""
        self._id = 0
        self.events: list[dict] = []  # every message that is not a reply (Network.*, Runtime.*), in order
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]

    def call(self, method: str, session: str | None = None, timeout: float = 30.0, **params):
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            while b"\0" not in self._buf:
                assert time.monotonic() < deadline, f"chromium did not answer {method}"
                chunk = os.read(self._r, 1 << 20)
                assert chunk, "chromium exited"
                self._buf += chunk
            raw, self._buf = self._buf.split(b"\0", 1)
            reply = json.loads(raw)
            if "method" in reply and "id" not in reply:
                self.events.append(reply)
            elif reply.get("id") == self._id:
                assert "error" not in reply, (method, reply["error"])
                return reply["result"]

    def page(self, method: str, **params):
        return self.call(method, self.session, **params)

    def js(self, expression: str):
        r = self.page("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        assert "exceptionDetails" not in r, r["exceptionDetails"]
        return r["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            try:
                value = self.js(expression)
            except AssertionError:  # the page is being replaced (a navigation)
                value = None
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)

    def goto(self, url: str) -> None:
        self.page("Page.navigate", url=url)
        self.wait_for(f"document.readyState === 'complete' && location.href !== 'about:blank'")

    def screenshot(self, width: int, height: int) -> bytes:
        self.page("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        return base64.b64decode(self.page("Page.captureScreenshot", format="png")["data"])

    def close(self) -> None:
        try:
            self.call("Browser.close", timeout=5)
        except Exception:  # noqa: BLE001 - it may be gone already
            pass
        self.proc.kill()
        self.proc.wait(10)
        os.close(self._w)
        os.close(self._r)
