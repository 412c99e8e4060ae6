"""Durable files: what the trainer's checkpoints and the client's spool both need (stdlib only)."""

from __future__ import annotations

import os
from pathlib import Path


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
