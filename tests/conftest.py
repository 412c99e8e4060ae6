"""Suite-wide collection order: the longest files first.

The suite runs on two workers (`pytest -n 2 --dist loadfile`, README's test command), which take
whole files in collection order; a long file collected last would leave one worker training
alone at the end. tests/file_seconds.json holds the seconds each file took in a full run
(refresh it with tests/file_seconds.py after changing a file's length by much): files go in
that order, the longest first. A file it does not list yet (a new one) goes before all of them,
those with the largest hang guards (`pytest.mark.timeout`, sized to a test's expected length)
first: started early, even a long new file cannot leave one worker alone at the end. Within a
file the order is kept."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

FILE_SECONDS = Path(__file__).with_name("file_seconds.json")

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
    seconds = json.loads(FILE_SECONDS.read_text())
    guard: dict[str, float] = {}
    for item in items:
        path = _file(item)
        guard[path] = max(guard.get(path, 0.0), _guard(item))

    def order(item) -> tuple[int, float]:
        path = _file(item)
        return (1, -seconds[path]) if path in seconds else (0, -guard[path])

    items.sort(key=order)  # stable: order within a file kept


def _file(item) -> str:
    return item.nodeid.split("::", 1)[0]  # tests/..., relative to the rootdir
