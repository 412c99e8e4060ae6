"""Screenshots of a running daemon's pages, desktop and phone, in real headless Chromium (issue 23:
the closing note shows what the pages look like, not what the code says they do).

    thermowatch serve --data-dir DIR &                      # the demo's, an advise-only run's, ...
    python bench/screens.py --url http://127.0.0.1:8765 --token $THERMOWATCH_API_TOKEN \\
        --run demo --compare demo,other --out shots/ [--dark]

Signs in with the token (the page's own form), then for each page (the runs index, each --run,
the --compare chart) and each size (1366 x 900 desktop, 390 x 844 phone) waits until the charts
have loaded and writes a full-page PNG: index_desktop.png, run_demo_phone.png, ... Prints one
line per file with what the page said (state, charts drawn, labels hidden, errors).
"""

from __future__ import annotations

import argparse
import base64
import json
import shutil
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote, urlencode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.supervisor.cdp import Browser  # noqa: E402

SIZES = {"desktop": (1366, 900, False), "phone": (390, 844, True)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", required=True)
    ap.add_argument("--token", required=True, help="a read (or operate) token")
    ap.add_argument("--run", action="append", default=[], help="a run page to shoot (repeatable)")
    ap.add_argument("--compare", help="comma-separated run ids for /compare")
    ap.add_argument("--metric", default="loss", help="the comparison's thermometer")
    ap.add_argument("--out", type=Path, default=Path("shots"))
    ap.add_argument("--dark", action="store_true", help="also every page in dark mode (desktop)")
    args = ap.parse_args()
    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    args.out.mkdir(parents=True, exist_ok=True)
    pages = [("index", "/")] + [(f"run_{r}", f"/runs/{quote(r, safe='')}") for r in args.run]
    if args.compare:
        q = urlencode([("run", r) for r in args.compare.split(",")] + [("metric", args.metric)])
        pages.append(("compare", f"/compare?{q}"))
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:  # chromium may still write
        b = Browser(chromium, Path(profile), "--disable-quic")
        try:
            b.page("Runtime.enable")
            b.goto(f"{args.url}/login?next=/")
            b.js(f"document.getElementById('token').value = {json.dumps(args.token)};"
                 "document.getElementById('sign-in').click()")
            b.wait_for("location.pathname === '/'")
            shots = [(n, p, size, False) for n, p in pages for size in SIZES]
            shots += [(n, p, "desktop", True) for n, p in pages] if args.dark else []
            for name, path, size, dark in shots:
                w, h, mobile = SIZES[size]
                b.page("Emulation.setDeviceMetricsOverride", width=w, height=h, deviceScaleFactor=1, mobile=mobile)
                b.page("Emulation.setEmulatedMedia",
                       features=[{"name": "prefers-color-scheme", "value": "dark" if dark else "light"}])
                b.goto(args.url + path)
                said = b.wait_for(
                    "(() => { const t = window.thermowatch; if (!t) return document.querySelector('h1') && "
                    "{page: document.title}; if (t.loads < 1 && !t.errors.length) return null;"
                    "const badge = document.getElementById('badge');"
                    "return {page: document.title, state: badge && badge.textContent, charts: Object.keys(t.charts).length,"
                    "hidden: Object.values(t.charts).reduce((n, c) => n + ((c.marks && c.marks.hidden) || 0), 0),"
                    "errors: t.errors}; })()", timeout=60)
                png = base64.b64decode(b.page("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"])
                out = args.out / f"{name}_{size}{'_dark' if dark else ''}.png"
                out.write_bytes(png)
                print(f"{out}: {json.dumps(said)}")
        finally:
            b.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
