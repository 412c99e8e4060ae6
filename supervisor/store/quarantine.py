"""Which samples did it (issue 24, item 5): after a rollback that skipped samples, did the
divergence come back on the re-trained path?

PaLM found that replaying the same batches from an earlier checkpoint often did not spike: the
data alone was not always the cause. So a skip is a hypothesis, and the re-trained path tests it.
For each rollback the trainer carried out with a skip (`result.skip_ranges`, the ack's ranges; after
a precise skip, only the offenders its search found among the suspects, `result.bisected`):

- `recurred`: an incident of the same signal family (attention growth and ceiling are one) was
  detected on the re-trained path, from the rollback's first re-trained step to `horizon` steps
  past the old detection. The skipped samples were not (alone) the cause: the optimizer state,
  the LR or the model were; they are not quarantined.
- `quarantine`: the re-trained path ran `horizon` steps past the old detection without it. The
  skipped samples are the likely cause: the data team gets them (`thermowatch quarantine RUN`).
- `pending`: the re-trained path has not got that far yet.

A recurrence answered by a rollback to the same checkpoint that skipped on (the policy's answer
to the rest of a bad stretch, issue 35) is the same stretch going on, not a refutation: the
earlier skip takes the verdict of the one that skipped on, and says so.

How sure a `quarantine` is (`sure`): `narrowed` when a precise skip's probes found these samples
among the suspects; `blunt` when the skip took every sample from the checkpoint to the detection,
so the cause is among them but most of them are likely clean (issue 35).

A manual rollback (no incident) is judged against any rollback signal. Derived on read from the
action, incident and step rows: nothing to keep in step, and a verdict changes the moment the
run reaches the horizon or the divergence recurs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from sqlalchemy.orm import Session

from thermowatch.monitors.contract import DEFAULT_ROLLBACK_SIGNALS, merge_ranges, signal_family
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.monitors.commands import ActionState, CommandKind
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import steps as steps_store

# Past the old detection: the policy's rollback margin (100), so a divergence the skipped data
# caused had the whole stretch it came from to come back in.
HORIZON = 100
# A manual rollback names no signal: any of the default policy's rollback signals coming back counts.
_ROLLBACK_FAMILIES = frozenset(signal_family(s) for s in DEFAULT_ROLLBACK_SIGNALS)


@dataclass(frozen=True)
class SkipVerdict:
    action_id: int
    incident_id: int | None
    signal: str | None  # the incident's signal; None for a manual rollback
    detect_step: int  # where it was detected before the rollback (a manual one: its first re-trained step)
    checkpoint_step: int | None
    first_step: int  # the first step trained after the rollback
    ranges: list[tuple[int, int]]  # the samples it skipped, [lo, hi)
    samples: int
    status: str  # quarantine | recurred | pending
    why: str
    recurrence_incident: int | None = None
    # a precise skip's search (Ack.bisected): the suspects it narrowed `ranges` from, its probes,
    # steps, seconds and outcome; None for a blunt skip
    bisected: dict[str, Any] | None = None
    sure: str = "blunt"  # narrowed | blunt (see the module docstring)
    extended_by: int | None = None  # the rollback that skipped on through the rest of the stretch

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranges"] = [list(r) for r in self.ranges]
        return out


def verdicts(session: Session, run_id: str, horizon: int = HORIZON) -> list[SkipVerdict]:
    """One verdict per carried-out rollback that skipped samples, oldest first."""
    acts = [a for a in actions_store.actions(session, run_id, limit=10_000)
            if a.kind is CommandKind.ROLLBACK and a.state is ActionState.DONE and (a.result or {}).get("skip_ranges")]
    if not acts:
        return []
    incs = incidents_store.incidents(session, run_id)
    by_id = {i.id: i for i in incs}
    attempts = runs_store.attempts(session, run_id)
    reached = steps_store.last_step(session, run_id, attempts[-1].attempt) if attempts else None
    out = []
    for a in sorted(acts, key=lambda a: a.id):
        res = a.result or {}
        ranges = [(int(lo), int(hi)) for lo, hi in res["skip_ranges"]]
        first = int(res["first_step"])
        inc = by_id.get(a.incident_id) if a.incident_id is not None else None
        detect = inc.detect_step if inc is not None else first
        families = {signal_family(inc.signal)} if inc is not None else _ROLLBACK_FAMILIES
        # Incidents opened after this one (ids rise) and detected on the re-trained stretch.
        after = inc.id if inc is not None else -1
        again = next((j for j in incs if j.id > after and j.opened_at >= a.created_at
                      and signal_family(j.signal) in families and first <= j.detect_step <= detect + horizon), None)
        what = f"{inc.signal} detected at step {detect}" if inc is not None else f"the manual rollback #{a.id}"
        if again is not None:
            status = "recurred"
            why = (f"{again.signal} came back at step {again.detect_step} (incident #{again.id}) on the path "
                   f"re-trained without these samples: they were not (alone) the cause of {what}")
        elif reached is not None and reached >= detect + horizon:
            status = "quarantine"
            why = (f"the re-trained path reached step {reached}, {reached - detect} steps past {what}, without it "
                   "coming back: these samples are the likely cause")
        else:
            status = "pending"
            why = (f"the re-trained path is at step {reached if reached is not None else '-'}; the verdict comes at "
                   f"step {detect + horizon} ({horizon} steps past {what}) or when it comes back")
        bis = res.get("bisected")
        sure = "narrowed" if bis and bis.get("outcome") == "narrowed" else "blunt"
        out.append(SkipVerdict(a.id, inc.id if inc is not None else None, inc.signal if inc is not None else None,
                               detect, res.get("checkpoint_step"), first, ranges, sum(hi - lo for lo, hi in ranges),
                               status, why, again.id if again is not None else None, bis, sure))
    return _chain(out, acts)


def _chain(found: list[SkipVerdict], acts: list) -> list[SkipVerdict]:
    """A `recurred` skip whose recurrence was answered by a rollback to the same checkpoint that
    skipped on takes that rollback's verdict (newest first, so a chain of them resolves)."""
    answer = {a.incident_id: a.id for a in acts if a.incident_id is not None}
    by_action = {v.action_id: v for v in found}
    for i in range(len(found) - 1, -1, -1):
        v = found[i]
        nxt = by_action.get(answer.get(v.recurrence_incident)) if v.status == "recurred" else None
        if nxt is None or nxt.checkpoint_step != v.checkpoint_step:
            continue
        why = (f"the bad stretch went on past these samples: incident #{v.recurrence_incident} at step "
               f"{nxt.detect_step} was answered by rollback #{nxt.action_id} to the same checkpoint, which skipped on; "
               f"judged with it: {nxt.why}")
        found[i] = by_action[v.action_id] = SkipVerdict(
            v.action_id, v.incident_id, v.signal, v.detect_step, v.checkpoint_step, v.first_step, v.ranges, v.samples,
            nxt.status, why, v.recurrence_incident, v.bisected, v.sure, nxt.action_id)
    return found


def data_order(session: Session, run_id: str) -> tuple[int | None, bool]:
    """The run's `data.dataset_size` (newest attempt) and whether its loader shuffles each pass
    (`data.shuffled`): unshuffled, sample id i is data index i % dataset_size."""
    newest = runs_store.newest_attempt(session, run_id)
    cfg = runs_store.attempt_config(session, run_id, newest) if newest is not None else None
    data = cfg.get("data") if isinstance(cfg, dict) else None
    data = data if isinstance(data, dict) else {}
    n = data.get("dataset_size")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None
    return n, bool(data.get("shuffled"))


def data_indices(held: list[tuple[int, int]], dataset_size: int) -> list[tuple[int, int]]:
    """The quarantined sample ranges as data indices [lo, hi) in [0, dataset_size): what the data
    team removes (an id is data index id % dataset_size in every pass)."""
    try:
        return SkipLedger(held, period=dataset_size).data_ranges
    except ValueError:  # they cover the whole dataset
        return [(0, dataset_size)]


def quarantined(found: list[SkipVerdict]) -> list[tuple[int, int]]:
    """The sample ranges whose skip held (status quarantine), sorted and merged."""
    return [(r.lo, r.hi) for r in merge_ranges([r for v in found if v.status == "quarantine" for r in v.ranges])]
