"""How a setting's value is read, strictly, in one place (issue 34: settings failed open).

Before, `THERMOWATCH_ADVISE_ONLY=on` read as *false* (only 1/true/yes were true, anything else
silently false: automatic actions where a person asked for approvals), `cooldown_s: .inf` and
`ack_retries: -3` were accepted, and `--multiplier nan` ended in a traceback. Now:

- `parse_bool(name, text)`: a boolean given as text (every environment variable) is one of
  TRUE_WORDS or FALSE_WORDS, compared without case and without surrounding whitespace; anything
  else is refused, naming the variable and the accepted words.
- `check_number(where, value, lo=, hi=)`: a number is finite (never NaN or +-inf), of the right
  kind (an int where an int is meant; never a bool) and inside its range, or refused naming
  `where`, the range and the value. Config classes call it in `__post_init__`, so
  `validate-config` and start-up run the same check.
- `arg_int` / `arg_float`: the same check as argparse types, for every numeric CLI flag: a bad
  value is argparse's one-line usage error, exit 2, never a traceback.

Every refusal is a SettingError (a ValueError): config classes turn it into their ConfigError,
argparse into its usage error. Stdlib only: monitors, trainer, supervisor and the client use it.
"""

from __future__ import annotations

import argparse
import math
from typing import Any, Callable

# Environment variables are text; YAML booleans arrive as bool already (config_tree refuses text).
TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


class SettingError(ValueError):
    """A setting's value that is not understood or out of range; the message names the setting,
    what it accepts and the value."""


def parse_bool(name: str, text: str) -> bool:
    """`text` as a boolean: TRUE_WORDS or FALSE_WORDS, any case, surrounding whitespace ignored
    (a trailing space from a shell or a YAML block is not a different answer). Anything else,
    "enabled" or "y" included, is refused: a guess either way could turn automatic actions on."""
    word = text.strip().lower() if isinstance(text, str) else None
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise SettingError(f"{name}={text!r} is not a boolean; use one of {', '.join(TRUE_WORDS)} (true) or "
                       f"{', '.join(FALSE_WORDS)} (false), in any case")


def describe_range(lo: float | None, hi: float | None, *, lo_open: bool = False, integer: bool = False) -> str:
    """'an integer >= 0', 'a finite number > 0', 'an integer in [1, 65535]'."""
    kind = "an integer" if integer else "a finite number"
    if lo is not None and hi is not None:
        return f"{kind} in {'(' if lo_open else '['}{_num(lo)}, {_num(hi)}]"
    if lo is not None:
        return f"{kind} {'>' if lo_open else '>='} {_num(lo)}"
    if hi is not None:
        return f"{kind} <= {_num(hi)}"
    return kind


def _num(x: float) -> str:
    # the database's integer columns by name, as supervisor.limits.check_int writes them
    return {2**63 - 1: "2**63-1", 2**31 - 1: "2**31-1"}.get(x, str(x)) if isinstance(x, int) else f"{x:g}"


def check_number(where: str, value: Any, *, lo: float | None = None, hi: float | None = None,
                 lo_open: bool = False, integer: bool = False) -> Any:
    """`value` if it is a finite number (an int when `integer`) in [lo, hi] ((lo, hi] when
    `lo_open`); else SettingError naming `where`, the range and the value. A bool is never a
    number here (YAML's `yes` would otherwise be the integer 1)."""
    ok = not isinstance(value, bool) and (isinstance(value, int) if integer else isinstance(value, (int, float)))
    if ok and isinstance(value, float):
        ok = math.isfinite(value)
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value <= hi
    if not ok:
        raise SettingError(f"{where} must be {describe_range(lo, hi, lo_open=lo_open, integer=integer)}, "
                           f"got {_show(value)}")
    return value


def parse_number(where: str, text: str, *, integer: bool = False, **bounds: Any) -> Any:
    """A number given as text (an environment variable, a flag): int() or float() of it, then
    check_number. 'nan', 'inf' and '1e999' parse as floats and are refused there."""
    try:
        value = int(text.strip()) if integer else float(text.strip())
    except (ValueError, AttributeError):
        value = text  # not a number at all: check_number's message names the range wanted
    return check_number(where, value, integer=integer, **bounds)


def arg_int(lo: int | None = None, hi: int | None = None) -> Callable[[str], int]:
    """An argparse `type=` for an integer flag in [lo, hi]."""
    return _arg(True, lo, hi, False)


def arg_float(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse `type=` for a finite float flag in [lo, hi] ((lo, hi] with lo_open)."""
    return _arg(False, lo, hi, lo_open)


def _arg(integer: bool, lo: Any, hi: Any, lo_open: bool) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return parse_number("the value", text, integer=integer, lo=lo, hi=hi, lo_open=lo_open)
        except SettingError as exc:
            # argparse prefixes "argument --flag:", so the message names the flag and the range
            raise argparse.ArgumentTypeError(str(exc).removeprefix("the value ")) from None

    parse.__name__ = "integer" if integer else "number"  # argparse's "invalid integer value" fallback
    return parse


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


__all__ = ["TRUE_WORDS", "FALSE_WORDS", "SettingError", "parse_bool", "check_number", "parse_number",
           "describe_range", "arg_int", "arg_float"]
