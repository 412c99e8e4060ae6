"""Checkpoint files read as data, never as code (issue 33).

`torch.load(weights_only=False)` unpickles whatever a file names: a file planted in a checkpoint
directory (a pickle whose `__reduce__` runs a command) runs in the training process the moment it
becomes the resume or rollback target. Every checkpoint file thermowatch reads goes through
`load_as_data` instead: `torch.load(weights_only=True)`, which rebuilds tensors and plain
containers only, with the few other types our own saves hold allow-listed for that one load
(`torch.serialization.safe_globals`, undone when the load ends), never process-wide.

A file that names anything else is refused with CheckpointRefused before any of it runs; the
callers (thermowatch.watch's loop, the bundled trainer) fall back to an older checkpoint.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import IO, Any, Iterable

import numpy as np
import torch

log = logging.getLogger(__name__)


class CheckpointRefused(pickle.UnpicklingError):
    """A checkpoint file that holds code or types outside the allow-list: nothing of it was run."""


def numpy_rng_globals() -> list[Any]:
    """What `np.random.get_state()` pickles as (thermowatch.ranks.rng_state's "numpy" part, a
    uint32 ndarray): numpy's array rebuild function, ndarray, dtype and the uint32 dtype's class.
    Taken from a live array, so numpy 1's `numpy.core` and numpy 2's `numpy._core` both match."""
    a = np.zeros(1, np.uint32)
    return [a.__reduce__()[0], np.ndarray, np.dtype, type(a.dtype)]


# What thermowatch.watch's checkpoints hold besides tensors and plain Python values (step,
# cursor, the scheduler's and optimizer's state dicts, torch's and Python's RNG state): numpy's
# RNG state. Found by torch.serialization.get_unsafe_globals_in_checkpoint on real checkpoints
# with SGD and AdamW under no scheduler, LambdaLR, CosineAnnealingLR, OneCycleLR, SequentialLR
# and ReduceLROnPlateau: the three numpy names and nothing else; the uint32 dtype's class is not
# named there but the load needs it too (the dtype's state is set on an instance of it).
CLIENT_GLOBALS: tuple[Any, ...] = tuple(numpy_rng_globals())

def refusal_reason(exc: BaseException) -> str:
    """The part of torch's weights_only error that names what was refused (e.g. "Unsupported
    global: GLOBAL posix.system ..."), without the paragraphs of advice around it."""
    text = str(exc)
    m = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text) or re.search(r"(Trying to load unsupported [^\n]+)", text)
    line = m.group(1) if m else next((ln for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return line.strip().split(". ")[0].rstrip(".")


def load_as_data(f: str | os.PathLike | IO[bytes], allowed: Iterable[Any] = CLIENT_GLOBALS,
                 map_location: Any = "cpu", name: str | None = None, mmap: bool = False) -> Any:
    """`torch.load(f, weights_only=True)` with `allowed` (classes and functions) allow-listed for
    this load only. Raises CheckpointRefused when the file names anything else (a planted pickle,
    a type our saves never write); other errors (a torn file, a missing one) pass through."""
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(f, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as exc:
        raise CheckpointRefused(
            f"{name or f}: refused to load: it names code or types outside the checkpoint allow-list "
            f"(torch.load weights_only=True: {refusal_reason(exc)}); nothing in it ran. thermowatch never "
            "writes such a file; if you wrote it and trust it, allow its types with "
            "torch.serialization.add_safe_globals"
        ) from exc


def refused_reason(path: str | os.PathLike, allowed: Iterable[Any] = CLIENT_GLOBALS) -> str | None:
    """Why load_as_data would refuse the file at `path`, or None when it loads. The tensors are
    memory-mapped, not read: checking a checkpoint just saved costs its pickle, not its size."""
    try:
        load_as_data(path, allowed, mmap=True)
    except CheckpointRefused as exc:
        return refusal_reason(exc.__cause__ or exc)
    return None


def set_aside(path: Path) -> Path | None:
    """Rename a refused checkpoint (a file or a directory) to `<name>.refused`, beside where it
    was: kept for whoever looks into it, never matched as a checkpoint again. The new path, or
    None when it cannot be moved (a read-only volume: it stays, and is refused again next time)."""
    aside = path.with_name(path.name + ".refused")
    try:
        if aside.is_dir():  # refused at this step before
            shutil.rmtree(aside)
        os.replace(path, aside)
    except OSError as exc:
        log.error("thermowatch: cannot set the refused checkpoint %s aside (%s); it stays where it is", path, exc)
        return None
    log.error("thermowatch: the refused checkpoint %s is kept as %s", path, aside)
    return aside
