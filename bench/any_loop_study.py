"""Issue 35's "must show": each loop kind left alone, with a poisoned stretch and with an LR blow-up.

Each loop kind trains for real on CPU, once under thermowatch and once without it (the same loop,
the same seed), in two scenarios:

  poisoned  a 15-step stretch of the data (15 x 16 = 240 samples, first-pass steps 151-165) is
            uniformly random bytes; healthy checkpoints (every 25 steps) precede it
  lr        at step 151 the LR jumps x300 (1e-3 -> 0.3), as a resume with a wrong config would: the
            attention logits grow ~10^5x within 30 steps and the loss diverges (10-60 nats) on
            these models without thermowatch
  clean     neither (not in the default list): a healthy run, on which the supervisor must do
            nothing (goal: 0 rollbacks, skips, LR changes and pauses, no alert after the finish)

Loop kinds (docs/any-trainer.md; each a user's loop as the docs write it):

  plain      a nanoGPT (tests/fixtures/nanogpt.py) in a plain loop under `thermowatch.watch`
  hf         a tiny random GPT-2 (sdpa) under the Hugging Face `Trainer` with thermowatch's callback
  lightning  the nanoGPT in a LightningModule under `lightning.pytorch.Trainer` with the callback
  run        the nanoGPT in a loop with its own checkpointing on `thermowatch.Run` (the docs' Run
             example: own checkpoints, thermometers, the LR forecast, every command, PauseNotice)
  ddp        the nanoGPT under `torchrun --nproc_per_node 2` (gloo, CPU), DDP, `thermowatch.watch`
  fsdp2      the same with FSDP2 (`fully_shard` per block, then the root)

Every run uses the embedded supervisor with its defaults (SQLite in a temporary directory; under
torchrun rank 0's). Every sample names its own id in its first two tokens (as
tests/client/adapter_run.py's do), so what each step trained is read at the model's input; the
loss leaves that id out (the label of token 1 is ignored). Per run it prints:

  rollbacks / skips / LR changes / pauses the supervisor carried out (its actions table, done)
  poisoned samples fed to the model before the first rollback and after it (precise-skip probes,
    `tw.probing`, excluded; target after: 0)
  pauses: whether each printed its line on stderr ("is PAUSED before step"); the study plays an
    on-call who stops a paused run once the line is there (or after 10 s without it)
  alerts recorded after the run finished (target none): the supervisor's stall check is run as if
    an hour had passed, and the pause re-page job likewise, then the alerts table is read
  final loss: the mean training loss of the last 10 steps of the path the model kept, and the loss
    on 64 held-out windows of clean text (the last 10% of the data, never trained on)
  the quarantine (poisoned runs under thermowatch): poisoned ids in it, clean ids in it (goal 0);
    the plain loop's poisoned run twice, precise skip on and off

A real step takes far longer than these toys' (~10 ms), while the client sends its records every
0.5 s and polls every 0.05 s here: runs under thermowatch are padded to `--step-floor-ms` (50) a
step, so the supervisor's reaction, counted in steps, is nearer a real run's. Runs without it
are not padded (their wall time means nothing).

    python bench/any_loop_study.py [--kinds plain,hf,lightning,run,ddp,fsdp2] [--scenarios poisoned,lr,clean]
                                   [--json] [--keep DIR] [--skip-ahead N]

`--skip-ahead 0` turns the policy's skip_ahead_steps off: the rollback's window then ends at the
detection, one step into the poisoned stretch, as before it (precise skip has to follow the
stretch past the window's end by itself).

Each (kind, scenario, mode) runs in a child process of its own (`--child`), its stderr kept in
the run's directory (`--keep DIR` keeps them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import REPO, free_port  # first: this checkout on sys.path

KINDS = ("plain", "hf", "lightning", "run", "ddp", "fsdp2")
SCENARIOS = ("poisoned", "lr", "clean")
B, SEQ, STEPS, EVERY = 16, 32, 300, 25  # global batch, tokens a sample (+1 target), steps, checkpoint every
N = 16384  # samples: id i is sample i (ids stay below N in these runs: no second pass)
VOCAB = 256
PEAK, WARMUP = 1e-3, 20
POISON_STEP, POISON_STEPS = 151, 15
POISON = range((POISON_STEP - 1) * B, (POISON_STEP - 1 + POISON_STEPS) * B)  # first-pass steps 151-165
RAISE_AT, JUMP = 151, 300.0
EVAL_N = 64
RUN_ID = "study"
PAUSED = f"thermowatch: run {RUN_ID} is PAUSED before step"  # the loop's line (thermowatch/paused.py)


# --- data ---------------------------------------------------------------------------------------


def corpus():
    """The standard library's bytes (1 MiB, the demo's data): the first 90% to train on, the rest held out."""
    import torch

    from thermowatch.trainer.data import stdlib_source

    tokens = torch.from_numpy(stdlib_source(1 << 20).tokens.astype("int64"))
    cut = int(len(tokens) * 0.9)
    return tokens[:cut], tokens[cut:]


def samples(scenario: str):
    """(N, SEQ + 1) tokens. The first two name the sample (id = t0 * 256 + t1); the rest is the
    window at (id * 7919) mod the training text, or, for a poisoned id, uniformly random bytes
    (the same for the same id)."""
    import torch

    train, _ = corpus()
    ids = torch.arange(N)
    starts = (ids * 7919) % (len(train) - SEQ)
    x = train[starts[:, None] + torch.arange(SEQ - 1)]
    if scenario == "poisoned":
        for i in POISON:
            g = torch.Generator().manual_seed(i)
            x[i] = torch.randint(0, VOCAB, (SEQ - 1,), generator=g)
    return torch.cat([(ids // VOCAB)[:, None], (ids % VOCAB)[:, None], x], dim=1)


def held_out():
    """EVAL_N windows of the held-out text, in the same format (their id tokens 255, 255)."""
    import torch

    _, test = corpus()
    starts = torch.linspace(0, len(test) - SEQ, EVAL_N).long()
    x = test[starts[:, None] + torch.arange(SEQ - 1)]
    return torch.cat([torch.full((EVAL_N, 2), 255), x], dim=1)


def ids_of(tokens) -> list[int]:
    return (tokens[:, 0] * VOCAB + tokens[:, 1]).tolist()


def xy(tokens):
    """Inputs and targets; the target of position 0 (the id's second token) is ignored."""
    x, y = tokens[:, :-1], tokens[:, 1:].clone()
    y[:, 0] = -100
    return x, y


def nano():
    from tests.fixtures.nanogpt import NanoConfig, NanoGPT

    return NanoGPT(NanoConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=64))


def warm(s: int) -> float:
    return min(1.0, (s + 1) / WARMUP)


def jump(opt, sched) -> None:
    """The LR blow-up: the schedule's base LR is now JUMP x (idempotent; a rollback to a checkpoint
    before it restores the scheduler's base, and the loop raises it again when it gets here)."""
    sched.base_lrs = [PEAK * JUMP for _ in sched.base_lrs]
    f = sched.lr_lambdas[0](sched.last_epoch)
    for g in opt.param_groups:
        g["lr"] = PEAK * JUMP * f


# --- what one child process records -------------------------------------------------------------


class Ctx:
    def __init__(self, args) -> None:
        self.kind, self.scenario, self.tw, self.precise = args.child, args.scenario, args.mode == "tw", args.precise
        self.dir = Path(args.workdir)
        self.stderr = Path(args.stderr) if args.stderr else None
        self.floor = args.step_floor_ms / 1000.0 if self.tw else 0.0
        self.rank = int(os.environ.get("RANK", "0"))
        self.trained: list[dict] = []
        self._t = time.perf_counter()
        self.oncall: OnCall | None = None
        self.out: dict = {}

    def cfg(self):
        from thermowatch.supervisor.app.config import SupervisorConfig

        ahead = os.environ.get("STUDY_SKIP_AHEAD")  # --skip-ahead: the policy's skip_ahead_steps
        return SupervisorConfig(data_dir=self.dir / "sup", db_url=f"sqlite:///{self.dir}/sup.sqlite",
                                policy={"skip_ahead_steps": int(ahead)} if ahead else {})

    def log(self, attempt: int, step: int, probe: bool, ids: list[int], loss: float) -> None:
        self.trained.append({"a": attempt, "s": step, "p": bool(probe), "ids": ids, "loss": float(loss)})

    def pad(self) -> None:
        """Each step under thermowatch takes at least the floor (see the module docstring)."""
        if self.floor:
            left = self.floor - (time.perf_counter() - self._t)
            if left > 0:
                time.sleep(left)
            self._t = time.perf_counter()

    def watch(self, model, opt, sched, **extra):
        """The loop's thermowatch.watch with the study's settings, its on-call started; None
        for the runs without thermowatch."""
        if not self.tw:
            return None
        import thermowatch

        tw = thermowatch.watch(model, opt, run=RUN_ID, steps=STEPS, global_batch=B, checkpoint_dir=self.dir / "ckpt",
                               checkpoint_every=EVERY, scheduler=sched, supervisor_config=self.cfg(),
                               poll_interval_s=0.05, **extra)
        self.start_oncall(lambda: tw.run.supervisor)
        return tw

    def start_oncall(self, get_sup) -> None:
        if self.tw and self.rank == 0:
            self.oncall = OnCall(get_sup, self.stderr)
            self.oncall.start()

    def write(self) -> None:
        (self.dir / f"trained{self.rank}.json").write_text(json.dumps(self.trained))
        if self.rank == 0:
            if self.oncall is not None:
                self.oncall.halt()
                self.out["oncall"] = self.oncall.events
            (self.dir / "result.json").write_text(json.dumps(self.out, default=str))


class OnCall(threading.Thread):
    """The study's on-call: when the supervisor's pause has been carried out, it looks for the
    loop's PAUSED line on stderr (10 s at most), then stops the run (there is nobody to decide)."""

    def __init__(self, get_sup, stderr: Path | None) -> None:
        super().__init__(daemon=True)
        self.get_sup, self.stderr = get_sup, stderr
        self.events: list[dict] = []
        self._halt = threading.Event()

    def halt(self) -> None:
        self._halt.set()
        self.join(5)

    def _lines(self) -> int:
        try:
            return self.stderr.read_text(errors="replace").count(PAUSED) if self.stderr else 0
        except OSError:
            return 0

    def run(self) -> None:
        from thermowatch.supervisor.store import actions as actions_store

        handled: set[int] = set()
        while not self._halt.wait(0.2):
            sup = self.get_sup()
            if sup is None:
                continue
            try:
                with sup.sessions() as s:
                    rows = [a for a in actions_store.actions(s, RUN_ID) if a.kind == "pause" and a.state == "done"]
                for p in rows:
                    if p.id in handled:
                        continue
                    handled.add(p.id)
                    t0, seen = time.monotonic(), False
                    while time.monotonic() - t0 < 10:
                        if self._lines() >= len(handled):
                            seen = True
                            break
                        time.sleep(0.1)
                    self.events.append({"pause": p.id, "before_step": p.ack_step, "line": seen,
                                        "line_after_s": round(time.monotonic() - t0, 2), "origin": p.origin,
                                        "reason": p.reason[:300]})
                    sup.executor.submit(RUN_ID, "stop", {}, "study-oncall", "the study stops a paused run")
            except Exception as exc:  # noqa: BLE001 - the supervisor closed under us at the end
                if not self._halt.is_set():
                    self.events.append({"error": f"{type(exc).__name__}: {exc}"})


def after_finish(ctx: Ctx, sup) -> None:
    """What the supervisor did, and what it says once the run is over (rank 0, after close())."""
    from thermowatch.supervisor.app.jobs import pause_repage
    from thermowatch.supervisor.store import actions as actions_store
    from thermowatch.supervisor.store import alerts as alerts_store
    from thermowatch.supervisor.store import incidents as incidents_store
    from thermowatch.supervisor.store import quarantine as quarantine_store
    from thermowatch.supervisor.store.views import run_status

    finished = dt.datetime.now(dt.timezone.utc)
    time.sleep(1.0)  # anything still in flight lands
    out = ctx.out
    out["stall_check_covers_run"] = RUN_ID in sup.banks._banks  # the check looks at it (Banks.stalls)
    try:
        stalls = sup.responder.check_stalls(now=time.time() + 3600)
        out["stall_findings_after_finish"] = [f"{f.signal.value} {f.module} {f.severity.value} at step {f.detect_step}"
                                              for f in stalls]
    except Exception as exc:  # noqa: BLE001 - reported, not hidden
        out["stall_check_error"] = f"{type(exc).__name__}: {exc}"
    try:
        rep = pause_repage(sup, now=dt.datetime.now(dt.timezone.utc) + dt.timedelta(hours=1))
        out["repages_after_finish"] = [a.title for a in rep]
    except Exception as exc:  # noqa: BLE001
        out["repage_error"] = f"{type(exc).__name__}: {exc}"
    with sup.sessions() as s:
        acts = sorted(actions_store.actions(s, RUN_ID), key=lambda a: a.id)
        alerts = alerts_store.alerts(s)
        incs = incidents_store.incidents(s, RUN_ID)
        status = run_status(s, RUN_ID, stall_after_s=600)
        verdicts = quarantine_store.verdicts(s, RUN_ID)
    out["actions"] = [{"id": a.id, "kind": a.kind, "state": a.state, "origin": a.origin, "who": a.who,
                       "ack_step": a.ack_step, "reason": a.reason[:300], "error": a.error[:200],
                       "result": {k: (a.result or {}).get(k) for k in ("checkpoint_step", "first_step", "skip_ranges",
                                                                       "lr_multiplier", "ok", "detail")}}
                      for a in acts]
    out["incidents"] = [{"signal": i.signal, "module": i.module, "severity": i.severity, "onset": i.onset_step,
                         "detect": i.detect_step, "state": i.state} for i in incs]
    out["alerts_total"] = len(alerts)
    after = [a for a in alerts if a.created_at is not None and a.created_at >= finished]
    out["alerts_after_finish"] = [a.text[:200] for a in after]
    out["status"] = {k: status.get(k) for k in ("state", "why", "finish_reason", "final_step")}
    held = quarantine_store.quarantined(verdicts)
    qids = {i for lo, hi in held for i in range(lo, hi)}
    out["quarantine"] = {"samples": len(qids), "poisoned": len(qids & set(POISON)),
                         "clean": len(qids - set(POISON)) if ctx.scenario == "poisoned" else len(qids),
                         "verdicts": [{"status": v.status, "sure": v.sure, "samples": v.samples,
                                       "signal": v.signal, "detect": v.detect_step,
                                       "outcome": (v.bisected or {}).get("outcome")} for v in verdicts]}


def eval_loss(model, forward) -> float:
    """The loss on the held-out windows (`forward(x, y)`: the loss of inputs x, targets y), dropout off."""
    import torch

    x, y = xy(held_out())
    was = model.training
    model.eval()
    with torch.no_grad():
        loss = float(forward(x, y))
    model.train(was)
    return loss


# --- the loop kinds -----------------------------------------------------------------------------


def kind_plain(ctx: Ctx) -> None:
    """docs/any-trainer.md's plain loop, with precise skip on or off."""
    import torch

    data = samples(ctx.scenario)
    torch.manual_seed(0)
    model = nano()
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    tw = ctx.watch(model, opt, sched, precise_skip=ctx.precise)
    for step in (tw.steps() if tw else range(1, STEPS + 1)):
        if ctx.scenario == "lr" and step == RAISE_AT:
            jump(opt, sched)
        ids = tw.batch_ids(step) if tw else range((step - 1) * B, step * B)
        tokens = data[torch.as_tensor(ids)]
        x, y = xy(tokens)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ctx.log(tw.attempt if tw else 1, step, tw.probing if tw else False, ids_of(x), loss.item())
        if tw:
            tw.record(loss)
            ctx.pad()
    if tw:
        tw.close()
        ctx.out["final_loss_reported"] = tw.final_loss
        after_finish(ctx, tw.run.supervisor)
    ctx.out["eval_loss"] = eval_loss(model, lambda x, y: model(x, y)[1])


def kind_hf(ctx: Ctx) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    data = samples(ctx.scenario)
    items = []
    for t in data:
        labels = t.clone()
        labels[1] = -100  # HF shifts the labels itself: token 1 (the id's second) is not predicted
        items.append({"input_ids": t, "labels": labels})

    class InOrder(torch.utils.data.IterableDataset):  # without thermowatch: the same order, no shuffle
        def __iter__(self):
            return iter(items)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ + 1, n_embd=64, n_layer=2, n_head=4,
                                       attn_implementation="sdpa"))
    tw = None
    if ctx.tw:
        from thermowatch.integrations.hf import ThermowatchCallback

        tw = ThermowatchCallback(run=RUN_ID, checkpoint_dir=ctx.dir / "ckpt", checkpoint_every=EVERY,
                                 poll_interval_s=0.05, supervisor_config=ctx.cfg())
        ctx.start_oncall(lambda: tw.watch.run.supervisor if tw.watch is not None else None)

    class Recorder(TrainerCallback):
        """Listed first: sees each step end before the adapter carries anything out."""

        def __init__(self):
            self.pending: list[int] = []
            self.loss = math.nan

        def on_train_begin(self, args, state, control, model=None, **kw):
            def seen(mod, a, kwargs, out):
                if mod.training and torch.is_grad_enabled():
                    self.pending += ids_of(kwargs["input_ids"])
                    self.loss = float(out.loss.detach())
            model.register_forward_hook(seen, with_kwargs=True)

        def on_step_begin(self, args, state, control, optimizer=None, lr_scheduler=None, **kw):
            if ctx.scenario == "lr" and state.global_step == RAISE_AT - 1:
                jump(getattr(optimizer, "optimizer", optimizer), getattr(lr_scheduler, "scheduler", lr_scheduler))

        def on_step_end(self, args, state, control, **kw):
            ctx.log(tw.attempt if tw else 1, state.global_step, False, self.pending, self.loss)
            self.pending = []
            ctx.pad()

    args = TrainingArguments(output_dir=str(ctx.dir / "out"), max_steps=STEPS, per_device_train_batch_size=B,
                             learning_rate=PEAK, lr_scheduler_type="constant_with_warmup", warmup_steps=WARMUP,
                             report_to="none", save_strategy="no", logging_steps=50, disable_tqdm=True,
                             use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=tw.dataset(items) if tw else InOrder(),
                      callbacks=[Recorder(), *([tw] if tw else [])])
    trainer.train()
    if tw:
        ctx.out["final_loss_reported"] = tw.final_loss
        after_finish(ctx, tw.watch.run.supervisor)
        ctx.out["hf_logged_loss"] = [(e["step"], round(e["loss"], 4)) for e in trainer.state.log_history if "loss" in e]
    # HF shifts the labels itself: the whole window in, the labels with token 1's ignored (as xy's y)
    ctx.out["eval_loss"] = eval_loss(model, lambda x, y: model(input_ids=torch.cat([x, y[:, -1:]], 1),
                                                               labels=torch.cat([x[:, :1], y], 1)).loss)


def kind_lightning(ctx: Ctx) -> None:
    import lightning.pytorch as pl
    import torch

    data = samples(ctx.scenario)
    torch.manual_seed(0)

    class NanoLM(pl.LightningModule):  # the user's LightningModule around their model
        def __init__(self):
            super().__init__()
            self.model = nano()

        def training_step(self, batch, batch_idx):
            x, y = xy(batch)
            _, loss = self.model(x, y)
            rec.pending, rec.loss = ids_of(x), float(loss.detach())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=PEAK)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    tw = None
    if ctx.tw:
        from thermowatch.integrations.lightning import ThermowatchCallback

        tw = ThermowatchCallback(run=RUN_ID, checkpoint_dir=ctx.dir / "ckpt", checkpoint_every=EVERY,
                                 poll_interval_s=0.05, supervisor_config=ctx.cfg())
        ctx.start_oncall(lambda: tw.watch.run.supervisor if tw.watch is not None else None)

    class Recorder(pl.Callback):
        """Listed first: sees each step end before the adapter carries anything out."""

        pending: list[int] = []
        loss = math.nan

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if ctx.scenario == "lr" and trainer.global_step == RAISE_AT - 1:
                jump(trainer.optimizers[0], trainer.lr_scheduler_configs[0].scheduler)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ctx.log(tw.attempt if tw else 1, trainer.global_step, False, self.pending, self.loss)
            ctx.pad()

    rec = Recorder()
    module = NanoLM()
    trainer = pl.Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[rec, *([tw] if tw else [])])
    rows = list(data)
    loader = tw.dataloader(rows, batch_size=B) if tw else torch.utils.data.DataLoader(rows, batch_size=B)
    trainer.fit(module, loader)
    if tw:
        ctx.out["final_loss_reported"] = tw.final_loss
        after_finish(ctx, tw.watch.run.supervisor)
    ctx.out["eval_loss"] = eval_loss(module, lambda x, y: module.model(x, y)[1])


def kind_run(ctx: Ctx) -> None:
    """docs/any-trainer.md's `thermowatch.Run` loop (own checkpoints, thermometers, the forecast,
    every command), on the nanoGPT, with PauseNotice's lines as the docs' prose asks."""
    import torch

    import thermowatch
    from thermowatch import Pause, Resume, Rollback, SetLR, Skip, StepRecord, Stop

    data = samples(ctx.scenario)
    torch.manual_seed(0)
    model = nano()
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK)
    ckpt = ctx.dir / "ckpt"
    ckpt.mkdir(parents=True, exist_ok=True)

    def schedule(step: int, base: float) -> float:  # the LR of 1-based step `step`, warm-up as the others'
        return base * warm(step - 1)

    def base_at(step: int) -> float:  # the config in force: raised from RAISE_AT on in the lr scenario
        return PEAK * (JUMP if ctx.scenario == "lr" and step >= RAISE_AT else 1.0)

    if not ctx.tw:
        for step in range(1, STEPS + 1):
            for g in opt.param_groups:
                g["lr"] = schedule(step, base_at(step))
            x, y = xy(data[(step - 1) * B:step * B])
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log(1, step, False, ids_of(x), loss.item())
        ctx.out["eval_loss"] = eval_loss(model, lambda x, y: model(x, y)[1])
        return

    th = thermowatch.instrument(model)
    run = thermowatch.Run(RUN_ID, steps=STEPS, global_batch=B, state_dir=ctx.dir / "state", poll_interval_s=0.05,
                          supervisor_config=ctx.cfg())
    ctx.start_oncall(lambda: run.supervisor)
    notice = thermowatch.PauseNotice(RUN_ID)

    def next_ids(cursor):
        ids = []
        while len(ids) < B:
            if not any(r.lo <= cursor < r.hi for r in run.skip_ranges):
                ids.append(cursor)
            cursor += 1
        return torch.tensor(ids), cursor

    def saved() -> list[int]:
        return sorted(int(f.name[5:-3]) for f in ckpt.glob("step_*.pt"))

    def carry_out(cmd, step, cursor):
        body = cmd.body
        if isinstance(body, Rollback):
            usable = [s for s in saved() if s <= body.to_step]
            if not usable:
                run.refuse(cmd, step + 1, f"no checkpoint at or before step {body.to_step}")
                return step, cursor, None, False
            path = os.path.abspath(ckpt / f"step_{usable[-1]}.pt")
            state = torch.load(path, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
            th.discard_pending()
            run.start(start_step=usable[-1])
            run.done(cmd, usable[-1] + 1, checkpoint_step=usable[-1], checkpoint_path=path)
            notice.ended(f"rolled back to checkpoint {usable[-1]}")
            return usable[-1], state["cursor"], False, False
        if isinstance(body, (Skip, SetLR)):
            run.done(cmd, step + 1)
            return step, cursor, None, False
        if isinstance(body, (Pause, Resume, Stop)):
            run.done(cmd, step + 1)
            if isinstance(body, Pause):
                notice.paused(step + 1, body.reason, saved())
            else:
                notice.ended("resumed" if isinstance(body, Resume) else f"stopping after step {step}")
            return step, cursor, isinstance(body, Pause), isinstance(body, Stop)
        run.refuse(cmd, step + 1, f"{cmd.kind.value} is not something this loop can do")
        return step, cursor, None, False

    step, cursor, paused, stop, values = 0, 0, False, False, {"loss": math.nan}
    run.start(start_step=0)
    while step < STEPS and not stop:
        for cmd in run.commands():
            step, cursor, now_paused, stop = carry_out(cmd, step, cursor)
            paused = paused if now_paused is None else now_paused
        if stop:
            break
        if paused:
            notice.tick()
            time.sleep(0.05)
            continue
        step += 1
        ids, cursor = next_ids(cursor)
        lr = schedule(step, base_at(step)) * run.lr_multiplier(step)
        for g in opt.param_groups:
            g["lr"] = lr
        th.begin_step(step)
        x, y = xy(data[ids])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        th.end_step(loss=loss, lr=lr)
        values = th.as_dict(th.collect())
        # the forecast, from the config in force (the raise is not planned: nothing ahead shows it)
        peak = max(schedule(s, base_at(step)) for s in range(step, STEPS + 1)) * run.lr_multiplier(step)
        run.send(StepRecord(step=step, values={**values, "lr_multiplier": run.lr_multiplier(step),
                                               "lr_peak_ahead": peak},
                            sample_lo=int(ids[0]), sample_hi=int(ids[-1]) + 1, wall_time=time.time(),
                            ledger_digest=run.ledger_digest))
        ctx.log(run.attempt, step, False, ids_of(x), loss.item())
        if step % EVERY == 0:
            path = os.path.abspath(ckpt / f"step_{step}.pt")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "cursor": cursor}, path)
            run.checkpoint_saved(step, path, sample_cursor=cursor)
        ctx.pad()
    run.finish(final_step=step, final_loss=values["loss"], reason="stopped" if stop else "completed")
    th.detach()
    ctx.out["final_loss_reported"] = values["loss"]
    after_finish(ctx, run.supervisor)
    ctx.out["eval_loss"] = eval_loss(model, lambda x, y: model(x, y)[1])


def kind_torchrun(ctx: Ctx) -> None:
    """docs/any-trainer.md's torchrun loop: every rank makes the same calls (DDP or FSDP2)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = samples(ctx.scenario)
    torch.manual_seed(0)
    model = nano()
    if ctx.kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.transformer.h:
            fully_shard(block)
        model = fully_shard(model)
    else:
        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warm)
    tw = ctx.watch(model, opt, sched)
    k = B // world
    for step in (tw.steps() if tw else range(1, STEPS + 1)):
        if ctx.scenario == "lr" and step == RAISE_AT:
            jump(opt, sched)
        ids = tw.batch_ids(step) if tw else range((step - 1) * B + rank * k, (step - 1) * B + (rank + 1) * k)
        x, y = xy(data[torch.as_tensor(ids)])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        ctx.log(tw.attempt if tw else 1, step, False, ids_of(x), loss.item())
        if tw:
            tw.record(loss)
            ctx.pad()
    if tw:
        tw.close()
        if rank == 0:
            ctx.out["final_loss_reported"] = tw.final_loss
            after_finish(ctx, tw.run.supervisor)
    ctx.out["eval_loss"] = eval_loss(model, lambda x, y: model(x, y)[1])  # every rank (FSDP2 gathers)
    dist.barrier()
    ctx.write()
    dist.destroy_process_group()


def child(args) -> None:
    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    ctx = Ctx(args)
    if ctx.kind in ("ddp", "fsdp2"):
        kind_torchrun(ctx)  # writes its own, every rank, before the process group ends
        return
    {"plain": kind_plain, "hf": kind_hf, "lightning": kind_lightning, "run": kind_run}[ctx.kind](ctx)
    ctx.write()


# --- the parent: run each, read what happened ---------------------------------------------------


def launch(kind: str, scenario: str, mode: str, precise: bool, root: Path, floor_ms: float, timeout: float) -> dict:
    name = f"{kind}-{scenario}-{mode}" + ("-precise" if precise else "")
    wd = root / name
    wd.mkdir(parents=True)
    me = [str(Path(__file__).resolve()), "--child", kind, "--scenario", scenario, "--mode", mode,
          "--workdir", str(wd), "--stderr", str(wd / "stderr.log"), "--step-floor-ms", str(floor_ms)]
    if precise:
        me.append("--precise")
    if kind in ("ddp", "fsdp2"):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *me]
    else:
        cmd = [sys.executable, *me]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    with open(wd / "stdout.log", "w") as out, open(wd / "stderr.log", "w") as err:
        try:
            rc = subprocess.run(cmd, cwd=wd, env=env, stdout=out, stderr=err, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    wall = round(time.perf_counter() - t0, 1)
    res = summarize(kind, scenario, mode, precise, wd, rc, wall)
    res["dir"] = str(wd)
    return res


def summarize(kind, scenario, mode, precise, wd: Path, rc, wall) -> dict:
    res: dict = {"kind": kind, "scenario": scenario, "thermowatch": mode == "tw",
                 "precise_skip": precise if mode == "tw" and kind == "plain" and scenario == "poisoned" else None,
                 "rc": rc, "wall_s": wall}
    err = (wd / "stderr.log").read_text(errors="replace")
    if rc != 0 or not (wd / "result.json").exists():
        res["error"] = err[-3000:]
        return res
    out = json.loads((wd / "result.json").read_text())
    ranks = sorted(wd.glob("trained*.json"))
    # per (attempt, step, probe): the ids every rank fed its model, the loss averaged over ranks
    steps: dict[tuple[int, int, bool], dict] = {}
    order: list[tuple[int, int, bool]] = []
    for f in ranks:
        for e in json.loads(f.read_text()):
            key = (e["a"], e["s"], e["p"])
            if key not in steps:
                steps[key] = {"ids": [], "loss": []}
                order.append(key)
            steps[key]["ids"] += e["ids"]
            steps[key]["loss"].append(e["loss"])
    # A (attempt, step) seen twice on one rank (a re-delivered step) would merge here; not expected.
    poison = set(POISON)
    first_attempt = min((a for a, _, _ in order), default=1)
    before = sum(1 for (a, s, p) in order if a == first_attempt and not p for i in steps[a, s, p]["ids"] if i in poison)
    after = sum(1 for (a, s, p) in order if a > first_attempt and not p for i in steps[a, s, p]["ids"] if i in poison)
    probes = sum(1 for (a, s, p) in order if p for i in steps[a, s, p]["ids"] if i in poison)
    # the path the model kept: in the order trained (rank 0's), a step at or before the last one kept
    # starts a re-trained path (a rollback), which abandons every step from it on
    kept: dict[int, float] = {}
    for a, s, p in order:
        if p:
            continue
        if kept and s <= max(kept):
            kept = {k: v for k, v in kept.items() if k < s}
        kept[s] = sum(steps[a, s, p]["loss"]) / len(steps[a, s, p]["loss"])
    last = sorted(kept)[-10:]
    res.update({
        "final_step": max(kept) if kept else None,
        "attempts": len({a for a, _, p in order if not p}),
        "steps_trained": sum(1 for _, _, p in order if not p),
        "probe_steps": sum(1 for _, _, p in order if p),
        "final_loss": sum(kept[s] for s in last) / len(last) if last else math.nan,
        "last_steps": last,
        "kept_loss": kept,
        "eval_loss": out.get("eval_loss"),
        "poisoned_before_first_rollback" if mode == "tw" else "poisoned_trained": before,
    })
    if mode != "tw":
        return res
    acts = out.get("actions", [])
    auto_done = [a for a in acts if a["origin"] == "auto" and a["state"] == "done"]
    count = {k: sum(1 for a in auto_done if a["kind"] == k) for k in ("rollback", "skip", "set_lr", "pause", "stop")}
    pause_lines = err.count(PAUSED)
    skipped = {i for a in acts if a["state"] == "done" for lo, hi in (a["result"].get("skip_ranges", a["result"].get("skipped")) or [])
               for i in range(lo, hi)}
    pauses = [a for a in acts if a["kind"] == "pause" and a["state"] == "done"]
    res.update({
        "poisoned_after_first_rollback": after if res["attempts"] > 1 else None,
        "poisoned_in_probes": probes,
        "samples_skipped": len(skipped),
        "clean_skipped": len(skipped - poison) if scenario == "poisoned" else len(skipped),
        "stall_check_covers_run": out.get("stall_check_covers_run"),
        "rollbacks": count["rollback"], "skips": count["skip"], "lr_changes": count["set_lr"],
        "pauses": len(pauses), "pause_lines": pause_lines,
        "silent_pauses": max(0, len(pauses) - pause_lines),
        "rollback_lines": err.count(f"thermowatch: run {RUN_ID} rolled back to checkpoint"),  # the client's line
        "not_done": [f"{a['kind']} {a['state']}: {a['error']}" for a in acts if a["state"] not in ("done",)],
        "oncall": out.get("oncall", []),
        "alerts_total": out.get("alerts_total"),
        "alerts_after_finish": out.get("alerts_after_finish"),
        "stall_findings_after_finish": out.get("stall_findings_after_finish"),
        "repages_after_finish": out.get("repages_after_finish"),
        "errors_after_finish": [out[k] for k in ("stall_check_error", "repage_error") if k in out],
        "status": out.get("status"),
        "incidents": out.get("incidents"),
        "actions": out.get("actions"),
        "quarantine": out.get("quarantine") if scenario == "poisoned" else None,
        "final_loss_reported": out.get("final_loss_reported"),
        "hf_logged_loss": out.get("hf_logged_loss"),
    })
    return res


def fmt(x, nd=3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.{nd}f}"
    return str(x)


def table(results: list[dict]) -> str:
    base = {(r["kind"], r["scenario"]): r for r in results if not r["thermowatch"]}
    head = ("| kind | scenario | rollbacks / skips / LR changes / pauses | poisoned trained before the 1st rollback "
            "/ after it | samples skipped (clean) | pauses with their stderr line | alerts after finish | end "
            "| final loss (last 10) / held-out | without thermowatch: final / held-out "
            "(same steps) | wall s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in results:
        if not r["thermowatch"]:
            continue
        name = r["kind"] + (f" (precise skip {'on' if r['precise_skip'] else 'off'})" if r["precise_skip"] is not None
                            else "")
        if "error" in r:
            lines.append(f"| {name} | {r['scenario']} | failed (rc {r['rc']}) | | | | | | | | {r['wall_s']} |")
            continue
        b = base.get((r["kind"], r["scenario"]), {})
        poisoned = (f"{r['poisoned_before_first_rollback']} / {fmt(r['poisoned_after_first_rollback'])}"
                    if r["scenario"] == "poisoned" else "-")
        st = r.get("status") or {}
        end = f"{st.get('finish_reason') or st.get('state')} @ {st.get('final_step')}"
        alerts = len(r["alerts_after_finish"] or []) + len(r["stall_findings_after_finish"] or []) \
            + len(r["repages_after_finish"] or [])
        same = ""
        if b.get("kept_loss") and r["last_steps"] and r["last_steps"] != b.get("last_steps"):
            kb = {int(k): v for k, v in b["kept_loss"].items()}  # JSON keys are strings
            vals = [kb[s] for s in r["last_steps"] if s in kb]
            if vals:
                same = f" ({fmt(sum(vals) / len(vals))} at steps {r['last_steps'][0]}-{r['last_steps'][-1]})"
        lines.append(
            f"| {name} | {r['scenario']} | {r['rollbacks']} / {r['skips']} / {r['lr_changes']} / {r['pauses']} "
            f"| {poisoned} | {r['samples_skipped']} ({r['clean_skipped']}) "
            f"| {r['pauses'] - r['silent_pauses']} of {r['pauses']} | {alerts} | {end} "
            f"| {fmt(r['final_loss'])} / {fmt(r['eval_loss'])} "
            f"| {fmt(b.get('final_loss'))} / {fmt(b.get('eval_loss'))}{same} | {r['wall_s']} |")
    q = [r for r in results if r["thermowatch"] and r.get("quarantine")]
    if q:
        lines += ["", "| quarantine (poisoned runs) | samples quarantined | poisoned ids in it (of 240) | clean ids "
                  "in it (goal 0) | verdicts |", "|---|---|---|---|---|"]
        for r in q:
            name = r["kind"] + (f" (precise skip {'on' if r['precise_skip'] else 'off'})"
                                if r["precise_skip"] is not None else "")
            qq = r["quarantine"]
            v = ", ".join(f"{x['status']}/{x['sure']}" + (f"/{x['outcome']}" if x["outcome"] else "")
                          for x in qq["verdicts"])
            lines.append(f"| {name} | {qq['samples']} | {qq['poisoned']} | {qq['clean']} | {v or '-'} |")
    return "\n".join(lines)


def notes(results: list[dict]) -> str:
    """What the table cannot say: the supervisor's actions, failures, alerts after the finish."""
    out = []
    for r in results:
        if not r["thermowatch"]:
            if "error" in r:
                out.append(f"- {r['kind']} {r['scenario']} without thermowatch FAILED (rc {r['rc']}): "
                           f"{r['error'][-400:]!r}")
            continue
        name = f"{r['kind']} {r['scenario']}" + (f" precise={r['precise_skip']}" if r["precise_skip"] is not None
                                                 else "")
        if "error" in r:
            out.append(f"- {name}: FAILED (rc {r['rc']}): {r['error'][-600:]!r}")
            continue
        acts = "; ".join(
            f"{a['kind']}({a['origin']},{a['state']})"
            + (f"->ckpt {a['result']['checkpoint_step']}"
               if a["kind"] == "rollback" and a["result"].get("checkpoint_step") is not None else "")
            + (f" skip {a['result'].get('skip_ranges', a['result'].get('skipped'))}"
               if a["result"].get("skip_ranges", a["result"].get("skipped")) else "")
            + (f" x{a['result']['lr_multiplier']}" if a["kind"] in ("set_lr", "rollback")
               and a["result"].get("lr_multiplier") not in (None, 1.0) else "")
            for a in r["actions"] or [])
        sig = ", ".join(f"{i['signal']}@{i['onset']}->{i['detect']}" for i in (r["incidents"] or [])[:8])
        out.append(f"- {name}: actions: {acts or 'none'}; incidents: {sig or 'none'}"
                   + (f"; NOT DONE: {r['not_done']}" if r["not_done"] else "")
                   + (f"; alerts after finish: {r['alerts_after_finish']}" if r["alerts_after_finish"] else "")
                   + (f"; stall findings after finish: {r['stall_findings_after_finish']}"
                      if r["stall_findings_after_finish"] else "")
                   + (f"; re-pages after finish: {r['repages_after_finish']}" if r["repages_after_finish"] else "")
                   + (f"; errors: {r['errors_after_finish']}" if r["errors_after_finish"] else "")
                   + ("; the stall check did not cover the run" if r["stall_check_covers_run"] is False else "")
                   + (f"; HF logged losses: max {max(v for _, v in r['hf_logged_loss']):.3f} (per-step training "
                      f"losses max {max(r['kept_loss'].values()):.3f} on the kept path)" if r.get("hf_logged_loss")
                      else "")
                   + (f"; on-call: {r['oncall']}" if r["oncall"] else "")
                   + (f"; rollback lines on stderr {r['rollback_lines']} vs rollbacks done {r['rollbacks']}"
                      if r["rollback_lines"] != sum(1 for a in r["actions"] or []
                                                    if a["kind"] == "rollback" and a["state"] == "done") else ""))
    return "\n".join(out)


def tree() -> str:
    """The commit the study ran at, and whether the code it imports had uncommitted changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "thermowatch", "supervisor", "monitors",
                                "trainer", "tests"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        return f"commit {head}" + (" with uncommitted changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "not a git checkout"


def machine() -> str:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    return f"{os.cpu_count()}-core {cpu}, torch {torch.__version__}, Python {platform.python_version()}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--scenarios", default="poisoned,lr", help=f"of {', '.join(SCENARIOS)}")
    ap.add_argument("--modes", default="tw,none", help="tw (under thermowatch), none (without), or both")
    ap.add_argument("--json", action="store_true", help="one JSON object per run, then the table")
    ap.add_argument("--keep", help="keep each run's directory (stderr, database) under this folder")
    ap.add_argument("--step-floor-ms", type=float, default=50.0)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take before it is killed")
    ap.add_argument("--skip-ahead", type=int, help="the policy's skip_ahead_steps (default: its own, 16); 0: the "
                                                   "rollback's window ends at the detection, one step into the stretch")
    # the child's own arguments
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--stderr", help=argparse.SUPPRESS)
    ap.add_argument("--precise", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    kinds = [k for k in args.kinds.split(",") if k]
    scenarios = [s for s in args.scenarios.split(",") if s]
    modes = [m for m in args.modes.split(",") if m]
    for k in kinds:
        if k not in KINDS:
            ap.error(f"unknown kind {k!r}; known: {', '.join(KINDS)}")
    for s in scenarios:
        if s not in SCENARIOS:
            ap.error(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")
    if args.skip_ahead is not None:  # the children read it (Ctx.cfg)
        os.environ["STUDY_SKIP_AHEAD"] = str(args.skip_ahead)
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="any-loop-study-"))
    root.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    print(f"# {dt.date.today().isoformat()}, {machine()}, {tree()}"
          + (f", skip_ahead_steps={args.skip_ahead}" if args.skip_ahead is not None else ""), flush=True)
    results = []
    for kind in kinds:
        for scenario in scenarios:
            plan = [(m, False) for m in modes]
            if kind == "plain" and scenario == "poisoned" and "tw" in modes:
                plan = [("tw", True), ("tw", False)] + [(m, False) for m in modes if m != "tw"]
            for mode, precise in plan:
                r = launch(kind, scenario, mode, precise, root, args.step_floor_ms, args.timeout)
                results.append(r)
                if args.json:
                    print(json.dumps(r, default=str), flush=True)
                else:
                    print(f"{kind:9} {scenario:8} {mode:4}{' precise' if precise else '':8} rc {r['rc']} "
                          f"{r['wall_s']:6.1f} s  final loss {fmt(r.get('final_loss'))} held-out "
                          f"{fmt(r.get('eval_loss'))}" + (f"  rollbacks {r.get('rollbacks')} skips {r.get('skips')} "
                                                          f"lr {r.get('lr_changes')} pauses {r.get('pauses')}"
                                                          if mode == "tw" and "error" not in r else "")
                          + ("  FAILED" if "error" in r else ""), flush=True)
    print()
    print(table(results))
    print()
    print(notes(results))
    print(f"\n# {len(results)} runs in {time.perf_counter() - started:.0f} s", flush=True)
    if not args.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
