"""Watching a run must not make its step wait for the device (issue 10; DESIGN.md, "Nothing
blocks training"). Every Python-level way to pull a device value to the host is wrapped with a
counter (`.item`, `.cpu`, `.tolist`, `float()`, `int()`, `bool()`, `torch.cuda.synchronize`,
`Event.synchronize`) and each call is attributed to the first frame outside torch. Training
runs through the real path: RunController, the worker with its thermometers read a step late
(the GPU default), DeepSpeed ZeRO-2 in bf16, and the HTTP sink with its daemon down (it
spools). Calls made by the thermometers, the worker, the controller or the sink are syncs that
would stall a GPU step: there must be none. (DeepSpeed's own are counted apart: its gradient
clipping and torch's AdamW on CPU keep a few; `check_grad_overflow`, which we turn off for bf16,
adds more.)

On this CPU nothing really waits; the counters still see every call a GPU would pay for. They
are shown to be live by DeepSpeed's own bf16 overflow check (`check_grad_overflow`, off in our
config), whose host syncs they count when it is turned back on."""

from __future__ import annotations

import collections
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.trainer.conftest import tiny_config

os.environ.setdefault("DS_ACCELERATOR", "cpu")

REPO = Path(__file__).resolve().parents[2]
OURS = tuple(str(REPO / d) + os.sep for d in ("monitors", "trainer", "supervisor"))
TORCH = str(Path(torch.__file__).parent) + os.sep
TENSOR_SYNCS = ("item", "cpu", "tolist", "__float__", "__int__", "__bool__", "__index__")


class SyncCounter:
    def __init__(self) -> None:
        self.on = False
        self.calls: collections.Counter[tuple[str, str]] = collections.Counter()  # (what, where)

    def origin(self) -> str:
        f = sys._getframe(2)
        while f is not None and (f.f_code.co_filename.startswith(TORCH) or f.f_code.co_filename == __file__):
            f = f.f_back
        return "?" if f is None else f"{f.f_code.co_filename}:{f.f_lineno}"

    def wrap(self, what: str, fn):
        def counted(*args, **kwargs):
            if self.on:
                self.calls[(what, self.origin())] += 1
            return fn(*args, **kwargs)

        return counted

    def ours(self) -> dict:
        return {k: n for k, n in self.calls.items() if k[1].startswith(OURS)}

    def deepspeed(self) -> int:
        return sum(n for (_, where), n in self.calls.items() if f"{os.sep}deepspeed{os.sep}" in where)


@pytest.fixture
def counter(monkeypatch):
    c = SyncCounter()
    for name in TENSOR_SYNCS:
        monkeypatch.setattr(torch.Tensor, name, c.wrap(name, getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch.cuda, "synchronize", c.wrap("cuda.synchronize", torch.cuda.synchronize))
    monkeypatch.setattr(torch.cuda.Event, "synchronize", c.wrap("Event.synchronize", torch.cuda.Event.synchronize))
    return c


def _train(tmp_path, counter: SyncCounter, **over) -> int:
    """Train 8 steps with the counters on from the first record on; returns the steps counted."""
    from thermowatch.trainer.controller import RunController
    from thermowatch.transport import HttpSink
    from thermowatch.trainer.local import InProcessGang, QueueCommands

    cfg = tiny_config(tmp_path, run_id="syncs", world_size=1, steps=8, zero_stage=2, read_late=True,
                      model={"n_layer": 2, "d_model": 32, "n_head": 2}, flush_every_steps=2,
                      data={"max_bytes": 1 << 18, "seq_len": 32, "global_batch": 4}, **over)
    # Nothing listens on port 9 (discard): the sink's thread spools, as while a daemon is down.
    sink = HttpSink("http://127.0.0.1:9", tmp_path / "spool", retry_interval=60.0)
    counted = []

    def on_record(rec, attempt):
        counter.on = True  # bring-up (model init, DeepSpeed's setup) is not a training step
        counted.append(rec.step)

    try:
        result = RunController(cfg, sink, QueueCommands(), progress=on_record, gang_factory=InProcessGang).run()
    finally:
        counter.on = False
        sink.close()
    assert result.final_step == 8 and counted == list(range(1, 9))
    return len(counted)


@pytest.mark.slow
def test_thermometers_worker_controller_and_sink_cause_no_host_sync(tmp_path, counter):
    _train(tmp_path / "a", counter)
    assert counter.ours() == {}, "host syncs on the training path:\n" + "\n".join(
        f"  {n}x {what} at {where}" for (what, where), n in sorted(counter.ours().items()))
    # DeepSpeed's own remain (gradient clipping tests its norm with bool(); torch's AdamW, which
    # CPU runs use instead of the fused CUDA Adam, reads its step count with .item()).
    without_check = counter.deepspeed()

    # The counters are live: DeepSpeed's bf16 overflow check, turned back on, is seen syncing.
    counter.calls.clear()
    steps = _train(tmp_path / "b", counter, deepspeed_config_override={"bf16": {"check_grad_overflow": True}})
    assert counter.deepspeed() - without_check >= steps - 2, (without_check, counter.calls)
    assert counter.ours() == {}
