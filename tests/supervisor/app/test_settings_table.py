"""docs/configuration.md's settings table is the code's (issue 34): every boolean and number of the
supervisor config, the environment and the command line is a row, and each row's rule is tried
against the code: its bounds accepted, one step past them refused, NaN and infinity refused, a
refusal naming the key. A setting added without a row, or a range changed without its row, fails."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import math
import re

import pytest

from thermowatch.cli import build_parser
from thermowatch.monitors.settings import FALSE_WORDS, TRUE_WORDS
from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from tests.config_walk import settings
from tests.supervisor import ROOT

DOC = ROOT / "docs" / "configuration.md"
_RULE = re.compile(r"`(integer|number) (?:(>=|>) (\S+)|in ([\[(])(\S+), (\S+)([\])]))`")


@dataclasses.dataclass(frozen=True)
class Rule:
    integer: bool
    lo: float | None
    lo_open: bool
    hi: float | None
    hi_open: bool
    null_ok: bool  # "or `null`"
    zero_ok: bool  # "or `0`": 0 is "off" below a range that excludes it
    also: bool  # a rule between two keys besides: the bounds alone are not enough to accept

    @classmethod
    def parse(cls, cell: str) -> "Rule":
        m = _RULE.search(cell)
        assert m, f"no rule in {cell!r}"
        kind, op, bound, lb, lo, hi, rb = m.groups()
        num = int if kind == "integer" else float
        if op:
            lo_, lo_open, hi_, hi_open = num(bound), op == ">", None, False
        else:
            lo_, lo_open, hi_, hi_open = num(lo), lb == "(", num(hi), rb == ")"
        return cls(kind == "integer", lo_, lo_open, hi_, hi_open, "or `null`" in cell, "or `0`" in cell,
                   ", also" in cell)

    def refused(self) -> list:
        out: list = [math.nan, math.inf, -math.inf]
        step = 1 if self.integer else 1e-6
        if self.lo is not None:
            out.append(self.lo if self.lo_open else self.lo - step)
        if self.hi is not None:
            out.append(self.hi if self.hi_open else self.hi + step)
        if self.integer:
            out.append((self.lo or 0) + 1.5)
        return [v for v in out if not (self.zero_ok and v == 0)]

    def accepted(self) -> list:
        if self.also:
            return [None] if self.null_ok else []
        step = 1 if self.integer else min(1e-3, (self.hi - self.lo) / 2 if self.hi is not None else 1e-3)
        out = [self.lo + step if self.lo_open else self.lo]
        if self.hi is not None:
            out.append(self.hi - step if self.hi_open else self.hi)
        return out + ([None] if self.null_ok else []) + ([0] if self.zero_ok else [])


def _table(heading: str) -> list[tuple[list[str], str]]:
    """(keys, accepts cell) of the first table after `heading`, brace groups expanded."""
    text = DOC.read_text()
    section = text[text.index(heading):]
    rows = []
    for line in section[section.index("\n|"):].splitlines()[3:]:
        if not line.startswith("|"):
            break
        keys_cell, accepts = [c.strip() for c in line.strip("|").split("|")]
        keys = []
        for span in re.findall(r"`([^`]+)`", keys_cell):
            parts = re.split(r"\{([^}]*)\}", span)  # literal, group, literal, group, ...
            choices = [[p] if i % 2 == 0 else [c.strip() for c in p.split(",")] for i, p in enumerate(parts)]
            keys += ["".join(c) for c in itertools.product(*choices)]
        rows.append((keys, accepts))
    return rows


CONFIG_ROWS = _table("## Settings table")
FLAG_ROWS = _table("### Numbers on the command line")


def _settings(cls: type):
    """(dotted key, kind) of every bool, int or float field under the config class `cls`."""
    for path, arms in settings(cls):
        kind = "bool" if bool in arms else "number" if arms & {int, float} else None
        if kind:
            yield ".".join(path), kind


def _nested(key: str, value) -> dict:
    *head, last = key.split(".")
    out = {last: value}
    for k in reversed(head):
        out = {k: out}
    return out


def test_every_boolean_and_number_of_the_supervisor_config_has_one_row():
    in_code = dict(_settings(SupervisorConfig))
    in_doc = [k for keys, _ in CONFIG_ROWS for k in keys if not k.startswith("THERMOWATCH_")]
    assert len(in_doc) == len(set(in_doc)), "a key has two rows"
    assert sorted(in_doc) == sorted(in_code), (sorted(set(in_code) - set(in_doc)), sorted(set(in_doc) - set(in_code)))


@pytest.mark.parametrize("keys, accepts", [r for r in CONFIG_ROWS if not r[0][0].startswith("THERMOWATCH_")],
                         ids=lambda v: v[0] if isinstance(v, list) else "")
def test_each_config_row_is_what_the_code_accepts(tmp_path, keys, accepts):
    import yaml

    for key in keys:
        def load(value):  # as a file holds it: .nan, .inf, null, a quoted "true"
            path = tmp_path / "sup.yaml"
            path.write_text(yaml.safe_dump(_nested(key, value)))
            return SupervisorConfig.load(path, env={}, data_dir=tmp_path)

        if "`true/false`" in accepts:
            for v in (True, False):
                load(v)
            bad = ["true", "on", 1, 0, None]
        else:
            rule = Rule.parse(accepts)
            for v in rule.accepted():
                load(v)
            bad = rule.refused()
        for v in bad:
            with pytest.raises(ConfigError) as exc:
                load(v)
            assert key.rsplit(".", 1)[-1] in str(exc.value), (key, v, str(exc.value))


def test_the_environments_rows_are_what_the_code_reads(tmp_path):
    rows = {keys[0]: accepts for keys, accepts in CONFIG_ROWS if keys[0].startswith("THERMOWATCH_")}
    assert set(rows) == {"THERMOWATCH_ADVISE_ONLY", "THERMOWATCH_PORT"}
    true_cell, false_cell = rows["THERMOWATCH_ADVISE_ONLY"].split(" / ")
    words = (tuple(re.findall(r"`([^`]+)`", true_cell)), tuple(re.findall(r"`([^`]+)`", false_cell)))
    assert words == (TRUE_WORDS, FALSE_WORDS)
    for value, spellings in ((True, words[0]), (False, words[1])):
        for w in spellings:
            for text in (w, w.upper(), f" {w.title()}\t"):
                assert SupervisorConfig.load(None, env={"THERMOWATCH_ADVISE_ONLY": text}, data_dir=tmp_path).advise_only \
                    is value
    rule = Rule.parse(rows["THERMOWATCH_PORT"])
    for v in rule.accepted():
        assert SupervisorConfig.load(None, env={"THERMOWATCH_PORT": str(v)}, data_dir=tmp_path).port == v
    for v in rule.refused() + ["x"]:
        with pytest.raises(ConfigError, match="THERMOWATCH_PORT"):
            SupervisorConfig.load(None, env={"THERMOWATCH_PORT": str(v)}, data_dir=tmp_path)


def _flags() -> dict[str, argparse.Action]:
    """'lr --multiplier' -> its argparse action, for every subcommand (nested ones too)."""
    out: dict[str, argparse.Action] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(sub, f"{prefix}{name} ")
            elif action.option_strings:
                out[prefix + max(action.option_strings, key=len)] = action
            elif action.dest != "help":
                out[prefix + action.dest] = action

    walk(build_parser(), "")
    return out


FLAGS = _flags()


def test_every_numeric_flag_is_checked_and_has_a_row():
    numeric = {k for k, a in FLAGS.items() if a.type in (int, float) or getattr(a.type, "__name__", "")
               in ("integer", "number")}
    plain = sorted(k for k in numeric if FLAGS[k].type in (int, float))
    assert plain == [], f"flags parsed by int()/float() take NaN, inf or any sign: use monitors.settings: {plain}"
    in_doc = [k for keys, _ in FLAG_ROWS for k in keys]
    assert sorted(in_doc) == sorted(numeric), (sorted(numeric - set(in_doc)), sorted(set(in_doc) - numeric))


@pytest.mark.parametrize("keys, accepts", FLAG_ROWS, ids=lambda v: v[0] if isinstance(v, list) else "")
def test_each_flag_row_is_what_the_flag_accepts(keys, accepts):
    rule = Rule.parse(accepts)
    for key in keys:
        parse = FLAGS[key].type
        for v in rule.accepted():
            assert parse(str(v)) == v
        for v in rule.refused():
            with pytest.raises(argparse.ArgumentTypeError):
                parse(str(v))
