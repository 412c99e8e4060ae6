"""The Hugging Face Trainer adapter (issue 22, item 6): a tiny random GPT-2 trained by the real
`transformers.Trainer` (gradient accumulation 2, dropout on), an operator's skip and rollback
carried out between two steps, on both databases. What each step trained is read at the model's
input, so a stale batch the DataLoader fetched ahead would show."""

from __future__ import annotations

import pytest
import torch

from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

from tests.client.adapter_checks import check_rolled_back_run
from tests.client.adapter_run import (
    ACCUM, EVERY, MICRO, POISON, PRECISE_STEPS, SEQ, STEPS, VOCAB, Operator, Steps, Trained, check_precise_skip,
    ids_of, samples,
)
from thermowatch.integrations.hf import ThermowatchCallback
from thermowatch.supervisor.store.views import run_status
from thermowatch.supervisor.app.config import SupervisorConfig


class Recorder(TrainerCallback):
    """Listed before the adapter: it sees each step end before the adapter moves on."""

    def __init__(self, tw: ThermowatchCallback, trained: Trained, op: Operator | None = None) -> None:
        self.tw, self.trained, self.op = tw, trained, op
        self.lr: dict[tuple[int, int], float] = {}  # the schedule's LR after each step

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        def seen(mod, a, kw, out):
            if mod.training:
                self.trained.micro_batch(kw["input_ids"], float(out.loss.detach()))
        model.register_forward_hook(seen, with_kwargs=True)

    def on_step_end(self, args, state, control, **kwargs):
        w = self.tw.watch
        self.trained.step_end(w.attempt, state.global_step)
        self.lr[w.attempt, state.global_step] = kwargs["lr_scheduler"].get_last_lr()[0]
        assert state.global_step == w._ids_step  # the Trainer and the Watch count the same steps
        if self.op is None:
            self.op = Operator(w.run.supervisor, w.run.run_id)
        self.op.at_step_end(w, w.attempt, state.global_step)


def test_the_trainer_carries_out_a_skip_and_a_rollback(db, tmp_path):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2, attn_implementation="sdpa")
    model = GPT2LMHeadModel(cfg)
    data = [{"input_ids": x, "labels": x} for x in samples()]
    tw = ThermowatchCallback(run="hf", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY, keep_checkpoints=10,
                             poll_interval_s=0.02,
                             supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
    trained = Trained()
    rec = Recorder(tw, trained)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUM, learning_rate=3e-3, lr_scheduler_type="linear",
                             warmup_steps=3, report_to="none", save_strategy="no", logging_steps=5,
                             disable_tqdm=True, use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=tw.dataset(data), callbacks=[rec, tw])
    out = trainer.train()

    assert out.global_step == STEPS
    check_rolled_back_run(db, "hf", tw, rec, trained, model, tmp_path / "ckpt")


def test_a_stop_ends_the_trainer_and_the_run_reads_stopped(db, tmp_path):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2))
    data = [{"input_ids": x, "labels": x} for x in samples()]
    tw = ThermowatchCallback(run="hf-stop", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY,
                             poll_interval_s=0.02,
                             supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))

    class StopAt4(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 4:
                op = Operator(tw.watch.run.supervisor, "hf-stop")
                op._post(tw.watch, "stop", {})

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=MICRO,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
    out = Trainer(model=model, args=args, train_dataset=tw.dataset(data), callbacks=[StopAt4(), tw]).train()
    with db.sessions() as s:
        st = run_status(s, "hf-stop", stall_after_s=600)
    assert out.global_step == 4 and tw.step == 4
    assert (st["state"], st["finish_reason"], st["final_step"]) == ("finished", "stopped", 4), st


def test_the_trainers_logged_loss_after_a_rollback_is_a_per_step_mean(db, tmp_path):
    """Issue 35: rewinding `state.global_step` left the Trainer's running loss and its last-logged
    step where the abandoned path had them, so it went silent over the re-trained steps and then
    logged their sum divided by a few ('loss': 481.7). Logged every 2 steps, rolled back after step
    13 to checkpoint 10 (the last log at 12): the re-trained path logs at 12 and 14 as usual, each
    the mean of the steps since the last log on the path the model kept."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2))
    data = [{"input_ids": x, "labels": x} for x in samples()]
    tw = ThermowatchCallback(run="hf-logs", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY,
                             keep_checkpoints=10, poll_interval_s=0.02,
                             supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
    trained = Trained()
    rec = Recorder(tw, trained)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUM, learning_rate=3e-3, report_to="none",
                             save_strategy="no", logging_steps=2, disable_tqdm=True, use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=tw.dataset(data), callbacks=[rec, tw])
    out = trainer.train()
    assert tw.watch.attempt == 2

    logged = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    # the first pass logs at 2..12; the rollback after 13 goes back to 10; the re-trained path at 12 and 14
    assert [s for s, _ in logged] == [2, 4, 6, 8, 10, 12, 12, 14], logged
    per_step = list(trained.loss.values())
    assert all(loss <= 2 * max(per_step) for _, loss in logged), (logged, max(per_step))
    # each is the mean of the steps since the last log on the kept path: after the rollback, 11-12
    # and 13-14 of attempt 2 (what the model trained at its input, summed over the micro-batches)
    path = {**{s: trained.loss[1, s] for s in range(1, 11)}, **{s: trained.loss[2, s] for s in range(11, 16)}}
    expected = [sum(path[s] for s in (k - 1, k)) / 2 for k in (2, 4, 6, 8, 10, 12, 12, 14)]
    expected[5] = (trained.loss[1, 11] + trained.loss[1, 12]) / 2  # the first pass's log at 12
    assert [round(v, 4) for _, v in logged] == [round(v, 4) for v in expected]
    # train_loss: the mean over the 15 steps of the kept path, not over every step trained
    assert abs(out.training_loss - sum(path.values()) / STEPS) < 1e-4, (out.training_loss, path)


def test_the_trainers_logged_loss_after_a_resume_is_a_per_step_mean(db, tmp_path):
    """A relaunch resumes at the newest checkpoint (5 here, the first launch stopped at 7): the
    Trainer had counted its logging interval from step 0, so its first log divided one step's loss by 6."""
    def launch(run_callbacks, trained):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2))
        tw = ThermowatchCallback(run="hf-resume", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY,
                                 poll_interval_s=0.02,
                                 supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=MICRO,
                                 report_to="none", save_strategy="no", logging_steps=2, disable_tqdm=True,
                                 use_cpu=True, seed=0)
        data = [{"input_ids": x, "labels": x} for x in samples()]
        trainer = Trainer(model=model, args=args, train_dataset=tw.dataset(data),
                          callbacks=[Recorder(tw, trained, op=NoCommands()), *run_callbacks(tw), tw])
        return trainer, trainer.train()

    class NoCommands:  # the Recorder's operator: this test posts only its stop
        def at_step_end(self, *args):
            pass

    class StopAt7(TrainerCallback):
        def __init__(self, tw):
            self.tw = tw

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 7:
                Operator(self.tw.watch.run.supervisor, "hf-resume")._post(self.tw.watch, "stop", {})

    launch(lambda tw: [StopAt7(tw)], Trained())
    trained = Trained()
    trainer, out = launch(lambda tw: [], trained)
    loss = {s: v for (_, s), v in trained.loss.items()}
    assert min(loss) == 6  # resumed at checkpoint 5
    logged = [(e["step"], e["loss"]) for e in trainer.state.log_history if "loss" in e]
    assert [s for s, _ in logged] == [6, 8, 10, 12, 14], logged
    expected = [loss[6]] + [(loss[k - 1] + loss[k]) / 2 for k in (8, 10, 12, 14)]
    assert [round(v, 4) for _, v in logged] == [round(v, 4) for v in expected]
    assert abs(out.training_loss - sum(loss.values()) / len(loss)) < 1e-4, (out.training_loss, loss)


@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_precise_skip_probes_run_through_the_trainers_own_loop(db, tmp_path):
    """Issue 39 item 3: precise skip under the Trainer. Sample 50 is corrupt (its loss is NaN);
    the supervisor rolls back and asks to skip the window; each probe re-trains from the
    checkpoint with its own ledger, served by a fresh iterator of the Trainer's DataLoader, and the
    search narrows the skip to the corrupt sample's step. The probes are not logged."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=1, n_head=2))

    def corrupt(mod, a, kw, out):  # a record whose loss is NaN, whenever it is trained
        if mod.training and POISON in ids_of(kw["input_ids"]):
            out.loss = out.loss * float("nan")
        return out

    model.register_forward_hook(corrupt, with_kwargs=True)
    data = [{"input_ids": x, "labels": x} for x in samples()]
    tw = ThermowatchCallback(run="hf-precise", checkpoint_dir=tmp_path / "ckpt", checkpoint_every=EVERY,
                             poll_interval_s=0.02, precise_skip=True,
                             supervisor_config=SupervisorConfig(data_dir=tmp_path / "sup", db_url=db.url))
    trained, steps = Trained(), Steps()

    class Seen(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            model.register_forward_hook(lambda mod, a, kw, out: trained.micro_batch(kw["input_ids"], 0.0)
                                        if mod.training else None, with_kwargs=True)

        def on_step_end(self, args, state, control, **kwargs):
            assert state.global_step == tw.watch._ids_step  # the Trainer's count follows every probe
            steps.step_end(tw.watch, trained, state.global_step)
            trained.step_end(tw.watch.attempt, state.global_step)

    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=PRECISE_STEPS, per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUM, learning_rate=3e-3, report_to="none",
                             save_strategy="no", logging_steps=1, disable_tqdm=True, use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=tw.dataset(data), callbacks=[Seen(), tw])
    out = trainer.train()
    assert out.global_step == PRECISE_STEPS
    check_precise_skip(db, "hf-precise", steps, PRECISE_STEPS)
    # logged every step, yet no probe was: each step of the paths trained for keeps, the first
    # attempt's last (the rollback's boundary, as before) aside
    first = [s for a, s, probing, _ in steps.rows if a == 1]
    kept = [s for a, s, probing, _ in steps.rows if a == 2 and not probing]
    logged = [e["step"] for e in trainer.state.log_history if "loss" in e]
    assert logged == first[:-1] + kept, logged
