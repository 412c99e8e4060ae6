"""What both adapters rest on: the watched dataset's order through real DataLoader workers, and
an `import thermowatch` that stays free of the trainers it adapts to."""

from __future__ import annotations

import subprocess
import sys

import torch

from tests.client.adapter_run import expected_ids
from thermowatch.integrations.core import Plan, WatchedDataset
from thermowatch.monitors.ledger import SkipLedger


def test_workers_serve_the_plan_in_order_with_the_ledger_applied():
    """Two forked workers hand out micro-batches round-robin; together they must serve exactly
    the plan's steps, in order, skipped ids left out (GLOBAL = 4 ids a step, 2 micro-batches)."""
    ds = WatchedDataset(list(range(1000)), adapter=None, batch_size=2)
    ds._plan = Plan(cursor=10, skip_ranges=((13, 17), (30, 31)), global_batch=4, micro_batch=2, steps=9)
    got = torch.cat(list(torch.utils.data.DataLoader(ds, batch_size=2, num_workers=2))).tolist()
    want = [i for step in expected_ids(10, SkipLedger([(13, 17), (30, 31)]), 9) for i in step]
    assert got == want and len(got) == 36


def test_a_shuffled_pass_is_one_fixed_permutation_per_pass():
    ds = WatchedDataset(list(range(50)), adapter=None, shuffle_seed=3)
    first, second = [ds._index(i) for i in range(50)], [ds._index(i) for i in range(50, 100)]
    assert sorted(first) == sorted(second) == list(range(50)) and first != second != list(range(50))
    assert [ds._index(i) for i in range(50)] == first  # a re-trained step sees the same samples


def test_import_thermowatch_pulls_in_no_trainer():
    code = ("import sys, thermowatch, thermowatch.integrations; thermowatch.watch; thermowatch.Run\n"
            "bad = sorted(m for m in ('transformers', 'lightning', 'accelerate') if m in sys.modules)\n"
            "assert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
