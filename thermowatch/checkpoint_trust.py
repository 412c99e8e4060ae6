"""thermowatch.watch's checkpoints prove themselves (issue 39, item 2): each is saved with a manifest
of its files' checksums and the health of the steps before it, the same listing the bundled
trainer's store writes (monitors/manifest.py), so a load can tell a flipped byte from a good file.

torch.load does not: a byte flipped in a tensor's data loads without an error, as other weights.
A single-file checkpoint `step_00000050.pt` gets `step_00000050.json` beside it (written after the
file is in place: a crash between leaves a checkpoint without one, which loads unverified, as the
checkpoints of earlier releases do); a torch.distributed.checkpoint directory gets `manifest.json`
inside, written before the directory is renamed into place.

    {"format": 1, "step": 50, "cursor": 3200, "healthy": true, "checksum": "full",
     "files": {"step_00000050.pt": {"size": 123456, "crc32": "1a2b3c4d"}}}

The single file's crc32 is taken as torch.save writes it (HashingWriter), so a save reads
nothing back; a directory's files are read once after dcp.save.
"""

from __future__ import annotations

import json
import logging
import zlib
from pathlib import Path
from typing import IO, Any

from thermowatch.monitors.durable import write_json_atomic
from thermowatch.monitors.manifest import MANIFEST, file_digest, files_problem

log = logging.getLogger(__name__)

FORMAT = 1


class HashingWriter:
    """A file object for torch.save that passes every write through and keeps its size and crc32."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.size, self.crc = f, 0, 0

    def write(self, b: Any) -> int:
        self.crc = zlib.crc32(b, self.crc)
        self.size += memoryview(b).nbytes
        return self.f.write(b)

    def flush(self) -> None:
        self.f.flush()

    def digest(self) -> dict[str, Any]:
        """The same {"size", "crc32"} as monitors.manifest.file_digest(path, "full")."""
        return {"size": self.size, "crc32": f"{self.crc:08x}"}


def manifest_path(ckpt: Path) -> Path:
    return ckpt / MANIFEST if ckpt.is_dir() else ckpt.with_suffix(".json")


def listing(ckpt: Path) -> dict[str, Any]:
    """Every file of a checkpoint directory (the manifest aside) with its full crc32."""
    return {p.relative_to(ckpt).as_posix(): file_digest(p, "full")
            for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != MANIFEST}


def write_manifest(ckpt: Path, step: int, cursor: int, healthy: bool, files: dict[str, Any]) -> None:
    """Write `ckpt`'s manifest atomically (a temp file, fsync, rename, fsync the directory)."""
    write_json_atomic(manifest_path(ckpt), {"format": FORMAT, "step": int(step), "cursor": int(cursor),
                                            "healthy": bool(healthy), "checksum": "full", "files": files})


def read_manifest(ckpt: Path) -> dict[str, Any] | None:
    """`ckpt`'s manifest, None when it has none (saved before this release, or a crash came
    between the file and its manifest). Raises ValueError when it is there but unreadable."""
    path = manifest_path(ckpt)
    try:
        body = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable: {exc}") from exc
    if not isinstance(body, dict) or not isinstance(body.get("files"), dict):
        raise ValueError(f"{path} is not a checkpoint manifest")
    return body


def problem(ckpt: Path) -> str | None:
    """Why `ckpt` cannot be trusted (a file missing, truncated or changed since it was saved; its
    manifest unreadable), or None when it matches its manifest or has none."""
    try:
        body = read_manifest(ckpt)
        if body is None:
            log.debug("thermowatch: checkpoint %s has no manifest; loaded unverified", ckpt)
            return None
        return files_problem(ckpt if ckpt.is_dir() else ckpt.parent, body)
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        return f"its manifest is unusable ({exc})"


def healthy(ckpt: Path) -> bool:
    """Whether every loss before `ckpt` was finite when it was saved (True without a manifest:
    nothing says otherwise, as the supervisor's record of it does)."""
    try:
        body = read_manifest(ckpt)
    except ValueError:
        return False
    return True if body is None else bool(body.get("healthy", True))


def remove_manifest(ckpt: Path) -> None:
    """Remove a single-file checkpoint's manifest (a directory's goes with the directory)."""
    if ckpt.suffix == ".pt":
        ckpt.with_suffix(".json").unlink(missing_ok=True)
