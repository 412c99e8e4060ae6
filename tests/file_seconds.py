"""Refresh tests/file_seconds.json, the seconds each test file took in a full run, which
tests/conftest.py orders the files by (the longest first), from that run's `--durations=0` output:

    python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=0 > run.log
    python tests/file_seconds.py run.log

A file's seconds are its tests' setup, call and teardown together (pytest leaves out phases under
5 ms). Files the run did not list are written with 0 (they took under 5 ms each phase)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
TABLE = HERE / "file_seconds.json"
LINE = re.compile(r"^([0-9.]+)s (?:setup|call|teardown)\s+(tests/[^:]+\.py)::")


def main(log: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    for line in Path(log).read_text().splitlines():
        m = LINE.match(line)
        if m:
            seconds[m.group(2)] += float(m.group(1))
    if not seconds:
        sys.exit(f"{log}: no --durations=0 lines")
    files = [f for f in subprocess.run(["git", "ls-files", "tests"], cwd=HERE.parent, capture_output=True,
                                       text=True, check=True).stdout.split()
             if Path(f).name.startswith("test_") and f.endswith(".py")]
    table = {f: round(seconds.get(f, 0.0), 1) for f in sorted(set(files) | set(seconds))}
    table = dict(sorted(table.items(), key=lambda kv: (-kv[1], kv[0])))
    TABLE.write_text(json.dumps(table, indent=0) + "\n")
    print(f"{TABLE}: {len(table)} files, {sum(table.values()):.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
