"""Skips follow the data across passes (issue 35: under DDP a second pass over the data brought the
same poisoned windows back, since the ledger held absolute ids): a loop that gives its
`dataset_size` and indexes `data[ids % dataset_size]` never trains a skipped sample again, in any
pass, and the supervisor takes every step it records (its claims bound knows a pass re-skips)."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tests.client.user_loop import DATA, calm, train_step, user_batch
from thermowatch.integrations.core import Plan, WatchedDataset
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import steps as steps_store

N, B, STEPS = 40, 8, 18  # five steps a pass: three passes and a half
BAD = (10, 14)  # data indices 10-13, skipped during the first pass


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_a_skipped_sample_is_never_trained_again_in_any_pass(db, tmp_path):
    tw, model, opt = calm(db, tmp_path, "passes", STEPS, global_batch=B, dataset_size=N)
    sup = tw.run.supervisor
    trained: dict[int, list[int]] = {}
    for step in tw.steps():
        ids = tw.batch_ids(step)
        trained[step] = ids.tolist()
        tw.record(train_step(model, opt, *user_batch(DATA, torch.as_tensor(ids % N))))
        if step == 1:
            tw.run.flush()
            cmd = sup.executor.submit("passes", "skip", {"skip_ranges": [list(BAD)]}, "ana", "test")
            deadline = time.monotonic() + 20
            while not any(c.id == cmd for c in list(tw.run._inbox)):
                assert time.monotonic() < deadline, "the skip never reached the client"
                time.sleep(0.01)
    tw.close()
    assert max(trained) == STEPS
    after = [i for step in range(2, STEPS + 1) for i in trained[step]]
    data = np.asarray(after) % N
    assert not np.isin(data, np.arange(*BAD)).any(), "a skipped sample came back in a later pass"
    # every other sample is still trained, in every pass the run reached
    passes = np.asarray(after) // N
    for p in range(1, int(passes.max())):
        assert set(data[passes == p]) == set(range(N)) - set(range(*BAD)), p
    with sup.sessions() as s:
        last = steps_store.last_step(s, "passes", tw.attempt)
        skip = [a for a in actions_store.actions(s, "passes") if a.kind == "skip"]
    assert last == STEPS, "the supervisor refused the claims of a later pass"
    assert skip and skip[0].state == "done"


def test_without_dataset_size_a_later_pass_brings_the_skipped_data_back():
    """The ledger as it was (absolute ids): the same data index returns in the next pass."""
    led = SkipLedger([BAD])
    ids = led.take(0, 3 * N)
    assert np.isin(ids % N, np.arange(*BAD)).sum() == 2 * (BAD[1] - BAD[0])
    follows = SkipLedger([BAD], period=N).take(0, 3 * N)
    assert not np.isin(follows % N, np.arange(*BAD)).any()


def test_a_shuffled_watched_dataset_skips_the_data_wherever_a_pass_puts_it():
    """An adapter's data served through real DataLoader workers, shuffled each pass, the loader's
    length as the period: the data skipped in the first pass never shows again."""
    ds = WatchedDataset(list(range(N)), adapter=None, shuffle_seed=5, batch_size=2)
    first = [ds._index(i) for i in range(N)]
    bad_data = sorted(first[12:16])  # what ids 12-15 served in the first pass
    ds._plan = Plan(cursor=16, skip_ranges=((12, 16),), global_batch=4, micro_batch=2, steps=25, dataset_size=N)
    got = torch.cat(list(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2))).tolist()
    assert len(got) == 100 and not set(got) & set(bad_data)
    assert set(got) == set(range(N)) - set(bad_data)


def test_the_quarantine_names_data_indices_across_a_pass_end():
    from thermowatch.supervisor.store.quarantine import data_indices

    assert data_indices([(38, 43), (85, 87)], N) == [(0, 3), (5, 7), (38, 40)]
    assert data_indices([(3, 3 + N)], N) == [(0, N)]
