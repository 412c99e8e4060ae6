"""The one way a CLI command writes a file (`export --out`, `plot -o`, `demo --json-summary`,
`login`'s saved address): whole or not at all, and only over a regular file (issue 34).

`thermowatch export R --out /dev/full` printed "wrote 10 records": it wrote `/dev/full.partial`
and renamed it over the target, so run as root it replaced the device node with a regular file.
Now the target is looked at first (through a symlink, to what it names): a device, a directory,
a fifo or a socket is refused with exit 2 naming it, before anything is written. The bytes go to
a new file beside the target, made with O_EXCL under a name no one can have planted (a fixed
`.partial` name followed a symlink someone left there), flushed to disk, and renamed over the
target only if it is still a regular file or still absent; any failure removes the new file and
leaves the target as it was.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path
from typing import IO, Iterator

from thermowatch.monitors.durable import fsync_dir
from thermowatch.supervisor.errors import UserError

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a fifo (named pipe)"), (stat.S_ISSOCK, "a socket"))


def target_of(path: str | os.PathLike, flag: str) -> Path:
    """The file a write to `path` replaces: `path` itself or, for a symlink, what it names (so the
    link keeps pointing at the new content). UserError when that is anything but a regular file
    or nothing, or when its folder does not exist."""
    given = Path(path)
    target = Path(os.path.realpath(given))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise UserError(f"{flag} {given}: cannot look at it ({exc.strerror})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "not a regular file")
        via = f" (which resolves to {target})" if os.path.abspath(given) != str(target) else ""
        raise UserError(f"{flag} {given}{via} is {kind}: thermowatch writes only to a regular file, which it "
                        "replaces whole; name a new file or an existing regular file")
    if not target.parent.is_dir():
        raise UserError(f"{flag} {given}: the folder {target.parent} does not exist")
    return target


@contextlib.contextmanager
def replacing(path: str | os.PathLike, *, flag: str, binary: bool = False,
              mode: int | None = None) -> Iterator[IO]:
    """`with replacing(out, flag="--out") as fh: fh.write(...)`: a new file beside `path` that
    replaces it when the block ends without an error (see the module docstring). `mode`: the new
    file's permission bits (0o600 for a secret); None keeps an existing file's, else the umask's."""
    target = target_of(path, flag)
    try:
        keep = stat.S_IMODE(os.stat(target).st_mode) if mode is None else mode
    except FileNotFoundError:
        keep = mode
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.partial")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if keep is not None else 0o666)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot write a new file in {target.parent} ({exc.strerror}); choose a "
                        "folder you may write to") from None
    try:
        if keep is not None:
            os.fchmod(fd, keep)
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8", "newline": ""})) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        target_of(target, flag)  # still a regular file or nothing: it is replaced only then
        os.replace(tmp, target)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(exc, OSError):
            raise UserError(f"{flag} {path}: writing failed ({exc.strerror or exc}); it was left as it was") from None
        raise
    fsync_dir(target.parent)


def write_file(path: str | os.PathLike, data: str | bytes, *, flag: str, mode: int | None = None) -> Path:
    """`data` as the whole new content of `path` (through `replacing`); returns the file written."""
    with replacing(path, flag=flag, binary=isinstance(data, bytes), mode=mode) as fh:
        fh.write(data)
    return target_of(path, flag)
