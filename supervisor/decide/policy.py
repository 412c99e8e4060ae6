"""The supervisor's decision: a pure function from one finding and the run's state to an action.

Only a finding whose outcome is `act` can change the run (DESIGN.md, Trust: three outcomes):
`watch` is recorded (no command), `alert` tells a human (no command, `alert`), whatever the
signal, the severity or the state of the run. An `act` finding still only acts if its signal is in `rollback_signals`
and its severity is at least `act_min_severity` (critical by default: a warning never acts).

Shaped like Ray Train v2's failure policy (`make_decision(status) -> Decision`): no DB, no clock,
no I/O. The responder (supervisor/act/respond.py) gathers a `PolicyInput` and calls
`make_decision`; the Decision holds the typed command (monitors/commands.py: Rollback, SetLR,
Pause) that the executor (supervisor/act/executor.py) stores as it is and hands to the trainer.
Every decision carries `reasons`: sentences an engineer reads in Slack at 3 a.m.

The ladder (DESIGN.md, "Rollback semantics"):

    rung 1  a rollback signal (attention-logit growth/ceiling, loss spike, a building loss and
            gradient rise, non-finite: monitors.contract.DEFAULT_ROLLBACK_SIGNALS)
            -> roll back to the newest HEALTHY checkpoint at or before onset - margin and skip the
               samples of the steps from onset - margin to the detection step (PaLM: restart
               ~100 steps before the spike, skip 200-500 batches). With none that old (a run
               younger than the margin): the oldest healthy one before the onset, skipping from
               the step after it.
    rung 2  the same signal again within `recurrence_window_steps` of a rollback
            -> roll back again AND lower the LR, one command (OPT-175B did this by hand; YaLM:
               halving the LR cost ~30% speed, which is why it is the second rung, not the first).
    rung 2  at once, for an attention finding that acts on the LR forecast alone (a logit over the
            ceiling while the schedule will still raise the LR, monitors/detectors/witness.py):
            -> lower the LR in place. Nothing is damaged yet, so there is nothing to roll back,
               and a rollback that kept the schedule would replay the same rise.
    rung 2  for an LR jump (monitors/detectors/lr_jump.py: a raise the schedule did not plan, the
            loss still behind its pre-raise trend a window later)
            -> set the LR back to what it was before the raise, in place. The damage is slow and
               the LR explains it; a rollback would keep the weights' history no better. Off with
               `revert_lr_jumps: false` (then it alerts).
    rung 1  non-finite values within BAD_LOAD_STEPS of where a rollback re-started (its first
            re-trained steps): the checkpoint it loaded holds bad weights, not the data or the LR
            -> distrust that checkpoint and roll back to the newest healthy one before it, at
               the same LR, skipping nothing more (Megatron-LM #5281: a corrupt checkpoint gave
               NaN three steps after every load, 44 restarts). At most MAX_BAD_LOADS of these in
               a row, then rung 3.
    rung 3  too many automatic interventions in `intervention_window_s`, the per-day rollback
            cap, no healthy checkpoint before the onset, the LR floor, or an action that failed
            -> PAUSE and page a human.

Cooldowns count steps, not seconds (issue 22): a fast loop trains hundreds of steps in a 600 s
cooldown, time enough to diverge again unchecked. An action's cooldown runs from the step it
took effect (the ack's first trained step: T + 1 after a rollback to T) for `cooldown_steps`
steps of the trajectory it left running. Findings of an attempt a rollback left behind are never
acted on. `cooldown_s` adds a wall-clock cooldown for teams who want one (off by default).

Time is epoch seconds (float) everywhere. A checkpoint at step s holds the weights after step s,
so a rollback to s replays from step s + 1; `skip_steps` is an inclusive step range.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Sequence, Union

from thermowatch.monitors.commands import CommandKind, ContractError, Pause, Rollback, SetLR
from thermowatch.monitors.contract import (DEFAULT_ROLLBACK_SIGNALS, CheckpointInfo, Finding, Outcome, Severity, Signal,
                                          signal_family)
from thermowatch.monitors.settings import SettingError, check_number
from thermowatch.supervisor.errors import UserError

DAY_S = 86_400.0


# The commands the policy may tell a run (monitors/commands.py's typed commands, stored and
# delivered as the policy built them): each changes the run, so each needs approval in
# advise-only mode and counts towards the caps.
PolicyCommand = Union[Rollback, SetLR, Pause]
ACTIONS = frozenset({CommandKind.ROLLBACK, CommandKind.SET_LR, CommandKind.PAUSE})
# Kinds after which the same signal coming back counts as a recurrence (rung 2).
_LADDER_KINDS = frozenset({CommandKind.ROLLBACK, CommandKind.SET_LR})

# A non-finite value within this many steps of a rollback's first re-trained step means the
# checkpoint it loaded is bad (Megatron-LM #5281: NaN three steps after every load). Constants, not
# PolicyConfig fields: a healthy checkpoint does not go non-finite within 3 steps at the LR it was
# saved at, so there is nothing for a team to tune.
BAD_LOAD_STEPS = 3
# Checkpoints that may prove bad one after another before a human is paged (the first rollback's
# target, then two fallbacks further back): more in a row is a broken loader or storage, not one
# bad file.
MAX_BAD_LOADS = 2

# A rollback cannot fix these: a stall is not in the weights, an outlier rank is hardware.
_NEVER_ROLLBACK = frozenset({Signal.STALL, Signal.OUTLIER_RANK})

_SEVERITY_ORDER = {Severity.INFO: 0, Severity.WARN: 1, Severity.CRITICAL: 2}

# Why a signal that is not a rollback signal only alerts (shown in the Slack message).
_ALERT_ONLY_WHY = {
    Signal.GRAD_SPIKE: (
        "gradient-norm spikes alone only alert: most are transient and absorbed by clipping "
        "(OPT-175B and PaLM logged many that never diverged); a loss or attention-logit signal "
        "confirms a real divergence and triggers the rollback"
    ),
    Signal.STALL: "a stall is not in the weights, so a rollback cannot fix it; someone needs to look at the run",
    Signal.ACT_OVERFLOW: (
        "activation overflow only alerts by default: it becomes a non-finite finding if it matters; "
        "add act_overflow to rollback_signals to act on it directly"
    ),
    Signal.LOSS_BEHIND_PEERS: (
        "a run behind the runs of its model config that trained with no more LR learns worse than it "
        "could: a rollback replays the same LR, so a human should decide (lower the LR, or compare the configs)"
    ),
    Signal.LOSS_DEGRADATION: (
        "a loss falling behind its own trend only alerts by default: a rollback replays the same LR, "
        "so a human should decide (lower the LR by hand, or add loss_degradation to rollback_signals)"
    ),
}


class PolicyConfigError(UserError):
    """A PolicyConfig field out of range. The message names the field, the value and the fix."""


def _signals(value: Iterable[Signal | str], name: str) -> frozenset[Signal]:
    try:
        return frozenset(Signal(v) for v in value)
    except ValueError as exc:
        known = ", ".join(s.value for s in Signal)
        raise PolicyConfigError(f"{name}: {exc}; known signals: {known}") from exc


@dataclass(frozen=True)
class PolicyConfig:
    """Per-run policy settings. YAML lists only what differs from these defaults."""

    # PaLM restarted ~100 steps before a spike; small runs (checkpoints every ~50 steps) use ~20.
    rollback_margin_steps: int = 100
    # A data rollback (a loss or gradient spike: the data is the likely cause) also skips this many
    # steps' worth of samples past the detection, not trained yet: a bad stretch of data (a corrupt
    # shard, a broken file) goes on past the step it was seen at. Issue 35: 15 poisoned steps, seen
    # one step in; the re-trained path met the rest and took two more rollbacks, 80-144 poisoned
    # samples trained on the paths they abandoned. A few clean steps ahead cost less than the
    # margin behind (rollback_margin_steps) already does; precise skip narrows both. 0: off.
    skip_ahead_steps: int = 16
    # The same signal within this many steps of a rollback means skipping data was not enough.
    recurrence_window_steps: int = 500
    # Rung 2's factor on the LR multiplier in force (relative: 0.5 halves it); YaLM: halving cost
    # ~30% speed, so it is not rung 1. `lr_multiplier` is always absolute (on the schedule) elsewhere.
    lr_factor: float = 0.5
    # Deprecated (issue 38: the only relative `lr_multiplier` in the product): read as lr_factor
    # for one release, with a warning. Removed after.
    lr_multiplier: float | None = None
    # Floor for the cumulative multiplier: below it the run barely learns; a human should decide.
    min_lr_multiplier: float = 0.1
    # None = lower for good (OPT-175B lowered it by hand and kept it); N = for N steps only.
    lr_steps: int | None = None
    # With lr_steps: steps to ramp back up to the schedule afterwards (a jump back can re-spike).
    rewarmup_steps: int = 0
    # Rung 2 rolls back again and lowers the LR in one command; False lowers the LR in place
    # (cheaper when checkpoints are far apart and the run has not diverged yet).
    recurrence_rollback: bool = True
    # More automatic actions than this within intervention_window_s -> rung 3 (pause, page).
    max_interventions: int = 4
    intervention_window_s: float = 6 * 3600.0
    # A finding within this many steps of where an action took effect (after a rollback to T:
    # from T + 1, on the re-trained attempt) is waiting for it to work: the same signal is the
    # same incident (noop), another one alerts. Steps, not seconds: step time varies 1000x
    # between a CPU toy and a cluster (issue 22). Keep it below rollback_margin_steps, so a
    # recurrence at the old onset is past it.
    cooldown_steps: int = 50
    # Also a wall-clock cooldown after any automatic action (0 or None: off). A fast loop trains
    # hundreds of steps in 600 s with nothing acting (issue 22), so it is off by default.
    cooldown_s: float | None = 0.0
    # OPT-175B: 105 restarts in ~2 months (~2/day) by hand; many more a day means it is not working.
    max_rollbacks_per_day: int = 8
    # Every action (rollback, lower LR, pause) needs a human's approval; alerts go out as usual.
    advise_only: bool = False
    # While a proposal waits for approval, the run is paused once it has trained this many steps
    # past the finding, rather than training on into the divergence (issue 37: the approval's
    # cost grew from 74 to 130 discarded steps while nobody answered). The approval's rollback, or
    # `thermowatch resume`, ends that pause. None: never paused for a wait.
    approval_pause_after_steps: int | None = 20
    # A second gate after the outcome: `act` findings below this severity only alert. Critical
    # by default, so no finding labelled a warning can roll a run back (issue 8: warn-level
    # attention growth on healthy runs rolled them back when this was "warn").
    act_min_severity: Severity = Severity.CRITICAL
    # Grad spikes, activation overflow and loss degradation are left out on purpose (see
    # _ALERT_ONLY_WHY); add loss_degradation to act on a run falling behind its own trend.
    rollback_signals: frozenset[Signal] = DEFAULT_ROLLBACK_SIGNALS
    # Set the LR back after an LR jump that did lasting harm (the signal lr_jump). A jump's
    # finding is an act only when its harm outlasted the detector's window, so this is on.
    revert_lr_jumps: bool = True
    # Alert-only signals that also page: a stalled run burns GPU hours until someone looks; a run
    # behind its peers (issue 24, item 1: "degradation that pages") learns worse by the hour.
    page_signals: frozenset[Signal] = frozenset({Signal.STALL, Signal.LOSS_BEHIND_PEERS})
    # Tell Slack about ranks far from the others (OPT-175B hunted bad nodes for weeks).
    outlier_rank_alerts: bool = True
    # Restart from the newest healthy checkpoint without the outlier's node. Off: draining a
    # node is a cluster decision, and a wrong call loses a node's worth of throughput.
    restart_without_outlier: bool = False

    def __post_init__(self) -> None:
        # Accept strings from YAML for the enum fields.
        object.__setattr__(self, "rollback_signals", _signals(self.rollback_signals, "rollback_signals"))
        object.__setattr__(self, "page_signals", _signals(self.page_signals, "page_signals"))
        try:
            object.__setattr__(self, "act_min_severity", Severity(self.act_min_severity))
        except ValueError as exc:
            raise PolicyConfigError(
                f"act_min_severity={self.act_min_severity!r}; use one of info, warn, critical"
            ) from exc
        bad = self.rollback_signals & _NEVER_ROLLBACK
        if bad:
            names = ", ".join(sorted(s.value for s in bad))
            raise PolicyConfigError(
                f"rollback_signals contains {names}: a rollback cannot fix it; remove it "
                "(outlier ranks are handled by restart_without_outlier)"
            )
        if self.approval_pause_after_steps is not None:
            try:
                check_number("approval_pause_after_steps", self.approval_pause_after_steps, lo=0, integer=True)
            except SettingError as exc:
                raise PolicyConfigError(f"{exc} (steps), or null") from None
        for name in ("rollback_margin_steps", "cooldown_steps", "rewarmup_steps", "skip_ahead_steps"):
            if getattr(self, name) < 0:
                raise PolicyConfigError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("recurrence_window_steps", "max_interventions", "max_rollbacks_per_day"):
            if getattr(self, name) < 1:
                raise PolicyConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.cooldown_s is None:
            object.__setattr__(self, "cooldown_s", 0.0)
        # Finite, of their kind, in range (monitors.settings, issue 34): `cooldown_s: .inf` read as
        # "never act again", and a NaN passed every `< 0` check.
        for name, lo_open, hint in (("intervention_window_s", True, "seconds"),
                                    ("cooldown_s", False, "seconds; 0 or null turns it off")):
            try:
                check_number(name, getattr(self, name), lo=0, lo_open=lo_open)
            except SettingError as exc:
                raise PolicyConfigError(f"{exc} ({hint})") from None
        if self.lr_multiplier is not None:
            if not (isinstance(self.lr_multiplier, (int, float)) and 0.0 < self.lr_multiplier < 1.0):
                raise PolicyConfigError(f"lr_multiplier={self.lr_multiplier} (the old name of lr_factor) must be in "
                                        "(0, 1): it lowers the LR (0.5 halves it)")
            if self.lr_factor not in (0.5, self.lr_multiplier):
                raise PolicyConfigError(f"lr_multiplier={self.lr_multiplier} and lr_factor={self.lr_factor} both set: "
                                        "lr_multiplier is lr_factor's old name; keep lr_factor only")
            warnings.warn(f"policy.lr_multiplier is deprecated: it is now policy.lr_factor (rung 2's relative factor: "
                          f"0.5 halves the multiplier in force); read as lr_factor={self.lr_multiplier:g}; rename it",
                          FutureWarning, stacklevel=3)
            object.__setattr__(self, "lr_factor", float(self.lr_multiplier))
            object.__setattr__(self, "lr_multiplier", None)
        if not 0.0 < self.lr_factor < 1.0:
            raise PolicyConfigError(
                f"lr_factor={self.lr_factor} must be in (0, 1): it lowers the LR (0.5 halves it)"
            )
        if not 0.0 < self.min_lr_multiplier <= 1.0:
            raise PolicyConfigError(f"min_lr_multiplier={self.min_lr_multiplier} must be in (0, 1]")
        if self.lr_steps is not None and self.lr_steps < 1:
            raise PolicyConfigError(f"lr_steps={self.lr_steps} must be >= 1, or None to lower the LR for good")


@dataclass(frozen=True, slots=True)
class Intervention:
    """One past action on this run (from the action rows), newest last or in any order."""

    kind: CommandKind  # a manual skip is booked as a rollback (respond._intervention_kind)
    signal: Signal | None  # None for manual actions not tied to a finding
    module: str
    step: int  # the run's step when the action was decided (the finding's detect step)
    time: float  # epoch seconds when it was decided
    ok: bool  # False: it failed
    automatic: bool = True  # False: issued by a human (CLI, web); not counted against the caps
    # ROLLBACK: the step it went back to, and whether it also lowered the LR. After a rollback
    # that kept the LR (rung 1), rung 2 goes back no later than that target: the checkpoints
    # saved since were trained at the very LR that diverged again.
    to_step: int | None = None
    lowered_lr: bool = False
    skipped_samples: bool = False  # ROLLBACK: it skipped samples (a data rollback)
    # The first step trained after it took effect (the ack's first_step; after a rollback to T, T + 1);
    # None until it is acknowledged. Cooldowns count from here.
    first_step: int | None = None
    # The attempt its finding was judged on; a rollback leaves this attempt (and older) behind.
    attempt: int | None = None
    seq: int = 0  # orders actions decided in the same second (the action row's id: higher is newer)
    # ROLLBACK: the checkpoint the trainer really loaded (its ack's checkpoint_step; to_step
    # when it fell back on a corrupt one). None until acknowledged.
    checkpoint_step: int | None = None
    onset: int | None = None  # the onset step of the finding it answered
    # A manual action has no finding, so no `attempt`: the attempt running when it was asked,
    # which a manual rollback leaves behind (only _bad_load reads it).
    left_attempt: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", CommandKind(self.kind))  # "rollback" from JSON is the member


@dataclass(frozen=True)
class PolicyInput:
    finding: Finding
    now: float  # epoch seconds
    checkpoints: Sequence[CheckpointInfo] = ()
    history: Sequence[Intervention] = ()
    current_lr_multiplier: float = 1.0  # the multiplier on the schedule in force now
    failed_action_pending: bool = False  # an action row ended `failed` and nobody resolved it
    action_in_flight: bool = False  # an action row is pending/sent, not yet acked
    paused: bool = False
    attempt: int | None = None  # the attempt the finding was judged on (None: unknown)


@dataclass(frozen=True)
class Decision:
    """What the policy says about one finding. `command` is what the run is told, as the typed
    command the executor stores and the trainer carries out (Rollback, SetLR or Pause); None
    changes nothing: an alert to a human (`alert`), or only recorded (a watch finding, a
    finding held back while an action is in flight)."""

    command: PolicyCommand | None
    reasons: list[str]
    alert: bool = True  # command None: tell a human (False: record only)
    # Rollback: the steps whose samples it skips (inclusive), and this many steps' worth of
    # samples past them, not trained yet: the rest of a bad stretch (_skip_further). Steps, since
    # the policy has no sample ids: the executor turns them into the command's skip ranges
    # from the run's stored steps (store/steps.sample_range).
    skip_steps: tuple[int, int] | None = None
    skip_ahead_steps: int = 0
    page: bool = False  # page a human now
    requires_approval: bool = False  # advise-only: do nothing until a human approves
    rung: int = 0  # 0: no ladder step (no command), 1..3: the rung taken
    # No command, held back by a step cooldown: the step it ends. The responder then lets the
    # detectors fire again on a condition that persists (their latches would keep it silent for
    # the rest of the run: issue 22), so a recurrence climbs the ladder after the cooldown.
    recheck_step: int | None = None
    # A checkpoint whose weights proved bad (non-finite right after it was loaded): the responder
    # marks it unhealthy in the store, so no later decision picks it again.
    distrust_step: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.command, Pause) and not self.command.reason:  # the paused loop prints why (issue 35)
            object.__setattr__(self, "command", Pause.saying("; ".join(self.reasons)))

    @property
    def kind(self) -> CommandKind | None:
        return None if self.command is None else self.command.kind

    @property
    def word(self) -> str:
        """The decision in one word, as the audit log and `replay --json` write it."""
        return self.command.kind.value if self.command is not None else "alert" if self.alert else "noop"

    @property
    def acts(self) -> bool:
        return self.command is not None

    @property
    def lr(self) -> SetLR | None:
        """The LR change it makes (a SetLR, or a rollback's), if any."""
        return self.command if isinstance(self.command, SetLR) else getattr(self.command, "lr", None)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.word, "reasons": list(self.reasons), "rung": self.rung, "page": self.page,
                "requires_approval": self.requires_approval,
                "skip_steps": list(self.skip_steps) if self.skip_steps else None,
                "skip_ahead_steps": self.skip_ahead_steps, "recheck_step": self.recheck_step,
                "distrust_step": self.distrust_step, **(self.command.to_args() if self.command is not None else {})}


# --- the decision ----------------------------------------------------------------------------


def make_decision(inp: PolicyInput, cfg: PolicyConfig | None = None) -> Decision:
    """Decide what to do about `inp.finding`. Pure: same input, same decision."""
    cfg = cfg or PolicyConfig()
    try:
        return _decide(inp, cfg)
    except ContractError as exc:  # a value no command may carry: never written, a human decides
        return _finish(cfg, _pause(_describe(inp.finding, inp.attempt),
                                   f"the decision is not a valid command ({exc}); pausing for a human instead"))


def _decide(inp: PolicyInput, cfg: PolicyConfig) -> Decision:
    f = inp.finding
    head = _describe(f, inp.attempt)
    # First, before any state of the run is looked at: only `act` may change the run.
    if f.outcome is Outcome.WATCH:
        return Decision(None, alert=False, reasons=[head, "outcome watch: recorded and drawn on the run's page"])
    if f.outcome is not Outcome.ACT:
        return Decision(None, [head, _why_alert(f, inp)], page=f.signal in cfg.page_signals)
    if inp.paused:
        return Decision(None, alert=False, reasons=[head, "the run is paused: findings are recorded, a human decides "
                                                  "when to resume"])
    if inp.failed_action_pending:
        return _finish(cfg, _pause(head, "a previous action failed, so the run is not in the state the supervisor "
                                         "believes; pausing instead of stacking another action on top"))
    if f.signal is Signal.OUTLIER_RANK:
        return _finish(cfg, _outlier(inp, cfg, head))
    if f.signal is Signal.LR_JUMP:
        if not cfg.revert_lr_jumps:
            return Decision(None, [head, "revert_lr_jumps is off: alert only; set the LR by hand "
                                                       "(thermowatch lr RUN --multiplier M)"])
        return _finish(cfg, _guards(inp, cfg, head) or _revert_lr(inp, head))
    if f.signal not in cfg.rollback_signals:
        why = _ALERT_ONLY_WHY.get(f.signal, f"{f.signal.value} is not in rollback_signals: alert only")
        return Decision(None, [head, why], page=f.signal in cfg.page_signals)
    if _SEVERITY_ORDER[f.severity] < _SEVERITY_ORDER[cfg.act_min_severity]:
        return Decision(None, [head, f"severity {f.severity.value} is below act_min_severity="
                                                   f"{cfg.act_min_severity.value}: alert only"])
    return _finish(cfg, _guards(inp, cfg, head) or _ladder(inp, cfg, head))


def _describe(f: Finding, attempt: int | None = None) -> str:
    where = f.module or f.metric or "the run"
    # Steps carry their attempt: after a rollback they run backwards ("detected at 84", then "at 54")
    of = f" of attempt {attempt}" if attempt is not None else ""
    origin = f.evidence.get("origin")  # non_finite: the first module whose output broke
    began = (f"; it began in {origin}, the first non-finite output of the forward pass"
             if origin and origin != f.metric else "")
    return (f"{f.signal.value} on {where}: onset step {f.onset_step}, detected at step {f.detect_step}{of} "
            # the detector's level, not the message's: a message's severity is the consequence
            # (issue 37: "severity critical" under an INFO header read as a contradiction)
            f"(detector level {f.severity.value}, outcome {f.outcome.value}){began}")


def _why_alert(f: Finding, inp: PolicyInput) -> str:
    why = f.evidence.get("outcome_why") if isinstance(f.evidence, dict) else None
    out = "outcome alert: a human is told, the run is not changed"
    if why:
        out += f" ({why})"
    if inp.failed_action_pending:
        out += "; note: an earlier action failed and nobody has resolved it"
    return out


def _family(signal: Signal | None) -> str | None:
    return signal_family(signal) if signal else None


def _pause(head: str, why: str) -> Decision:
    return Decision(Pause(), [head, f"rung 3: {why}"], page=True, rung=3)


def _lower(cfg: PolicyConfig, multiplier: float) -> SetLR:
    """Rung 2's LR change: the new absolute multiplier, for `lr_steps` (then re-warmed) or for good."""
    return SetLR(multiplier, cfg.lr_steps, cfg.rewarmup_steps if cfg.lr_steps is not None else 0)


def _finish(cfg: PolicyConfig, d: Decision) -> Decision:
    if cfg.advise_only and d.acts:
        return dataclasses.replace(  # a pause's reason is written again with the new sentence
            d, requires_approval=True, page=True, command=Pause() if isinstance(d.command, Pause) else d.command,
            reasons=[*d.reasons, "advise-only: nothing happens until a human approves this"],
        )
    return d


def _guards(inp: PolicyInput, cfg: PolicyConfig, head: str) -> Decision | None:
    """Reasons not to act now: an action in flight, a late finding of an abandoned attempt, the
    same incident, a cooldown, the caps."""
    f = inp.finding
    if inp.action_in_flight:
        return Decision(None, alert=False, reasons=[head, "an action for this run is in flight; waiting for its "
                                                  "acknowledgement before deciding again"])
    fam = _family(f.signal)
    live = _live(inp.history)
    for h in live:
        if _abandoned(inp, h):
            return Decision(None, alert=False, reasons=[
                head, f"late finding of attempt {inp.attempt}, which the rollback to step {h.to_step} (decided "
                      f"at step {h.step}) left behind; the re-trained attempt from step {h.first_step} is judged "
                      "on its own"])
        into = _cooling(inp, cfg, h)
        if (into is not None and _family(h.signal) == fam and _data_recurrence(inp, h) is None
                and _bad_load(inp, h) is None):
            return Decision(None, alert=False, reasons=[
                head, f"same incident as the {h.kind.value} at step {h.step}: {_since_text(h, into)} (within "
                      f"cooldown_steps={cfg.cooldown_steps}); waiting for it to take effect, judged again at "
                      f"step {_cooldown_end(cfg, h)} if it persists"], recheck_step=_cooldown_end(cfg, h))
    auto = [h for h in inp.history if h.automatic and h.kind in ACTIONS]
    # Non-finite values cannot be trained through: waiting out a cooldown only burns compute. Nor
    # can the rest of a bad stretch a data rollback's skip stopped short of (_data_recurrence).
    if f.signal is not Signal.NON_FINITE and not any(_data_recurrence(inp, h) is not None for h in live):
        for h in _newest_first([h for h in auto if h.ok]):
            into = _cooling(inp, cfg, h) if h in live else None
            age = inp.now - h.time
            if into is not None or age < cfg.cooldown_s:
                why = (f"{_since_text(h, into)} (cooldown_steps={cfg.cooldown_steps})" if into is not None
                       else f"{age:.0f}s ago (cooldown_s={cfg.cooldown_s:g})")
                return Decision(None, [
                    head, f"cooldown: the last automatic {h.kind.value} (step {h.step}) was {why}; not acting "
                          "again so soon; if it persists it is handled after the cooldown"],
                    page=f.severity is Severity.CRITICAL,
                    recheck_step=_cooldown_end(cfg, h) if into is not None else None)
    in_window = [h for h in auto if inp.now - h.time < cfg.intervention_window_s]
    if len(in_window) >= cfg.max_interventions:
        return _pause(head, f"{len(in_window)} automatic interventions in the last "
                            f"{_hours(cfg.intervention_window_s)} (max_interventions={cfg.max_interventions}); "
                            "the ladder is not holding, pausing for a human")
    return None


def _live(history: Sequence[Intervention]) -> list[Intervention]:
    """Actions that took no effect are left out, and so is everything before the newest rollback
    that took effect: their step windows belong to a trajectory that rollback abandoned (after
    rolling back twice, the first rollback's re-trained steps are being trained over again)."""
    out = []
    for h in _newest_first(history):
        if h.kind in ACTIONS and h.ok:
            out.append(h)
            if h.kind is CommandKind.ROLLBACK and h.first_step is not None:
                break
    return out


def _abandoned(inp: PolicyInput, h: Intervention) -> bool:
    """The finding was judged on an attempt that rollback `h` left behind (it arrived late)."""
    return (h.kind is CommandKind.ROLLBACK and h.ok and h.first_step is not None
            and inp.attempt is not None and h.attempt is not None and inp.attempt <= h.attempt)


def _cooling(inp: PolicyInput, cfg: PolicyConfig, h: Intervention) -> int | None:
    """Steps from where `h` took effect to the finding, if the finding falls in h's cooldown;
    else None. After a rollback the cooldown runs over the re-trained steps from its first step;
    after an LR change or a pause it also covers the steps between the decision and the ack,
    which the action had not reached yet."""
    step = inp.finding.detect_step
    took_effect = h.first_step if h.first_step is not None else h.step
    lo = took_effect if h.kind is CommandKind.ROLLBACK else min(h.step, took_effect)
    return step - took_effect if lo <= step < took_effect + cfg.cooldown_steps else None


# Bad data shows as a spike of the loss or the gradient at the step that trains it; a logit
# growth or a non-finite value on the re-trained path is the optimizer or the LR, whose next rung
# (the LR cut after the cooldown) is the ladder's.
_DATA_FAMILIES = frozenset({Signal.LOSS_SPIKE.value, Signal.GRAD_SPIKE.value})
# Steps into a re-trained path within which a spike is the stretch a skip stopped short of.
_FOLLOWS_SKIP_STEPS = 8


def _data_recurrence(inp: PolicyInput, h: Intervention) -> int | None:
    """The target of `h` when the finding is the same cause coming back on the path `h` re-trained:
    `h` an automatic data rollback (it skipped samples) that took effect, the finding of the same
    family, judged on a newer attempt, after `h`'s first re-trained step. Else None.

    Issue 35: a poisoned stretch of 15 steps, detected one step into it; the skip covered the
    samples up to the detection, and the re-trained path reached the rest of the stretch inside
    the 50-step cooldown: loss 7.8-10.2 on the re-trained steps, no action, no audit row. A
    cooldown waits for an action to take effect; here it took effect and the next samples of the
    same stretch are the cause, so waiting only trains them. Spikes only (_DATA_FAMILIES).
    Replay triage (issue 39) is what will tell data from the optimizer for certain."""
    f = inp.finding
    if not (h.kind is CommandKind.ROLLBACK and h.ok and h.automatic and h.skipped_samples and h.first_step is not None
            and h.to_step is not None and _family(h.signal) == _family(f.signal) in _DATA_FAMILIES):
        return None
    if inp.attempt is None or h.attempt is None or inp.attempt <= h.attempt or f.detect_step < h.first_step:
        return None
    # The rest of a bad stretch follows the samples the skip ended at, so it comes back right where
    # the re-trained path starts. Back at the very step it was detected before, on other samples
    # (the skip moved them), it is the step, not the data: the schedule's LR (issue 35's study: an
    # LR blow-up answered by four data rollbacks that skipped 7,084 clean samples). The ladder's.
    if f.detect_step > h.first_step + _FOLLOWS_SKIP_STEPS and abs(f.detect_step - h.step) <= 2:
        return None
    return h.to_step


def _cooldown_end(cfg: PolicyConfig, h: Intervention) -> int:
    """The first step past `h`'s step cooldown."""
    return (h.first_step if h.first_step is not None else h.step) + cfg.cooldown_steps


def _since_text(h: Intervention, into: int | None) -> str:
    if h.first_step is None:
        return f"{into} steps after it"
    if into is not None and into < 0:
        return f"before it took effect at step {h.first_step}"
    where = "the re-trained attempt" if h.kind is CommandKind.ROLLBACK else "its effect"
    return f"{into} steps into {where} (first step {h.first_step})"


def _ladder(inp: PolicyInput, cfg: PolicyConfig, head: str) -> Decision:
    f = inp.finding
    reasons = [head]
    for h in _live(inp.history):
        bad = _bad_load(inp, h)
        if bad is not None:
            return _fall_back(inp, cfg, head, h, bad)
        again = _data_recurrence(inp, h)
        if again is not None:
            return _skip_further(inp, cfg, head, h, again)
    prev = _recurrence(inp, cfg)
    forecast = (f.evidence.get("witnesses") or {}).get("lr_forecast")
    lr: SetLR | None = None
    if prev is None and not forecast:
        reasons.append(f"rung 1: {f.signal.value} is a rollback signal")
        rung = 1
    else:
        rung = 2
        if prev is not None:
            gap = f.detect_step - prev.step  # negative: the re-trained steps diverged before the old spot
            when = (f"{gap} steps after the {prev.kind.value} at step {prev.step}" if gap >= 0 else
                    f"{-gap} steps short of step {prev.step}, where the {prev.kind.value} was decided")
            reasons.append(
                f"rung 2: {f.signal.value} again at step {f.detect_step}, {when} (recurrence_window_steps="
                f"{cfg.recurrence_window_steps}): the last {prev.kind.value} was not enough")
        else:  # the LR forecast (monitors/detectors/witness.py): the harm is ahead, in the schedule
            reasons.append(f"rung 2 at once: {forecast}")
        # Rounded: 0.2 * 0.2 is 0.04000000000000001 in binary, and humans read this number.
        new = round(inp.current_lr_multiplier * cfg.lr_factor, 12)
        if new < cfg.min_lr_multiplier * (1 - 1e-9):
            return _pause(head, f"lowering the LR again would take its multiplier from {inp.current_lr_multiplier:g} "
                                f"to {new:g}, below min_lr_multiplier={cfg.min_lr_multiplier:g}; pausing for a human")
        lr = _lower(cfg, new)
        reasons.append(_lr_reason(inp.current_lr_multiplier, new, cfg))
        if prev is None:
            reasons.append("no witness of harm yet, so nothing to roll back: lowering the LR in place before the "
                           "schedule raises it further")
            return Decision(lr, reasons, rung=2)
        if not cfg.recurrence_rollback:
            reasons.append("recurrence_rollback is off: lowering the LR in place, no rollback")
            return Decision(lr, reasons, rung=2)

    rollbacks = [h for h in inp.history if h.automatic and h.kind is CommandKind.ROLLBACK
                 and inp.now - h.time < DAY_S]
    if len(rollbacks) >= cfg.max_rollbacks_per_day:
        return _pause(head, f"{len(rollbacks)} automatic rollbacks in the last 24 h "
                            f"(max_rollbacks_per_day={cfg.max_rollbacks_per_day}); pausing for a human")
    cap = (prev.to_step if prev is not None and prev.kind is CommandKind.ROLLBACK and not prev.lowered_lr
           else None)
    target, why = _pick_checkpoint(inp, cfg, cap)
    if target is None:
        return _pause(head, why)
    reasons.append(why)
    # Rung 2 cuts the LR and skips nothing: the cause is taken to be the LR, not the data (the
    # rollback and skip before it did not stop it, or the schedule's forecast names the LR). Issue
    # 35's study: an LR blow-up answered with a skip on every rung lost 6,560 clean samples.
    # DESIGN.md: reproduced anyway is optimizer state or LR, rolled back with the LR cut.
    skip = _skip_range(f, cfg, target.step) if rung == 1 else None
    if rung == 2:
        reasons.append("no samples skipped: at rung 2 the cause is the LR, not the data")
    ahead = 0
    if skip:
        start = (f"onset {f.onset_step} - margin {cfg.rollback_margin_steps}"
                 if skip[0] == f.onset_step - cfg.rollback_margin_steps else "the checkpoint")
        reasons.append(f"skipping the samples of steps {skip[0]}-{skip[1]} (from {start} to detection)")
        if rung == 1 and _family(f.signal) in _DATA_FAMILIES and cfg.skip_ahead_steps:
            ahead = cfg.skip_ahead_steps
            reasons.append(f"and {ahead} steps' worth past them, not trained yet (skip_ahead_steps): a bad stretch "
                           "of data goes on past the step it was seen at")
    return Decision(Rollback(target.step, checkpoint=target.path, lr=lr), reasons, skip_steps=skip,
                    skip_ahead_steps=ahead, rung=rung)


def after_triage(finding: Finding, cause: str, current_lr_multiplier: float, cfg: PolicyConfig | None = None,
                 attempt: int | None = None, rank: int | None = None,
                 checkpoint: tuple[int, str | None] | None = None) -> Decision | None:
    """What follows a rollback (done) whose replay triage named `cause` (issue 39; the ack's
    bisected.cause). "optimizer": both replays from its checkpoint diverged, the second without the
    suspects, so the same LR will diverge again from it: rung 2's LR cut comes now, in place (the
    run has just gone back to the checkpoint: the cut applies from its next steps), instead of
    after a recurrence the replays have already shown. The LR floor pauses as rung 2 does.
    "hardware" with the one `rank` whose figures broke (torchrun): the run goes on from the
    rollback, and a person is paged to look at that rank's device, since a chip that corrupted
    one step may corrupt the next (Gemini 2.5 excluded such chips within minutes). With
    `restart_without_outlier` on (the team lets the supervisor drain a suspect node: the bundled
    trainer restarts without it where the cluster has room, and refuses, saying so, where it has
    not) the same page comes with a rollback to `checkpoint` (the one the rollback loaded: the run
    is a few steps past it) without that rank's node, nothing skipped; off, a person decides (a
    plain loop cannot restart without a node, its launcher can). "data", and "hardware" with no rank named: the
    rollback was the answer (the offenders skipped; a transient fault left nothing to repair);
    None. Pure: same input, same decision."""
    cfg = cfg or PolicyConfig()
    head = _describe(finding, attempt)
    if cause == "hardware" and rank is not None and cfg.restart_without_outlier and checkpoint is not None:
        return _finish(cfg, Decision(Rollback(checkpoint[0], checkpoint=checkpoint[1], exclude_rank=int(rank)), [
            head, f"replay triage: the divergence did not reproduce from the checkpoint, and only rank {rank}'s "
                  f"figures went non-finite on the abandoned path: suspect rank {rank}'s device",
            f"restart_without_outlier: restarting from the checkpoint at step {checkpoint[0]} (the one the rollback "
            f"loaded) without rank {rank}'s node; no data skipped"],
            page=True, rung=1))
    if cause == "hardware" and rank is not None:
        return Decision(None, [
            head, f"replay triage: the divergence did not reproduce from the checkpoint, and only rank {rank}'s "
                  f"figures went non-finite on the abandoned path: suspect rank {rank}'s device",
            f"the run goes on from the rollback; if it happens again, restart without rank {rank}'s node "
            "(your launcher's node exclusion; the bundled trainer restarts without it given a rollback with "
            f"exclude_rank={rank})"],
            page=True)
    if cause != "optimizer":
        return None
    new = round(current_lr_multiplier * cfg.lr_factor, 12)
    if new < cfg.min_lr_multiplier * (1 - 1e-9):
        return _finish(cfg, _pause(head, f"replay triage names the optimizer state or the LR, and lowering the LR "
                                         f"would take its multiplier from {current_lr_multiplier:g} to {new:g}, below "
                                         f"min_lr_multiplier={cfg.min_lr_multiplier:g}; pausing for a human"))
    return _finish(cfg, Decision(_lower(cfg, new), [
        head, "rung 2 at once: replay triage reproduced the divergence from the rollback's checkpoint with the "
              "suspect samples skipped too, so the data is not the reason: the optimizer state or the LR is",
        _lr_reason(current_lr_multiplier, new, cfg)], rung=2))


def _skip_further(inp: PolicyInput, cfg: PolicyConfig, head: str, h: Intervention, to_step: int) -> Decision:
    """The same cause on the path a data rollback re-trained (_data_recurrence): back to that
    rollback's checkpoint again, at once and at the same LR, the skip grown through this detection.
    The caps (max_interventions, max_rollbacks_per_day) still bound it."""
    f = inp.finding
    rollbacks = [x for x in inp.history if x.automatic and x.kind is CommandKind.ROLLBACK
                 and inp.now - x.time < DAY_S]
    if len(rollbacks) >= cfg.max_rollbacks_per_day:
        return _pause(head, f"{len(rollbacks)} automatic rollbacks in the last 24 h "
                            f"(max_rollbacks_per_day={cfg.max_rollbacks_per_day}); pausing for a human")
    healthy = [c for c in inp.checkpoints if c.healthy]
    target = _newest_at_or_before(healthy, to_step)
    if target is None:
        return _pause(head, f"no healthy checkpoint at or before step {to_step}, where the data rollback at "
                            f"step {h.step} went; a human has to pick a target")
    skip = (target.step + 1, f.detect_step) if target.step + 1 <= f.detect_step else None
    # The stretch goes on past this detection too: skip ahead of it, doubling with each return
    # (2x, 4x, ... the steps from onset to detection), so a stretch of any length is passed
    # within the caps, at the cost of a few clean samples (issue 35: 2 steps at a time met the
    # 4-intervention cap 9 poisoned steps short of the end).
    again = sum(1 for x in rollbacks if x.skipped_samples and x.ok and x.to_step == h.to_step) - 1
    ahead = (f.detect_step - f.onset_step + 1) * 2 ** (max(0, again) + 1) if skip else 0
    reasons = [head,
               f"the same cause again on the path the rollback at step {h.step} re-trained (first step "
               f"{h.first_step}, attempt {inp.attempt}): the bad stretch goes on past the samples it skipped, so no "
               "cooldown holds this back; waiting would train the rest of it",
               f"roll back to the checkpoint at step {target.step} again, at the same LR, and skip on through step "
               f"{f.detect_step}"]
    if skip:
        reasons.append(f"skipping the samples of steps {skip[0]}-{skip[1]} (from the checkpoint to detection; "
                       f"the samples already skipped stay skipped) and {ahead} steps' worth past them, not trained "
                       "yet: the stretch has come back before, so it likely goes on")
    return Decision(Rollback(target.step, checkpoint=target.path), reasons, skip_steps=skip, skip_ahead_steps=ahead,
                    rung=1)


def _bad_load(inp: PolicyInput, h: Intervention) -> int | None:
    """The checkpoint rollback `h` loaded, when the finding says its weights are bad: non-finite,
    judged on an attempt newer than h's, with its onset in the first BAD_LOAD_STEPS steps `h`
    re-trained. Else None. Manual rollbacks count too: a bad file is bad whoever asked for it."""
    f = inp.finding
    if not (f.signal is Signal.NON_FINITE and h.kind is CommandKind.ROLLBACK and h.ok
            and h.first_step is not None and h.checkpoint_step is not None):
        return None
    left = h.attempt if h.attempt is not None else h.left_attempt
    if inp.attempt is None or left is None or inp.attempt <= left:
        return None
    return h.checkpoint_step if h.first_step <= f.onset_step < h.first_step + BAD_LOAD_STEPS else None


def _bad_loads_before(inp: PolicyInput, h: Intervention) -> list[int]:
    """The checkpoints that proved bad right after loading in the chain `h` ends (h's own loaded
    one not included), newest first: each rollback of the chain answered a non-finite finding
    whose onset fell in the first BAD_LOAD_STEPS steps the rollback before it re-trained."""
    done = _newest_first([x for x in inp.history if x.kind is CommandKind.ROLLBACK and x.ok
                          and x.first_step is not None and x.checkpoint_step is not None])
    out: list[int] = []
    at = next((i for i, x in enumerate(done) if x is h), None)
    while at is not None and at + 1 < len(done):
        cur, prev = done[at], done[at + 1]
        if not (cur.signal is Signal.NON_FINITE and cur.onset is not None
                and prev.first_step <= cur.onset < prev.first_step + BAD_LOAD_STEPS):
            break
        out.append(prev.checkpoint_step)
        at += 1
    return out


def _fall_back(inp: PolicyInput, cfg: PolicyConfig, head: str, h: Intervention, bad: int) -> Decision:
    """Non-finite right after a rollback loaded checkpoint `bad`: its weights are bad (the data and
    the LR trained finely from it before). Back to the newest healthy checkpoint before it, at the
    same LR and with no new skip, and `bad` distrusted; bounded by MAX_BAD_LOADS in a row."""
    f = inp.finding
    earlier = _bad_loads_before(inp, h)
    proved = [bad, *earlier]
    what = (f"non-finite at step {f.onset_step}, {f.onset_step - h.first_step + 1} step(s) after the rollback "
            f"to checkpoint {bad} took effect (first step {h.first_step}): the weights it loaded are bad, not "
            "the data or the LR")
    if len(proved) > MAX_BAD_LOADS:
        d = _pause(head, f"{what}; checkpoints {', '.join(map(str, proved))} each went non-finite right after "
                         f"loading ({len(proved)} in a row, at most {MAX_BAD_LOADS} are fallen back past): the "
                         "storage or the loader is suspect; a human has to check the files and pick a target "
                         "(`thermowatch rollback RUN --to-step N`)")
        return dataclasses.replace(d, distrust_step=bad)
    rollbacks = [x for x in inp.history if x.automatic and x.kind is CommandKind.ROLLBACK
                 and inp.now - x.time < DAY_S]
    if len(rollbacks) >= cfg.max_rollbacks_per_day:
        d = _pause(head, f"{what}; {len(rollbacks)} automatic rollbacks in the last 24 h "
                         f"(max_rollbacks_per_day={cfg.max_rollbacks_per_day}); pausing for a human")
        return dataclasses.replace(d, distrust_step=bad)
    older = [c for c in inp.checkpoints if c.healthy and c.step < min(proved)]
    target = _newest_at_or_before(older, min(proved) - 1)
    if target is None:
        d = _pause(head, f"{what}; no healthy checkpoint before step {min(proved)} to fall back to; a human has "
                         "to pick a target")
        return dataclasses.replace(d, distrust_step=bad)
    return Decision(Rollback(target.step, checkpoint=target.path), [
        head, what,
        f"checkpoint {bad} is distrusted (marked unhealthy); falling back to checkpoint {target.step}, the newest "
        f"healthy one before it (fallback {len(proved)} of at most {MAX_BAD_LOADS} in a row), at the same LR, "
        "skipping nothing more (the samples skipped already stay skipped)"],
        rung=1, distrust_step=bad)


def _revert_lr(inp: PolicyInput, head: str) -> Decision:
    """Back to the LR before an unplanned raise: the multiplier on the schedule times
    before/after, so the effective LR is the one the run trained well at. No floor applies
    (min_lr_multiplier): the target is an LR this run already trained at, whatever the schedule
    now says."""
    ev = inp.finding.evidence
    before, after = float(ev["lr_before"]), float(ev["lr_after"])
    # 6 significant digits: the LRs come from fp32 records (0.01 would read 0.010000000326)
    new = float(f"{inp.current_lr_multiplier * before / after:.6g}")
    jump, peak = ev.get("jump_step", inp.finding.onset_step), ev.get("planned_peak")
    planned = (f"past the schedule's own forecast of at most {peak:.3g}" if peak is not None else
               "after a flat LR, and the trainer sends no forecast of its schedule")
    return Decision(SetLR(new), [
        head,
        f"the LR rose x{after / before:.3g} at step {jump} (from {before:.3g} to {after:.3g}), {planned}: "
        "a change nobody planned in the schedule (an edit, or a resume with another config)",
        f"{inp.finding.detect_step - jump} steps later the loss is still {ev.get('above_trend', 0):.0%} above its "
        f"trend from before the raise, {ev.get('points_behind')} smoothed points in a row past the "
        f"{ev.get('margin', 0):.0%} margin: the raise is doing lasting harm, not a transient cost",
        f"setting the LR back to {before:.3g}, as before the raise: multiplier {inp.current_lr_multiplier:g} -> "
        f"{new:g} for the rest of the run"], rung=2)


def _newest_first(history: Sequence[Intervention]) -> list[Intervention]:
    return sorted(history, key=lambda h: (h.time, h.seq), reverse=True)


def _recurrence(inp: PolicyInput, cfg: PolicyConfig) -> Intervention | None:
    """The newest successful rollback/LR change on the same signal within the step window.

    The window is symmetric: after a rollback to step T < detect, the signal may come back
    before the run even reaches the old detection step again.
    """
    fam = _family(inp.finding.signal)
    for h in _newest_first(inp.history):
        if (h.ok and h.kind in _LADDER_KINDS and _family(h.signal) == fam
                and abs(inp.finding.detect_step - h.step) <= cfg.recurrence_window_steps):
            return h
    return None


def _lr_reason(old: float, new: float, cfg: PolicyConfig) -> str:
    if cfg.lr_steps is None:
        span = "for the rest of the run"
    else:
        span = f"for {cfg.lr_steps} steps" + (f", then re-warm-up over {cfg.rewarmup_steps} steps"
                                              if cfg.rewarmup_steps else "")
    return f"lowering the LR x{cfg.lr_factor:g}: multiplier {old:g} -> {new:g} {span}"


def _pick_checkpoint(inp: PolicyInput, cfg: PolicyConfig,
                     cap: int | None = None) -> tuple[CheckpointInfo | None, str]:
    """Newest healthy checkpoint at or before onset - margin (and at or before `cap`, the previous
    rollback's target on a recurrence); never one saved while unhealthy. When there is none that
    old, the oldest healthy one before the onset; only with none before the onset, None (pause)."""
    f = inp.finding
    limit = f.onset_step - cfg.rollback_margin_steps
    healthy = [c for c in inp.checkpoints if c.healthy]
    capped = cap is not None and cap < limit
    best = _newest_at_or_before(healthy, cap if capped else limit)
    if best is not None:
        why = (f"roll back to the checkpoint at step {best.step}, the newest healthy one at or before "
               f"onset {f.onset_step} - margin {cfg.rollback_margin_steps} = step {limit}")
        if capped:
            why += (f" and at or before step {cap}, where the previous rollback went (the checkpoints since "
                    f"were trained at the settings that diverged again)")
        return best, why + _passed_over(inp.checkpoints, best.step, limit)
    # Issue 35: a run younger than the margin (onset 71 - margin 100 = step -29) paused for a
    # human, and its loop waited 9 minutes. With none that old, every healthy checkpoint before
    # the onset is inside the margin (or past the cap); the oldest of them is the nearest to the
    # target the margin asked for, and it lies less than the margin before the onset, so it costs
    # no more re-training than a rollback with the margin kept. Non-finite weights cannot be
    # trained through either: any healthy checkpoint before the onset beats none.
    before = [c for c in healthy if c.step < f.onset_step]
    if before:
        best = min(reversed(before), key=lambda c: c.step)  # of equal steps, the newest attempt's
        if best.step > limit:
            why = (f"no healthy checkpoint at or before step {limit} (onset {f.onset_step} - margin "
                   f"{cfg.rollback_margin_steps}), so rolling back inside the margin to step {best.step}, the "
                   f"oldest healthy checkpoint before the onset ({f.onset_step - best.step} steps before it, the "
                   f"nearest to the margin asked for)")
        else:
            why = f"roll back to the checkpoint at step {best.step}, the oldest healthy one before the onset"
        if capped:
            why += f"; none is left at or before step {cap}, where the previous rollback went"
        return best, why + _passed_over(inp.checkpoints, best.step, f.onset_step - 1)
    steps_ok = sorted(c.step for c in healthy)
    steps_bad = sorted(c.step for c in inp.checkpoints if not c.healthy)
    return None, (f"no healthy checkpoint before the onset at step {f.onset_step} (onset - margin "
                  f"{cfg.rollback_margin_steps} = step {limit}); healthy checkpoints at {steps_ok or 'none'}, "
                  f"unhealthy at {steps_bad or 'none'}; a human has to pick a target: `thermowatch rollback RUN "
                  f"--to-step N` with one of them, or `thermowatch resume RUN` to train on as it is")


def _newest_at_or_before(ckpts: Iterable[CheckpointInfo], step: int) -> CheckpointInfo | None:
    eligible = [c for c in ckpts if c.step <= step]
    # The same step can exist in several attempts (re-trained after a rollback); the store lists
    # them by (step, attempt), and max() keeps the first of equals: search from the newest.
    return max(reversed(eligible), key=lambda c: c.step) if eligible else None


def _passed_over(ckpts: Iterable[CheckpointInfo], after: int, upto: int) -> str:
    bad = sorted(c.step for c in ckpts if not c.healthy and after < c.step <= upto)
    if not bad:
        return ""
    return f"; passed over the checkpoint(s) at step {', '.join(map(str, bad))}: saved while unhealthy"


def _skip_range(f: Finding, cfg: PolicyConfig, to_step: int) -> tuple[int, int] | None:
    # Steps up to to_step are already inside the checkpoint's weights: nothing to skip there.
    lo = max(f.onset_step - cfg.rollback_margin_steps, to_step + 1)
    return (lo, f.detect_step) if lo <= f.detect_step else None


def _outlier(inp: PolicyInput, cfg: PolicyConfig, head: str) -> Decision:
    f = inp.finding
    rank = f.evidence.get("rank")
    node = f.evidence.get("node") or f.evidence.get("host")
    who = f"rank {rank if rank is not None else '?'}" + (f" on node {node}" if node else "")
    if not cfg.outlier_rank_alerts:
        return Decision(None, alert=False, reasons=[head, f"{who} is an outlier; outlier_rank_alerts is off"])
    seen = f"{who} is an outlier on {f.metric or 'its metrics'} (a slow or faulty GPU/node drags every step)"
    if not cfg.restart_without_outlier:
        return Decision(None, [head, seen, "restart_without_outlier is off: a human decides "
                                                         "whether to drain the node"])
    if rank is None:
        return Decision(None, [head, seen, "the finding names no rank, so the run cannot be "
                                                         "restarted without it; alert only"])
    guard = _guards(inp, cfg, head)
    if guard is not None:
        return guard
    best = max((c for c in inp.checkpoints if c.healthy and c.step <= f.detect_step),
               key=lambda c: c.step, default=None)
    if best is None:
        return _pause(head, f"{seen}; no healthy checkpoint to restart from without it")
    # The data is not at fault, so nothing is skipped.
    return Decision(Rollback(best.step, checkpoint=best.path, exclude_rank=int(rank),
                             exclude_node=str(node) if node else None), [
        head, seen, f"restart_without_outlier: restarting from the checkpoint at step {best.step} "
                    f"(newest healthy) without {who}; no data skipped"], rung=1)


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:g} h" if seconds >= 3600 else f"{seconds:g} s"
