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
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from thermowatch.integrations.core import Adapter, WatchedDataset, check_fit


class ThermowatchCallback(Adapter, TrainerCallback):
    """`thermowatch.watch` for `transformers.Trainer`: `callbacks=[tw]` and
    `train_dataset=tw.dataset(your_dataset)`. Keywords: those of `thermowatch.watch` except
    model, optimizer, steps, global_batch and scheduler, which come from the Trainer."""

    client = "thermowatch.integrations.hf"

    def __init__(self, *, run: str, **watch_kwargs: Any) -> None:
        Adapter.__init__(self, run=run, **watch_kwargs)
        self._hook = None
        self._mean = False

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
        b = self.end(mean=self._mean)
        if b.next_step is None:
            control.should_training_stop = True
            return control
        if b.rolled_back:
            state.global_step = b.step
            control.should_training_stop = False  # it may have been the last step before the rollback
        if b.restart:
            control.should_epoch_stop = True  # the next epoch's iterator starts from the Watch's cursor
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.close()
