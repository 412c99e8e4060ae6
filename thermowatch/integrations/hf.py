"""Thermowatch for the Hugging Face `Trainer` (docs/any-trainer.md, "Hugging Face Trainer"):

    tw = ThermowatchCallback(run="my-run", checkpoint_dir="ckpt", checkpoint_every=50)
    Trainer(model, args, train_dataset=tw.dataset(train_ds), callbacks=[tw]).train()

`args.max_steps` is the run's length; a step is one optimizer step of `per_device_train_batch_size
x gradient_accumulation_steps` samples. The Trainer owns the loop, so the commands are carried out
in `on_step_end` (the scheduler has stepped, the next batch is not yet fetched for the Trainer):

- rollback: the Watch loads model, optimizer, scheduler and RNG; `state.global_step` goes back to
  the checkpoint's step; the Trainer's epoch ends (`should_epoch_stop`), so the batches its
  DataLoader fetched ahead are dropped and the next epoch's iterator serves the checkpoint's
  samples again (core.py explains why we never patch a fetched batch);
- skip: the ledger grows and the epoch ends the same way, so the very next step passes over it;
- set_lr, pause, stop: as in `thermowatch.watch` (stop: `should_training_stop`).

The loss is the model output's `loss` (what `Trainer.compute_loss` trains on), read by a forward
hook on training forwards only, summed over the micro-batches when the Trainer hands the model
`num_items_in_batch` (the loss is then already normalised over the whole step), else averaged.

The Trainer's own logged loss stays a per-step mean across a resume and a rollback (_LoggedLoss).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from thermowatch.integrations.core import Adapter, WatchedDataset, check_fit

log = logging.getLogger(__name__)


class ThermowatchCallback(Adapter, TrainerCallback):
    """`thermowatch.watch` for `transformers.Trainer`: `callbacks=[tw]` and
    `train_dataset=tw.dataset(your_dataset)`. Keywords: those of `thermowatch.watch` except
    model, optimizer, steps, global_batch and scheduler, which come from the Trainer."""

    client = "thermowatch.integrations.hf"

    def __init__(self, *, run: str, **watch_kwargs: Any) -> None:
        Adapter.__init__(self, run=run, **watch_kwargs)
        self._hook = None
        self._mean = False
        self._logged: _LoggedLoss | None = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None,
                       train_dataloader=None, **kwargs):
        check_fit("HF", "TrainingArguments(max_steps=N)", args.max_steps, args.world_size)
        if args.dataloader_persistent_workers:
            raise ValueError("thermowatch: dataloader_persistent_workers=True keeps the sample order of the first "
                             "iterator after a rollback or a skip; leave it False")
        if state.global_step != 0:
            raise ValueError(f"thermowatch: the Trainer resumed at step {state.global_step} from its own checkpoint; "
                             "resume through thermowatch instead (run the script again with the same run and "
                             "checkpoint_dir, without resume_from_checkpoint)")
        dataset = getattr(train_dataloader, "dataset", None)
        if not isinstance(dataset, WatchedDataset) or dataset.adapter is not self:
            raise ValueError("thermowatch: pass Trainer(train_dataset=tw.dataset(your_dataset), callbacks=[tw]) "
                             "with the same tw: the samples each step trains must come from the Watch")
        inner_opt = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it
        inner_sched = getattr(lr_scheduler, "scheduler", lr_scheduler)  # and AcceleratedScheduler
        state.global_step = self.start(model, inner_opt, inner_sched, steps=args.max_steps,
                                       micro_batch=args.train_batch_size, accumulation=args.gradient_accumulation_steps)
        self._hook = model.register_forward_hook(self._on_forward, with_kwargs=True)
        self._logged = _LoggedLoss.of(_calling_trainer(), state.global_step)
        if self._next is None:
            control.should_training_stop = True  # resumed at its end: the dataset serves nothing
        return control

    def _on_forward(self, module, args, kwargs, output) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation, generation
        loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
        if loss is not None:
            self._mean = kwargs.get("num_items_in_batch") is None
            self.add_loss(loss)

    def on_step_begin(self, args, state, control, **kwargs):
        self.begin()

    def on_step_end(self, args, state, control, **kwargs):
        w, logged = self.watch, self._logged
        if logged is not None and state.global_step % w.checkpoint_every == 0:
            logged.step_ended(state.global_step)  # before end(): it saves the checkpoint, and may roll back to it
        probe = w.probing  # a precise skip's probe: re-trained and thrown away, so neither logged nor saved
        b = self.end(mean=self._mean)
        if probe:
            control.should_log = control.should_save = control.should_evaluate = False
        if logged is not None and state.global_step % w.checkpoint_every == 0:
            logged.keep(w.ckpts.steps())
        if b.next_step is None:
            control.should_training_stop = True
            return control
        if b.rolled_back:
            state.global_step = b.step
            control.should_training_stop = False  # it may have been the last step before the rollback
            if logged is not None:
                logged.rolled_back(b.step)
                control.should_log = False  # the next log comes at the usual interval on the new path
        if b.restart:
            control.should_epoch_stop = True  # the next epoch's iterator starts from the Watch's cursor
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.close()


def _calling_trainer() -> Any:
    """The Trainer whose loop calls us: HF hands a callback its model, optimizer and scheduler but
    never the Trainer, so it is found on the stack (Trainer -> CallbackHandler -> this callback)."""
    from transformers import Trainer

    f = sys._getframe(1)
    try:
        while f is not None:
            if isinstance(f.f_locals.get("self"), Trainer):
                return f.f_locals["self"]
            f = f.f_back
        return None
    finally:
        del f  # a frame held here would keep the whole stack alive


class _LoggedLoss:
    """The Trainer's running loss, kept a per-step mean across a resume and a rollback.

    HF's Trainer sums each step's loss into `_tr_loss` (a device tensor) and logs it divided by the
    steps since `_globalstep_last_logged`; `_total_loss_scalar` gathers what was logged, and the final
    `train_loss` divides it by the steps since `_initial_global_step`. All three assume
    `state.global_step` only grows. Rewound by a rollback from 71 to 40 with the last log at 70, the
    Trainer logged nothing until it passed 70 again, then the sum of every step since the log divided
    by the few after 70 (issue 35: 'loss': 481.7 after 143 silent steps); resumed at step 50, its
    first log divided 10 steps' sum by 60. So at a rollback to checkpoint c they are set as when step
    c ended, and the next log is the mean of the re-trained steps since c, at the usual interval."""

    def __init__(self, trainer: Any, step: int) -> None:
        self.trainer = trainer
        # step -> (logged sum, unlogged sum) as the step ended: the checkpoint steps still on disk
        self.at: dict[int, tuple[float, torch.Tensor | None]] = {}
        self.resumed(step)

    @classmethod
    def of(cls, trainer: Any, step: int) -> "_LoggedLoss | None":
        if trainer is None or not all(hasattr(trainer, a) for a in
                                      ("_tr_loss", "_total_loss_scalar", "_globalstep_last_logged",
                                       "_initial_global_step")):
            # transformers 4 keeps the running loss in a local of its loop, out of a callback's reach
            log.warning("thermowatch: this Trainer keeps its running loss where the callback cannot reset it "
                        "(transformers < 5?); after a rollback its first logged loss includes the abandoned "
                        "steps. thermowatch's own records are per step either way")
            return None
        return cls(trainer, step)

    def resumed(self, step: int) -> None:
        t = self.trainer
        t._initial_global_step = t._globalstep_last_logged = step  # read before on_train_begin set the step
        self.at = {step: (0.0, None)}

    def step_ended(self, step: int) -> None:
        t = self.trainer
        self.at[step] = (t._total_loss_scalar, t._tr_loss.clone())  # a device copy: no sync per checkpoint

    def keep(self, steps: list[int]) -> None:
        kept = set(steps)
        self.at = {s: v for s, v in self.at.items() if s in kept or s == min(self.at)}

    def rolled_back(self, step: int) -> None:
        t = self.trainer
        if step in self.at:
            logged, pending = self.at[step]
            t._total_loss_scalar = logged + (0.0 if pending is None else float(pending.item()))
        else:  # a checkpoint from before this train() call: count train_loss from it
            t._total_loss_scalar, t._initial_global_step = 0.0, step
        t._tr_loss.zero_()
        t._globalstep_last_logged = step
        self.at = {s: v for s, v in self.at.items() if s <= step}
