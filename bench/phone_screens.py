"""The pages on a phone (issue 37, item 6): screenshots of the first screen (390 x 844) of the run
page with an approval waiting, the runs index and compare, and what each page measures.

    python bench/phone_screens.py [--out docs/screenshots]

Builds tests/supervisor/phone.py's runs (the jump_qkln trace through the real Supervisor in
advise-only mode, a demo-like run, the seeded rollback run) in a temporary SQLite database, serves
them with the real daemon app, and shoots them in headless Chromium: phone-run.png,
phone-index.png, phone-compare.png. Prints one line per page: its height and scrollWidth at 390 px,
and where the story, the approval and the first chart sit.
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from thermowatch.supervisor.serve.server import build_app  # noqa: E402
from tests.live_server import running  # noqa: E402
from tests.supervisor.cdp import Browser  # noqa: E402
from tests.supervisor.phone import DEMO, JUMP, open_page, phone_daemon, sign_in  # noqa: E402

PAGES = [("phone-run.png", f"/runs/{JUMP}"), ("phone-run-demo.png", f"/runs/{DEMO}"), ("phone-index.png", "/"),
         ("phone-compare.png", f"/compare?run={DEMO}&run={JUMP}")]
SHOTS = {"phone-run.png", "phone-index.png", "phone-compare.png"}  # the demo-like run: measured, not shot


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("docs/screenshots"))
    args = ap.parse_args()
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as tmp:  # chromium may still write
        runs = phone_daemon(Path(tmp))
        try:
            with running(build_app(runs.sup)) as base:
                b = Browser(chromium, Path(tmp) / "profile", "--disable-quic")
                try:
                    sign_in(b, base)
                    for name, path in PAGES:
                        said = open_page(b, base + path)
                        if name in SHOTS:  # the first screen, as a phone shows it
                            png = base64.b64decode(b.page("Page.captureScreenshot", format="png")["data"])
                            (args.out / name).write_bytes(png)
                        print(f"{path}: {json.dumps(said)}")
                finally:
                    b.close()
        finally:
            runs.sup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
