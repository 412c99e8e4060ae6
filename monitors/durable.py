"""Durable files: what the trainer's checkpoints and the client's spool both need (stdlib only)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a new or renamed file's name) durable. Checkpoints and the sink's spool both need it."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some network filesystems refuse fsync on a directory; the rename still happened
    finally:
        os.close(fd)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to a sibling temp file, fsync, rename over `path`, fsync the directory:
    a reader sees the old file or the new one, whole (checkpoint manifests, the store's index)."""
    tmp = path.with_name(path.name + ".partial")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
