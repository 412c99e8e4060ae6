"""Suite-wide collection order: the longest tests first.

The suite runs on two workers (`pytest -n 2 --dist loadfile`, README's test command), which take
whole files in collection order; a long file collected last would leave one worker training
alone at the end. A test's hang guard (`pytest.mark.timeout`) is sized to its expected length,
so files holding the largest guards go first; everything else keeps its order."""

from __future__ import annotations


def _guard(item) -> float:
    mark = item.get_closest_marker("timeout")
    return float(mark.args[0]) if mark and mark.args else 0.0


def pytest_collection_modifyitems(session, config, items) -> None:
    by_file: dict[str, float] = {}
    for item in items:
        by_file[item.fspath.strpath] = max(by_file.get(item.fspath.strpath, 0.0), _guard(item))
    items.sort(key=lambda item: -by_file[item.fspath.strpath])  # stable: order within a file kept
