"""What thermowatch.watch sends for each step, and what it keeps of what it sent.

A step's figures: the thermometers (monitors/thermometers: reduced across ranks on the device,
read a step later with no sync), the loss, the LR the step trained at and the schedule's peak
ahead, the loop's own scalars; one StepRecord each, queued to the run's background sender. Kept
for the loop: the last loss (`final_loss`), whether every loss since the last checkpoint was
finite (`healthy`, the checkpoint's health), the path's newest losses and the steps whose
non-finite figures one rank alone held (a rollback's evidence for precise skip and replay triage)."""

from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Iterator

import torch

from thermowatch.monitors.collective import CollectiveReducer
from thermowatch.monitors.contract import LR_MULTIPLIER, LR_PEAK_AHEAD, StepRecord
from thermowatch.monitors.reduce import Reducer
from thermowatch.monitors.thermometers import ThermometerConfig, instrument
from thermowatch.probing import LossTrail
from thermowatch.ranks import Ranks

LOSSES_KEPT = 256  # the path's newest (step, loss): enough for a rollback's window and the trail


class LateScalars:
    """Without thermometers, a step's loss (the ranks' mean) and the loop's gradient norm, read as
    the thermometers read theirs: a CUDA tensor is reduced on its device and copied into pinned
    memory without a sync, and read once its copy is done (a step later it has long finished). A
    float(loss) every step instead made the host wait for the GPU: the client without thermometers
    cost more on an H200 than with them (x1.044 vs x1.021, BENCHMARKS.md). Elsewhere (a float, a
    CPU tensor) the figures are read at once."""

    def __init__(self, dist: Ranks) -> None:
        self.dist = dist
        self._pending: deque[tuple[int, object, torch.cuda.Event | None, dict[str, float]]] = deque()
        self._free: list[torch.Tensor] = []  # pinned [loss, grad_norm] buffers whose copy was read

    def put(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None,
            values: dict[str, float]) -> None:
        if not (isinstance(loss, torch.Tensor) and loss.is_cuda):
            gn = None if grad_norm is None else float(grad_norm)
            self._pending.append((step, (self.dist.mean(loss), gn), None, values))
            return
        out = torch.empty(2, dtype=torch.float32, device=loss.device)
        out[0].copy_(loss.detach().reshape(()))
        self.dist.sum_on_device(out[:1])
        if self.dist.world > 1:
            out[0].div_(self.dist.world)
        if isinstance(grad_norm, torch.Tensor):
            out[1].copy_(grad_norm.detach().reshape(()))
        else:
            out[1].fill_(math.nan if grad_norm is None else float(grad_norm))
        host = self._free.pop() if self._free else torch.empty(2, dtype=torch.float32, pin_memory=True)
        host.copy_(out, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((step, (host, grad_norm is not None), event, values))

    def ready(self, block: bool) -> Iterator[tuple[int, dict[str, float], dict[str, float]]]:
        """(step, its scalars, its values) of each step whose figures are read, oldest first
        (`block`: every pending one, waiting for its copy)."""
        while self._pending:
            step, got, event, values = self._pending[0]
            if event is not None:
                if not block and not event.query():
                    return
                event.synchronize()
                host, given = got
                loss, gn = host.tolist()
                self._free.append(host)
                got = (loss, gn if given else None)
            self._pending.popleft()
            loss, gn = got
            yield step, {"loss": loss} if gn is None else {"loss": loss, "grad_norm": gn}, values

    def discard(self) -> None:
        self._pending.clear()


class Recorder:
    """The record path of one Watch. `send(record)` is the run's (rank 0's Run; the other ranks'
    stand-in sends nothing); `digest()` is the skip ledger's digest each record carries."""

    def __init__(self, model: torch.nn.Module, thermometers: ThermometerConfig | bool | None, dist: Ranks,
                 send: Callable[[StepRecord], None], digest: Callable[[], str]) -> None:
        self.dist, self._send, self._digest = dist, send, digest
        self.final_loss = math.nan
        self.healthy = True  # every loss since the last checkpoint was finite
        self.trail = LossTrail(LOSSES_KEPT)  # the path's newest losses, the steps a rank broke alone
        self._meta: dict[int, tuple[int, int, float, float, float]] = {}  # step -> ids lo, hi, lr x, peak, lr
        self.th = None
        self._reducer: Reducer | None = None
        self._late = LateScalars(dist)  # the figures without thermometers
        if thermometers is not False:
            # gradient norms read from .grad in the optimizer post-hook (grads_from_params)
            self.th = instrument(model, thermometers if isinstance(thermometers, ThermometerConfig) else None,
                                 grad_hooks=False)
            if dist.world > 1:  # reduced on the device, in the step's stream, before the one host copy
                self.th.finish = CollectiveReducer(self.th.names, len(self.th.names), self.th.device)
                self._reducer = Reducer(self.th.names)

    def begin(self, step: int, lo: int, hi: int, multiplier: float, peak: float, lr: float, *, probe: bool) -> None:
        """Step `step` trains samples [lo, hi) at `lr` (the schedule's times `multiplier`); a
        precise skip's probe is never sent, so its thermometers stay off."""
        self._meta[step] = (lo, hi, multiplier, peak, lr)
        if self.th is not None and not probe:
            self.th.begin_step(step)

    def samples(self, step: int) -> tuple[int, int]:
        lo, hi, *_ = self._meta[step]
        return lo, hi

    def trained_at(self, step: int, lr: float) -> None:
        """The LR step `step` really trains at (a loop that sets it by hand has by optimizer.step())."""
        meta = self._meta.get(step)
        if meta is not None:
            self._meta[step] = (*meta[:4], lr)

    def drop(self, step: int) -> None:
        """A probe's step: nothing of it is sent."""
        self._meta.pop(step, None)

    def end(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor | float | None,
            values: dict[str, float]) -> None:
        """Close step `step`: its thermometers read later (a step behind, no sync), or at once
        without them."""
        lr = self._meta[step][4]
        if self.th is not None:
            self.th.end_step(loss=loss, lr=lr, grad_norm=grad_norm)
            self.drain(False, values)
            return
        self._late.put(step, loss, grad_norm, values)
        self.drain(False)

    def drain(self, block: bool, extra: dict[str, float] | None = None) -> None:
        """Send every step whose figures are read (`block`: wait for all of them)."""
        if self.th is None:
            for step, scalars, values in self._late.ready(block):
                self._emit(step, {**scalars, "lr": self._meta[step][4]}, values)
            return
        vals = self.th.collect(block=block)
        while vals is not None:
            ranks: dict[str, int] = {}
            if self._reducer is not None:
                vals, ranks = self._reducer.unpack(vals)
            # a budget's unread figures are absent, not NaN (issue 36)
            self._emit(self.th.last_step, self.th.as_dict(vals, self.th.last_step), extra or {}, ranks)
            vals = self.th.collect(block=block)

    def _emit(self, step: int, vals: dict[str, float], extra: dict[str, float],
              ranks: dict[str, int] | None = None) -> None:
        lo, hi, mult, peak, _ = self._meta.pop(step, (-1, -1, 1.0, math.nan, math.nan))
        vals = {**vals, LR_MULTIPLIER: mult, **{k: float(v) for k, v in extra.items()}}
        if math.isfinite(peak):
            vals[LR_PEAK_AHEAD] = peak
        loss = vals.get("loss", math.nan)
        self.healthy &= math.isfinite(loss)
        self.final_loss = loss
        self.trail.add(step, loss, vals.get("grad_norm"), vals, ranks)
        self._send(StepRecord(step=step, values=vals, sample_lo=lo, sample_hi=hi, wall_time=time.time(),
                              ranks=ranks or {}, ledger_digest=self._digest()))

    def grads_from_params(self) -> None:
        """Read the gradient norms the optimizer step used (its post-hook)."""
        if self.th is not None:
            self.th.grads_from_params(self.dist.sum_on_device)

    def rewind(self, loaded: int) -> tuple[list[tuple[int, float]], set[int]]:
        """A rollback loaded checkpoint `loaded`: what is pending is dropped and the path after it
        forgotten. Returns the abandoned path's losses and the ranks that broke alone on it."""
        left, lone = self.trail.abandon(loaded)
        if self.th is not None:
            self.th.discard_pending()
        self._late.discard()
        self._meta.clear()
        self.healthy = True
        return left, lone

    def detach(self) -> None:
        if self.th is not None:
            self.th.detach()
