"""One walk over a config's dataclass tree for the tests that check every setting (issue 34): the
supervisor's numbers (tests/supervisor/app/test_config.py), its settings table
(tests/supervisor/app/test_settings_table.py) and the training config's numbers
(tests/trainer/test_config.py) all enumerate the fields the same way."""

from __future__ import annotations

import dataclasses
import typing

from thermowatch.monitors.config_tree import SCHEMA, _resolve


def settings(cls: type, path: tuple[str, ...] = ()):
    """(path, types) of every leaf field under the config class `cls` that its constructor takes:
    `types` is the set of its type's arms, None left out (int | None -> {int})."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        target, tp = f.metadata.get(SCHEMA), hints.get(f.name)
        if target is not None:
            yield from settings(_resolve(target), path + (f.name,))
        elif dataclasses.is_dataclass(tp):
            yield from settings(tp, path + (f.name,))
        else:
            yield path + (f.name,), set(typing.get_args(tp)) - {type(None)} or {tp}


def numeric_settings(cls: type):
    """(path, is_int) of every int or float setting under `cls`."""
    for path, arms in settings(cls):
        if arms & {int, float}:
            yield path, float not in arms
