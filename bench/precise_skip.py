"""Which samples did it (issue 24, item 5): a blunt skip against precise skip on a poisoned run.

A user's loop under thermowatch.watch (the nanoGPT of tests/client/user_loop.py, README.md's
bytes as data, the embedded supervisor on SQLite) trains with a stretch of its samples replaced
by uniformly random bytes (a corrupt shard). The loss spikes, the policy rolls back and skips
its window. Run once with a blunt skip and once with `precise_skip=True`, side by side, per
poisoned stretch; for each: the samples skipped against the samples poisoned, whether every
poisoned one was skipped, the quarantine's verdict, the probes, steps and seconds the search
spent, the steps the loop trained in all, and the final loss.

    python bench/precise_skip.py [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import thermowatch  # noqa: E402
from tests.client.user_loop import DATA, train_step, user_batch, user_model  # noqa: E402
from thermowatch.supervisor.app.config import SupervisorConfig  # noqa: E402
from thermowatch.supervisor.store import quarantine as quarantine_store  # noqa: E402

B, STEPS = 16, 280
# (name, first poisoned step on the first pass, poisoned steps): where the stretch sits in the
# skipped window changes how the halves cut it
CASES = (("2 steps at 150", 150, 2), ("5 steps at 170", 170, 5), ("1 step at 200", 200, 1))
# (a poisoned step before 126 has no checkpoint 100 steps before its onset: the policy pauses)


def run(poison: range, precise: bool, tmp: Path) -> dict:
    def batch(ids: torch.Tensor):
        x, y = user_batch(DATA, ids)
        bad = torch.tensor([int(i) in poison for i in ids])
        if bad.any():
            g = torch.Generator().manual_seed(int(ids[bad][0]))
            noise = torch.randint(0, 256, (int(bad.sum()), x.shape[1] + 1), generator=g)
            x, y = x.clone(), y.clone()
            x[bad], y[bad] = noise[:, :-1], noise[:, 1:]
        return x, y

    torch.manual_seed(0)
    model = user_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    cfg = SupervisorConfig(data_dir=tmp / "sup", db_url=f"sqlite:///{tmp}/db.sqlite", api_token="b" * 40)
    tw = thermowatch.watch(model, opt, run="bench", steps=STEPS, global_batch=B, checkpoint_dir=tmp / "ckpt",
                           checkpoint_every=25, scheduler=sched, supervisor_config=cfg, poll_interval_s=0.05,
                           precise_skip=precise)
    t0, trained = time.perf_counter(), 0
    for step in tw.steps():
        ids = torch.as_tensor(tw.batch_ids(step))
        tw.record(train_step(model, opt, *batch(ids)))
        sched.step()
        trained += 1
    tw.close()
    with tw.run.supervisor.sessions() as s:
        found = quarantine_store.verdicts(s, "bench")
    skipped = {i for v in found for lo, hi in v.ranges for i in range(lo, hi)}
    b = found[0].bisected if found and found[0].bisected else {}
    return {"skipped": len(skipped), "poisoned": len(poison), "all_poison_skipped": set(poison) <= skipped,
            "verdicts": [v.status for v in found], "rollbacks": len(found),
            "suspects": sum(hi - lo for lo, hi in b.get("suspects", [])) or None, "outcome": b.get("outcome"),
            "probes": b.get("probes", 0), "probe_steps": b.get("steps", 0), "search_s": b.get("seconds", 0.0),
            "steps_trained": trained, "wall_s": round(time.perf_counter() - t0, 1), "final_loss": round(tw.final_loss, 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    out = []
    for name, at, n in CASES:
        poison = range((at - 1) * B, (at - 1 + n) * B)  # step s trains ids [(s-1)B, sB) on the first pass
        for precise in (False, True):
            with tempfile.TemporaryDirectory() as d:
                r = run(poison, precise, Path(d))
            out.append({"case": name, "skip": "precise" if precise else "blunt", **r})
            print(json.dumps(out[-1]) if args.json else
                  f"{name:15} {out[-1]['skip']:8} skipped {r['skipped']:5} of poisoned {r['poisoned']:3} "
                  f"(all: {r['all_poison_skipped']}) verdicts {r['verdicts']} probes {r['probes']:2} "
                  f"probe steps {r['probe_steps']:3} search {r['search_s']:5.1f} s, trained {r['steps_trained']} "
                  f"steps in {r['wall_s']} s, final loss {r['final_loss']}", flush=True)


if __name__ == "__main__":
    main()
