"""A config file checked as one tree against the dataclasses it fills (issue 12, item 6).

`check_tree(SupervisorConfig, mapping)` walks the mapping beside the dataclass's fields and
refuses the first unknown key or mistyped value *anywhere* with one message that names its
dotted path, the keys known at that level and the closest one:

    detectors.attn.celing: unknown key; did you mean 'ceiling'? known keys at detectors.attn: ceiling, ...
    policy.lr_multiplier: expected a number, got 'half'

A field typed `dict[str, Any]` whose keys are another dataclass's fields (the supervisor's
`policy:`, the trainer's `model:`) names that class in its metadata, `schema("module:Class")`,
so the walk goes on into it; a lazy name keeps the import rule (DESIGN.md) and avoids cycles.

Why not pydantic: the configs are plain (some frozen, slotted) dataclasses whose __post_init__
checks ranges and coerces YAML's lists and strings into tuples and enums; pydantic would build a
second copy of each, coerce differently ("0.5" -> 0.5 in lax mode) and add a dependency to
`monitors`, which depends on torch only. This walk only *types and names* keys; the ranges stay
in each class's __post_init__, which runs after it. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import importlib
import math
import types
import typing
from pathlib import PurePath
from typing import Any, Mapping

SCHEMA = "config_tree.schema"  # the field-metadata key


class ConfigTreeError(ValueError):
    """A key or value that does not fit the config's tree; `path` is its dotted path."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path or 'config'}: {message}")
        self.path = path


def schema(target: str) -> dict[str, str]:
    """Field metadata: this dict field's keys are the fields of the dataclass `module:Class`."""
    return {SCHEMA: target}


def check_tree(cls: type, obj: Any, path: str = "") -> None:
    """Raise ConfigTreeError for the first unknown key or wrongly typed value under `obj`."""
    if dataclasses.is_dataclass(obj) and isinstance(obj, cls):
        return  # already built (a caller passed the object itself): its __post_init__ checked it
    if not isinstance(obj, Mapping):
        raise ConfigTreeError(path, f"expected a mapping of keys (known keys: {_names(cls)}), got {_show(obj)}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    for key, val in obj.items():
        where = f"{path}.{key}" if path else str(key)
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ConfigTreeError(where, f"unknown key; {hint}known keys at {path or 'the top level'}: {_names(cls)}")
        target = fields[key].metadata.get(SCHEMA)
        if target is not None and val is not None:
            check_tree(_resolve(target), val, where)
        elif key in hints:
            _check_value(hints[key], val, where)


def changed(obj: Any) -> dict[str, Any]:
    """The fields of the dataclass `obj` that differ from its class's defaults, a nested section as
    its own changed fields: what a config file would have to say to build it."""
    default = type(obj)()
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        mine, theirs = getattr(obj, f.name), getattr(default, f.name)
        if f.init and mine != theirs:
            out[f.name] = changed(mine) if dataclasses.is_dataclass(mine) and type(mine) is type(theirs) else mine
    return out


def _check_value(tp: Any, val: Any, where: str) -> None:
    if tp is Any or isinstance(tp, (str, typing.TypeVar)):
        return
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or origin is types.UnionType:
        if val is None and type(None) in args:
            return
        if float in args and isinstance(val, float) and not math.isfinite(val):
            return _check_value(float, val, where)  # "a finite number", not "a number or null"
        errors = []
        for arm in (a for a in args if a is not type(None)):
            try:
                return _check_value(arm, val, where)
            except ConfigTreeError as exc:
                errors.append(exc)
        if len(errors) == 1 and errors[0].path != where:
            raise errors[0]  # deeper down (a list item, a nested key): that message is the precise one
        raise ConfigTreeError(where, f"expected {_expected(tp)}, got {_show(val)}")
    if origin is typing.Literal:
        if val not in args:
            raise ConfigTreeError(where, f"expected one of {list(args)}, got {_show(val)}")
        return
    if dataclasses.is_dataclass(tp):
        return check_tree(tp, val, where)
    if tp is bool:
        if not isinstance(val, bool):
            raise ConfigTreeError(where, f"expected true or false, got {_show(val)}")
    elif tp is int:
        if isinstance(val, bool) or not isinstance(val, int):
            raise ConfigTreeError(where, f"expected an integer, got {_show(val)}")
    elif tp is float:
        if isinstance(val, bool) or not isinstance(val, (int, float)):
            hint = ""
            if isinstance(val, str) and _is_number(val):
                # YAML 1.1 (PyYAML) reads 1e-3 as a string: a float needs a dot, 1.0e-3.
                hint = " (YAML reads an exponent without a dot as text: write 1.0e-3, not 1e-3)"
            raise ConfigTreeError(where, f"expected a number, got {_show(val)}{hint}")
        if not math.isfinite(val):
            # No setting means "forever" or "never" by .inf, and NaN compares false with every
            # bound a class checks afterwards (issue 34: `cooldown_s: .inf` was accepted).
            raise ConfigTreeError(where, f"expected a finite number, got {_show(val)}")
    elif tp is str:
        if not isinstance(val, (str, PurePath)):  # a Path from code, for a directory kept as text
            raise ConfigTreeError(where, f"expected a string, got {_show(val)}")
    elif isinstance(tp, type) and issubclass(tp, PurePath):
        if not isinstance(val, (str, PurePath)):
            raise ConfigTreeError(where, f"expected a path, got {_show(val)}")
    elif isinstance(tp, type) and issubclass(tp, enum.Enum):
        known = [m.value for m in tp]
        if not isinstance(val, tp) and val not in known:
            raise ConfigTreeError(where, f"expected one of {known}, got {_show(val)}")
    elif origin in (tuple, list, frozenset, set) or tp in (tuple, list, frozenset, set):
        if isinstance(val, (str, bytes, Mapping)) or not isinstance(val, (list, tuple, set, frozenset)):
            raise ConfigTreeError(where, f"expected a list, got {_show(val)}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(val) != len(args):
                raise ConfigTreeError(where, f"expected a list of {len(args)} values, got {_show(val)}")
            for i, (arm, item) in enumerate(zip(args, val)):
                _check_value(arm, item, f"{where}[{i}]")
        elif args:
            for i, item in enumerate(val):
                _check_value(args[0], item, f"{where}[{i}]")
    elif origin is dict or tp is dict:
        if not isinstance(val, Mapping):
            raise ConfigTreeError(where, f"expected a mapping, got {_show(val)}")
    # anything else (a callable, a numpy type): left to the class's own __post_init__


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a hint only resolvable under TYPE_CHECKING: keys are still checked, not types
        return {}


def _resolve(target: str) -> type:
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _names(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls) if f.init)


def _expected(tp: Any) -> str:
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    arms = [a for a in typing.get_args(tp) if a is not type(None)]
    text = " or ".join(words.get(a, getattr(a, "__name__", str(a))) for a in arms)
    return text + (" or null" if type(None) in typing.get_args(tp) else "")


def _is_number(s: str) -> bool:
    try:
        return math.isfinite(float(s))
    except ValueError:
        return False


def _show(val: Any) -> str:
    if isinstance(val, Mapping):
        return "a mapping"
    text = repr(val)
    return text if len(text) <= 60 else text[:57] + "..."
