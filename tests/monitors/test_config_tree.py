"""config_tree: the walk itself, on small dataclasses (the configs' own cases live in
tests/supervisor/app/test_config.py and tests/trainer/test_config.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from thermowatch.monitors.config_tree import ConfigTreeError, check_tree, schema


class Color(enum.Enum):
    RED = "red"


@dataclass
class Leaf:
    n: int = 1
    x: float = 0.5
    names: tuple[str, ...] = ()
    pair: tuple[float, float] = (0.0, 1.0)
    color: Color = Color.RED
    maybe: int | None = None


@dataclass
class Mid:
    leaf: Leaf = field(default_factory=Leaf)
    free: dict[str, Any] = field(default_factory=dict)  # no schema: any keys
    typed: dict[str, Any] = field(default_factory=dict, metadata=schema(f"{__name__}:Leaf"))


@dataclass
class Top:
    mid: Mid = field(default_factory=Mid)
    where: Path = Path(".")


def _err(obj: Any) -> ConfigTreeError:
    with pytest.raises(ConfigTreeError) as exc:
        check_tree(Top, obj)
    return exc.value


def test_valid_trees_pass():
    check_tree(Top, {"where": "/tmp", "mid": {"leaf": {"n": 2, "x": 3, "names": ["a"], "pair": [1, 2.5],
                                                        "color": "red", "maybe": None},
                                               "free": {"anything": {"goes": 1}}, "typed": {"n": 4}}})
    check_tree(Top, {"mid": Mid()})  # an object already built is its own class's business


def test_unknown_keys_at_each_depth_name_path_known_keys_and_closest():
    e = _err({"mdi": {}})
    assert (e.path, str(e)) == ("mdi", "mdi: unknown key; did you mean 'mid'? known keys at the top level: mid, where")
    assert str(_err({"mid": {"leaf": {"nn": 1}}})).startswith(
        "mid.leaf.nn: unknown key; did you mean 'n'? known keys at mid.leaf: n, x, names, pair, color, maybe")
    assert "mid.typed.zzz: unknown key; known keys at mid.typed: n," in str(_err({"mid": {"typed": {"zzz": 1}}}))


@pytest.mark.parametrize("leaf, message", [
    ({"n": True}, "mid.leaf.n: expected an integer, got True"),
    ({"n": 1.5}, "mid.leaf.n: expected an integer, got 1.5"),
    ({"x": "half"}, "mid.leaf.x: expected a number, got 'half'"),
    ({"names": "abc"}, "mid.leaf.names: expected a list, got 'abc'"),
    ({"names": ["a", 2]}, "mid.leaf.names[1]: expected a string, got 2"),
    ({"pair": [1.0]}, "mid.leaf.pair: expected a list of 2 values, got [1.0]"),
    ({"color": "blue"}, "mid.leaf.color: expected one of ['red'], got 'blue'"),
    ({"maybe": "x"}, "mid.leaf.maybe: expected an integer or null, got 'x'"),
])
def test_wrong_types_name_path_expected_and_got(leaf, message):
    assert str(_err({"mid": {"leaf": leaf}})) == message


def test_not_a_mapping():
    assert str(_err({"mid": {"leaf": 3}})).startswith("mid.leaf: expected a mapping of keys (known keys: n, x,")
    assert str(_err({"where": 5})) == "where: expected a path, got 5"
