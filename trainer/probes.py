"""Precise skip and replay triage in the bundled trainer (issue 39): the run controller
(trainer/controller.py) drives the same search as thermowatch.watch's loop
(thermowatch/probing.py, thermowatch/precise_skip.py), with its gang as the probes' trainer.

    rollback (a data rollback's skip, `precise_skip` on)
      -> the checkpoint loaded, the new attempt opened, nothing skipped yet (RunController.transition)
      -> the executor's Outcome (trainer/obey.py) -> `Probes.run`: each probe step is one
         `probe_step` call on every rank (the probe's ledger and cursor, the step's own values),
         judged here on the reduced loss (a non-finite gradient counts as a spike), never sent;
         a probe that ends loads the checkpoint again
      -> the offenders join the ledger, the ranks get the final data state, the ack leaves.

A probe's verdict needs no agreement between ranks here: the controller is one process and
reads the reduction of every rank's figures, where one rank's NaN wins. The search answers
within `max_seconds` (PreciseSkip), under the daemon's ack timeout; a gang failure cuts it short
and every suspect is skipped (the blunt skip the policy asked for)."""

from __future__ import annotations

import logging
import math
from typing import Protocol

import numpy as np

from thermowatch.monitors.contract import GRAD_NORM, LOSS, CheckpointInfo
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.precise_skip import PreciseSkip
from thermowatch.probing import Probing
from thermowatch.protocol import Outcome
from thermowatch.ranks import Ranks
from thermowatch.trainer.lifecycle import GangLike

log = logging.getLogger(__name__)


class ProbeController(Protocol):
    """What the probes read on the run controller (trainer.controller.RunController)."""

    gang: GangLike | None
    ledger: SkipLedger

    def reduce(self, outs: list) -> dict[str, float]: ...


class Probes:
    """One search from a rollback's checkpoint, on the controller's gang (thermowatch.probing's
    ProbeHost: `step`, `total`, `cursor`, `global_batch`, `dist`, `_load`)."""

    def __init__(self, ctl: ProbeController, ckpt: CheckpointInfo, probing: Probing, total: int,
                 global_batch: int, timeout_s: float) -> None:
        self.ctl, self.ckpt, self.probing = ctl, ckpt, probing
        self.total, self.global_batch, self.timeout_s = total, global_batch, timeout_s
        self.dist = Ranks()  # one process decides: the reduction already holds every rank's figures
        self._adopt()

    @classmethod
    def begin(cls, ctl: ProbeController, cfg: PreciseSkip, suspects: np.ndarray, ckpt: CheckpointInfo,
              left: list[tuple[int, float]], total: int, global_batch: int, timeout_s: float,
              rank: int | None = None) -> "Probes":
        """`left`: the abandoned path's (step, loss), where triage looks for the spike it replays;
        the spike bar's trail is the checkpoint's own newest losses (its manifest's `losses`)."""
        healthy = [float(v) for v in ckpt.manifest.get("losses") or []]
        probing = Probing.begin(cfg, suspects, ckpt.step, ctl.ledger.copy(), healthy, left, global_batch, rank)
        return cls(ctl, ckpt, probing, total, global_batch, timeout_s)

    def _adopt(self) -> None:
        data = self.ckpt.manifest["data"]
        self.step, self.cursor, self.tokens = self.ckpt.step, int(data["cursor"]), int(data["tokens_consumed"])

    def _load(self, step: int) -> int:
        """The checkpoint again, after a probe (Probing.advance calls it)."""
        self.ctl.gang.call("load", self.ckpt.path, timeout_s=self.timeout_s)
        self._adopt()
        return self.step

    def run(self, out: Outcome) -> Outcome:
        """Train the probes to the verdict; the rollback's Outcome (`out`, the executor's) with
        the search's words, `skipped` the offenders and `bisected` what it cost."""
        p = self.probing
        p.out = out
        while p.advance(self):
            self._train()
        return p.result()

    def _train(self) -> None:
        p = self.probing
        if p.clean is not None and self.cursor >= p.clean[1]:
            self.cursor = p.clean[0]  # replay triage's known-clean samples, round again
        step = self.step + 1
        ids = p.ledger.take(self.cursor, self.global_batch)
        state = {**self.ckpt.manifest["data"], "cursor": self.cursor, "tokens_consumed": self.tokens,
                 "step": self.step, "skip_ranges": p.ledger.to_json()}
        outs = self.ctl.gang.call("probe_step", step, state, timeout_s=self.timeout_s)
        first = outs[0]
        if first is None or first.step != step or first.sample_hi != int(ids[-1]) + 1:
            raise RuntimeError(f"probe step {step}: the ranks trained {first and (first.sample_lo, first.sample_hi)}, "
                               f"the probe's ledger gives ids up to {int(ids[-1])}")
        values = self.ctl.reduce(outs)
        loss, grad = values.get(LOSS, math.nan), values.get(GRAD_NORM, 0.0)
        # a non-finite gradient is a spike at its step, as on the recorded path (the loop's rule)
        p.observe(step, ids, loss if math.isfinite(grad) else math.nan)
        self.step, self.cursor, self.tokens = step, first.sample_hi, self.tokens + first.tokens
