"""A local stand-in for the Slack Web API, the one thing outside the machine the tests fake.

It speaks Slack's wire format (https://api.slack.com/web): `POST /api/<method>` with a bearer
token, JSON or form bodies, answers `{"ok": true, ...}` or HTTP 200 `{"ok": false, "error": ...}`,
and HTTP 429 with `Retry-After` when rate limited. The real slack-sdk WebClient talks to it
through `base_url`. Every request is recorded (headers + parsed body) for assertions.

User groups (`usergroups.users.list`, a GET with `usergroup` in the query, as slack-sdk sends
it): `usergroups` maps a group id to its member ids; an unknown group answers `no_such_subteam`.

Uploads as files_upload_v2 makes them: `files.getUploadURLExternal` (filename, length) answers an
`upload_url` on this server and a file id; the raw bytes are POSTed there (recorded in
`uploads`); `files.completeUploadExternal` (files JSON, channel_id, thread_ts) shares the file,
as a message in the thread.

Use the `fake_slack` fixture (import it into a test module or list this module in
`pytest_plugins`), or `with FakeSlack() as fake:` directly.
"""

from __future__ import annotations

import itertools
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any, Iterator
from urllib.parse import parse_qs, urlsplit

import pytest

from tests.fakes.served import ServedFake

BOT = {"user_id": "U0THERMO", "bot_id": "B0THERMO", "team_id": "T0FAKE"}


@dataclass
class RecordedRequest:
    api_method: str  # e.g. "chat.postMessage"
    headers: dict[str, str]
    body: dict[str, Any]  # parsed JSON, or the form/query fields (one value each)
    status: int  # HTTP status answered
    answer: dict[str, Any]  # the JSON answered


@dataclass
class Upload:
    file_id: str
    filename: str
    length: int  # as announced to files.getUploadURLExternal
    data: bytes = b""  # as POSTed to the upload URL
    title: str = ""
    channel: str | None = None  # set by files.completeUploadExternal
    thread_ts: str | None = None
    shared: bool = False


class FakeSlack(ServedFake):
    """`auth.test`, `chat.postMessage` (threads: `thread_ts`, `reply_broadcast`), `chat.update`,
    `usergroups.users.list` and the upload trio of files_upload_v2, with switches for failures."""

    def __init__(self, token: str = "xoxb-fake-token", channels: set[str] | None = None):
        self.token = token
        self.channels = channels  # None: every channel exists and the bot is in it
        self.requests: list[RecordedRequest] = []
        self.messages: dict[str, dict[str, Any]] = {}  # ts -> message
        self.channel_ids: dict[str, str] = {}  # "#name" -> "C..." (Slack answers with the id)
        self.usergroups: dict[str, list[str]] = {}  # "S..." -> member ids "U...", for usergroups.users.list
        self._lock = threading.Lock()
        self._rate_limited = 0
        self._retry_after = "0"
        self._failures: list[str] = []
        self._server_errors = 0
        self._server_error_method: str | None = None
        self._open = threading.Event()
        self._open.set()
        self._ts = itertools.count(1)
        self.uploads: dict[str, Upload] = {}  # file id -> what was announced, POSTed and shared
        self._upload_failures = 0
        self._file_ids = itertools.count(1)

    # --- switches -------------------------------------------------------------------------

    def rate_limit(self, calls: int, retry_after: float | str = 0) -> None:
        """Answer the next `calls` requests with HTTP 429 and `Retry-After: retry_after`."""
        with self._lock:
            self._rate_limited = calls
            self._retry_after = str(retry_after)

    def fail_next(self, error: str, calls: int = 1) -> None:
        """Answer the next `calls` requests with HTTP 200 {"ok": false, "error": error}."""
        with self._lock:
            self._failures += [error] * calls

    def server_error(self, calls: int, api_method: str | None = None) -> None:
        """Answer the next `calls` requests (of `api_method` only, when given) with HTTP 500
        (after any rate limiting)."""
        with self._lock:
            self._server_errors = calls
            self._server_error_method = api_method

    def fail_uploads(self, calls: int) -> None:
        """Answer the next `calls` POSTs of bytes to an upload URL with HTTP 500."""
        with self._lock:
            self._upload_failures = calls

    def hold(self) -> None:
        """Accept requests but answer none until `release()` (a Slack that hangs)."""
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        assert self._server is not None, "FakeSlack is not started"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/api/"  # slack-sdk appends the method name

    thread_name = "fake-slack"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                fake._handle(self)

            def do_GET(self) -> None:  # noqa: N802 - slack-sdk GETs some methods (usergroups.users.list)
                fake._handle(self)

            def log_message(self, fmt: str, *args: Any) -> None:
                pass  # quiet in test output

        return Handler

    # --- queries for tests ------------------------------------------------------------------

    def calls(self, api_method: str) -> list[RecordedRequest]:
        with self._lock:
            return [r for r in self.requests if r.api_method == api_method]

    def posted(self) -> list[dict[str, Any]]:
        """Bodies of chat.postMessage calls that succeeded, oldest first."""
        return [r.body for r in self.calls("chat.postMessage") if r.answer.get("ok")]

    def top_level(self) -> list[dict[str, Any]]:
        """Messages in the channel itself (not replies), oldest first."""
        with self._lock:
            return [m for ts, m in sorted(self.messages.items()) if m.get("thread_ts") in (None, ts)]

    def shared_files(self) -> list[Upload]:
        """Uploads completed into a channel, oldest first."""
        with self._lock:
            return [u for u in self.uploads.values() if u.shared]

    def thread(self, ts: str) -> list[dict[str, Any]]:
        """A thread as conversations.replies gives it: the parent, then its replies, oldest first."""
        with self._lock:
            return [m for t, m in sorted(self.messages.items()) if t == ts or m.get("thread_ts") == ts]

    # --- the wire format ---------------------------------------------------------------------

    def _handle(self, req: BaseHTTPRequestHandler) -> None:
        self._open.wait()
        url = urlsplit(req.path)
        if url.path.startswith("/upload/"):
            return self._receive_upload(req, url.path.rsplit("/", 1)[-1])
        api_method = url.path[len("/api/"):] if url.path.startswith("/api/") else ""
        raw = req.rfile.read(int(req.headers.get("Content-Length") or 0))
        body: dict[str, Any] = {k: v[0] for k, v in parse_qs(url.query).items()}
        ctype = req.headers.get("Content-Type", "")
        if raw and ctype.startswith("application/json"):
            body.update(json.loads(raw))
        elif raw:
            body.update({k: v[0] for k, v in parse_qs(raw.decode()).items()})
        with self._lock:
            status, answer, extra = self._answer(api_method, req.headers.get("Authorization", ""), body)
            self.requests.append(RecordedRequest(api_method, dict(req.headers.items()), body, status, answer))
        data = json.dumps(answer).encode()
        req.send_response(status)
        req.send_header("Content-Type", "application/json; charset=utf-8")
        req.send_header("Content-Length", str(len(data)))
        for key, value in extra.items():
            req.send_header(key, value)
        req.end_headers()
        req.wfile.write(data)

    def _answer(self, api_method: str, auth: str, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        if self._rate_limited > 0:
            self._rate_limited -= 1
            return 429, {"ok": False, "error": "ratelimited"}, {"Retry-After": self._retry_after}
        if self._server_errors > 0 and self._server_error_method in (None, api_method):
            self._server_errors -= 1
            return 500, {"ok": False, "error": "internal_error"}, {}
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else body.get("token", "")
        if not token:
            return 200, {"ok": False, "error": "not_authed"}, {}
        if token != self.token:
            return 200, {"ok": False, "error": "invalid_auth"}, {}
        if self._failures:
            return 200, {"ok": False, "error": self._failures.pop(0)}, {}
        if api_method == "auth.test":
            return 200, {"ok": True, "url": "https://fake.slack.com/", "team": "fake", "user": "thermowatch", **BOT}, {}
        if api_method == "chat.postMessage":
            return self._post(body)
        if api_method == "chat.update":
            return self._update(body)
        if api_method == "files.getUploadURLExternal":
            return self._upload_url(body)
        if api_method == "files.completeUploadExternal":
            return self._complete_upload(body)
        if api_method == "usergroups.users.list":
            members = self.usergroups.get(body.get("usergroup", ""))
            if members is None:
                return 200, {"ok": False, "error": "no_such_subteam"}, {}
            return 200, {"ok": True, "users": list(members)}, {}
        return 404, {"ok": False, "error": "unknown_method"}, {}

    def _channel_error(self, body: dict[str, Any]) -> str | None:
        channel = body.get("channel")
        if not channel:
            return "channel_not_found"
        if self.channels is not None and channel not in self.channels:
            return "channel_not_found"
        return None

    def _post(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        error = self._channel_error(body)
        if error:
            return 200, {"ok": False, "error": error}, {}
        if not body.get("text") and not body.get("blocks"):
            return 200, {"ok": False, "error": "no_text"}, {}
        ts = f"1700000000.{next(self._ts):06d}"
        channel_id = self._id_of(body["channel"])
        message = {"type": "message", "text": body.get("text", ""), "ts": ts, "user": BOT["user_id"],
                   "bot_id": BOT["bot_id"], "channel": channel_id}
        if body.get("blocks"):
            message["blocks"] = body["blocks"]
        if body.get("thread_ts"):
            parent = self.messages.get(body["thread_ts"])
            if parent is None:
                return 200, {"ok": False, "error": "thread_not_found"}, {}
            # A reply to a reply joins the parent's thread, as in Slack.
            root = parent.get("thread_ts", parent["ts"])
            message["thread_ts"] = root
            if body.get("reply_broadcast") in (True, "true", "1", 1):
                message["subtype"] = "thread_broadcast"  # also shown in the channel
            top = self.messages[root]
            top.update(thread_ts=root, reply_count=top.get("reply_count", 0) + 1, latest_reply=ts)
        self.messages[ts] = message
        return 200, {"ok": True, "channel": channel_id, "ts": ts, "message": message}, {}

    def _id_of(self, channel: str) -> str:
        """chat.postMessage takes a name or an id and answers with the id, as Slack does."""
        if channel in self.channel_ids.values():
            return channel
        return self.channel_ids.setdefault(channel, f"C{len(self.channel_ids) + 1:08d}")

    def _update(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        # chat.update, unlike chat.postMessage, takes only the channel's id, not its name.
        if body.get("channel") not in self.channel_ids.values():
            return 200, {"ok": False, "error": "channel_not_found"}, {}
        message = self.messages.get(body.get("ts", ""))
        if message is None or message["channel"] != body["channel"]:
            return 200, {"ok": False, "error": "message_not_found"}, {}
        message.update({k: body[k] for k in ("text", "blocks") if k in body})
        return 200, {"ok": True, "channel": body["channel"], "ts": message["ts"], "text": message["text"],
                     "message": message}, {}


    # --- files_upload_v2 --------------------------------------------------------------------

    def _upload_url(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        try:
            length = int(body.get("length", ""))
        except ValueError:
            return 200, {"ok": False, "error": "invalid_arguments"}, {}
        if not body.get("filename") or length <= 0:
            return 200, {"ok": False, "error": "invalid_arguments"}, {}
        file_id = f"F{next(self._file_ids):08d}"
        self.uploads[file_id] = Upload(file_id, body["filename"], length)
        host, port = self._server.server_address[:2] if self._server else ("127.0.0.1", 0)
        # Slack answers a files.slack.com URL; ours points back at this server.
        return 200, {"ok": True, "upload_url": f"http://{host}:{port}/upload/v1/{file_id}", "file_id": file_id}, {}

    def _receive_upload(self, req: BaseHTTPRequestHandler, file_id: str) -> None:
        data = req.rfile.read(int(req.headers.get("Content-Length") or 0))
        with self._lock:
            upload = self.uploads.get(file_id)
            if self._upload_failures > 0:
                self._upload_failures -= 1
                status, text = 500, "internal error"
            elif upload is None:
                status, text = 404, "unknown upload"
            else:
                upload.data = data
                status, text = 200, f"OK - {len(data)}"
            self.requests.append(RecordedRequest("upload", dict(req.headers.items()), {"file_id": file_id,
                                                                                       "bytes": len(data)},
                                                 status, {"text": text}))
        out = text.encode()
        req.send_response(status)
        req.send_header("Content-Type", "text/plain; charset=utf-8")
        req.send_header("Content-Length", str(len(out)))
        req.end_headers()
        req.wfile.write(out)

    def _complete_upload(self, body: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, str]]:
        try:
            files = json.loads(body["files"]) if isinstance(body.get("files"), str) else body.get("files")
            ids = [(f["id"], f.get("title") or "") for f in files]
        except (KeyError, TypeError, ValueError):
            return 200, {"ok": False, "error": "invalid_arguments"}, {}
        channel = body.get("channel_id")
        if channel is not None and channel not in self.channel_ids.values():
            return 200, {"ok": False, "error": "channel_not_found"}, {}  # an id, never a '#name'
        thread_ts = body.get("thread_ts")
        if thread_ts and (channel is None or thread_ts not in self.messages):
            return 200, {"ok": False, "error": "invalid_thread_ts"}, {}
        answered = []
        for file_id, title in ids:
            upload = self.uploads.get(file_id)
            if upload is None or len(upload.data) != upload.length:
                return 200, {"ok": False, "error": "file_not_found"}, {}  # never POSTed, or cut short
            upload.title, upload.channel, upload.thread_ts, upload.shared = title, channel, thread_ts, True
            answered.append({"id": file_id, "title": title, "name": upload.filename})
        if channel is not None:  # the share shows as a message, in the thread when one is given
            ts = f"1700000000.{next(self._ts):06d}"
            message = {"type": "message", "subtype": "file_share", "text": body.get("initial_comment", ""),
                       "ts": ts, "user": BOT["user_id"], "channel": channel, "files": answered}
            if thread_ts:
                root = self.messages[thread_ts].get("thread_ts", thread_ts)
                message["thread_ts"] = root
                top = self.messages[root]
                top.update(thread_ts=root, reply_count=top.get("reply_count", 0) + 1, latest_reply=ts)
            self.messages[ts] = message
        return 200, {"ok": True, "files": answered}, {}


@pytest.fixture
def fake_slack() -> Iterator[FakeSlack]:
    with FakeSlack() as fake:
        yield fake
