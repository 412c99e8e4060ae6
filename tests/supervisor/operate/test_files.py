"""supervisor/operate/files.py, the one way the CLI writes a file (issue 34): whole or not at all,
only over a regular file or nothing. The CLI's own refusals (export, plot) are in test_cli.py."""

from __future__ import annotations

import os
import stat

import pytest

from thermowatch.supervisor.errors import UserError
from thermowatch.supervisor.operate.files import replacing, write_file


def test_a_failure_while_writing_leaves_the_old_file_and_no_partial(tmp_path):
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    with pytest.raises(RuntimeError, match="the daemon went away"):
        with replacing(out, flag="--out") as fh:
            fh.write("half of the new\n")
            raise RuntimeError("the daemon went away")
    assert out.read_text() == "old\n" and os.listdir(tmp_path) == ["out.jsonl"]


def test_a_secret_gets_its_mode_and_a_replaced_file_keeps_its_own(tmp_path):
    secret = write_file(tmp_path / "client.json", "{}", flag="login", mode=0o600)
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    shared = tmp_path / "shared.csv"
    shared.write_text("a\n")
    os.chmod(shared, 0o640)
    write_file(shared, b"b\n", flag="--out")
    assert shared.read_bytes() == b"b\n" and stat.S_IMODE(os.stat(shared).st_mode) == 0o640


def test_a_planted_partial_name_is_never_followed(tmp_path):
    """The old writers used `<name>.partial`: a symlink planted there was written through."""
    victim = tmp_path / "victim"
    victim.write_text("keep me\n")
    (tmp_path / "out.json.partial").symlink_to(victim)
    write_file(tmp_path / "out.json", "new\n", flag="--out")
    assert victim.read_text() == "keep me\n" and (tmp_path / "out.json").read_text() == "new\n"


def test_a_device_behind_a_symlink_is_named_with_what_it_resolves_to(tmp_path):
    (tmp_path / "null").symlink_to("/dev/null")
    with pytest.raises(UserError) as exc:
        write_file(tmp_path / "null", "x", flag="--out")
    assert str(exc.value) == (f"--out {tmp_path / 'null'} (which resolves to /dev/null) is a character device: "
                              "thermowatch writes only to a regular file, which it replaces whole; name a new file "
                              "or an existing regular file")
    assert (tmp_path / "null").is_symlink() and os.listdir(tmp_path) == ["null"]
