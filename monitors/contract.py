"""The types that cross the trainer <-> supervisor boundary.

Both sides import this module and nothing else from each other (DESIGN.md, import rule):
metric names, the per-step record, commands and their acknowledgements, findings, and the
small Protocols at the two seams (record sink, command channel).

Plain dataclasses and dicts only: this module must stay importable without torch so the
supervisor never pulls the trainer's stack in.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

# --- metric names (DESIGN.md, "Metric names") ------------------------------------------------

LOSS = "loss"
LR = "lr"
GRAD_NORM = "grad_norm"  # global, before clipping; also "grad_norm/<module>"
ATTN_LOGIT_MAX = "attn_logit_max"  # exact max of QK^T/sqrt(d), pre-softmax
ATTN_LOGIT_LSE = "attn_logit_lse"  # log-sum-exp bound: max <= lse <= max + ln(keys)
ATTN_ENTROPY_MIN = "attn_entropy_min"  # min over heads of the mean attention entropy, nats
ACT_MAX = "act_max"
ACT_MIN = "act_min"
Z = "z"  # log-sum-exp of the output logits
PARAM_NORM = "param_norm"
UPDATE_RATIO = "update_ratio"  # ||dW|| / ||W|| of one step; identical on every rank (mean)
TOKENS_PER_S = "tokens_per_s"
SKIPPED_STEPS = "skipped_steps"
# The LR multiplier on the schedule the trainer really used for the step (contract.multiplier_at
# of its own LR changes); the supervisor compares it with its own view (supervisor.judge.consistency).
LR_MULTIPLIER = "lr_multiplier"
# The largest LR the trainer's schedule will train at from this step on, under the multiplier in
# force (warm-up still to climb, or the current LR once it only decays). A forecast only the
# trainer can make: the supervisor sees the LR of each step, not the schedule ahead. The attention
# detectors act on a logit over the ceiling while this is still a multiple of the LR (issue 8).
LR_PEAK_AHEAD = "lr_peak_ahead"
# Consecutive checkpoint saves that failed (disk full, read-only volume, a rank's save raising),
# set by the controller in every record while it is above 0 and once more at 0 when a save
# succeeds again; the supervisor pages on it (supervisor.judge.checkpoint_health).
CHECKPOINT_FAILURES = "checkpoint_failures"
# What the thermometers cost (issue 36, monitors/thermometers/budget.py): the fraction of the step
# they took over a recent window, and the cadence in force per group, `thermometer_every/<group>`
# (act, attn, grad): a figure read every n-th step is NaN ("not read") on the others.
THERMOMETER_COST = "thermometer_cost"
THERMOMETER_EVERY = "thermometer_every"

SEP = "/"

# How the run controller reduces one metric across ranks. Anything not listed is averaged.
_REDUCE_MAX = frozenset({ATTN_LOGIT_MAX, ATTN_LOGIT_LSE, ACT_MAX, Z, GRAD_NORM, SKIPPED_STEPS})
_REDUCE_MIN = frozenset({ACT_MIN, ATTN_ENTROPY_MIN})
_REDUCE_SUM = frozenset({TOKENS_PER_S})


class Reduce(str, enum.Enum):
    MAX = "max"
    MIN = "min"
    MEAN = "mean"
    SUM = "sum"


def metric_key(name: str, module: str | None = None) -> str:
    """`attn_logit_max` + `blocks.3.attn` -> `attn_logit_max/blocks.3.attn`."""
    return f"{name}{SEP}{module}" if module else name


def split_key(key: str) -> tuple[str, str]:
    """Inverse of metric_key: returns (metric, module); module is "" for scalars."""
    name, _, module = key.partition(SEP)
    return name, module


def reduction(key: str) -> Reduce:
    name = split_key(key)[0]
    if name in _REDUCE_MAX:
        return Reduce.MAX
    if name in _REDUCE_MIN:
        return Reduce.MIN
    if name in _REDUCE_SUM:
        return Reduce.SUM
    return Reduce.MEAN


# --- the per-step record -----------------------------------------------------------------------

# |wall_time| at most this: a clock reading in seconds (the controller sends time.time()), bounded
# so the OpenAPI can state it (issue 21: +-1.8e308 is finite, and no clock reads it).
MAX_WALL_TIME = 1e15

# Keys of the flat JSON record that are not metrics.
RECORD_FIELDS = ("step", "sample_lo", "sample_hi", "tokens", "wall_time", "ranks", "ledger_digest")


@dataclass(slots=True)
class StepRecord:
    """One training step's thermometers, already reduced across ranks.

    `values` maps metric keys to floats (NaN and +-Inf are data, not errors).
    `ranks` maps a metric key to the rank that held the extreme, for keys reduced by max/min.
    `sample_lo`/`sample_hi` is the half-open range of *absolute* sample indices this step
    consumed (skipped indices inside it were passed over); the policy turns an onset step into
    a skip range with it. `ledger_digest` is contract.ledger_digest of the skip ledger the step
    was trained under ("" when the sender does not report it).
    """

    step: int
    values: dict[str, float]
    sample_lo: int = -1
    sample_hi: int = -1
    tokens: int = 0
    wall_time: float = 0.0
    ranks: dict[str, int] = field(default_factory=dict)
    ledger_digest: str = ""

    def to_json(self) -> dict[str, Any]:
        """Flat shape of DESIGN.md: {"step": 1200, "loss": 2.31, "attn_logit_max/...": 41.2}."""
        out: dict[str, Any] = {"step": self.step}
        if self.sample_lo >= 0:
            out["sample_lo"] = self.sample_lo
            out["sample_hi"] = self.sample_hi
        if self.tokens:
            out["tokens"] = self.tokens
        if self.wall_time:
            out["wall_time"] = self.wall_time
        if self.ranks:
            out["ranks"] = dict(self.ranks)
        if self.ledger_digest:
            out["ledger_digest"] = self.ledger_digest
        out.update(self.values)
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "StepRecord":
        """Parse the flat shape. Raises ContractError naming the bad field."""
        if not isinstance(obj, Mapping):
            raise ContractError(f"a step record must be a JSON object, got {type(obj).__name__}")
        step = json_int(obj.get("step"))
        if step is None or step < 0:
            raise ContractError(f"'step' must be a non-negative integer, got {obj.get('step')!r}")
        values: dict[str, float] = {}
        for key, val in obj.items():
            if key in RECORD_FIELDS:
                continue
            if isinstance(val, bool) or not isinstance(val, (int, float)):
                if val is None:
                    values[key] = math.nan
                    continue
                raise ContractError(f"step {step}: metric {key!r} must be a number, got {val!r}")
            values[key] = float(val)
        ranks = obj.get("ranks")
        ranks = {} if ranks is None else ranks  # not `or {}`: false or [] is not an object of ranks
        digest = obj.get("ledger_digest", "")
        if not isinstance(digest, str) or len(digest) > 64:
            raise ContractError(f"step {step}: 'ledger_digest' must be a short string, got {digest!r}")
        if not isinstance(ranks, Mapping):
            raise ContractError(f"step {step}: 'ranks' must be an object of metric -> rank")
        ints = {}
        for name, default in (("sample_lo", -1), ("sample_hi", -1), ("tokens", 0)):
            ints[name] = json_int(obj.get(name, default))
            if ints[name] is None:
                raise ContractError(f"step {step}: {name!r} must be an integer, got {str(obj.get(name))[:40]}")
        rank_of = {str(k): json_int(v) for k, v in ranks.items()}
        if None in rank_of.values():
            bad = next(k for k, v in rank_of.items() if v is None)
            raise ContractError(f"step {step}: ranks[{bad!r}] must be an integer rank, got {str(ranks[bad])[:40]}")
        wall = obj.get("wall_time", 0.0)
        if isinstance(wall, bool) or not isinstance(wall, (int, float)) or not -MAX_WALL_TIME <= wall <= MAX_WALL_TIME:
            raise ContractError(f"step {step}: 'wall_time' must be a finite number of seconds within "
                                f"+-{MAX_WALL_TIME:g}, got {str(wall)[:40]}")
        return cls(step=step, values=values, wall_time=float(wall), ranks=rank_of, ledger_digest=digest, **ints)


# --- commands, acknowledgements and the values they carry: monitors/commands.py ----------------
# (one vocabulary, re-exported here so both sides import it from the contract)

from thermowatch.monitors.commands import (  # noqa: E402
    BISECT_OUTCOMES, CAUSES, COMMAND_TYPES, INT32_MAX, INT64_MAX, MAX_LR_MULTIPLIER, Ack, Bisected, Cause, Command, CommandBody, CommandKind, ContractError,
    describe, describe_args, LRChange, Pause, Profile, Resume, Rollback, SampleRange, SetLR, Skip, Stop, dumps, json_int, ledger_digest, loads,
    merge_ranges, multiplier_at, parse_command, ranges_from_json, Replay,
)
from thermowatch.monitors.names import check_run_id  # noqa: E402


# --- findings (detectors -> policy) -------------------------------------------------------------


class Severity(str, enum.Enum):
    """How far the series is from its baseline. Says nothing about what may be done: see Outcome."""

    INFO = "info"
    WARN = "warn"
    CRITICAL = "critical"


class Outcome(str, enum.Enum):
    """What a finding may lead to (DESIGN.md, Trust: "three outcomes").

    watch  stored and drawn on the run's page; nobody is told
    alert  a message to the on-call engineer (Slack)
    act    the policy may change the run (roll back, lower the LR, pause), if its settings let it

    Only `act` can change a run. A detector says `act` only when its evidence is enough to
    justify an automatic change on its own (attention growth needs a second witness of harm).
    """

    WATCH = "watch"
    ALERT = "alert"
    ACT = "act"

    @property
    def rank(self) -> int:
        return _OUTCOME_RANK[self]


_OUTCOME_RANK = {Outcome.WATCH: 0, Outcome.ALERT: 1, Outcome.ACT: 2}

# A finding built without an outcome (a new signal, a stored finding from before outcomes
# existed) tells a human and changes nothing: the safe middle.
DEFAULT_OUTCOME = Outcome.ALERT


class Signal(str, enum.Enum):
    ATTN_LOGIT_GROWTH = "attn_logit_growth"
    ATTN_LOGIT_CEILING = "attn_logit_ceiling"
    LOSS_SPIKE = "loss_spike"
    LOSS_DEGRADATION = "loss_degradation"  # behind its own trend, no attention signal needed
    # An LR raise the schedule did not plan, the loss still behind its pre-raise trend a window
    # later (detectors/lr_jump.py): the policy sets the LR back to what it was before the raise.
    LR_JUMP = "lr_jump"
    # The loss and the gradient norm rising together against their own recent past, a few steps
    # in a row (detectors/co_rise.py): a blow-up that builds, acted on before it is a spike.
    LOSS_GRAD_RISE = "loss_grad_rise"
    # The loss behind the runs of the same model config that trained with no more LR so far
    # (monitors/envelope.py, judged by a supervisor job over the database): alert and page.
    LOSS_BEHIND_PEERS = "loss_behind_peers"
    GRAD_SPIKE = "grad_spike"
    NON_FINITE = "non_finite"
    ACT_OVERFLOW = "act_overflow"
    STALL = "stall"
    OUTLIER_RANK = "outlier_rank"
    # The trainer's effective LR multiplier or skip-ledger digest differs from the supervisor's
    # record of the commands it acknowledged (supervisor.judge.consistency): page, never act.
    STATE_MISMATCH = "state_mismatch"
    # The trainer could not save a checkpoint (supervisor.judge.checkpoint_health): page, never act.
    CHECKPOINT_FAILED = "checkpoint_failed"



# The divergences a rollback can fix, by default (a policy setting, `rollback_signals`): they live in
# the weights. The policy's default, and what the quarantine counts as the skipped data coming back.
DEFAULT_ROLLBACK_SIGNALS = frozenset(
    {Signal.ATTN_LOGIT_GROWTH, Signal.ATTN_LOGIT_CEILING, Signal.LOSS_SPIKE, Signal.LOSS_GRAD_RISE, Signal.NON_FINITE}
)

def signal_family(signal: "Signal | str") -> str:
    """The divergence a signal belongs to: attention-logit growth and ceiling are two views of one
    blowup ("attn_logit"), a building loss-and-gradient rise and a loss spike of one loss
    divergence ("loss_spike"); every other signal is its own. What a recurrence is judged by (the
    policy's ladder, the quarantine's verdicts)."""
    value = signal.value if isinstance(signal, Signal) else str(signal)
    if value in (Signal.ATTN_LOGIT_GROWTH.value, Signal.ATTN_LOGIT_CEILING.value):
        return "attn_logit"
    # A building blow-up is a loss spike seen early: one loss divergence, two views of it.
    return Signal.LOSS_SPIKE.value if value == Signal.LOSS_GRAD_RISE.value else value


def _outcome(value: Any) -> Outcome:
    if value is None or value == "":
        return DEFAULT_OUTCOME
    try:
        return Outcome(value)
    except ValueError as exc:
        raise ContractError(f"finding outcome {value!r} is not one of watch, alert, act") from exc


@dataclass(slots=True)
class Finding:
    """What a detector saw. `onset_step` is where the series left its baseline; `outcome` is
    what it may lead to (Outcome); `key` names it for de-duplication (finding_key)."""

    signal: Signal
    module: str  # "" for scalar series
    severity: Severity
    onset_step: int
    detect_step: int
    metric: str = ""  # the metric key the finding is about
    evidence: dict[str, Any] = field(default_factory=dict)
    outcome: Outcome = DEFAULT_OUTCOME

    @property
    def key(self) -> str:
        """Stable identity: the same detector judging the same step of the same series again
        (a batch delivered twice) produces the same key, so the store keeps one row."""
        return finding_key(self)

    def to_json(self) -> dict[str, Any]:
        return {
            "signal": self.signal.value,
            "module": self.module,
            "severity": self.severity.value,
            "outcome": self.outcome.value,
            "onset_step": self.onset_step,
            "detect_step": self.detect_step,
            "metric": self.metric,
            "evidence": self.evidence,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "Finding":
        """Findings stored before outcomes existed have none: they read as `alert`."""
        return cls(
            signal=Signal(obj["signal"]),
            module=str(obj.get("module", "")),
            severity=Severity(obj["severity"]),
            onset_step=int(obj["onset_step"]),
            detect_step=int(obj["detect_step"]),
            metric=str(obj.get("metric", "")),
            evidence=dict(obj.get("evidence") or {}),
            outcome=_outcome(obj.get("outcome")),
        )


def finding_key(f: Finding) -> str:
    """signal|metric-or-module|detect_step|outcome|severity. Onset is left out: it is an estimate
    that may shift with buffered history, while a re-judged step is the same event."""
    return f"{f.signal.value}|{f.metric or f.module}|{f.detect_step}|{f.outcome.value}|{f.severity.value}"


# --- run and checkpoint descriptions ------------------------------------------------------------


@dataclass(slots=True)
class RunInfo:
    """Sent by the run controller when a run (or a new attempt of it) starts."""

    run_id: str
    attempt: int
    world_size: int
    config: dict[str, Any] = field(default_factory=dict)
    start_step: int = 0
    hosts: dict[int, str] = field(default_factory=dict)  # rank -> node address

    def to_json(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "attempt": self.attempt, "world_size": self.world_size, "config": self.config,
                "start_step": self.start_step, "hosts": {str(k): v for k, v in self.hosts.items()}}

    @classmethod
    def from_json(cls, obj: Any) -> "RunInfo":
        if not isinstance(obj, Mapping):
            raise ContractError(f"run info must be a JSON object, got {type(obj).__name__}")
        if "run_id" not in obj:
            raise ContractError("missing field 'run_id'")
        run_id = check_run_id(obj["run_id"])  # the daemon's own rule: the client refuses what it would
        config, hosts = obj.get("config"), obj.get("hosts")
        config = {} if config is None else config  # null: none given; any other non-object is refused below
        hosts = {} if hosts is None else hosts
        if not isinstance(config, Mapping):
            raise ContractError("'config' must be an object")
        if not isinstance(hosts, Mapping):
            raise ContractError("'hosts' must be an object of rank -> host")
        bad = [k for k, v in hosts.items() if not (isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 9
                                                    and isinstance(v, str))]
        if bad:
            raise ContractError(f"'hosts' maps ranks (decimal strings) to host names (strings); {bad[0][:40]!r} is not "
                                "that")
        hosts = {int(k): v for k, v in hosts.items()}
        return cls(run_id=run_id, attempt=_req_int(obj, "attempt", 0, INT32_MAX),
                   world_size=_req_int(obj, "world_size", 1, INT32_MAX), config=dict(config),
                   start_step=_req_int(obj, "start_step", 0, INT64_MAX, 0), hosts=hosts)


@dataclass(slots=True)
class CheckpointInfo:
    """A checkpoint's manifest as the supervisor needs it (the full manifest rides in `manifest`)."""

    step: int
    path: str
    sample_cursor: int
    healthy: bool
    manifest: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "path": self.path, "sample_cursor": self.sample_cursor, "healthy": self.healthy,
                "manifest": self.manifest}

    @classmethod
    def from_json(cls, obj: Any) -> "CheckpointInfo":
        if not isinstance(obj, Mapping):
            raise ContractError(f"checkpoint must be a JSON object, got {type(obj).__name__}")
        path, healthy, manifest = obj.get("path"), obj.get("healthy"), obj.get("manifest")
        manifest = {} if manifest is None else manifest
        if not isinstance(path, str) or not path:
            raise ContractError(f"'path' must be a non-empty string, got {path!r}")
        if not isinstance(healthy, bool):
            raise ContractError(f"'healthy' must be true or false, got {healthy!r}")
        if not isinstance(manifest, Mapping):
            raise ContractError("'manifest' must be an object")
        return cls(step=_req_int(obj, "step", 0, INT64_MAX), path=path,
                   sample_cursor=_req_int(obj, "sample_cursor", 0, INT64_MAX), healthy=healthy,
                   manifest=dict(manifest))


class FinishReason(str, enum.Enum):
    """Why a run's attempt ended of its own accord (issue 22, item 9)."""

    COMPLETED = "completed"  # the planned step count was trained
    STOPPED = "stopped"  # a stop command ended it
    CLOSED = "closed"  # the user's loop ended (early, or with no total to reach) and closed the session


# JSON carries a non-finite loss as Python's json writes it (NaN, Infinity) or as the supervisor's
# answers spell it (the strings below); both read back as the float.
_NONFINITE_TEXT = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


@dataclass(frozen=True, slots=True)
class RunFinished:
    """Sent once when an attempt ends of its own accord: the last step trained, the loss it ended
    on (None: none measured; NaN or Inf is data, the loss a diverged run ended on), and why."""

    step: int
    final_loss: float | None
    reason: FinishReason

    def __post_init__(self) -> None:
        if isinstance(self.step, bool) or not isinstance(self.step, int) or not 0 <= self.step <= INT64_MAX:
            raise ContractError(f"'step' must be an integer in [0, 2**63-1], got {self.step!r}")
        if self.final_loss is not None and (isinstance(self.final_loss, bool)
                                            or not isinstance(self.final_loss, (int, float))):
            raise ContractError(f"'final_loss' must be a number or null, got {str(self.final_loss)[:40]!r}")
        if not isinstance(self.reason, FinishReason):
            try:
                object.__setattr__(self, "reason", FinishReason(self.reason))
            except ValueError:
                raise ContractError(f"'reason' must be one of {[r.value for r in FinishReason]}, "
                                    f"got {str(self.reason)[:40]!r}") from None
        if self.final_loss is not None:
            object.__setattr__(self, "final_loss", float(self.final_loss))

    def to_json(self) -> dict[str, Any]:
        """NaN/Inf as Python's json writes them (the supervisor's parser reads them)."""
        return {"step": self.step, "final_loss": self.final_loss, "reason": self.reason.value}

    @classmethod
    def from_json(cls, obj: Any) -> "RunFinished":
        if not isinstance(obj, Mapping):
            raise ContractError(f"a finished report must be a JSON object, got {type(obj).__name__}")
        loss = obj.get("final_loss")
        if isinstance(loss, str) and loss in _NONFINITE_TEXT:
            loss = _NONFINITE_TEXT[loss]
        if "reason" not in obj:
            raise ContractError("missing field 'reason'")
        return cls(step=_req_int(obj, "step", 0, INT64_MAX), final_loss=loss, reason=obj["reason"])

    def same_as(self, other: "RunFinished") -> bool:
        """Equality with NaN equal to NaN: a re-sent report is the same report (idempotent)."""
        a, b = self.final_loss, other.final_loss
        same_loss = a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))
        return self.step == other.step and self.reason == other.reason and same_loss


def _req_int(obj: Mapping[str, Any], name: str, lo: int, hi: int, default: Any = ...) -> int:
    v = obj.get(name, default)
    if v is ...:
        raise ContractError(f"missing field {name!r}")
    n = json_int(v)
    if n is None or not lo <= n <= hi:
        raise ContractError(f"{name!r} must be an integer in [{lo}, {hi}], got {v!r}")
    return n


# --- seams --------------------------------------------------------------------------------------


@runtime_checkable  # tests/client/test_sinks.py holds every sink to it
class RecordSink(Protocol):
    """Where the run controller sends what it measured. The supervisor's ingest implements it
    in-process (embedded mode) and over HTTP (cluster mode)."""

    def open_run(self, info: RunInfo) -> None: ...

    def write(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> None: ...

    def checkpoint_saved(self, run_id: str, attempt: int, ckpt: CheckpointInfo) -> None: ...

    def checkpoints_deleted(self, run_id: str, attempt: int, steps: Sequence[int], reason: str) -> None:
        """The trainer deleted these checkpoints (retention), as it did so: the supervisor's
        list and the page must never offer a checkpoint that is gone."""
        ...

    def finish_run(self, run_id: str, attempt: int, finished: RunFinished) -> None:
        """The attempt ended of its own accord (the loop closed, the steps were trained, a stop
        was obeyed): the run reads "finished" with its final loss. Sent once, before close()."""
        ...

    def drain(self, timeout: float | None = None) -> bool:
        """Hand on everything written so far now and wait until it is taken (stored, posted or
        spooled), `timeout` seconds at most (None: no limit; 0: start, do not wait); False if it
        was not. The barrier before a checkpoint and before an ack: the supervisor sees the steps
        trained before either. A sink that stores as it is called returns True at once."""
        ...

    def close(self) -> None: ...


class CommandChannel(Protocol):
    """How the run controller learns what to do. Polled between steps."""

    def poll(self, run_id: str) -> list[Command]: ...

    def ack(self, run_id: str, ack: Ack) -> None: ...


class AckWatch:
    """A CommandChannel that calls `on_ack(run_id, kind, ack)` for each acknowledgement, with the kind of
    the command it answers (the trainer's launcher prints it; the detached controller records it
    for its followers). Anything else goes to the real channel."""

    def __init__(self, inner: CommandChannel, on_ack: Callable[[str, str, Ack], None]) -> None:
        self.inner, self.on_ack = inner, on_ack
        self._kinds: dict[int, str] = {}

    def poll(self, run_id: str) -> list[Command]:
        cmds = self.inner.poll(run_id)
        for c in cmds:
            self._kinds[c.id] = c.kind.value
        return cmds

    def ack(self, run_id: str, ack: Ack) -> None:
        self.on_ack(run_id, self._kinds.pop(ack.command_id, "command"), ack)
        self.inner.ack(run_id, ack)

    def __getattr__(self, name: str):  # close, ...
        return getattr(self.inner, name)
