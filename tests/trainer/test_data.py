"""The data pipeline on real text (the stdlib's sources) and real shard files in tmp_path."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from thermowatch.trainer.data import (
    Curriculum,
    DataConfig,
    DataError,
    DataLoader,
    DataState,
    SkipLedger,
    bin_source,
    open_bin,
    sample_windows,
    stdlib_source,
    text_source,
)

MB = 1 << 20


@pytest.fixture(scope="module")
def source():
    return stdlib_source(max_bytes=2 * MB)


def run(loader: DataLoader, steps: int):
    return [loader.next_batch() for _ in range(steps)]


# --- corpus -------------------------------------------------------------------------------------


def test_stdlib_corpus_is_real_capped_and_deterministic(source):
    again = stdlib_source(max_bytes=2 * MB)
    assert len(source) == 2 * MB  # capped exactly: the stdlib holds far more than 2 MB of *.py
    assert np.array_equal(source.tokens, again.tokens)
    assert source.fingerprint == again.fingerprint
    assert source.vocab_size == 256
    text = source.tokens[:MB].tobytes()
    assert b"def " in text and b"import " in text  # Python source, not noise
    assert stdlib_source(max_bytes=MB).fingerprint != source.fingerprint


def test_same_seed_and_index_give_same_tokens_in_another_process(source):
    cfg = DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8, seed=7)
    ids = np.array([0, 1, 5, 999, 12_345, 10**9 + 3], dtype=np.int64)
    here = DataLoader(source, cfg).tokens(ids)
    code = (
        "import sys, zlib, numpy as np\n"
        "from thermowatch.trainer.data import DataConfig, DataLoader\n"
        "cfg = DataConfig(max_bytes=2 << 20, seq_len=64, global_batch=8, seed=7)\n"
        f"ids = np.array({ids.tolist()}, dtype=np.int64)\n"
        "print(zlib.crc32(DataLoader.from_config(cfg).tokens(ids).tobytes()))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert int(out.stdout.strip()) == zlib.crc32(here.tobytes())
    other_seed = DataLoader(source, DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8, seed=8)).tokens(ids)
    assert not np.array_equal(here, other_seed)


def test_order_is_a_fresh_permutation_every_epoch():
    n = 1000
    w = sample_windows(np.arange(3 * n), n, seed=1)
    epochs = w.reshape(3, n)
    for e in range(3):
        assert np.array_equal(np.sort(epochs[e]), np.arange(n))  # each window once per epoch
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], np.arange(n))  # actually shuffled
    assert not np.array_equal(sample_windows(np.arange(n), n, seed=2), epochs[0])


# --- world sizes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ramp", [False, True])
def test_world_sizes_that_divide_the_batch_see_the_same_global_batch(source, ramp):
    kw = dict(start_batch=4, start_seq_len=16, batch_multiple=4, ramp_tokens=1000) if ramp else {}
    cfg = DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=16, **kw)
    ref = run(DataLoader(source, cfg), 10)
    if ramp:  # the ramp passes through several shapes and reaches the full one
        shapes = [(b.global_batch, b.seq_len) for b in ref]
        assert shapes[0] == (4, 16) and shapes[-1] == (16, 64) and len(set(shapes)) > 3
    for w in (2, 4):
        per_rank = [run(DataLoader(source, cfg, rank=r, world_size=w), 10) for r in range(w)]
        for t, whole in enumerate(ref):
            parts = [per_rank[r][t] for r in range(w)]
            assert torch.equal(torch.cat([p.inputs for p in parts]), whole.inputs)
            assert torch.equal(torch.cat([p.targets for p in parts]), whole.targets)
            assert np.array_equal(np.concatenate([p.sample_ids for p in parts]), whole.global_ids)
            assert all(p.inputs.shape == (whole.global_batch // w, whole.seq_len) for p in parts)
            assert all(p.state.to_json() == whole.state.to_json() for p in parts)


def test_world_size_that_does_not_divide_the_batch_is_refused(source):
    with pytest.raises(DataError, match=r"world size 3 does not divide .*\[8\]"):
        DataLoader(source, DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8), rank=0, world_size=3)
    ramp = DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=16, start_batch=4, batch_multiple=4, ramp_tokens=1000)
    with pytest.raises(DataError, match="batch_multiple=4"):
        DataLoader(source, ramp, rank=0, world_size=8)


def test_targets_are_inputs_shifted_by_one_within_the_window(source):
    loader = DataLoader(source, DataConfig(max_bytes=2 * MB, seq_len=32, global_batch=4))
    b = loader.next_batch()
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    window = loader.tokens(b.sample_ids)
    assert np.array_equal(window[:, :-1], b.inputs.numpy()) and b.inputs.dtype == torch.int64


# --- skip ledger ----------------------------------------------------------------------------------


def test_skip_ledger_merges_and_answers_vectorised():
    led = SkipLedger([(10, 20), (15, 30), (30, 35), (50, 60), (7, 7)])
    assert led.ranges == [(10, 35), (50, 60)]
    ids = np.arange(0, 70)
    expected = ((ids >= 10) & (ids < 35)) | ((ids >= 50) & (ids < 60))
    assert np.array_equal(led.contains(ids), expected)
    assert led.contains(34) is True and led.contains(35) is False
    assert led.next_unskipped(12) == 35 and led.next_unskipped(40) == 40
    assert led.take(5, 10).tolist() == [5, 6, 7, 8, 9, 35, 36, 37, 38, 39]
    assert led.take(45, 8).tolist() == [45, 46, 47, 48, 49, 60, 61, 62]
    assert led.skipped_between(0, 55) == 25 + 5
    assert SkipLedger.from_json(json.loads(json.dumps(led.to_json()))) == led
    with pytest.raises(ValueError, match=r"\[5, 2\)"):
        SkipLedger.from_json([[5, 2]])
    with pytest.raises(ValueError, match="list of"):
        SkipLedger.from_json({"lo": 1})


def test_skipped_ids_never_appear_and_lo_hi_span_the_step(source):
    cfg = DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8)
    loader = DataLoader(source, cfg)
    loader.skip(3, 5)
    loader.skip(20, 45)  # spans several whole batches, as PaLM's 200-500 batch skips do
    seen = []
    for b in run(loader, 8):
        assert not loader.state.ledger.contains(b.global_ids).any()
        assert b.sample_lo == b.global_ids[0] and b.sample_hi == b.global_ids[-1] + 1
        seen.extend(b.global_ids.tolist())
    assert seen == [i for i in range(len(seen) + 27) if not (3 <= i < 5 or 20 <= i < 45)]
    # The batch that meets the skip consumed ids on both sides of it: its range covers the gap.
    b2 = DataLoader(source, cfg, state=DataState(cursor=16, ledger=SkipLedger([(20, 45)]))).next_batch()
    assert (b2.sample_lo, b2.sample_hi) == (16, 49) and len(b2.global_ids) == 8


def test_skip_added_after_restore_takes_effect_and_is_saved(source):
    cfg = DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8)
    first = DataLoader(source, cfg)
    run(first, 5)
    saved = json.loads(json.dumps(first.state.to_json()))  # as in a checkpoint manifest
    # The supervisor saw a spike in the steps after the checkpoint: roll back and skip them.
    resumed = DataLoader(source, cfg, state=DataState.from_json(saved))
    resumed.skip(40, 64)
    ids = np.concatenate([b.global_ids for b in run(resumed, 4)])
    assert ids[0] == 64 and not ((ids >= 40) & (ids < 64)).any()
    assert resumed.state.to_json()["skip_ranges"] == [[40, 64]]
    # A second relaunch from the new state keeps the skip without being told again.
    again = DataLoader(source, cfg, state=DataState.from_json(json.loads(json.dumps(resumed.state.to_json()))))
    assert again.next_batch().global_ids[0] == ids[-1] + 1


# --- resume and curriculum -------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
def test_resume_from_state_is_bit_identical_to_never_stopping(source, world_size):
    cfg = DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8, start_batch=4, start_seq_len=16,
                     batch_multiple=2, ramp_tokens=4000, seed=3)
    for rank in range(world_size):
        continuous = DataLoader(source, cfg, rank, world_size)
        continuous.skip(30, 37)
        ref = run(continuous, 14)
        head = DataLoader(source, cfg, rank, world_size)
        head.skip(30, 37)
        run(head, 6)
        state = DataState.from_json(json.loads(json.dumps(head.state.to_json())))
        tail = run(DataLoader(source, cfg, rank, world_size, state=state), 8)
        for a, b in zip(ref[6:], tail):
            assert a.step == b.step and (a.global_batch, a.seq_len) == (b.global_batch, b.seq_len)
            assert torch.equal(a.inputs, b.inputs) and np.array_equal(a.sample_ids, b.sample_ids)
        # The ramp crosses the resume point: shapes change inside both halves.
        assert len({(b.global_batch, b.seq_len) for b in ref[6:]}) > 1


def test_curriculum_values_at_token_counts():
    cur = Curriculum(full_batch=64, full_seq_len=1024, start_batch=8, start_seq_len=128, ramp_tokens=1_000_000)
    assert cur.at(0) == (8, 128)
    # Halfway: 8 + 56/2 = 36 -> multiple of 8 -> 32; 128 + 896/2 = 576 (already a multiple of 8).
    assert cur.at(500_000) == (32, 576)
    assert cur.at(999_999) == (56, 1016)
    assert cur.at(1_000_000) == (64, 1024) == cur.at(10**12)
    values = [cur.at(t) for t in range(0, 1_000_001, 10_000)]
    assert all(a <= b for a, b in zip(values, values[1:]))  # never shrinks
    assert all(b % 8 == 0 and s % 8 == 0 for b, s in values)
    assert Curriculum.constant(16, 256).at(123) == (16, 256)


def test_curriculum_config_errors_say_how_to_fix():
    with pytest.raises(ValueError, match="start_seq_len=100 must be a multiple of 8.*try 96"):
        Curriculum(full_batch=8, full_seq_len=256, start_seq_len=100, ramp_tokens=10)
    with pytest.raises(ValueError, match="start_batch=32 must be in"):
        Curriculum(full_batch=16, full_seq_len=256, start_batch=32, ramp_tokens=10)
    with pytest.raises(ValueError, match="neither start_batch nor start_seq_len"):
        Curriculum(full_batch=16, full_seq_len=256, ramp_tokens=10)


def test_short_seq_len_samples_are_prefixes_of_the_full_window(source):
    cfg = DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8, start_seq_len=16, ramp_tokens=10**6)
    loader = DataLoader(source, cfg)
    b = loader.next_batch()
    assert b.seq_len == 16
    full = loader.tokens(b.sample_ids)  # the same ids at full length
    assert np.array_equal(full[:, :16], b.inputs.numpy()) and np.array_equal(full[:, 1:17], b.targets.numpy())
    assert b.state.tokens_consumed == 8 * 16


def test_state_from_another_corpus_or_seed_is_refused(source):
    cfg = DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8)
    state = DataLoader(source, cfg).state
    with pytest.raises(DataError, match="seed"):
        DataLoader(source, DataConfig(max_bytes=2 * MB, seq_len=64, global_batch=8, seed=5), state=state)
    small = stdlib_source(max_bytes=MB)
    with pytest.raises(DataError, match="corpus fingerprint"):
        DataLoader(small, cfg, state=state)
    loader = DataLoader(small, cfg)
    loader.load_state(state, strict=False)
    assert loader.state.fingerprint == small.fingerprint


# --- shard and text files --------------------------------------------------------------------------


def write_llmc(path, tokens, magic=20240520, version=1, dtype=np.uint16, count=None):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [magic, version, len(tokens) if count is None else count]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, dtype=dtype).tobytes())


def test_llmc_shard_with_header_reads_tokens_after_the_header(tmp_path):
    toks = (np.arange(5000) * 7919 % 50257).astype(np.uint16)
    write_llmc(tmp_path / "fineweb_train_000001.bin", toks)
    arr, vocab = open_bin(tmp_path / "fineweb_train_000001.bin")
    assert vocab == 50257 and arr.dtype == np.uint16 and np.array_equal(arr, toks)
    src = bin_source(tmp_path / "fineweb_train_000001.bin")
    assert np.array_equal(src.read(np.array([0, 4000]), 10), np.stack([toks[:10], toks[4000:4010]]))
    # Llama-3 shards: a different magic, uint32 tokens.
    big = np.arange(3000, dtype=np.uint32) * 40_000
    write_llmc(tmp_path / "llama.bin", big, magic=20240801, version=7, dtype=np.uint32)
    arr, vocab = open_bin(tmp_path / "llama.bin")
    assert vocab == 128256 and np.array_equal(arr, big)


def test_headerless_nanogpt_bin_and_multi_shard_stream(tmp_path):
    toks = np.arange(3000, dtype=np.uint16)
    toks.tofile(tmp_path / "train.bin")  # exactly what nanoGPT's prepare.py writes
    arr, vocab = open_bin(tmp_path / "train.bin")
    assert vocab == 50257 and np.array_equal(arr, toks)
    d = tmp_path / "shards"
    d.mkdir()
    write_llmc(d / "b.bin", np.arange(100, 200))
    write_llmc(d / "a.bin", np.arange(0, 100))  # sorted by name: a before b
    src = bin_source(d)
    assert len(src) == 200
    assert np.array_equal(src.read(np.array([95, 0, 150]), 10), np.stack([np.arange(95, 105), np.arange(10), np.arange(150, 160)]))
    loader = DataLoader(src, DataConfig(source="bin", path=str(d), seq_len=16, global_batch=4))
    b = loader.next_batch()
    assert torch.equal(b.inputs + 1, b.targets)  # consecutive ids: a window is contiguous text


def test_broken_shards_are_refused_with_the_reason(tmp_path):
    write_llmc(tmp_path / "short.bin", np.arange(100), count=1000)
    with pytest.raises(DataError, match="truncated"):
        open_bin(tmp_path / "short.bin")
    write_llmc(tmp_path / "v9.bin", np.arange(100), version=9)
    with pytest.raises(DataError, match="version 9"):
        open_bin(tmp_path / "v9.bin")
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(DataError, match="3 bytes"):
        open_bin(tmp_path / "odd.bin")
    with pytest.raises(DataError, match="does not exist"):
        bin_source(tmp_path / "nope")


def test_text_source_reads_a_folder_in_path_order(tmp_path):
    (tmp_path / "b.txt").write_text("second\n")
    (tmp_path / "a.txt").write_text("first\n")
    (tmp_path / "skip.md").write_text("not me\n")
    src = text_source(tmp_path, suffixes=[".txt"])
    assert src.tokens.tobytes() == b"first\nsecond\n"
    assert text_source(tmp_path, max_bytes=4, suffixes=[".txt"]).tokens.tobytes() == b"firs"
    with pytest.raises(DataError, match="fewer than one window"):
        DataLoader(src, DataConfig(source="text", path=str(tmp_path), seq_len=64, global_batch=1))


def test_a_skip_follows_its_windows_into_every_epoch():
    """Issue 35: the ledger held ids, so the next epoch brought the same (poisoned) windows back at
    other ids. The bundled loader reads a skipped id as its corpus window, skipped in every epoch,
    whatever each epoch's permutation; through a checkpoint's JSON state and a pickle (Ray) too."""
    import pickle

    small = stdlib_source(max_bytes=64 * 256 + 1)  # 256 windows of 64 tokens
    cfg = DataConfig(max_bytes=64 * 256 + 1, seq_len=64, global_batch=8, seed=3)
    loader = DataLoader(small, cfg)
    n = loader.n_windows
    assert n == 256
    bad = range(40, 56)  # two steps' samples in the first epoch
    loader.skip(bad.start, bad.stop)
    bad_windows = set(sample_windows(np.arange(bad.start, bad.stop), n, cfg.seed).tolist())
    seen_ids, seen_windows = [], []
    resumed = None
    for step in range(3 * n // 8):  # three epochs' worth of steps
        b = loader.next_batch()
        seen_ids += b.global_ids.tolist()
        seen_windows += sample_windows(b.global_ids, n, cfg.seed).tolist()
        assert len(b.global_ids) == 8  # a skip never shrinks a batch
        if step == n // 8:  # into the second epoch: a checkpoint's state, saved and loaded, then pickled
            resumed = DataLoader(small, cfg, state=pickle.loads(pickle.dumps(
                DataState.from_json(json.loads(json.dumps(b.state.to_json()))))))
    assert not set(seen_ids) & set(bad)
    assert not set(seen_windows) & bad_windows  # not in the first epoch, nor the second or third
    epochs = np.asarray(seen_ids) // n
    assert {0, 1, 2} <= set(epochs.tolist())
    # every other window is served once an epoch
    for e in (1,):
        got = sorted(w for w, ep in zip(seen_windows, epochs) if ep == e)
        assert got == sorted(set(range(n)) - bad_windows)
    nxt = resumed.next_batch()
    assert not set(sample_windows(nxt.global_ids, n, cfg.seed).tolist()) & bad_windows
