"""The Lightning adapter (issue 22, item 6): a small LightningModule (a causal transformer layer
through nn.MultiheadAttention, dropout on) trained by the real `lightning.pytorch.Trainer` with
gradient accumulation 2 and a step-interval warmup schedule; an operator's skip and rollback
carried out between two steps, on both databases. What each step trained is read from the batch
Lightning handed to training_step, so a stale batch its fetcher held ahead would show."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from tests.client.adapter_checks import check_rolled_back_run
from tests.client.adapter_run import (
    ACCUM, EVERY, GLOBAL, MICRO, POISON, PRECISE_STEPS, SEQ, STEPS, VOCAB, Operator, Steps, Trained,
    check_precise_skip, ids_of, samples,
)
from thermowatch.integrations.lightning import ThermowatchCallback
from thermowatch.supervisor.store.views import run_status
from thermowatch.supervisor.app.config import SupervisorConfig


class TinyLM(pl.LightningModule):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=2 * d, dropout=0.1, batch_first=True)
        self.head = nn.Linear(d, VOCAB)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ - 1), persistent=False)

    def training_step(self, batch, batch_idx):
        x, y = batch[:, :-1], batch[:, 1:]
        logits = self.head(self.layer(self.emb(x), src_mask=self.mask, is_causal=True))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4) * (1 - s / 40))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    """Listed before the adapter: it sees each step end before the adapter moves on."""

    def __init__(self, tw: ThermowatchCallback, trained: Trained) -> None:
        self.tw, self.trained, self.op, self.seen_step = tw, trained, None, 0
        self.lr: dict[tuple[int, int], float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.trained.micro_batch(batch, float(outputs["loss"]))
        if trainer.global_step == self.seen_step:
            return
        w = self.tw.watch
        self.seen_step = step = trainer.global_step
        assert step == w._ids_step  # Lightning and the Watch count the same steps
        self.trained.step_end(w.attempt, step)
        self.lr[w.attempt, step] = trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0]
        if self.op is None:
            self.op = Operator(w.run.supervisor, w.run.run_id)
        self.op.at_step_end(w, w.attempt, step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen_step = trainer.global_step  # after a rollback, the adapter set it back


def _trainer(callbacks, max_steps: int = STEPS, **kw) -> pl.Trainer:
    return pl.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks, **kw)


def test_lightning_carries_out_a_skip_and_a_rollback(db, tmp_path):
    torch.manual_seed(0)
    model = TinyLM()
    tw = ThermowatchCallback(run="pl", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY, keep_checkpoints=10,
                             poll_interval_s=0.02,
                             supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
    trained = Trained()
    rec = Recorder(tw, trained)
    trainer = _trainer([rec, tw], accumulate_grad_batches=ACCUM)
    trainer.fit(model, tw.dataloader(list(samples()), batch_size=MICRO))

    assert trainer.global_step == STEPS
    check_rolled_back_run(db, "pl", tw, rec, trained, model, tmp_path / "ckpt")


def test_a_stop_ends_the_fit_and_the_run_reads_stopped(db, tmp_path):
    torch.manual_seed(0)
    tw = ThermowatchCallback(run="pl-stop", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY,
                             poll_interval_s=0.02,
                             supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))

    class StopAt4(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 4 and "stop" not in getattr(self, "op", Operator(None, "")).ids:
                self.op = Operator(tw.watch.run.supervisor, "pl-stop")
                self.op._post(tw.watch, "stop", {})

    trainer = _trainer([StopAt4(), tw])
    trainer.fit(TinyLM(), tw.dataloader(list(samples()), batch_size=MICRO))
    with db.sessions() as s:
        st = run_status(s, "pl-stop", stall_after_s=600)
    assert trainer.global_step == 4 and tw.step == 4
    assert (st["state"], st["finish_reason"], st["final_step"]) == ("finished", "stopped", 4), st
    from thermowatch.supervisor.store import thermometers

    with db.sessions() as s:  # Lightning steps with a closure: the grads exist only after step() ran it
        steps, norms = thermometers.history(s, "pl-stop", "grad_norm")
    assert steps.tolist() == [1, 2, 3, 4] and all(0 < n < 1e3 for n in norms.tolist()), norms



class LoggingLM(TinyLM):
    """TinyLM that logs its loss the usual way: per step and as the epoch's mean."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss


def test_lightnings_logged_loss_after_a_rollback_is_each_steps_own(db, tmp_path):
    """Issue 35 (HF's Trainer logged the sum of the re-trained steps after a rollback): Lightning's
    loggers log each step's own loss under its own step, the abandoned ones included, then the
    re-trained ones at the usual interval; each epoch's figure is a mean, never a sum. The loggers'
    step is 0-based (Lightning's `_batches_that_stepped`): step s logs as s - 1."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    torch.manual_seed(0)
    tw = ThermowatchCallback(run="pl-logs", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY,
                             keep_checkpoints=10, poll_interval_s=0.02,
                             supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
    trained = Trained()
    rec = Recorder(tw, trained)
    # no accumulation (one batch of GLOBAL per step): the loss logged for a step is its one batch's, as the
    # Recorder sees it
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path / "logs"),
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[rec, tw])
    trainer.fit(LoggingLM(), tw.dataloader(list(samples()), batch_size=GLOBAL))
    assert tw.watch.attempt == 2

    with open(tmp_path / "logs" / "lightning_logs" / "version_0" / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    logged = [(int(r["step"]), float(r["train_loss_step"])) for r in rows if r["train_loss_step"]]
    # the first pass's 13 steps (the rollback came after 13), then 11-15 re-trained from checkpoint 10
    expected = [(s - 1, trained.loss[1, s]) for s in range(1, 14)] + [(s - 1, trained.loss[2, s]) for s in range(11, 16)]
    assert [s for s, _ in logged] == [s for s, _ in expected], logged
    assert [round(v, 5) for _, v in logged] == [round(v, 5) for _, v in expected]
    epochs = [float(r["train_loss_epoch"]) for r in rows if r["train_loss_epoch"]]
    per_step = list(trained.loss.values())
    assert len(epochs) == 3 and all(min(per_step) <= v <= max(per_step) for v in epochs), (epochs, per_step)


class CorruptLM(TinyLM):
    """Sample 50 is a corrupt record: its loss is NaN whenever it is trained."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if POISON in ids_of(batch) else loss


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_precise_skip_probes_run_through_lightnings_own_loop(db, tmp_path):
    """Issue 39 item 3: precise skip under Lightning. The supervisor rolls back on the NaN and asks
    to skip the window; each probe re-trains from the checkpoint, its batches served by a new
    iterator of Lightning's DataLoader through the probe's own ledger, and the search narrows the
    skip to the corrupt sample's step."""
    torch.manual_seed(0)
    tw = ThermowatchCallback(run="pl-precise", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY,
                             poll_interval_s=0.02, precise_skip=True,
                             supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
    trained, steps = Trained(), Steps()

    class Seen(pl.Callback):
        seen = 0

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.seen = trainer.global_step

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            trained.micro_batch(batch, 0.0)
            if trainer.global_step == self.seen:
                return  # accumulating
            assert trainer.global_step == tw.watch._ids_step  # Lightning's count follows every probe
            steps.step_end(tw.watch, trained, trainer.global_step)
            trained.step_end(tw.watch.attempt, trainer.global_step)

    trainer = _trainer([Seen(), tw], accumulate_grad_batches=ACCUM, max_steps=PRECISE_STEPS)
    trainer.fit(CorruptLM(), tw.dataloader(list(samples()), batch_size=MICRO))
    assert trainer.global_step == PRECISE_STEPS
    check_precise_skip(db, "pl-precise", steps, PRECISE_STEPS)
