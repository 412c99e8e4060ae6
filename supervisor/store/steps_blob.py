"""The steps column shared by thermometer chunks and the rollups read from them: NULL when a
chunk's steps are first_step..first_step+n-1 without gaps, else the steps as raw int64 bytes.
Its own module so that thermometers (which calls the rollup hook) and rollups (which decodes
chunks) do not import each other."""

from __future__ import annotations

import numpy as np


def decode_steps(first: np.ndarray, ns: np.ndarray, blobs: list) -> np.ndarray:
    """Steps of many chunks at once: contiguous chunks (blob NULL) are built with one arange."""
    total = int(ns.sum())
    starts = np.cumsum(ns) - ns
    steps = np.arange(total, dtype=np.int64) - np.repeat(starts, ns) + np.repeat(first, ns)
    for i in np.flatnonzero([b is not None for b in blobs]):
        steps[starts[i]:starts[i] + ns[i]] = np.frombuffer(blobs[i], np.int64)
    return steps
