"""The collective reduction (monitors.collective, issue 13 item 5) against the driver-side one
(monitors.reduce.Reducer), bit for bit: first on hand-made rank vectors with NaN, ±Inf, ties and
outlier ranks, all-reduced by real gloo process groups; then on a real 2-rank DeepSpeed run."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from tests.trainer.conftest import tiny_config

# float32 values, as the thermometers hold them: their float64 sum over ranks is exact in any
# order, so the ring order of gloo's sum and numpy's row order agree bit for bit.
NAMES = ["loss", "lr", "grad_norm", "act_max/blocks.0", "act_min/blocks.0", "attn_logit_max/blocks.0.attn",
         "attn_entropy_min/blocks.0.attn", "update_ratio", "tokens_per_s"]
N_DEVICE = len(NAMES) - 1  # tokens_per_s is a host float, handed to the reducer beside the buffer


def _cases(world: int) -> list[np.ndarray]:
    """(world, len(NAMES)) rank matrices; float32-representable except tokens_per_s."""
    rng = np.random.default_rng(7)
    out = [rng.standard_normal((world, len(NAMES)))]
    tie = np.ones((world, len(NAMES)))  # every rank agrees: no rank is named
    out.append(tie)
    ext = rng.standard_normal((world, len(NAMES)))
    ext[:, 3] = 2.0  # a max tie between all ranks ...
    ext[world - 1, 3] = 3.0  # ... broken by the last rank
    ext[1:, 4] = -5.0  # a min shared by every rank but rank 0: the lowest of them is named
    ext[0, 5] = np.inf
    ext[world - 1, 6] = -np.inf
    out.append(ext)
    one = min(1, world - 1)
    nan = rng.standard_normal((world, len(NAMES)))
    nan[one, 0] = np.nan  # a mean with a NaN rank: NaN
    nan[world - 1, 3] = nan[one, 3] = np.nan  # max: NaN, the first NaN rank named
    nan[world - 1, 4] = np.nan  # min: NaN beats every number
    nan[:, 5] = np.nan  # NaN on every rank (a sampled thermometer's off-step): they agree, no rank named
    nan[:, 6] = np.nan  # the same for a min metric
    nan[0, 2], nan[world - 1, 2] = np.inf, -np.inf
    nan[0, 7], nan[world - 1, 7] = np.inf, -np.inf  # inf + -inf: NaN
    out.append(nan)
    for m in out:
        m[:, -1] = np.abs(m[:, -1]) * 1e4 + 1 / 3  # tokens/s, a host float (the worker rounds it to float32)
        m[:] = m.astype(np.float32)
    return out


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from thermowatch.monitors.collective import CollectiveReducer

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    red = CollectiveReducer(NAMES, N_DEVICE, torch.device("cpu"))
    got = []
    for m in _cases(world):
        buf = torch.tensor(m[rank, :N_DEVICE], dtype=torch.float32)
        got.append(red(buf, (float(m[rank, -1]),)).numpy())
    np.save(os.path.join(out_dir, f"rank{rank}.npy"), np.stack(got))
    dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3])
def test_collective_reduction_equals_the_driver_reduction_bit_for_bit(tmp_path, world):
    import torch.multiprocessing as mp

    from thermowatch.monitors.reduce import Reducer
    from thermowatch.trainer.worker import _free_port

    mp.spawn(_rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    red = Reducer(NAMES)
    packed = [np.load(tmp_path / f"rank{r}.npy") for r in range(world)]
    for r in range(1, world):  # every rank ends with the same vector
        assert np.array_equal(packed[r], packed[0], equal_nan=True)
    for i, m in enumerate(_cases(world)):
        want_values, want_ranks = red(m)
        values, ranks = red.unpack(packed[0][i])
        assert ranks == want_ranks, (i, ranks, want_ranks)
        nan = np.isnan(want_values)
        assert np.array_equal(np.isnan(values), nan), i
        # bit for bit where a number (NaN payloads are canonical on the collective path)
        assert values[~nan].tobytes() == want_values[~nan].tobytes(), (i, values, want_values)
    if world > 1:  # the cases really exercise outliers and NaN
        assert red.unpack(packed[0][3])[1]["act_max/blocks.0"] == 1
        assert red.unpack(packed[0][3])[1]["act_min/blocks.0"] == world - 1  # NaN on one rank: named
        assert not {"attn_logit_max/blocks.0.attn", "attn_entropy_min/blocks.0.attn"} & set(red.unpack(packed[0][3])[1])
        assert red.unpack(packed[0][2])[1] and not red.unpack(packed[0][1])[1]


def _train(tmp_path, reduction: str):
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import ListSink, QueueCommands

    cfg = tiny_config(tmp_path / reduction, run_id=f"red-{reduction}", steps=6, reduction=reduction,
                      model={"n_layer": 2, "d_model": 32, "n_head": 2}, optim={"warmup_steps": 2},
                      data={"max_bytes": 1 << 18, "seq_len": 32, "global_batch": 4})
    sink = ListSink()
    result = RunController(cfg, sink, QueueCommands()).run()
    assert result.final_step == 6
    return sink.attempt(cfg.run_id, 0)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_real_2_rank_deepspeed_run_records_the_same_steps_on_both_paths(ray_session, tmp_path):
    """The same deterministic 2-rank ZeRO-2 run, once reduced on the driver and once by gloo
    collectives: identical records, bit for bit, but tokens/s (a wall-clock figure)."""
    old, new = _train(tmp_path, "driver"), _train(tmp_path, "collective")
    assert [r.step for r in new] == [r.step for r in old] == list(range(1, 7))
    outliers = 0
    for a, b in zip(old, new):
        assert set(a.values) == set(b.values)
        for key, va in a.values.items():
            if key == "tokens_per_s":
                assert math.isfinite(b.values[key]) and b.values[key] > 0
                continue
            vb = b.values[key]
            assert (math.isnan(va) and math.isnan(vb)) or np.float64(va).tobytes() == np.float64(vb).tobytes(), (
                a.step, key, va, vb)
        assert a.ranks == b.ranks, (a.step, a.ranks, b.ranks)
        assert (a.sample_lo, a.sample_hi, a.tokens, a.ledger_digest) == (b.sample_lo, b.sample_hi, b.tokens,
                                                                         b.ledger_digest)
        outliers += len(a.ranks)
    assert outliers > 0  # the ranks saw different data: extremes were attributed to a rank


def test_an_unknown_reduction_is_refused_naming_the_choices(tmp_path):
    from thermowatch.trainer.config import ConfigError

    with pytest.raises(ConfigError, match=r"reduction='gather' is not one of \('collective', 'driver'\)"):
        tiny_config(tmp_path, reduction="gather")
    assert tiny_config(tmp_path).reduction == "collective"  # the default: one vector per step to the driver
