"""What crosses the Ray seam between the run controller and its ranks (trainer.worker.TrainWorker,
trainer.local.InProcessGang), besides the LR changes (contract.LRChange): frozen dataclasses,
pickled by Ray as they are, so both sides read one field by one name (STYLE.md 13)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RankReady:
    """TrainWorker.setup's answer: the rank is up."""

    names: list[str]  # the thermometer keys of a step's vector, in order (tokens/s last)
    host: str  # socket.gethostname() of the rank's machine
    flops_per_token: int  # the model's, for MFU


@dataclass(frozen=True)
class TrainedStep:
    """One trained step as a rank hands it out (TrainWorker.step / drain), a step late."""

    step: int
    # Aligned with RankReady.names (driver reduction: this rank's own), or the reduced vector
    # packed by monitors.collective (collective reduction: rank 0's only).
    values: np.ndarray
    loss: float  # read from `values` on the rank: the host has it already
    sample_lo: int  # the half-open range of sample ids the step trained on
    sample_hi: int
    tokens: int
    global_batch: int
    seq_len: int
    time_s: float  # the step's wall time on this rank
    lr_multiplier: float  # absolute, on the schedule, in force at this step
    lr_peak_ahead: float  # the schedule's highest LR from this step on, times that multiplier
    ledger_digest: str  # of the skip ledger the rank trained with (monitors.contract.ledger_digest)
