"""A user's DDP loop under `torchrun --nproc_per_node 2` (gloo, CPU), written as
docs/any-trainer.md shows it; tests/client/test_torchrun.py runs it. Rank 0 also plays the
operator: once the loop has passed step 15 it asks (through its embedded supervisor's executor,
as `thermowatch rollback` would) to roll back to step 10 skipping samples 96-119, and once the
re-trained attempt passes step 25, to stop. Each rank writes what it trained to <out>/rank<r>.json.

    torchrun --nproc_per_node 2 tests/client/torchrun_loop.py <db_url> <data_dir> <out> ddp|fsdp|precise

`precise` (FSDP2, issue 39 item 3): no operator; sample 50 is a corrupt record whose loss is NaN
on the rank that trains it (its NaN gradients reach every rank's shards), the supervisor rolls
back on it by itself, and precise skip's probes run on both ranks together until they find it. `hardware` (DDP, replay triage on): rank 1's gradient
is corrupted once, at step 12, after DDP's all-reduce (tests/client/faults.py's stuck exponent), so
rank 1 alone breaks first.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import thermowatch
from tests.client.faults import Faults
from thermowatch.precise_skip import PreciseSkip
from tests.client.user_loop import DATA, train_step, user_batch, user_model
from thermowatch.supervisor.app.config import SupervisorConfig

db_url, data_dir, out, wrap = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = user_model()
POISON = 50
precise = wrap in ("precise", "hardware")
faults = Faults(grad_step=12 if wrap == "hardware" and rank == 1 else None)
if wrap in ("fsdp", "precise"):  # FSDP2: each block its own unit, then the root
    from torch.distributed.fsdp import fully_shard

    for block in model.transformer.h:
        fully_shard(block)
    model = fully_shard(model)
else:
    model = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))

tw = thermowatch.watch(model, opt, run=wrap, steps=40 if precise else 400, global_batch=8,
                       checkpoint_dir=data_dir / "ckpt",
                       checkpoint_every=5, scheduler=sched, poll_interval_s=0.05,
                       precise_skip=PreciseSkip(triage=True) if precise else False,
                       supervisor_config=SupervisorConfig(data_dir=data_dir / "sup", db_url=db_url))
trained, asked = [], {}
for step in tw.steps():
    ids = tw.batch_ids(step)
    if precise:  # a corrupt record: NaN on the rank that trains it (DDP carries it into both ranks' grads)
        _, loss = model(*user_batch(DATA, ids))
        loss = loss * float("nan") if wrap == "precise" and POISON in ids else loss
        opt.zero_grad()
        loss.backward()
        faults.after_backward(step, getattr(model, "module", model))
        opt.step()
    else:
        loss = train_step(model, opt, *user_batch(DATA, ids))
    sched.step()
    trained.append({"step": step, "attempt": tw.attempt, "probing": tw.probing, "ids": ids.tolist(),
                    "loss": float(loss)})
    tw.record(loss)
    if precise:
        continue
    if rank == 0 and step >= 15 and "rollback" not in asked:
        # the supervisor refuses to skip samples it has not seen trained: hand it the steps first
        # (the client batches its records for up to half a second)
        tw.run.flush()
        asked["rollback"] = tw.run.supervisor.executor.submit(
            wrap, "rollback", {"to_step": 10, "skip_ranges": [[96, 120]]}, "ana", "spike")
    if rank == 0 and step >= 25 and tw.attempt == 2 and "stop" not in asked:
        asked["stop"] = tw.run.supervisor.executor.submit(wrap, "stop", {}, "ana", "enough")
    time.sleep(0.01)  # a real step takes longer than this toy's: give the operator's commands time
tw.close()
digest = float(sum((p.full_tensor() if hasattr(p, "full_tensor") else p).double().sum() for p in model.parameters()))
(out / f"rank{rank}.json").write_text(json.dumps({"trained": trained, "params": digest, "step": tw.step,
                                                   "attempt": tw.attempt, "asked": asked}))
dist.destroy_process_group()
