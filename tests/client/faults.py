"""A fault injector for tests (issue 39), on CPU: the three causes replay triage tells apart, each
made real in a user's own loop (tests/client/user_loop.py):

- hardware: one gradient element's exponent bits stuck at one, at one step, once (a flipped
  exponent reads as NaN: Adam carries it into the weights and the next loss is NaN). A replay
  from a checkpoint does not repeat it, as a transient fault would not;
- data: a sample range whose data is uniformly random bytes, the same bytes on every pass
  (tests/client/test_quarantine.py's corrupt shard);
- optimizer: the schedule's base LR raised `lr_factor`-fold when the loop reaches a step, on
  every pass (bench/any_loop_study.py's wrong config: a rollback restores the scheduler, and the
  loop raises it again when it gets there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tests.client.user_loop import DATA, user_batch

_EXPONENT = 0x7F800000  # float32's exponent bits


@dataclass
class Faults:
    grad_step: int | None = None  # hardware: the step whose gradient is corrupted, once
    poison: range = range(0)  # data: these sample ids are random bytes
    lr_step: int | None = None  # optimizer: from this step the schedule's base LR is lr_factor x
    lr_factor: float = 30.0
    fired: list[int] = field(default_factory=list)  # the steps a one-time fault fired at

    def batch(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = user_batch(DATA, ids)
        bad = torch.tensor([int(i) in self.poison for i in ids])
        if bad.any():  # a corrupt shard: uniformly random bytes, the same for the same id
            g = torch.Generator().manual_seed(int(ids[bad][0]))
            noise = torch.randint(0, 256, (int(bad.sum()), x.shape[1] + 1), generator=g)
            x, y = x.clone(), y.clone()
            x[bad], y[bad] = noise[:, :-1], noise[:, 1:]
        return x, y

    def before_step(self, step: int, opt: torch.optim.Optimizer, sched) -> None:
        """Call before the step's forward: raises the LR at `lr_step` (idempotent)."""
        if self.lr_step is not None and step == self.lr_step:
            base = [g["initial_lr"] * self.lr_factor for g in opt.param_groups]
            sched.base_lrs = base
            f = sched.lr_lambdas[0](sched.last_epoch)
            for g, b in zip(opt.param_groups, base):
                g["lr"] = b * f

    def after_backward(self, step: int, model: torch.nn.Module) -> None:
        """Call between backward and optimizer.step(): the one-time gradient fault."""
        if self.grad_step is None or step != self.grad_step or self.fired:
            return
        p = next(q for q in model.parameters() if q.grad is not None)
        bits = p.grad.view(-1)[:1].view(torch.int32)
        bits |= _EXPONENT  # the exponent's bits stuck at one: NaN (or Inf), as a flipped exponent reads
        self.fired.append(step)
