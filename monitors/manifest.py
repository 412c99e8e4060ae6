"""The checkpoint manifest's file list, checked the same way by the trainer (which writes it and
picks resume points) and by the supervisor (whose scan job distrusts broken rollback targets).

A manifest's "files" maps each path relative to the checkpoint directory to {"size", "crc32"}.
Torch-free on purpose: the supervisor imports it and never the trainer (DESIGN.md).
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any, Mapping

MANIFEST = "manifest.json"
# The default checksum covers the first and last MiB of each file: it catches truncation and
# torn tails while a scan of multi-GB ZeRO shards stays cheap; "full" reads every byte.
EDGE_BYTES = 1 << 20
_CHUNK = 8 << 20


def file_digest(path: Path, mode: str = "edges") -> dict[str, Any]:
    """{"size", "crc32"} of a file; "edges" hashes the first and last MiB, "full" everything."""
    size = path.stat().st_size
    crc = 0
    with open(path, "rb") as f:
        if mode == "full" or size <= 2 * EDGE_BYTES:
            while chunk := f.read(_CHUNK):
                crc = zlib.crc32(chunk, crc)
        else:
            crc = zlib.crc32(f.read(EDGE_BYTES), crc)
            f.seek(size - EDGE_BYTES)
            crc = zlib.crc32(f.read(EDGE_BYTES), crc)
    return {"size": size, "crc32": f"{crc:08x}"}


def files_problem(directory: Path, manifest: Mapping[str, Any]) -> str | None:
    """Why the files a manifest lists are not all there and intact, or None.

    Raises KeyError/TypeError/AttributeError/ValueError for a manifest of the wrong shape; the
    callers turn that into their own message."""
    mode = manifest.get("checksum", "edges")
    for rel, want in manifest["files"].items():
        p = directory / rel
        if not p.is_file():
            return f"{rel} is missing"
        size = p.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size} bytes, the manifest says {want['size']} (truncated?)"
        got = file_digest(p, mode)["crc32"]
        if got != want["crc32"]:
            return f"{rel} crc32 {got} != manifest {want['crc32']} (corrupted)"
    return None
