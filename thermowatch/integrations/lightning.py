"""Thermowatch for Lightning (docs/any-trainer.md, "Lightning"):

    tw = ThermowatchCallback(run="my-run", checkpoint_dir="ckpt", checkpoint_every=50)
    Trainer(max_steps=N, callbacks=[tw]).fit(model, tw.dataloader(train_ds, batch_size=32))

`tw.dataloader(...)` takes `torch.utils.data.DataLoader`'s keywords and serves the samples the
Watch says each step trains (core.WatchedDataset). A step is one optimizer step, so
`batch_size x accumulate_grad_batches` samples. Commands are carried out in `on_train_batch_end`
of the micro-batch whose optimizer step completed (the step-interval schedulers have stepped):

- rollback: the Watch loads the LightningModule, optimizer, scheduler and RNG; the loop's
  optimizer-step counter (`trainer.global_step`) goes back to the checkpoint's step; the epoch
  ends (`batch_progress.is_last_batch`), so the batch Lightning's fetcher holds ahead is dropped
  and the next epoch's iterator serves the checkpoint's samples again. The loggers' step goes back
  when the next step starts, so the abandoned step's metrics and the epoch's are logged under the
  step that made them, and the re-trained steps under theirs (logged values are per step or an
  epoch's mean: Lightning keeps no running sum across steps that a rollback could inflate);
- skip: the ledger grows and the epoch ends the same way;
- set_lr, pause, stop: as in `thermowatch.watch` (stop: `trainer.should_stop`).

The loss is what `training_step` returned (`{"loss": ...}` or a tensor), summed over the micro-
batches under automatic optimization (Lightning has divided each by `accumulate_grad_batches`),
averaged under manual optimization.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch import Callback

from thermowatch.integrations.core import Adapter, WatchedDataset, check_fit


class ThermowatchCallback(Adapter, Callback):
    """`thermowatch.watch` for `lightning.pytorch.Trainer`: `callbacks=[tw]` and
    `fit(model, tw.dataloader(your_dataset, batch_size=...))`. Keywords: those of
    `thermowatch.watch` except model, optimizer, steps, global_batch and scheduler, which come
    from the Trainer."""

    client = "thermowatch.integrations.lightning"

    def __init__(self, *, run: str, **watch_kwargs: Any) -> None:
        Adapter.__init__(self, run=run, **watch_kwargs)
        self._in_step = False
        self._global_step = 0
        self._loggers_step: int | None = None  # after a rollback: the loggers' step, set when the next step starts

    def dataloader(self, data: Any, *, batch_size: int, shuffle_seed: int | None = None,
                   **loader_kwargs: Any) -> torch.utils.data.DataLoader:
        """A DataLoader over `data` in the Watch's order; `loader_kwargs` go to DataLoader (not
        `shuffle`, `sampler`: the order is the Watch's; use `shuffle_seed` for a shuffled pass)."""
        for bad in ("shuffle", "sampler", "batch_sampler", "drop_last"):
            if loader_kwargs.get(bad):
                raise ValueError(f"thermowatch: {bad}= would reorder or drop the Watch's samples; "
                                 "pass shuffle_seed= to shuffle each pass over the data")
        if loader_kwargs.get("persistent_workers"):
            raise ValueError("thermowatch: persistent_workers=True keeps the sample order of the first iterator "
                             "after a rollback or a skip; leave it False")
        return torch.utils.data.DataLoader(self.dataset(data, shuffle_seed=shuffle_seed, batch_size=batch_size),
                                           batch_size=batch_size, **loader_kwargs)

    def on_fit_start(self, trainer, pl_module) -> None:
        # Before the fit loop makes its first data iterator (and prefetches from it): the Watch
        # must have resumed by then, so that iterator starts at the resumed cursor.
        check_fit("Lightning", "Trainer(max_steps=N)", trainer.max_steps, trainer.world_size)
        if len(trainer.optimizers) != 1:
            raise ValueError(f"thermowatch: {len(trainer.optimizers)} optimizers; the adapter protects one")
        sizes = {d.batch_size for d in self.datasets}
        if len(sizes) != 1 or None in sizes:
            raise ValueError("thermowatch: fit the model on tw.dataloader(your_dataset, batch_size=...) made by this "
                             "callback (the samples each step trains must come from the Watch)")
        configs = trainer.lr_scheduler_configs
        if len(configs) > 1 or any(c.interval != "step" for c in configs):
            raise ValueError("thermowatch: one LR scheduler with interval='step' at most: each rollback or skip ends "
                             "an epoch, which would step an epoch-interval scheduler")
        step = self.start(pl_module, trainer.optimizers[0], configs[0].scheduler if configs else None,
                          steps=trainer.max_steps, micro_batch=sizes.pop(), accumulation=trainer.accumulate_grad_batches)
        _set_global_step(trainer, step)
        _set_loggers_step(trainer, step)
        self._global_step = step
        if self._next is None:
            trainer.should_stop = True  # resumed at its end: the dataset serves nothing

    def on_train_start(self, trainer, pl_module) -> None:
        dataset = getattr(trainer.train_dataloader, "dataset", None)
        if not isinstance(dataset, WatchedDataset) or dataset.adapter is not self:
            raise ValueError("thermowatch: fit the model on tw.dataloader(your_dataset, batch_size=...) made by this "
                             "callback (the samples each step trains must come from the Watch)")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._in_step:  # the step's first micro-batch
            self._in_step = True
            if self._loggers_step is not None:
                _set_loggers_step(trainer, self._loggers_step)
                self._loggers_step = None
            self.begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        self.add_loss(loss)
        if trainer.global_step == self._global_step:
            return  # accumulating: the optimizer has not stepped yet
        self._in_step = False
        b = self.end(mean=not pl_module.automatic_optimization)
        if b.next_step is None:
            trainer.should_stop = True
        elif b.rolled_back:
            _set_global_step(trainer, b.step)
            # Not the loggers' step yet: Lightning logs this (abandoned) step's metrics after this hook,
            # and the epoch's at its end, under it; set back at once, they read as the checkpoint's step's.
            self._loggers_step = b.step
        if b.restart:
            # Ends this epoch; the next one calls iter() on the data again, from the Watch's cursor.
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch = True
        self._global_step = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        self.close()

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self.close(finished=False)  # a crash is not a finish


def _set_global_step(trainer, step: int) -> None:
    """`trainer.global_step`: the loop's count of completed optimizer steps."""
    loop = trainer.fit_loop.epoch_loop
    if trainer.lightning_module.automatic_optimization:
        total = loop.automatic_optimization.optim_progress.optimizer.step.total
    else:
        total = loop.manual_optimization.optim_step_progress.total
    total.ready = total.completed = step


def _set_loggers_step(trainer, step: int) -> None:
    """The step the loggers are given (`_batches_that_stepped`): the steps completed, before a step's
    own increment, which Lightning makes after logging it."""
    trainer.fit_loop.epoch_loop._batches_that_stepped = step
