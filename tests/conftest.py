"""Suite-wide collection order: the longest tests first.

The suite runs on two workers (`pytest -n 2 --dist loadfile`, README's test command), which take
whole files in collection order; a long file collected last would leave one worker training
alone at the end. A test's hang guard (`pytest.mark.timeout`) is sized to its expected length,
so files holding the largest guards go first; everything else keeps its order."""

from __future__ import annotations

import os
import sys

# One intra-op thread per process the suite starts (each pytest worker, and the CLIs and ranks it
# spawns, which inherit the environment; a user's OMP_NUM_THREADS is kept). Two workers each
# training with torch's default two threads on two cores oversubscribe them: OpenMP's spinning
# threads wait on each other, and an in-process training test ran 4-7x slower than alone
# (tests/client/test_quarantine.py + test_replay_triage.py: 127 s on `-n 2`, 28 s with one
# thread). What a test trains and asserts is the same; only the thread pool's size differs.
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config) -> None:
    if "torch" in sys.modules:  # imported before this file (a plugin): the variable came too late
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _guard(item) -> float:
    mark = item.get_closest_marker("timeout")
    return float(mark.args[0]) if mark and mark.args else 0.0


def pytest_collection_modifyitems(session, config, items) -> None:
    by_file: dict[str, float] = {}
    for item in items:
        by_file[item.fspath.strpath] = max(by_file.get(item.fspath.strpath, 0.0), _guard(item))
    items.sort(key=lambda item: -by_file[item.fspath.strpath])  # stable: order within a file kept
