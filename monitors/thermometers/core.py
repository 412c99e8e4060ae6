"""Thermometers for any torch model: hooks that measure into one device tensor per step, so a step
costs one host copy instead of a `.item()` per metric.

Per step (the order the trainer calls things):

    th.begin_step(step)          # arm the groups sampled this step, NaN-fill the slots
    loss = model(...); loss.backward()   # hooks write amax/amin, attention logits, grad norms
    with th.measure_update():    # update_ratio: weight copy before, ||dW||/||W|| after
        opt.step()
    th.end_step(loss=loss, lr=lr, grad_norm=gn)   # finish grad norms, start ONE host copy
    values = th.collect()        # float64 [len(th.names)], NaN where a group was not sampled

Read a step late so the step never waits (the trainer's worker does): end step k, then collect
step k-1, whose copy finished while step k ran. Ended steps wait in a first-in first-out queue
of two (one per pinned host buffer); `collect()` hands out the oldest.

Cost (Composer's activation monitor reads `.item()` per module; we do not): every hook issues
a few small device ops into preallocated slots, nothing waits for the device until the
single copy in end_step, which is `non_blocking` into pinned memory on CUDA (collect() waits
for that copy only, so call it a step later to never stall) and synchronous on CPU.

Gradient norms come from parameter tensor hooks (`p.register_hook`), which see each gradient
as autograd produces it. That works under DeepSpeed ZeRO 1/2/3, where `.grad` is None after
backward because ZeRO moves gradients into its buckets: the value is the rank's *local,
pre-reduction* gradient (before the all-reduce / reduce-scatter and before clipping; with
fp16 loss scaling it includes the loss scale). With gradient accumulation the hook fires
once per micro-batch and the norms combine as sqrt(sum of squares over micro-batches).
A tied parameter is one tensor and counts in every group that holds it.

Cost budget (ThermometerConfig.budget, issue 36; budget.py): on read steps each hook, probe and
begin/end_step's own work runs inside timer.start()/stop(group); begin_step hands the budget the
steps measured so far, and every 32nd step it sets the act, attn and grad cadences (`cadence`) to
keep the measured share of the step (`cost`) within the budget. A hook on an off-step calls no timer.

Attention entropy and z have their costs and exactness stated where they are computed
(trainer.model.attention_entropy, GPT.forward's z probe, attention.py); the update ratio in
update.py.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn

from thermowatch.monitors.thermometers.attention import AttnProbe, mha_scores_stats
from thermowatch.monitors.thermometers.budget import (
    ACT, ATTN, BASE, BUDGETED, GRAD, UPDATE, Budget, NullTimer, ThreadTimer, Timer, bounds, timer_for,
)
from thermowatch.monitors.thermometers.config import ThermometerConfig
from thermowatch.monitors.thermometers.intercept import Interceptor, Site
from thermowatch.monitors.thermometers.layout import layout, select
from thermowatch.monitors.thermometers.slots import Slots
from thermowatch.monitors.thermometers.unread import Unread
from thermowatch.monitors.thermometers.update import UpdateRatio

def _first_float_tensor(out) -> torch.Tensor | None:
    """A module's output, or the first floating tensor of a tuple/list output (HF models,
    nn.MultiheadAttention return tuples)."""
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        for t in out:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                return t
    return None


class ZProbe:
    """The z slot of a logits module that reports its own log-sum-exp (trainer.model's head
    carries `thermo_z_probe`): the model hands over the per-token lse it already has."""

    def __init__(self, slots: Slots, slot: int, timer: Timer) -> None:
        self.slots, self.slot, self.timer = slots, slot, timer
        self.on = False  # set by Thermometers.begin_step with the activation group

    def put_lse(self, lse: torch.Tensor) -> None:
        self.timer.start()
        # Max over tokens (not the mean PaLM's z-loss penalises): one runaway token shows.
        self.slots.put(self.slot, lse.amax().float().reshape(1))
        self.timer.stop(ACT)


@dataclass
class _Attn:
    name: str
    module: nn.Module
    probe: AttnProbe
    kind: str  # "probe": the module calls thermo_probe; "mha": our pre-hook recomputes
    # nn.MultiheadAttention; "found": its SDPA / softmax calls are intercepted (intercept.py)
    mode: str  # what probe.mode becomes on sampled steps


class Thermometers:
    """Build with `instrument(model, config)`. `names` is the fixed order of `collect()`."""

    def __init__(self, model: nn.Module, config: ThermometerConfig | None = None, device=None, *,
                 grad_hooks: bool = True) -> None:
        cfg = config or ThermometerConfig()
        self.model, self.config = model, cfg
        param = next(model.parameters(), None)
        # The slots must live where the activations do, or every hook becomes a D2H sync.
        self.device = torch.device(device) if device is not None else param.device if param is not None else torch.device("cpu")
        act, z, attn, groups = select(model, cfg)
        lay = layout(cfg, act, z, attn, groups)
        names = self.names = lay.names
        self._unread = Unread(names)  # as_dict leaves out what a budget did not read
        self._grad_slice, self._extras = lay.grad, lay.extras
        self._slots = Slots(len(names), self.device, keep=lay.extras.stop - lay.extras.start)
        self._budget: Budget | None = None
        self._timer: Timer = NullTimer()
        if cfg.budget is not None:
            self._timer = timer_for(self.device)
            self._budget = Budget(cfg.budget, *bounds(cfg), self._timer, self.device)
        # The host's share of a step read (collect, as_dict) is the thermometers' cost too where the
        # training thread pays it: on a CPU. On a GPU the host runs ahead and the events time the device.
        self._host_timer: Timer = self._timer if isinstance(self._timer, ThreadTimer) else NullTimer()
        self._every = (cfg.act_every, cfg.attn_every, cfg.grad_every)  # in force this step
        self._extras_version = -1  # the budget's version last written into the device slots
        if self._budget is None and lay.extras.stop > lay.extras.start:  # fixed cadences: written once, kept
            self._slots.buf[lay.extras] = torch.tensor(self._every, dtype=torch.float32, device=self.device)
        # Did the latest end_step get the global gradient norm from its caller? Until it does, the
        # grad group is read on every step whatever its cadence (a fixed grad_every, or the budget's
        # between two decisions): the global norm is the non-finite and spike detectors' input,
        # never left unread.
        self._grad_norm_given = False

        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._act_on = self._attn_on = self._grad_on = self._update_on = False
        self._detached = False
        # Filled as hooks and probes go on, so a failed _claim() can detach() what is there.
        self._z_probes: list[tuple[nn.Module, ZProbe]] = []
        self._attn: list[_Attn] = []
        self._head_index: dict[tuple[int, int], torch.Tensor] = {}
        self._intercept = Interceptor(self._timer)
        self._hook_forward(act, lay.act, z, lay.z, lay.attn)
        self._hook_grads(model, groups, grad_hooks, lay.update)
        self._host_buffers(len(names))

    def _hook_forward(self, act, act_slots, z, z_slots, attn_slots) -> None:
        """The forward's hooks and probes: activations, z, and each attention by its kind."""
        cfg = self.config
        for name, mod in act:
            self._handles.append(mod.register_forward_hook(self._act_hook(act_slots[name])))
        for name, mod in z:
            if hasattr(mod, "thermo_z_probe"):  # the model reports its own lse: no vocab pass here
                self._claim(name, mod, "thermo_z_probe")
                zp = ZProbe(self._slots, z_slots[name], self._timer)
                mod.thermo_z_probe = zp
                self._z_probes.append((mod, zp))
            else:
                self._handles.append(mod.register_forward_hook(self._z_hook(z_slots[name])))
        for name, mod, slot, n_head, kind, mode, ent_slot in attn_slots:
            probe = AttnProbe(self._slots, slot, n_head, cfg.per_head, ent_slot)
            probe.entropy_batch = cfg.attn_entropy_batch
            probe.timer = self._timer
            if kind == "mha":
                self._handles.append(mod.register_forward_pre_hook(self._mha_hook(probe), with_kwargs=True))
            elif kind == "found":
                self._handles += self._intercept.hooks(mod, Site(name, mod, probe))
            else:
                self._claim(name, mod, "thermo_probe")
                mod.thermo_probe = probe
            self._attn.append(_Attn(name, mod, probe, kind, mode))

    def _hook_grads(self, model: nn.Module, groups, grad_hooks: bool, update_start: int) -> None:
        """Gradient norms: one slot per unique trainable parameter, summed into groups at end_step;
        the update ratio around the optimizer step over the same groups."""
        params, index = [], {}
        for p in model.parameters():
            if p.requires_grad and id(p) not in index:
                index[id(p)] = len(params)
                params.append(p)
        src, dst = [], []
        for g, (_, mod) in enumerate(groups):
            for p in {id(p): p for p in mod.parameters() if id(p) in index}.values():
                src.append(index[id(p)])
                dst.append(g)
        self._params = params
        self._sum_ranks = None  # set by grads_from_params for one step: the squares' all-reduce
        self._pnorm = torch.zeros(len(params), dtype=torch.float32, device=self.device)
        self._pseen = [False] * len(params)
        self._src = torch.tensor(src, dtype=torch.long, device=self.device)
        self._dst = torch.tensor(dst, dtype=torch.long, device=self.device)
        if grad_hooks:  # else the caller reads .grad around the optimizer step: grads_from_params
            for j, p in enumerate(params):
                self._handles.append(p.register_hook(self._grad_hook(j)))
        self._update = None
        if self.config.update_ratio:
            self._update = UpdateRatio(params, self._src, self._dst, len(groups), self._slots.buf, update_start,
                                       split=self.config.update_split)

    def _host_buffers(self, size: int) -> None:
        # Maps the step's slot buffer to what is copied to the host, on the device and before
        # the one copy (the trainer's cross-rank reduction, monitors.collective); None = the
        # buffer itself. `finish_args` are host values for it, set before end_step.
        self.finish = None
        self.finish_args: tuple = ()
        self._host: list[torch.Tensor] = []
        if self.device.type == "cuda":  # two pinned buffers: step k+1's copy never overwrites k's
            self._host = [torch.empty(size, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self._ring = 0
        # Ended steps not yet collected, oldest first: at most one per host buffer.
        # (step, host values, copy event, the budget's figures for collect() to fill or None)
        self._pending: deque[tuple[int, torch.Tensor, object, tuple | None, bool]] = deque()
        self.dropped = 0  # ended steps overwritten before anyone collected them
        self.step: int | None = None
        self.last_step: int | None = None  # the step the latest collect() returned
        self.last_norm_unread = False  # its global grad_norm was not read (end_step: norm_unread)

    def _claim(self, name: str, mod: nn.Module, attr: str) -> None:
        if getattr(mod, attr) is not None:
            self.detach()
            raise RuntimeError(
                f"{name!r} already carries a {attr}: the model is instrumented twice; "
                "detach() the other Thermometers first"
            )

    # --- hooks (hot path: tensor ops only, no host sync) ------------------------------------

    def _out_hook(self, put):
        """A forward hook handing the module's first float output, detached, to `put` (timed as ACT)."""
        def hook(mod, args, out):
            if not self._act_on:
                return
            t = _first_float_tensor(out)
            if t is not None and t.numel():
                self._timer.start()
                put(t.detach())
                self._timer.stop(ACT)

        return hook

    def _act_hook(self, slot: int):
        return self._out_hook(lambda t: self._slots.put_aminmax(slot, t))

    def _z_hook(self, slot: int):
        def put(t: torch.Tensor) -> None:
            # Foreign models only (ours hand over their lse: ZProbe). Max over tokens (not
            # the mean PaLM's z-loss penalises): one runaway token shows. Over the first
            # z_batch sequences: an fp32 logsumexp of every token's logits was ~20% of a
            # GPT-2-small bf16 step on an H100 (BENCHMARKS.md), 1/B of it now.
            n = self.config.z_batch
            t = t if n is None or t.dim() < 3 else t[:n]
            z = torch.logsumexp(t.float(), dim=-1).amax()
            self._slots.put(slot, z.reshape(1))

        return self._out_hook(put)

    def _mha_hook(self, probe: AttnProbe):
        def hook(mod, args, kwargs):
            if probe.mode is not None:
                self._timer.start()
                mx, ent = mha_scores_stats(mod, args, kwargs, probe.heads, probe.entropy)
                probe.put_scores_max(mx)
                if ent is not None:
                    probe.put_entropy(ent)
                self._timer.stop(ATTN)

        return hook

    def _grad_hook(self, j: int):
        def hook(grad: torch.Tensor):
            if not self._grad_on:
                return None
            self._timer.start()
            slot = self._pnorm[j]
            if not self._pseen[j]:
                torch.linalg.vector_norm(grad, dtype=torch.float32, out=slot)
                self._pseen[j] = True
            else:  # another micro-batch: sqrt(a^2 + b^2)
                torch.hypot(slot, torch.linalg.vector_norm(grad, dtype=torch.float32), out=slot)
            self._timer.stop(GRAD)
            return None  # never changes the gradient

        return hook

    # --- step protocol ----------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        if self._detached:
            raise RuntimeError("these thermometers were detached; call instrument(model) again")
        cfg = self.config
        self.step = step
        # The step begins here: the budget's plan() is its work too (tagged once the cadences are
        # known; until then as a step that reads no group).
        self._timer.mark((False, False, False, False, True))
        self._timer.start()
        if self._budget is not None:  # takes in the steps measured so far; decides every 32nd step
            self._every = tuple(self._budget.plan(step))
        act, attn, grad = self._every
        self._act_on = step % act == 0
        self._attn_on = step % attn == 0
        self._grad_on = step % grad == 0 or not self._grad_norm_given
        self._update_on = self._update is not None and step % cfg.update_every == 0
        self._timer.tag((self._act_on, self._attn_on, self._grad_on, self._update_on, True))
        self._slots.reset()
        for _, zp in self._z_probes:
            zp.on = self._act_on
        if self._grad_on:
            self._pnorm.zero_()
            self._pseen = [False] * len(self._pseen)
        entropy_on = step % cfg.attn_entropy_every == 0
        for a in self._attn:
            a.probe.mode = a.mode if self._attn_on else None
            a.probe.entropy = entropy_on and a.probe.entropy_slot is not None
            a.probe.heads = self._heads(step, a.probe.n_head) if a.mode in ("exact", "sample") else None
        self._timer.stop(BASE)

    def _heads(self, step: int, n_head: int) -> torch.Tensor | None:
        """The heads the explicit path computes this step: attn_heads of them, rotating."""
        k = self.config.attn_heads
        if k is None or k >= n_head:
            return None
        start = (step * k) % n_head
        key = (start, n_head)
        if key not in self._head_index:  # built once per rotation, then reused: no H2D per step
            idx = [(start + j) % n_head for j in range(k)]
            self._head_index[key] = torch.tensor(idx, dtype=torch.long, device=self.device)
        return self._head_index[key]

    @contextmanager
    def measure_update(self):
        """Wrap the optimizer step (between begin_step and end_step) to measure update_ratio
        on sampled steps; a no-op context on the others:

            with th.measure_update():
                opt.step()          # or engine.step() under DeepSpeed

        Under ZeRO-3 or update_split every rank must enter it on the same steps (it all-reduces)."""
        if not self._update_on:
            yield
            return
        self._timer.start()
        self._update.before()
        self._timer.stop(UPDATE)
        yield
        self._timer.start()
        self._update.after()
        self._timer.stop(UPDATE)

    def grads_from_params(self, all_reduce=None) -> None:
        """Gradient norms read from each parameter's `.grad`, on a sampled step whose hooks saw
        no gradient: FSDP2 writes the reduce-scattered shard to `.grad` outside autograd, so the
        per-parameter hooks never fire. A DTensor's local shard is read; `all_reduce(t)` (SUM
        over the ranks, in place) then makes the group and global norms the whole model's.
        Call after backward, before or after the optimizer step (which leaves `.grad` as it is;
        thermowatch.watch calls it in its step post-hook, after a closure's backward), on every
        rank alike; a no-op where the hooks measured."""
        if not self._grad_on or any(self._pseen):
            return
        self._timer.start()
        self._grads_from_params(all_reduce)
        self._timer.stop(GRAD)

    def _grads_from_params(self, all_reduce) -> None:
        have = [(j, p.grad) for j, p in enumerate(self._params) if p.grad is not None]
        if not have:
            return
        grads = [g.to_local() if hasattr(g, "to_local") else g for _, g in have]
        norms = torch.stack(torch._foreach_norm(grads)).to(device=self.device, dtype=torch.float32)  # as clip_grad_norm_
        if len(have) == len(self._params):
            self._pnorm.copy_(norms)
        else:  # a parameter without a gradient this step (frozen, unused) keeps its zero
            self._pnorm.zero_()
            self._pnorm.index_copy_(0, torch.tensor([j for j, _ in have], dtype=torch.long, device=self.device), norms)
        self._pseen = [True] * len(self._pseen)
        self._sum_ranks = all_reduce if any(hasattr(g, "to_local") for _, g in have) else None

    def end_step(self, loss=None, lr=None, grad_norm=None) -> None:
        """Close the step: scalars (floats or device tensors, never synced), group grad norms
        (global norm over this rank's gradients when `grad_norm` is None), one host copy."""
        self._timer.start()
        buf = self._slots.buf
        for i, val in enumerate((loss, lr, grad_norm)):
            if isinstance(val, torch.Tensor):
                buf[i].copy_(val.detach().reshape(()))
            elif val is not None:
                buf[i].fill_(float(val))
        self._grad_norm_given = grad_norm is not None
        if self._budget is not None:  # the per-layer norms may thin only while the global one comes from the caller
            self._budget.grad_norm_given = self._grad_norm_given
        self._timer.stop(BASE)
        if self._grad_on and any(self._pseen):
            self._timer.start()
            self._grad_groups(global_norm=grad_norm is None)
            self._timer.stop(GRAD)
        self._timer.start()
        # The loop handed no norm over on a step the grad group did not read (the first step after
        # one that handed it over): the global norm is unread, left out of the record, not NaN.
        norm_unread = grad_norm is None and not self._grad_on
        self._act_on = self._attn_on = self._grad_on = self._update_on = False
        for a in self._attn:
            a.probe.mode = None
        for _, zp in self._z_probes:
            zp.on = False
        if len(self._pending) == _MAX_PENDING:  # its host buffer is about to be reused
            self._pending.popleft()
            self.dropped += 1
        extras = self._step_extras()
        out = buf if self.finish is None else self.finish(buf, self.finish_args)
        if self._host:
            if self._host[0].shape != out.shape or self._host[0].dtype != out.dtype:
                # Once, on the first step with a finish of another shape (nothing is pending yet).
                self._host = [torch.empty(out.shape, dtype=out.dtype, pin_memory=True) for _ in range(2)]
            host = self._host[self._ring]
            self._ring ^= 1
            host.copy_(out, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self._pending.append((self.step, host, event, extras, norm_unread))
        else:
            self._pending.append((self.step, out.clone() if out is buf else out, None, extras, norm_unread))
        self._timer.stop(BASE)

    def _grad_groups(self, global_norm: bool) -> None:
        """Per-group gradient norms (and the global one) from the per-parameter norms."""
        sq = self._pnorm.square()
        groups = torch.zeros(self._grad_slice.stop - self._grad_slice.start + 1, device=self.device)
        groups[:-1].index_add_(0, self._dst, sq.index_select(0, self._src))
        groups[-1] = sq.sum()
        if self._sum_ranks is not None:  # shards: the squares add up over the ranks
            self._sum_ranks(groups)
            self._sum_ranks = None
        groups.sqrt_()
        buf = self._slots.buf
        buf[self._grad_slice].copy_(groups[:-1])
        if global_norm:
            buf[2].copy_(groups[-1])

    def _step_extras(self) -> tuple[float, ...] | None:
        """The budget's figures for this step: for collect() to fill on the host, or (None) already
        in the device slots, where a finish reduces them across ranks."""
        b = self._budget
        if b is None:
            return None
        extras = (b.cost, *map(float, self._every))
        if self.finish is None:
            return extras
        if b.version != self._extras_version:  # four fills every DECIDE_EVERY steps at most
            self._extras_version = b.version
            for i, v in enumerate(extras):
                self._slots.buf[self._extras.start + i].fill_(v)
        return None

    @property
    def cost(self) -> float:
        """The measured fraction of the step the thermometers took over the last DECIDE_EVERY
        steps, off-steps included (budget.py); NaN before the first window or without a budget."""
        return self._budget.cost if self._budget is not None else float("nan")

    @property
    def cadence(self) -> dict[str, int]:
        """Group -> every: the cadences in force (the budget's, or the config's fixed ones)."""
        return {**dict(zip(BUDGETED, self._every)), "update": self.config.update_every}

    @property
    def over_budget(self) -> bool:
        """The floors alone exceed the budget: the groups run at their slowest (warned once)."""
        return self._budget is not None and self._budget.over_budget

    @property
    def pending_steps(self) -> list[int]:
        """Steps ended and not yet collected, oldest first."""
        return [p[0] for p in self._pending]

    def collect(self, block: bool = True) -> np.ndarray | None:
        """Values of the oldest ended step not yet collected (float64, aligned with `names`),
        each step at most once; None when nothing is waiting. On CUDA with block=False, None
        while its copy still runs (a step later it has long finished). `last_step` names the
        step returned."""
        if not self._pending:
            return None
        step, host, event, extras, norm_unread = self._pending[0]
        if event is not None:
            if not block and not event.query():
                return None
            event.synchronize()
        self._host_timer.start()
        self._pending.popleft()
        self.last_step, self.last_norm_unread = step, norm_unread
        values = host.numpy().astype(np.float64)
        if extras is not None:
            values[self._extras] = extras
        self._host_timer.stop(BASE)
        return values

    def discard_pending(self) -> int:
        """Forget ended steps not collected (a rollback abandons their trajectory). Returns how many."""
        n = len(self._pending)
        self._pending.clear()
        return n

    def as_dict(self, values: np.ndarray, step: int | None = None) -> dict[str, float]:
        """The figures of one collected step by name, those a budget left unread absent (never NaN:
        a NaN act_max reads as a non-finite finding; unread.py). `step`: the step `values` are of,
        by default the one the latest collect() returned (`th.as_dict(th.collect())`)."""
        step = self.last_step if step is None else step
        if step is None:
            return dict(zip(self.names, values.tolist()))
        self._host_timer.start()
        try:
            return self._unread.as_dict(values, step, norm_read=not self.last_norm_unread)
        finally:
            self._host_timer.stop(BASE)

    def detach(self) -> None:
        """Remove every hook and probe; the model then runs exactly as before instrument()."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for a in self._attn:
            if a.kind == "probe" and a.module.thermo_probe is a.probe:
                a.module.thermo_probe = None
        for mod, zp in self._z_probes:
            if mod.thermo_z_probe is zp:
                mod.thermo_z_probe = None
        self._detached = True

    def __enter__(self) -> "Thermometers":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()


_MAX_PENDING = 2  # one per pinned host buffer


def instrument(model: nn.Module, config: ThermometerConfig | None = None, device=None, *,
               grad_hooks: bool = True) -> Thermometers:
    """Attach thermometers to `model` (any nn.Module). See ThermometerConfig for what is measured.

    Call it once the model sits on its device (e.g. after `deepspeed.initialize`), or pass
    `device`: the slots are allocated there. Works on a ZeRO-3 model whose parameters are
    already partitioned (hooks go on the Parameter objects, which ZeRO keeps).

    `grad_hooks=False`: no hook per parameter; the caller calls `grads_from_params()` between
    backward and the optimizer step (thermowatch.watch does, in its step pre-hook). One foreach
    norm over the finished gradients: cheaper on a small model, the norm of what the optimizer
    steps with (accumulated micro-batches summed, AMP's scale already removed)."""
    return Thermometers(model, config, device, grad_hooks=grad_hooks)
