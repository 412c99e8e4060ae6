"""A local stand-in for a mail server outside the machine (STYLE.md 12): SMTP (RFC 5321) on
127.0.0.1, plain TCP, recording every message it accepts.

It speaks the commands smtplib sends: EHLO/HELO, AUTH PLAIN and LOGIN (when `users` is set),
MAIL FROM, RCPT TO, DATA (dot-stuffed, ended by <CRLF>.<CRLF>), RSET, NOOP, QUIT. Without AUTH
configured it does not advertise it. A message is recorded parsed (email.message.EmailMessage)
with its envelope. `fail_next(code, calls)` answers the next DATA with that code (451: greylisted,
try later; 554: refused for good); a wrong password is 535.
"""

from __future__ import annotations

import base64
import socketserver
import threading
from dataclasses import dataclass
from email import policy
from email.message import EmailMessage
from email.parser import BytesParser
from tests.fakes.served import ServedFake


@dataclass
class Mail:
    mail_from: str
    rcpt_to: list[str]
    message: EmailMessage

    @property
    def subject(self) -> str:
        return str(self.message["Subject"])

    @property
    def body(self) -> str:
        return self.message.get_content()


class FakeSMTP(ServedFake):
    server_class = socketserver.ThreadingTCPServer

    def __init__(self, users: dict[str, str] | None = None) -> None:
        self.users = users or {}
        self.mails: list[Mail] = []
        self.logins: list[str] = []
        self._failures: list[int] = []
        self._lock = threading.Lock()

    @property
    def port(self) -> int:
        assert self._server is not None, "not started"
        return self._server.server_address[1]

    def fail_next(self, code: int, calls: int = 1) -> None:
        with self._lock:
            self._failures += [code] * calls

    def _handler(self) -> type[socketserver.StreamRequestHandler]:
        fake = self

        class Handler(socketserver.StreamRequestHandler):
            def reply(self, line: str) -> None:
                self.wfile.write(line.encode() + b"\r\n")

            def handle(self) -> None:
                self.reply("220 fake-smtp ESMTP ready")
                mail_from, rcpts, authed = "", [], not fake.users
                while True:
                    raw = self.rfile.readline(1 << 16)
                    if not raw:
                        return
                    line = raw.decode(errors="replace").rstrip("\r\n")
                    verb, _, arg = line.partition(" ")
                    verb = verb.upper()
                    if verb in ("EHLO", "HELO"):
                        if verb == "EHLO":
                            self.reply("250-fake-smtp")
                            if fake.users:
                                self.reply("250-AUTH PLAIN LOGIN")
                            self.reply("250 SIZE 10485760")
                        else:
                            self.reply("250 fake-smtp")
                    elif verb == "AUTH" and fake.users:
                        authed = self._auth(arg)
                    elif verb == "MAIL":
                        if not authed:
                            self.reply("530 5.7.0 Authentication required")
                            continue
                        mail_from, rcpts = _address(arg), []
                        self.reply("250 OK")
                    elif verb == "RCPT":
                        rcpts.append(_address(arg))
                        self.reply("250 OK")
                    elif verb == "DATA":
                        if not rcpts:
                            self.reply("503 5.5.1 RCPT first")
                            continue
                        self.reply("354 End data with <CR><LF>.<CR><LF>")
                        data = self._data()
                        with fake._lock:
                            forced = fake._failures.pop(0) if fake._failures else None
                            if forced is None:
                                msg = BytesParser(policy=policy.default).parsebytes(data)
                                fake.mails.append(Mail(mail_from, list(rcpts), msg))  # type: ignore[arg-type]
                        self.reply(f"{forced} forced failure" if forced is not None else "250 OK queued")
                    elif verb == "RSET":
                        mail_from, rcpts = "", []
                        self.reply("250 OK")
                    elif verb == "NOOP":
                        self.reply("250 OK")
                    elif verb == "QUIT":
                        self.reply("221 Bye")
                        return
                    else:
                        self.reply("502 5.5.2 Command not implemented")

            def _data(self) -> bytes:
                lines = []
                while True:
                    raw = self.rfile.readline(1 << 20)
                    if raw in (b".\r\n", b".\n", b""):
                        return b"".join(lines)
                    lines.append(raw[1:] if raw.startswith(b"..") else raw)

            def _auth(self, arg: str) -> bool:
                mech, _, initial = arg.partition(" ")
                if mech.upper() == "PLAIN":
                    if not initial:
                        self.reply("334 ")
                        initial = self.rfile.readline().decode().strip()
                    _, user, password = base64.b64decode(initial).decode().split("\0")
                elif mech.upper() == "LOGIN":
                    self.reply("334 " + base64.b64encode(b"Username:").decode())
                    user = base64.b64decode(self.rfile.readline().strip()).decode()
                    self.reply("334 " + base64.b64encode(b"Password:").decode())
                    password = base64.b64decode(self.rfile.readline().strip()).decode()
                else:
                    self.reply("504 5.5.4 Unrecognized authentication type")
                    return False
                if fake.users.get(user) != password:
                    self.reply("535 5.7.8 Authentication credentials invalid")
                    return False
                with fake._lock:
                    fake.logins.append(user)
                self.reply("235 2.7.0 Authentication successful")
                return True

        return Handler


def _address(arg: str) -> str:
    """'FROM:<a@b> SIZE=12' -> 'a@b'."""
    _, _, rest = arg.partition(":")
    return rest.strip().split(" ")[0].strip("<>")
