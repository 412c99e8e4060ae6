"""Commands, acknowledgements and the values they carry across the trainer <-> supervisor
boundary: one typed vocabulary (DESIGN.md, "Trust"; STYLE.md rule 13).

Each command kind is a frozen dataclass validated in its constructor, so the HTTP API, the CLI,
the policy's executor and the run controller cannot disagree on what is valid: they all build
these. Integer fields are bounded by what the supervisor's columns hold, so a command whose
acknowledgement could not be stored is refused when it is built. `thermowatch.monitors.contract`
re-exports every name here; import them from there.

Plain Python only (no torch, no numpy): the supervisor imports this.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import warnings
from dataclasses import dataclass
from typing import AbstractSet, Any, ClassVar, Iterable, Mapping, Sequence, Union

import numpy as np


class ContractError(ValueError):
    """A record, command or ack that does not match the contract. The message names the field."""


# --- values that cross the boundary: limits, sample ranges, LR changes, one JSON codec ---------

# Integer limits the supervisor's columns hold (BIGINT on PostgreSQL; SQLite's INTEGER is the same
# 64 bits), so a command whose acknowledgement could not be stored is refused when it is built,
# not after the trainer has carried it out. Action ids are INTEGER (32 bits) on PostgreSQL.
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
# An LR multiplier above this is a typo (10x the schedule diverges any tuned run).
MAX_LR_MULTIPLIER = 10.0


def dumps(obj: Any) -> str:
    """The one JSON encoder for what crosses a process: NaN and +-Infinity are data and travel
    as the literals Python's json writes and reads (a finding's evidence, a step's values)."""
    return json.dumps(obj, allow_nan=True, separators=(",", ":"))


def json_safe(obj: Any) -> Any:
    """What is stored as JSON (a finding's evidence, a detector's state, an action's args, an audit
    entry): non-finite floats become the strings "nan", "inf", "-inf" (PostgreSQL's json type
    rejects NaN literals; Python's float() reads the strings back), numpy scalars plain numbers.
    The HTTP API's answers spell them "NaN"/"Infinity" instead, for JavaScript's Number()
    (supervisor/store/views.py, to_wire)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "nan" if math.isnan(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, (np.floating, np.integer)):
        return json_safe(obj.item())
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def loads(text: str | bytes) -> Any:
    """The decoder matching `dumps` (accepts NaN, Infinity, -Infinity). ContractError if unreadable."""
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ContractError(f"not valid JSON: {exc}") from None


def json_int(v: Any) -> int | None:
    """An integer as JSON carries it: an int, or a float with no fraction (`232.0` is the integer
    232 to JSON and to JSON Schema's "integer", which schema-driven clients send); None for
    anything else (bools, strings, 1.5, NaN)."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, float) and v.is_integer() and abs(v) < 2.0**63:
        return int(v)
    return None


def _int(owner: str, name: str, v: Any, lo: int = 0, hi: int = INT64_MAX) -> int:
    n = json_int(v)
    if n is None or not lo <= n <= hi:
        limit = "2**63-1" if hi == INT64_MAX else ("2**31-1" if hi == INT32_MAX else str(hi))
        raise ContractError(f"{owner}: {name} must be an integer in [{lo}, {limit}], got {v!r}")
    return n


def _opt_int(owner: str, name: str, v: Any, lo: int = 0, hi: int = INT64_MAX) -> int | None:
    return None if v is None else _int(owner, name, v, lo, hi)


def _float(owner: str, name: str, v: Any, lo: float, hi: float, *, lo_open: bool = True) -> float:
    ok = not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
    if ok:
        ok = (lo < v if lo_open else lo <= v) and v <= hi
    if not ok:
        raise ContractError(f"{owner}: {name} must be a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}], "
                            f"got {v!r}")
    return float(v)


def _opt_str(owner: str, name: str, v: Any) -> str | None:
    """A text field or null; not str() of whatever came ({} is not a path or a node name)."""
    if v is not None and not isinstance(v, str):
        raise ContractError(f"{owner}: {name} must be a string or null, got {str(v)[:40]}")
    return v


def _only(owner: str, obj: Any, known: AbstractSet[str]) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise ContractError(f"{owner} must be a JSON object, got {type(obj).__name__}")
    extra = sorted(set(obj) - known)
    if extra:
        raise ContractError(f"{owner}: unknown field(s) {extra}; expected some of {sorted(known)}")
    return obj


def _args(command: Any, args: Any) -> Mapping[str, Any]:
    """A command's JSON args: no key its class does not take (its ARGS), and the one it needs
    (NEEDS: the key and what it means) given."""
    o = _only(command.kind.value, args, command.ARGS)
    needs = getattr(command, "NEEDS", None)
    if needs is not None and o.get(needs[0]) is None:
        raise ContractError(f"{command.kind.value} needs {needs[0]}: {needs[1]}")
    return o


def _fields(owner: str, obj: Any, required: tuple[str, ...], optional: tuple[str, ...] = ()) -> Mapping[str, Any]:
    """`obj` as a JSON object of these fields only, every `required` one present."""
    o = _only(owner, obj, {*required, *optional})
    for name in required:
        if name not in o:
            raise ContractError(f"{owner}: missing field {name!r}")
    return o


@dataclass(frozen=True, slots=True)
class SampleRange:
    """Half-open [lo, hi) of absolute sample ids (DESIGN.md, "Rollback semantics")."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        _int("skip range", "lo", self.lo)
        _int("skip range", "hi", self.hi)
        if self.lo >= self.hi:
            raise ContractError(f"skip range [{self.lo}, {self.hi}) is empty: lo must be < hi")

    def __len__(self) -> int:
        return self.hi - self.lo

    def to_json(self) -> list[int]:
        return [self.lo, self.hi]

    @classmethod
    def from_json(cls, obj: Any) -> "SampleRange":
        if not isinstance(obj, (list, tuple)) or len(obj) != 2:
            raise ContractError(f"a skip range is a pair [lo, hi] of absolute sample ids, got {obj!r}")
        return cls(obj[0], obj[1])

    def __str__(self) -> str:
        return f"[{self.lo}, {self.hi})"


def ranges_from_json(obj: Any, *, drop_empty: bool = False) -> tuple[SampleRange, ...]:
    """`drop_empty`: a pair of valid sample ids with lo >= hi is an empty range, so nothing, and
    is dropped rather than refused (an ack reports what was done; a command must say what to do)."""
    if obj is None:
        return ()
    if not isinstance(obj, (list, tuple)):
        raise ContractError(f"skip ranges must be a list of [lo, hi] pairs, got {obj!r}")
    return tuple(SampleRange.from_json(r) for r in obj if not (drop_empty and _empty_pair(r)))


def _empty_pair(r: Any) -> bool:
    if not isinstance(r, (list, tuple)) or len(r) != 2:
        return False
    lo, hi = json_int(r[0]), json_int(r[1])
    return lo is not None and hi is not None and 0 <= hi <= lo <= INT64_MAX


def merge_ranges(ranges: Iterable[SampleRange | Sequence[int]]) -> tuple[SampleRange, ...]:
    """The one range merge: sorted, overlapping and touching ranges fused (the ledger's form)."""
    out: list[list[int]] = []
    for lo, hi in sorted((r.lo, r.hi) if isinstance(r, SampleRange) else (int(r[0]), int(r[1])) for r in ranges):
        if lo >= hi:
            continue
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return tuple(SampleRange(lo, hi) for lo, hi in out)


def ledger_digest(ranges: Iterable[SampleRange | Sequence[int]]) -> str:
    """A short digest of a skip ledger (merged first, so equal ledgers digest equally). The
    trainer puts it in every step record; the supervisor compares it with its own ledger."""
    canon = dumps([r.to_json() for r in merge_ranges(ranges)])
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class LRChange:
    """The LR multiplier on the schedule is `multiplier` from `start_step` on, for `steps` steps
    (None = for the rest of the run). Absolute, never relative: a newer change replaces the
    older ones for the steps it covers (`multiplier_at`), so 0.5 then 0.25 trains at x0.25.
    `rewarmup_steps` ramps it in linearly from 0: after a rollback the optimizer moments are
    those of the checkpoint, and OPT-175B's logbook restarts with a short warm-up."""

    start_step: int
    multiplier: float
    steps: int | None = None
    rewarmup_steps: int = 0

    def __post_init__(self) -> None:
        _int("LRChange", "start_step (1-based)", self.start_step, 1)
        object.__setattr__(self, "multiplier", _float("LRChange", "multiplier", self.multiplier, 0.0,
                                                      MAX_LR_MULTIPLIER))
        _opt_int("LRChange", "steps", self.steps, 1)
        _int("LRChange", "rewarmup_steps", self.rewarmup_steps, 0)

    def covers(self, step: int) -> bool:
        k = step - self.start_step
        return k >= 0 and (self.steps is None or k < self.steps)

    def factor(self, step: int) -> float:
        """The multiplier at `step` (this change alone); 1.0 outside its window."""
        if not self.covers(step):
            return 1.0
        k = step - self.start_step
        if k < self.rewarmup_steps:
            return self.multiplier * (k + 1) / self.rewarmup_steps
        return self.multiplier

    def to_json(self) -> dict[str, Any]:
        return {"start_step": self.start_step, "multiplier": self.multiplier, "steps": self.steps,
                "rewarmup_steps": self.rewarmup_steps}

    @classmethod
    def from_json(cls, obj: Any) -> "LRChange":
        o = _only("LR change", obj, {"start_step", "multiplier", "steps", "rewarmup_steps"})
        if "start_step" not in o or "multiplier" not in o:
            raise ContractError(f"LR change needs start_step and multiplier, got {dict(o)!r}")
        return cls(o["start_step"], o["multiplier"], o.get("steps"), o.get("rewarmup_steps", 0))


def multiplier_at(step: int, changes: Sequence[LRChange]) -> float:
    """The multiplier in force at `step`: the newest change (in the order they were applied)
    whose window covers it, else 1.0. Trainer and supervisor both call this one function."""
    for change in reversed(changes):
        if change.covers(step):
            return change.factor(step)
    return 1.0


# --- commands (supervisor -> run controller) ---------------------------------------------------


class Word(str, enum.Enum):
    """A stored word with a closed vocabulary: compares equal to its value, and formats and
    prints as it (an f-string of a plain str mixin prints "ActionState.DONE" on Python 3.11+)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class CommandKind(Word):
    PAUSE = "pause"
    RESUME = "resume"
    ROLLBACK = "rollback"
    SKIP = "skip"
    SET_LR = "set_lr"
    STOP = "stop"
    PROFILE = "profile"


@dataclass(frozen=True, slots=True)
class SetLR:
    """Set the LR multiplier (absolute, on the schedule) from the step it takes effect.
    `factor`/`base` record the relative request it came from ("halve it": factor 0.5 of base
    0.5 -> multiplier 0.25), for people; the trainer reads only the absolute fields."""

    kind: ClassVar[CommandKind] = CommandKind.SET_LR
    multiplier: float
    steps: int | None = None
    rewarmup_steps: int = 0
    factor: float | None = None
    base: float | None = None

    def __post_init__(self) -> None:
        # The change's rules, under the names people type (the CLI's and the API's field names).
        object.__setattr__(self, "multiplier", _float("set_lr", "lr_multiplier", self.multiplier, 0.0,
                                                      MAX_LR_MULTIPLIER))
        _opt_int("set_lr", "lr_steps", self.steps, 1)
        _int("set_lr", "rewarmup_steps", self.rewarmup_steps, 0)
        if self.factor is not None:
            _float("set_lr", "factor", self.factor, 0.0, MAX_LR_MULTIPLIER)
        if self.base is not None:
            _float("set_lr", "base", self.base, 0.0, MAX_LR_MULTIPLIER)

    def change(self, start_step: int) -> LRChange:
        return LRChange(start_step, self.multiplier, self.steps, self.rewarmup_steps)

    def describe(self) -> str:
        rel = f" (x{self.factor:g} of x{self.base:g})" if self.factor is not None and self.base is not None else ""
        span = f" for {self.steps} steps" if self.steps else ""
        return f"lr x{self.multiplier:g}{rel}{span}"

    _KEYS: ClassVar[dict[str, str]] = {"lr_multiplier": "multiplier", "lr_steps": "steps",
                                       "rewarmup_steps": "rewarmup_steps", "lr_factor": "factor",
                                       "lr_base": "base"}
    ARGS: ClassVar[frozenset[str]] = frozenset(_KEYS)  # the JSON args from_args takes (the API's mirror: schemas.py)
    NEEDS: ClassVar[tuple[str, str]] = ("lr_multiplier",
                                        f"the absolute multiplier on the schedule, in (0, {MAX_LR_MULTIPLIER:g}]")

    def to_args(self) -> dict[str, Any]:
        out = {"lr_multiplier": self.multiplier, "lr_steps": self.steps, "rewarmup_steps": self.rewarmup_steps}
        if self.factor is not None:
            out.update(lr_factor=self.factor, lr_base=self.base)
        return out

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "SetLR":
        o = _args(cls, args)
        # rewarmup_steps null is 0; not `v or 0`, which took {} or false for 0 as well
        return cls(**{cls._KEYS[k]: (v if k != "rewarmup_steps" or v is not None else 0) for k, v in o.items()})


@dataclass(frozen=True, slots=True)
class Rollback:
    """Load the newest valid, healthy checkpoint at or before `to_step` (exactly `to_step` with
    `exact`), add `skip` to the ledger, set `lr` from the step after the checkpoint: one restart."""

    kind: ClassVar[CommandKind] = CommandKind.ROLLBACK
    to_step: int
    exact: bool = False
    skip: tuple[SampleRange, ...] = ()
    lr: SetLR | None = None
    checkpoint: str | None = None  # the path the policy chose (informational; to_step decides)
    exclude_rank: int | None = None
    exclude_node: str | None = None

    ARGS: ClassVar[frozenset[str]] = frozenset({"to_step", "exact", "checkpoint", "skip_ranges", "exclude_rank",
                                                "exclude_node", *SetLR.ARGS})
    NEEDS: ClassVar[tuple[str, str]] = ("to_step", "roll back to the newest healthy checkpoint at or before it")

    def __post_init__(self) -> None:
        _int("rollback", "to_step", self.to_step)
        if not isinstance(self.exact, bool):
            raise ContractError(f"rollback: exact must be true or false, got {self.exact!r}")
        object.__setattr__(self, "skip", tuple(self.skip))
        _opt_int("rollback", "exclude_rank", self.exclude_rank, 0, INT32_MAX)

    def to_args(self) -> dict[str, Any]:
        out: dict[str, Any] = {"to_step": self.to_step}
        if self.exact:
            out["exact"] = True
        if self.checkpoint:
            out["checkpoint"] = self.checkpoint
        if self.skip:
            out["skip_ranges"] = [r.to_json() for r in self.skip]
        if self.lr is not None:
            out.update(self.lr.to_args())
        if self.exclude_rank is not None or self.exclude_node:
            out.update(exclude_rank=self.exclude_rank, exclude_node=self.exclude_node)
        return out

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "Rollback":
        o = _args(cls, args)
        lr_args = {k: v for k, v in o.items() if k in SetLR._KEYS and v is not None}
        return cls(to_step=o["to_step"], exact=o.get("exact", False), skip=ranges_from_json(o.get("skip_ranges")),
                   lr=SetLR.from_args(lr_args) if lr_args.get("lr_multiplier") is not None else None,
                   checkpoint=_opt_str("rollback", "checkpoint", o.get("checkpoint")),
                   exclude_rank=o.get("exclude_rank"),
                   exclude_node=_opt_str("rollback", "exclude_node", o.get("exclude_node")))


@dataclass(frozen=True, slots=True)
class Skip:
    """Never train the samples in `ranges` (absolute ids), from now on."""

    kind: ClassVar[CommandKind] = CommandKind.SKIP
    ARGS: ClassVar[frozenset[str]] = frozenset({"skip_ranges"})
    ranges: tuple[SampleRange, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranges", tuple(self.ranges))
        if not self.ranges:
            raise ContractError("skip needs skip_ranges: [[lo, hi], ...] absolute sample ids, lo < hi")

    def to_args(self) -> dict[str, Any]:
        return {"skip_ranges": [r.to_json() for r in self.ranges]}

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "Skip":
        o = _args(cls, args)
        return cls(ranges_from_json(o.get("skip_ranges")))


@dataclass(frozen=True, slots=True)
class Profile:
    """Trace the next `steps` steps with torch.profiler (into `out_dir`, or the run's profiles/)."""

    kind: ClassVar[CommandKind] = CommandKind.PROFILE
    ARGS: ClassVar[frozenset[str]] = frozenset({"steps", "out_dir"})
    steps: int = 5
    out_dir: str | None = None

    def __post_init__(self) -> None:
        _int("profile", "steps", self.steps, 1, 100_000)

    def to_args(self) -> dict[str, Any]:
        return {"steps": self.steps, **({"out_dir": self.out_dir} if self.out_dir else {})}

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "Profile":
        o = _args(cls, args)
        return cls(o.get("steps", 5), _opt_str("profile", "out_dir", o.get("out_dir")))


def _no_args(kind: CommandKind):
    @dataclass(frozen=True, slots=True)
    class NoArgs:
        def to_args(self) -> dict[str, Any]:
            return {}

        @classmethod
        def from_args(cls, args: Mapping[str, Any]):
            _args(cls, args or {})
            return cls()

    NoArgs.kind = kind  # type: ignore[attr-defined]
    NoArgs.ARGS = frozenset()  # type: ignore[attr-defined]
    NoArgs.__name__ = NoArgs.__qualname__ = kind.value.capitalize()
    return NoArgs


MAX_PAUSE_REASON = 2000  # characters: the policy's reasons for a pause, or a person's words


@dataclass(frozen=True, slots=True)
class Pause:
    """Wait between two steps until a resume, a rollback or a stop. `reason`: why, in the words the
    policy or the person who paused gave; the paused loop prints it with the commands that end the
    pause (issue 35: paused loops printed nothing and waited until someone happened to look)."""

    kind: ClassVar[CommandKind] = CommandKind.PAUSE
    ARGS: ClassVar[frozenset[str]] = frozenset({"reason"})
    reason: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.reason, str) or len(self.reason) > MAX_PAUSE_REASON:
            raise ContractError(f"pause: reason must be text of at most {MAX_PAUSE_REASON} characters, "
                                f"got {str(self.reason)[:40]!r}{' ...' if len(str(self.reason)) > 40 else ''}")

    @classmethod
    def saying(cls, text: str) -> "Pause":
        """A pause whose reason is `text`, cut to MAX_PAUSE_REASON characters."""
        return cls(text if len(text) <= MAX_PAUSE_REASON else text[:MAX_PAUSE_REASON - 4] + " ...")

    def to_args(self) -> dict[str, Any]:
        return {"reason": self.reason} if self.reason else {}

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> "Pause":
        o = _args(cls, args or {})
        return cls(_opt_str("pause", "reason", o.get("reason")) or "")


Resume = _no_args(CommandKind.RESUME)
Stop = _no_args(CommandKind.STOP)

CommandBody = Union[Rollback, Skip, SetLR, Profile, Pause, Any]  # Resume, Stop: built by _no_args
COMMAND_TYPES: dict[CommandKind, Any] = {c.kind: c for c in (Rollback, Skip, SetLR, Profile, Pause, Resume, Stop)}


def describe(body: CommandBody) -> str:
    """A command in plain words, for alerts and terminals (never a Python dict, issue 23):
    "roll back to the newest healthy checkpoint at or before step 100, skip samples [200, 240),
    LR x0.5"."""
    if isinstance(body, Rollback):
        words = [f"roll back to checkpoint {body.to_step}" if body.exact
                 else f"roll back to the newest healthy checkpoint at or before step {body.to_step}"]
        if body.skip:
            words.append("skip samples " + ", ".join(str(r) for r in body.skip))
        if body.lr is not None:
            words.append(describe(body.lr))
        if body.exclude_node:
            words.append(f"without node {body.exclude_node}")
        elif body.exclude_rank is not None:
            words.append(f"without rank {body.exclude_rank}")
        return ", ".join(words)
    if isinstance(body, Skip):
        return "skip samples " + ", ".join(str(r) for r in body.ranges)
    if isinstance(body, SetLR):
        rel = f" (x{body.factor:g} of the x{body.base:g} in force)" if body.factor is not None and body.base is not None else ""
        span = f" for {body.steps} steps" if body.steps else ""
        warm = f", re-warmed over {body.rewarmup_steps} steps" if body.rewarmup_steps else ""
        return f"set the LR to x{body.multiplier:g} of the schedule{rel}{span}{warm}"
    if isinstance(body, Profile):
        return f"profile the next {body.steps} steps"
    return body.kind.value  # pause, resume, stop


def parse_command(kind: CommandKind | str, args: Mapping[str, Any] | None) -> CommandBody:
    """A command body from its kind and JSON args; ContractError names the bad field."""
    try:
        k = CommandKind(kind)
    except ValueError:
        raise ContractError(f"unknown command {kind!r}; expected one of {[c.value for c in CommandKind]}") from None
    return COMMAND_TYPES[k].from_args(args or {})


def describe_args(kind: str, args: Mapping[str, Any]) -> str:
    """describe() of a stored action's kind and args. A row that is no valid command (written by
    an older version) is shown as its kind and raw arguments, never an error."""
    try:
        return describe(parse_command(kind, args))
    except ContractError:
        return f"{kind} " + ", ".join(f"{k} {v}" for k, v in (args or {}).items())


@dataclass(frozen=True, slots=True)
class Command:
    """One command from the supervisor's action queue. `id` is the action row's id."""

    id: int
    body: CommandBody

    def __post_init__(self) -> None:
        _int("command", "id", self.id, 0, INT32_MAX)
        if type(self.body) not in COMMAND_TYPES.values():
            raise ContractError(f"command {self.id}: body must be one of the command types, got {self.body!r}")

    @property
    def kind(self) -> CommandKind:
        return self.body.kind

    @property
    def args(self) -> dict[str, Any]:
        return self.body.to_args()

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind.value, "args": self.args}

    @classmethod
    def from_json(cls, obj: Any) -> "Command":
        o = _only("command", obj, {"id", "kind", "args"})
        return cls(id=_int("command", "id", o.get("id"), 0, INT32_MAX), body=parse_command(o.get("kind"), o.get("args")))


# cleared: replay triage (issue 39) found the cause was not the data, so nothing was skipped
BISECT_OUTCOMES = ("narrowed", "inseparable", "budget", "cleared")
# Replay triage's labels (thermowatch/precise_skip.py, Search): the divergence reproduced with the
# same samples and not without the suspects (data), did not reproduce (hardware: a transient
# fault), or reproduced without the suspects too (optimizer: its state or the LR).
CAUSES = ("data", "hardware", "optimizer")

class ActionState(Word):
    """An action's life (the command queue's rows, supervisor/store/actions.py), one vocabulary
    for the store, the executor, the API, the page and the CLI's `--wait`:
    pending -> sent -> acked -> done, or failed / cancelled / expired on the way."""

    PENDING = "pending"  # waiting to be polled (or for a person's approval: requires_approval)
    SENT = "sent"  # in a poll's answer, not yet acknowledged
    ACKED = "acked"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def next_states(self) -> frozenset["ActionState"]:
        return _ACTION_MOVES[self]

    @property
    def is_final(self) -> bool:
        return not _ACTION_MOVES[self]


_ACTION_MOVES: dict[ActionState, frozenset[ActionState]] = {
    ActionState.PENDING: frozenset({ActionState.SENT, ActionState.FAILED, ActionState.CANCELLED, ActionState.EXPIRED}),
    # sent -> pending: redelivered after a lost poll answer
    ActionState.SENT: frozenset({ActionState.ACKED, ActionState.FAILED, ActionState.PENDING, ActionState.EXPIRED}),
    ActionState.ACKED: frozenset({ActionState.DONE, ActionState.FAILED, ActionState.EXPIRED}),
    ActionState.DONE: frozenset(), ActionState.FAILED: frozenset(), ActionState.CANCELLED: frozenset(),
    ActionState.EXPIRED: frozenset(),
}
ACTION_STATES = tuple(ActionState)
FINAL_STATES = tuple(x for x in ActionState if x.is_final)
OPEN_STATES = tuple(x for x in ActionState if not x.is_final)


class ActionOrigin(Word):
    """Who decided an action: the policy (`auto`) or a person (`manual`: the CLI, the API, the page)."""

    AUTO = "auto"
    MANUAL = "manual"


def _loss(owner: str, name: str, v: Any) -> float | None:
    if v is None:
        return None
    return _float(owner, name, v, -1e30, 1e30)


@dataclass(frozen=True, slots=True)
class Replay:
    """One replay of replay triage (issue 39), trained from the rollback's checkpoint: with the
    same samples as the path the rollback abandoned (`suspects_skipped` false) or with every
    suspect skipped (the healthy path's last samples before the checkpoint in their place). Whether its loss spiked (precise skip's bar), at which step (`step`: the
    spike's, or the last step trained when it ran clean), the loss there and the level it was
    judged against (the median of the newest 4 before it), and the steps it trained. A loss is
    None when it was not finite (NaN or Inf: a JSON column on PostgreSQL refuses them); a level
    is None when the bar had fewer than 4 losses yet."""

    suspects_skipped: bool
    spiked: bool
    step: int
    loss: float | None
    level: float | None
    steps: int

    def __post_init__(self) -> None:
        if not isinstance(self.suspects_skipped, bool) or not isinstance(self.spiked, bool):
            raise ContractError("replay: suspects_skipped and spiked must be true or false")
        _int("replay", "step", self.step)
        _int("replay", "steps", self.steps)
        object.__setattr__(self, "loss", _loss("replay", "loss", self.loss))
        object.__setattr__(self, "level", _loss("replay", "level", self.level))

    def to_json(self) -> dict[str, Any]:
        return {"suspects_skipped": self.suspects_skipped, "spiked": self.spiked, "step": self.step,
                "loss": self.loss, "level": self.level, "steps": self.steps}

    @classmethod
    def from_json(cls, obj: Any) -> "Replay":
        names = ("suspects_skipped", "spiked", "step", "loss", "level", "steps")
        o = _fields("replay", obj, names)
        return cls(*(o[n] for n in names))

    def words(self) -> str:
        what = "without the suspects" if self.suspects_skipped else "of the same samples"
        if self.spiked:
            over = "" if self.level is None else f" over a level of {self.level:.3g}"
            return f"the replay {what} spiked at step {self.step}, loss {_loss_words(self.loss)}{over}"
        return f"the replay {what} ran clean through step {self.step}, loss {_loss_words(self.loss)}"


def _loss_words(v: float | None) -> str:
    return "non-finite" if v is None else f"{v:.3g}"


@dataclass(frozen=True, slots=True)
class Cause:
    """Replay triage's verdict (issue 39), before precise skip bisects: `label` (CAUSES), its
    evidence (the step where the abandoned path's loss spiked, `recorded_step`, and its loss
    there; the replays, the same samples first, then without the suspects when the first spiked)
    and what the replays cost (steps, seconds). The label follows from the replays: the checks
    below keep a label and its evidence from disagreeing on the wire. `rank`: under torchrun, the
    one rank whose figures went non-finite on the abandoned path, when only one did (the
    reduction names the rank that held a NaN extreme); None when every rank did, or no figure
    named one."""

    label: str
    recorded_step: int
    recorded_loss: float | None
    replays: tuple[Replay, ...]
    steps: int
    seconds: float
    rank: int | None = None

    def __post_init__(self) -> None:
        if self.label not in CAUSES:
            raise ContractError(f"cause: label must be one of {CAUSES}, got {self.label!r}")
        _int("cause", "recorded_step", self.recorded_step)
        object.__setattr__(self, "recorded_loss", _loss("cause", "recorded_loss", self.recorded_loss))
        object.__setattr__(self, "replays", tuple(self.replays))
        _int("cause", "steps", self.steps)
        object.__setattr__(self, "seconds", _float("cause", "seconds", self.seconds, 0.0, 1e9, lo_open=False))
        object.__setattr__(self, "rank", _opt_int("cause", "rank", self.rank, 0, INT32_MAX))
        r = self.replays
        if not 1 <= len(r) <= 2 or r[0].suspects_skipped or (len(r) == 2 and not r[1].suspects_skipped):
            raise ContractError("cause: replays are the same samples' replay, then (when it spiked) the one "
                                "without the suspects")
        label = ("hardware" if not r[0].spiked else None if len(r) < 2
                 else "optimizer" if r[1].spiked else "data")
        if label != self.label:
            raise ContractError(f"cause: label {self.label!r} disagrees with its replays (they say {label!r})")

    def words(self) -> str:
        """"hardware (the replay of the same samples ran clean through step 171, ...)": the label and
        its evidence."""
        return (f"{self.label} ({'; '.join(x.words() for x in self.replays)}; the run had spiked at step "
                f"{self.recorded_step}, loss {_loss_words(self.recorded_loss)}"
                + (f", only rank {self.rank}'s figures non-finite" if self.rank is not None else "") + ")")

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "recorded_step": self.recorded_step, "recorded_loss": self.recorded_loss,
                "replays": [x.to_json() for x in self.replays], "steps": self.steps, "seconds": self.seconds,
                "rank": self.rank}

    @classmethod
    def from_json(cls, obj: Any) -> "Cause":
        o = _fields("cause", obj, ("label", "recorded_step", "recorded_loss", "replays", "steps", "seconds"),
                    ("rank",))  # rank: a client before it sends none
        if not isinstance(o["replays"], list):
            raise ContractError("cause: replays must be a list")
        return cls(o["label"], o["recorded_step"], o["recorded_loss"], tuple(Replay.from_json(x) for x in o["replays"]),
                   o["steps"], o["seconds"], o.get("rank"))


@dataclass(frozen=True, slots=True)
class Bisected:
    """A precise skip's search (thermowatch/precise_skip.py): the rollback's suspect samples,
    how many probes and training steps the search spent re-training from the checkpoint and in
    how many seconds, and its outcome: narrowed (the ack's `skipped` is fewer than the suspects),
    inseparable (no half spiked alone: all of them skipped) or budget (it ran out of steps or time:
    what it had not cleared is skipped) or cleared (replay triage found the cause was not the data:
nothing skipped). `cause`: replay triage's verdict, None when it did not run (an older client,
a divergence the loss did not show, or the budget ran out during it)."""

    suspects: tuple[SampleRange, ...]
    probes: int
    steps: int
    seconds: float
    outcome: str
    cause: Cause | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "suspects", tuple(self.suspects))
        _int("bisected", "probes", self.probes, 0, INT32_MAX)
        _int("bisected", "steps", self.steps)
        object.__setattr__(self, "seconds", _float("bisected", "seconds", self.seconds, 0.0, 1e9, lo_open=False))
        if self.outcome not in BISECT_OUTCOMES:
            raise ContractError(f"bisected: outcome must be one of {BISECT_OUTCOMES}, got {self.outcome!r}")
        if self.cause is not None and not isinstance(self.cause, Cause):
            raise ContractError(f"bisected: cause must be a Cause, got {type(self.cause).__name__}")
        # cleared <=> the cause is not the data (nothing skipped)
        if (self.outcome == "cleared") != (self.cause is not None and self.cause.label != "data"):
            raise ContractError(f"bisected: outcome 'cleared' goes with a cause other than data, and only with it "
                                f"(outcome {self.outcome!r}, cause {self.cause.label if self.cause else None!r})")

    @property
    def samples(self) -> int:
        return sum(len(r) for r in self.suspects)

    def to_json(self) -> dict[str, Any]:
        return {"suspects": [r.to_json() for r in self.suspects], "probes": self.probes, "steps": self.steps,
                "seconds": self.seconds, "outcome": self.outcome,
                "cause": None if self.cause is None else self.cause.to_json()}

    @classmethod
    def from_json(cls, obj: Any) -> "Bisected":
        o = _fields("bisected", obj, ("suspects", "probes", "steps", "seconds", "outcome"), ("cause",))
        cause = o.get("cause")  # absent from an older client's acks
        return cls(ranges_from_json(o["suspects"]), o["probes"], o["steps"], o["seconds"], o["outcome"],
                   None if cause is None else Cause.from_json(cause))


# Ack fields renamed for one name per concept (issue 38), read under their old names for one
# release: an older client's acks, and the acks stored in action rows before the rename.
ACK_OLD_NAMES = {"step": "first_step", "skipped": "skip_ranges"}


@dataclass(frozen=True, slots=True)
class Ack:
    """The run controller's answer, carrying what really happened. `first_step` is the first
    step trained after the command took effect (after a rollback to checkpoint T, T + 1); the
    rest say what it did: the checkpoint loaded (rollback: `checkpoint_step`), the effective LR
    multiplier at `first_step`, the LR change it applied and that change's position in the
    trainer's list (`lr_seq`, the order changes are applied in), the sample ranges it added to
    the skip ledger (`skip_ranges`, half-open), and the ledger's digest afterwards; `bisected`,
    when a precise skip searched the rollback's suspects for the ones it skipped (Bisected).
    `step` and `skipped`, the old names, are read for one release (a DeprecationWarning)."""

    command_id: int
    ok: bool
    first_step: int
    detail: str = ""
    checkpoint_step: int | None = None
    checkpoint_path: str | None = None
    lr_multiplier: float | None = None
    lr_change: LRChange | None = None
    lr_seq: int | None = None
    skip_ranges: tuple[SampleRange, ...] = ()
    ledger_digest: str = ""
    bisected: Bisected | None = None

    def __init__(self, command_id: int, ok: bool, first_step: int | None = None, detail: str = "",
                 checkpoint_step: int | None = None, checkpoint_path: str | None = None,
                 lr_multiplier: float | None = None, lr_change: LRChange | None = None, lr_seq: int | None = None,
                 skip_ranges: Iterable[SampleRange] = (), ledger_digest: str = "", bisected: Bisected | None = None,
                 **old: Any) -> None:
        for name in old:
            if name not in ACK_OLD_NAMES:
                raise TypeError(f"Ack() got an unexpected keyword argument {name!r}")
            _deprecated(name)
        if "step" in old:
            if first_step is not None:
                raise ContractError("ack: first_step and step (its old name) both given")
            first_step = old["step"]
        if "skipped" in old:
            if skip_ranges:
                raise ContractError("ack: skip_ranges and skipped (its old name) both given")
            skip_ranges = old["skipped"]
        if first_step is None:
            raise ContractError("ack: missing field 'first_step', the first step trained after the command")
        for name, value in (("command_id", command_id), ("ok", ok), ("first_step", first_step), ("detail", detail),
                            ("checkpoint_step", checkpoint_step), ("checkpoint_path", checkpoint_path),
                            ("lr_multiplier", lr_multiplier), ("lr_change", lr_change), ("lr_seq", lr_seq),
                            ("skip_ranges", tuple(skip_ranges)), ("ledger_digest", ledger_digest),
                            ("bisected", bisected)):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        _int("ack", "command_id", self.command_id, 0, INT32_MAX)
        if not isinstance(self.ok, bool):  # bool("false") is True: a refused rollback read as done
            raise ContractError(f"ack: ok must be true or false, got {self.ok!r}")
        _int("ack", "first_step", self.first_step)
        _opt_int("ack", "checkpoint_step", self.checkpoint_step)
        _opt_int("ack", "lr_seq", self.lr_seq, 0, INT32_MAX)
        if self.lr_multiplier is not None:
            object.__setattr__(self, "lr_multiplier", _float("ack", "lr_multiplier", self.lr_multiplier, 0.0,
                                                             MAX_LR_MULTIPLIER, lo_open=False))
        if (self.lr_change is None) != (self.lr_seq is None):
            raise ContractError("ack: lr_change and lr_seq go together (the change and its place in the list)")
        if not isinstance(self.detail, str) or not isinstance(self.ledger_digest, str):
            raise ContractError("ack: detail and ledger_digest must be strings")

    @property
    def step(self) -> int:
        """Deprecated: first_step."""
        _deprecated("step")
        return self.first_step

    @property
    def skipped(self) -> tuple[SampleRange, ...]:
        """Deprecated: skip_ranges."""
        _deprecated("skipped")
        return self.skip_ranges

    def to_json(self) -> dict[str, Any]:
        return {"command_id": self.command_id, "ok": self.ok, "first_step": self.first_step, "detail": self.detail,
                "checkpoint_step": self.checkpoint_step, "checkpoint_path": self.checkpoint_path,
                "lr_multiplier": self.lr_multiplier,
                "lr_change": None if self.lr_change is None else self.lr_change.to_json(), "lr_seq": self.lr_seq,
                "skip_ranges": [r.to_json() for r in self.skip_ranges], "ledger_digest": self.ledger_digest,
                "bisected": None if self.bisected is None else self.bisected.to_json()}

    @classmethod
    def from_json(cls, obj: Any) -> "Ack":
        o = dict(_only("ack", obj, {"command_id", "ok", "first_step", "detail", "checkpoint_step", "checkpoint_path",
                                    "lr_multiplier", "lr_change", "lr_seq", "skip_ranges", "ledger_digest",
                                    "bisected", *ACK_OLD_NAMES}))
        for old, new in ACK_OLD_NAMES.items():  # an older client's ack (null: not given)
            if o.get(old) is not None:
                if new in o:
                    raise ContractError(f"ack: {new} and {old} (its old name) both given")
                o[new] = o[old]
            o.pop(old, None)
        for name in ("command_id", "ok", "first_step"):
            if name not in o:
                raise ContractError(f"ack: missing field {name!r}")
        path = o.get("checkpoint_path")
        return cls(o["command_id"], o["ok"], o["first_step"], o.get("detail", ""), o.get("checkpoint_step"),
                   _opt_str("ack", "checkpoint_path", path), o.get("lr_multiplier"),
                   None if o.get("lr_change") is None else LRChange.from_json(o["lr_change"]), o.get("lr_seq"),
                   # issue 21: [x, x) is schema-valid (JSON Schema cannot say lo < hi) and skipped nothing
                   ranges_from_json(o.get("skip_ranges"), drop_empty=True), o.get("ledger_digest", ""),
                   None if o.get("bisected") is None else Bisected.from_json(o["bisected"]))


def _deprecated(old: str) -> None:
    warnings.warn(f"Ack.{old} is deprecated: use {ACK_OLD_NAMES[old]} (the old name is read until the next "
                  "release)", DeprecationWarning, stacklevel=3)
