"""Values as a person reads them at 3 a.m. (issue 12): evidence and action arguments as
`name value` pairs with numbers rounded to 4 significant digits, not raw JSON with 16-digit
floats. Output is HTML-escaped here; callers insert it as is."""

from __future__ import annotations

import html
import math
from typing import Any

MAX_ITEMS = 8  # a list longer than this is cut, saying how many more there were
# Thermometers drawn on a log y axis (the page, its PNGs, Slack's charts): they grow by factors.


def e(value: Any) -> str:
    return html.escape("" if value is None else str(value), quote=True)


def number(v: float) -> str:
    if isinstance(v, int):  # bool too
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "∞" if v > 0 else "−∞"
    return f"{v:.4g}"


def _value(v: Any) -> str:
    if isinstance(v, str) and v.lower() in ("nan", "infinity", "-infinity", "inf", "-inf"):
        v = float(v)  # how JSON columns and the API spell non-finite floats
    if isinstance(v, (int, float)):
        return number(v)
    if isinstance(v, (list, tuple)):
        shown = ", ".join(_value(x) for x in v[:MAX_ITEMS])
        more = f", … {len(v) - MAX_ITEMS} more" if len(v) > MAX_ITEMS else ""
        return f"[{shown}{more}]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in list(v.items())[:MAX_ITEMS]) + "}"
    return str(v)


def pairs(obj: Any) -> str:
    """{"slope": 0.18234567, "ratio": inf} -> `slope 0.1823 · ratio ∞` as escaped HTML."""
    if not obj:
        return ""
    if not isinstance(obj, dict):
        return f"<span class='kv'>{e(_value(obj))}</span>"
    return " ".join(f"<span class='kv'><span class='k'>{e(k)}</span> {e(_value(v))}</span>"
                    for k, v in sorted(obj.items()))


def ago(seconds: float) -> str:
    """"12 s ago", "5 min ago", "3 h ago", "2 d ago": when a run last reported, at a glance."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit} ago"
    return f"{max(0.0, seconds):.0f} s ago"
