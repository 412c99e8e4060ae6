"""The checkpoint store on a real filesystem: commit order, corruption, retention, health."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from thermowatch.trainer.checkpoint import CheckpointError, CheckpointStore, Retention, file_digest, make_manifest
from thermowatch.trainer.data import DataConfig, DataLoader, DataState, stdlib_source

MB = 1 << 20


def writer(payload_bytes: int = 4096, seed: int = 0):
    """A write_fn like an engine's: a torch state dict plus a raw shard in a subfolder."""

    def write(d: Path) -> None:
        torch.save({"w": torch.arange(16.0) + seed}, d / "model_states.pt")
        (d / "zero").mkdir()
        rng = np.random.default_rng(seed)
        (d / "zero" / "shard_rank0.bin").write_bytes(rng.integers(0, 256, payload_bytes, dtype=np.uint8).tobytes())

    return write


def manifest(cursor: int = 0, **kw):
    return make_manifest({"cursor": cursor, "tokens_consumed": cursor * 64, "skip_ranges": []}, **kw)


def save(store: CheckpointStore, step: int, **kw) -> None:
    size = kw.pop("payload_bytes", 4096)
    store.save(step, writer(size, seed=step), manifest(cursor=step * 8, **kw))


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_save_commits_files_and_manifest(tmp_path):
    store = CheckpointStore(tmp_path, Retention(keep_last=5))
    info = store.save(100, writer(), manifest(cursor=800, attempt=2, lr_multiplier=0.5,
                                              lr_changes=[{"step": 90, "multiplier": 0.5}]))
    assert info.step == 100 and info.sample_cursor == 800 and info.healthy
    assert Path(info.path) == tmp_path / "step_00000100" and not (tmp_path / "step_00000100.tmp").exists()
    body = json.loads((tmp_path / "step_00000100" / "manifest.json").read_text())
    assert body["step"] == 100 and body["attempt"] == 2 and body["data"]["tokens_consumed"] == 800 * 64
    assert body["lr"] == {"multiplier": 0.5, "changes": [{"step": 90, "multiplier": 0.5}]}
    assert set(body["files"]) == {"model_states.pt", "zero/shard_rank0.bin"}
    assert body["files"]["zero/shard_rank0.bin"]["size"] == 4096
    assert torch.load(Path(info.path) / "model_states.pt")["w"][3] == 3.0
    assert store.load_manifest(100) == body == info.manifest
    # The manifest is the last thing written into the directory.
    mtimes = [p.stat().st_mtime_ns for p in Path(info.path).rglob("*") if p.is_file() and p.name != "manifest.json"]
    assert (Path(info.path) / "manifest.json").stat().st_mtime_ns >= max(mtimes)


def test_half_written_checkpoints_are_passed_over(tmp_path):
    store = CheckpointStore(tmp_path, Retention(keep_last=5))
    save(store, 10)
    # A writer that dies mid-save leaves nothing under a checkpoint's name.
    def dies(d: Path) -> None:
        (d / "model_states.pt").write_bytes(b"partial")
        raise OSError("node lost")
    with pytest.raises(OSError, match="node lost"):
        store.save(20, dies, manifest())
    assert store.steps() == [10] and not any(tmp_path.glob("*.tmp"))
    # A crash between the engine's write and commit: staged, never committed.
    writer()(store.begin(30))
    assert store.steps() == [10] and store.latest_valid().step == 10
    # A final-named dir without a manifest (e.g. copied by hand, or written by another tool).
    (tmp_path / "step_00000040").mkdir()
    (tmp_path / "step_00000040" / "model_states.pt").write_bytes(b"x" * 10)
    assert store.latest_valid().step == 10
    assert "no " in store.problem(40) and "manifest.json" in store.problem(40)
    assert [c.step for c in store.list()] == [10]
    assert store.clean_staging() == [tmp_path / "step_00000030.tmp"]
    # A manifest that is not JSON.
    save(store, 50)
    (tmp_path / "step_00000050" / "manifest.json").write_text('{"step": 50, "fil')
    assert store.latest_valid().step == 10 and "unreadable" in store.problem(50)


def test_truncated_or_corrupted_files_are_passed_over(tmp_path):
    store = CheckpointStore(tmp_path, Retention(keep_last=5))
    for step in (10, 20, 30):
        save(store, step)
    shard = tmp_path / "step_00000030" / "zero" / "shard_rank0.bin"
    os.truncate(shard, 1000)
    assert "truncated" in store.problem(30)
    assert store.latest_valid().step == 20
    flip_byte(tmp_path / "step_00000020" / "model_states.pt", 100)  # same size, one byte changed
    assert "corrupted" in store.problem(20)
    assert store.latest_valid().step == 10
    (tmp_path / "step_00000010" / "zero" / "shard_rank0.bin").unlink()
    assert "missing" in store.problem(10)
    assert store.latest_valid() is None and store.list() == []


def test_edges_checksum_misses_mid_file_rot_that_full_catches(tmp_path):
    """The documented trade-off: "edges" reads 2 MiB per file whatever its size."""
    big = tmp_path / "big.bin"
    big.write_bytes(np.random.default_rng(0).integers(0, 256, 5 * MB, dtype=np.uint8).tobytes())
    edges, full = file_digest(big, "edges"), file_digest(big, "full")
    flip_byte(big, 2 * MB)
    assert file_digest(big, "edges") == edges and file_digest(big, "full") != full
    flip_byte(big, 5 * MB - 1)  # a torn tail is caught by both
    assert file_digest(big, "edges") != edges
    store = CheckpointStore(tmp_path / "ck", Retention(checksum="full"))
    save(store, 1, payload_bytes=3 * MB)
    flip_byte(tmp_path / "ck" / "step_00000001" / "zero" / "shard_rank0.bin", MB + 5)
    assert "corrupted" in store.problem(1)


def test_retention_keeps_last_k_and_one_per_m_steps(tmp_path):
    store = CheckpointStore(tmp_path, Retention(keep_last=2, keep_every=10, keep_behind=0))
    for step in range(0, 40, 3):  # saves at 0, 3, ..., 39: none after the first lands on 10/20/30
        save(store, step)
    # Last 2: 36, 39. First save in each 10-step span: 0, 12, 21, 30.
    assert store.steps() == [0, 12, 21, 30, 36, 39]
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["retained"] == [0, 12, 21, 30, 36, 39] and index["deleting"] == [33]
    assert not any(tmp_path.glob("*.deleting"))


def test_retention_keeps_the_last_110_steps_whatever_keep_last_is(tmp_path):
    """Issue 35: the rule is in steps back from the newest, not a count. Checkpointing every 10
    steps and keeping 3, a rollback asked for at step 40 at step 150 still finds step 40."""
    store = CheckpointStore(tmp_path, Retention(keep_last=3, keep_every=0))
    for step in range(10, 151, 10):
        save(store, step)
    assert {40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150} <= set(store.steps())
    assert len(store.steps()) <= 15


def test_retention_never_deletes_the_newest_valid_or_healthy(tmp_path):
    store = CheckpointStore(tmp_path, Retention(keep_last=1, keep_every=0, keep_behind=0))
    save(store, 1)
    save(store, 2, healthy=False)
    save(store, 3, healthy=False)
    assert store.steps() == [1, 3]  # 1 survives: the only rollback target that was healthy
    save(store, 4)
    assert store.steps() == [4]
    roomy = CheckpointStore(tmp_path, Retention(keep_last=2, keep_every=0, keep_behind=0))
    save(roomy, 5)
    save(roomy, 6)
    flip_byte(tmp_path / "step_00000006" / "model_states.pt", 10)  # bit rot after commit
    CheckpointStore(tmp_path, Retention(keep_last=1, keep_every=0, keep_behind=0)).prune()  # retention tightened
    # 6 is the newest (kept by keep_last) but corrupt; 5 is the newest valid and survives.
    assert store.steps() == [5, 6] and store.latest_valid().step == 5


def test_leftover_deleting_dirs_are_finished_on_open(tmp_path):
    (tmp_path / "step_00000007.deleting" / "zero").mkdir(parents=True)
    CheckpointStore(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_mark_unhealthy_and_latest_valid_filters(tmp_path):
    store = CheckpointStore(tmp_path, Retention(keep_last=10))
    for step in (100, 200, 300, 400):
        save(store, step)
    store.mark_unhealthy(300, "attn_logit_growth onset at 290")
    body = store.load_manifest(300)
    assert body["healthy"] is False and body["unhealthy_reason"] == "attn_logit_growth onset at 290"
    assert store.problem(300) is None  # still intact, just not a rollback target
    assert store.latest_valid().step == 400
    assert store.latest_valid(max_step=350).step == 300
    assert store.latest_valid(max_step=350, healthy_only=True).step == 200
    assert store.latest_valid(max_step=99) is None
    assert store.abandon_after(200) == [300, 400]
    assert store.latest_valid(healthy_only=True).step == 200
    assert [c.healthy for c in store.list()] == [True, True, False, False]
    with pytest.raises(CheckpointError, match="step 250"):
        store.mark_unhealthy(250)


def test_saving_a_step_again_replaces_it(tmp_path):
    store = CheckpointStore(tmp_path, Retention(keep_last=5))
    save(store, 10)
    store.save(10, writer(seed=99), manifest(cursor=1234))
    assert store.latest_valid().sample_cursor == 1234
    assert torch.load(tmp_path / "step_00000010" / "model_states.pt")["w"][0] == 99.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000010"]


def test_bad_manifests_are_refused_before_anything_is_committed(tmp_path):
    store = CheckpointStore(tmp_path)
    with pytest.raises(CheckpointError, match="make_manifest"):
        store.save(1, writer(), {"healthy": True})
    with pytest.raises(CheckpointError, match=r"\['files'\]"):
        store.save(2, writer(), {**manifest(), "files": {}})
    with pytest.raises(TypeError):
        store.save(3, writer(), {**manifest(), "obj": object()})
    assert store.steps() == []
    with pytest.raises(ValueError, match="keep_last"):
        Retention(keep_last=0)
    with pytest.raises(ValueError, match="sha1"):
        Retention(checksum="sha1")


def test_data_state_round_trips_through_a_checkpoint(tmp_path):
    cfg = DataConfig(max_bytes=MB, seq_len=64, global_batch=8, start_seq_len=16, ramp_tokens=3000)
    source = stdlib_source(MB)
    loader = DataLoader(source, cfg)
    loader.skip(10, 20)
    for _ in range(4):
        loader.next_batch()
    store = CheckpointStore(tmp_path)
    store.save(4, writer(), make_manifest(loader.state, attempt=1))
    expected = [loader.next_batch() for _ in range(3)]
    info = store.latest_valid(healthy_only=True)
    resumed = DataLoader(source, cfg, state=DataState.from_json(info.manifest["data"]))
    assert info.sample_cursor == resumed.state.cursor and resumed.state.ledger.ranges == [(10, 20)]
    for want in expected:
        got = resumed.next_batch()
        assert torch.equal(got.inputs, want.inputs) and np.array_equal(got.global_ids, want.global_ids)
