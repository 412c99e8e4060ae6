"""thermowatch.protocol: the trainer's side of the command protocol, one implementation for
thermowatch.Run / watch and the bundled controller (issue 22, item 7)."""

from __future__ import annotations

import json

import pytest

import thermowatch.protocol as protocol
from thermowatch.monitors.contract import Ack, Command, LRChange, SampleRange, SetLR, Skip, ledger_digest
from thermowatch.protocol import CheckpointRef, CommandBook, Outcome, ack_for, next_attempt


def _cmd(i: int, body) -> Command:
    return Command(id=i, body=body)


def test_attempt_numbers_never_repeat_across_relaunches_and_survive_a_torn_file(tmp_path):
    assert next_attempt(tmp_path) == 1
    assert next_attempt(tmp_path) == 2  # a relaunch: this process remembers nothing
    assert next_attempt(tmp_path, current=7) == 8  # memory ahead of the file wins
    assert json.loads((tmp_path / "attempt.json").read_text())["attempt"] == 8
    (tmp_path / "attempt.json").write_text("{torn")
    assert next_attempt(tmp_path, current=8) == 9  # unreadable: numbered from memory, never back to 1
    assert not (tmp_path / "attempt.json.partial").exists()


def test_a_command_delivered_again_is_answered_with_its_ack_and_a_reused_id_is_carried_out(tmp_path):
    book = CommandBook(tmp_path)
    assert not book.loaded
    skip = _cmd(3, Skip(ranges=(SampleRange(10, 20),)))
    assert book.answered(skip) is None
    ack = Ack(command_id=3, ok=True, first_step=5, detail="skipping [10, 20)")
    book.record(ack, skip, lr_changes=[LRChange(start_step=5, multiplier=0.5)], skip_ranges=[(10, 20), (15, 30)])
    again = CommandBook(tmp_path)  # a relaunched trainer reads the same file
    assert again.loaded and again.answered(skip) == ack
    assert again.skip_ranges == (SampleRange(10, 30),)  # merged
    assert again.lr_changes == [LRChange(start_step=5, multiplier=0.5)]
    other = _cmd(3, SetLR(multiplier=0.1))  # the same id, another body: a reset queue
    assert again.answered(other) is None


def test_the_book_keeps_the_newest_acks_only(tmp_path, monkeypatch):
    monkeypatch.setattr(protocol, "KEEP_ACKS", 3)
    book = CommandBook(tmp_path)
    for i in range(1, 6):
        book.record(Ack(command_id=i, ok=True, first_step=i, detail="x"), _cmd(i, SetLR(multiplier=1.0)))
    again = CommandBook(tmp_path)
    assert sorted(again.acks) == [3, 4, 5] and sorted(again.commands) == [3, 4, 5]


def test_ack_for_says_what_was_done_or_why_not():
    lr = [LRChange(start_step=3, multiplier=0.5)]
    ranges = [SampleRange(0, 8)]
    cmd = _cmd(1, Skip(ranges=(SampleRange(0, 8),)))
    done = ack_for(cmd, Outcome("rolled back", checkpoint=CheckpointRef(10, "/c/10"), skip_ranges=(SampleRange(0, 8),)),
                   None, first_step=11, lr_changes=lr, skip_ranges=ranges)
    assert done.ok and done.step == 11 and done.checkpoint_step == 10 and done.checkpoint_path == "/c/10"
    assert done.lr_multiplier == 0.5 and done.ledger_digest == ledger_digest(ranges)
    refused = ack_for(cmd, None, "no checkpoint", first_step=4, lr_changes=[], skip_ranges=())
    assert not refused.ok and refused.detail == "no checkpoint" and refused.checkpoint_step is None
    assert refused.lr_multiplier == 1.0


@pytest.mark.parametrize("module", ["thermowatch.run", "thermowatch.loop", "thermowatch.trainer.obey",
                                    "thermowatch.trainer.controller"])
def test_no_trainer_keeps_a_copy_of_the_protocol(module):
    """The twins this module replaced (Run._next_attempt / RunController._next_attempt, Run's acks /
    obey.CommandState, two Ack builders) must not come back."""
    import ast
    import importlib
    import inspect

    tree = ast.parse(inspect.getsource(importlib.import_module(module)))
    code = [n for n in ast.walk(tree) if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    strings = {n.value for n in code if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    assert not strings & {"attempt.json", "commands.json"}  # docstrings may name them, code may not
    calls = [n for n in code if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "Ack"]
    assert not calls, f"{module} builds an Ack itself; use thermowatch.protocol.ack_for"
