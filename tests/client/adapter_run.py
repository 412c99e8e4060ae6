"""What the adapter tests share: data whose every sample names its own id (so the test reads,
from the very tensors the model trains on, which samples each step trained), an operator who
posts commands the way tests/client/test_watch.py does, and the assertions a rollback and a skip
must satisfy whatever trainer carried them out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from thermowatch.monitors.ledger import SkipLedger
from thermowatch.supervisor.store.views import run_status
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import runs as runs_store

SEQ, VOCAB, N = 16, 64, 200  # N samples: id i is sample i % N (ids stay below N in these runs)
STEPS, EVERY, MICRO, ACCUM = 15, 5, 2, 2
GLOBAL = MICRO * ACCUM
SKIP = [36, 40]  # a standalone skip, posted after step 3: first-pass step 10's ids
# posted after step 13: back to checkpoint 10, skipping id 49 (step 12's: a rollback skips only what was
# trained, and the supervisor has step 12's record once step 13 ends and the client has flushed)
ROLLBACK_AT, ROLLBACK_TO = 13, 10
ROLLBACK_SKIP = [49, 50]


def samples() -> torch.Tensor:
    """(N, SEQ) tokens; the first two name the sample: id = t0 * VOCAB + t1."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (N, SEQ), generator=g)
    i = torch.arange(N)
    x[:, 0], x[:, 1] = i // VOCAB, i % VOCAB
    return x


def ids_of(x: torch.Tensor) -> list[int]:
    return (x[:, 0] * VOCAB + x[:, 1]).tolist()


@dataclass
class Trained:
    """What each step really trained, seen at the model's input: (attempt, step) -> ids, loss."""

    ids: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    loss: dict[tuple[int, int], float] = field(default_factory=dict)
    pending_ids: list[int] = field(default_factory=list)
    pending_loss: float = 0.0

    def micro_batch(self, x: torch.Tensor, loss: float) -> None:
        self.pending_ids += ids_of(x)
        self.pending_loss += loss

    def step_end(self, attempt: int, step: int) -> None:
        self.ids[attempt, step], self.loss[attempt, step] = self.pending_ids, self.pending_loss
        self.pending_ids, self.pending_loss = [], 0.0


class Operator:
    """Posts the test's commands between two steps, and waits until the client holds each one,
    so the adapter carries it out at this very boundary (the poll runs on the client's thread)."""

    def __init__(self, sup, run_id: str) -> None:
        self.sup, self.run_id, self.ids = sup, run_id, {}

    def at_step_end(self, watch, attempt: int, step: int) -> None:
        if attempt == 1 and step == 3:
            self._post(watch, "skip", {"skip_ranges": [SKIP]})
        if attempt == 1 and step == ROLLBACK_AT:
            self._post(watch, "rollback", {"to_step": ROLLBACK_TO, "skip_ranges": [ROLLBACK_SKIP]})

    def _post(self, watch, kind: str, args: dict) -> None:
        watch.run.flush()
        self.ids[kind] = i = self.sup.executor.submit(self.run_id, kind, args, "ana", "test")
        deadline = time.monotonic() + 20
        while not any(c.id == i for c in list(watch.run._inbox)):
            assert time.monotonic() < deadline, f"{kind} never reached the client"
            time.sleep(0.01)


def expected_ids(cursor: int, ledger: SkipLedger, steps: int) -> list[list[int]]:
    out = []
    for _ in range(steps):
        ids = ledger.take(cursor, GLOBAL)
        cursor = int(ids[-1]) + 1
        out.append(ids.tolist())
    return out


def check_rollback_and_skip(db, run_id: str, op: Operator, trained: Trained, final_step: int) -> None:
    """The acks are done with the real step, and the model trained exactly the samples they say."""
    deadline = time.monotonic() + 30
    while True:
        with db.sessions() as s:
            rows = {k: actions_store.get_action(s, i) for k, i in op.ids.items()}
        if all(r.state in ("done", "failed") for r in rows.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert {k: r.state for k, r in rows.items()} == {"skip": "done", "rollback": "done"}, rows
    skip, rb = rows["skip"].result, rows["rollback"].result
    assert skip["ok"] and skip["first_step"] == 4 and skip["skip_ranges"] == [SKIP], skip
    assert rb["ok"] and rb["checkpoint_step"] == ROLLBACK_TO and rb["first_step"] == ROLLBACK_TO + 1, rb
    assert rb["skip_ranges"] == [ROLLBACK_SKIP], rb

    # attempt 1: steps 1-3 in order, then the skip from step 4 on, until the rollback after 12
    first = expected_ids(0, SkipLedger(), 3) + expected_ids(12, SkipLedger([SKIP]), ROLLBACK_AT - 3)
    assert [trained.ids[1, s] for s in range(1, ROLLBACK_AT + 1)] == first
    assert (1, ROLLBACK_AT + 1) not in trained.ids
    # attempt 2: from checkpoint 10's cursor (step 10's last id + 1), both ranges skipped
    again = expected_ids(first[ROLLBACK_TO - 1][-1] + 1, SkipLedger([SKIP, ROLLBACK_SKIP]), final_step - ROLLBACK_TO)
    assert [trained.ids[2, s] for s in range(ROLLBACK_TO + 1, final_step + 1)] == again
    assert min(s for a, s in trained.ids if a == 2) == ROLLBACK_TO + 1
    # the re-trained step 11 (no skipped id in it) is the first pass's, bit for bit: the weights,
    # optimizer, scheduler and RNG (dropout) of checkpoint 10, and the same samples
    assert trained.ids[2, 11] == trained.ids[1, 11]
    assert trained.loss[2, 11] == trained.loss[1, 11]
    # step 12 is the first pass's minus the skipped id 49, the next id taking its place
    assert trained.ids[2, 12] == [i for i in trained.ids[1, 12] if i != 49] + [trained.ids[1, 12][-1] + 1]
    assert trained.loss[2, 12] != trained.loss[1, 12]

    with db.sessions() as s:
        attempts = runs_store.attempts(s, run_id)
        st = run_status(s, run_id, stall_after_s=600)
    assert [a.attempt for a in attempts] == [1, 2] and attempts[-1].start_step == ROLLBACK_TO
    assert (st["state"], st["finish_reason"], st["final_step"]) == ("finished", "completed", final_step), st
    # issue 35: a finished run pages no stall, however long after its last step the check runs
    assert op.sup.responder.check_stalls(now=time.time() + 3600) == []


# --- precise skip through a framework's data iterator (issue 39 item 3) ---------------------------
POISON = 50  # this sample's loss is NaN (a corrupt record): first-pass step 13 holds it (ids 48-51)
PRECISE_STEPS = 40  # room for the supervisor's rollback to arrive, the probes, and the path after


@dataclass
class Steps:
    """Every step trained, in order, probes included: (attempt, step, probing, ids at the input)."""

    rows: list[tuple[int, int, bool, list[int]]] = field(default_factory=list)

    def step_end(self, watch, trained: Trained, step: int) -> None:
        ids = trained.pending_ids
        # the framework's iterator served exactly what the Watch says this step trains: a probe's
        # ledger (the other suspects skipped), or after it the run's, never a batch fetched before
        assert ids == watch._ids.tolist(), (step, watch.probing, ids, watch._ids.tolist())
        self.rows.append((watch.attempt, step, watch.probing, ids))


def check_precise_skip(db, run_id: str, steps: Steps, final_step: int) -> None:
    """The supervisor rolled back on the NaN and asked to skip its window; the probes, trained
    through the framework's own loop, narrowed the skip to the poisoned sample's step."""
    deadline = time.monotonic() + 30
    while True:
        with db.sessions() as s:
            rb = next((a for a in actions_store.actions(s, run_id) if a.kind == "rollback"), None)
        if (rb is not None and rb.state in ("done", "failed")) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert rb is not None and rb.state == "done", rb
    res = rb.result
    assert res["bisected"]["outcome"] == "narrowed" and res["bisected"]["probes"] >= 2, res
    skipped = [i for lo, hi in res["skip_ranges"] for i in range(lo, hi)]
    assert POISON in skipped and len(skipped) <= GLOBAL, res["skip_ranges"]
    probes = [r for r in steps.rows if r[2]]
    assert probes and all(r[0] == 2 for r in probes)  # after the rollback, before the path goes on
    assert any(POISON in r[3] for r in probes) and any(POISON not in r[3] for r in probes)
    kept = [r for r in steps.rows if r[0] == 2 and not r[2]]
    assert kept[0][1] == res["checkpoint_step"] + 1 and kept[-1][1] == final_step
    assert [r[1] for r in kept] == list(range(kept[0][1], final_step + 1))  # each step once, in order
    assert not any(i in skipped for r in kept for i in r[3])
    with db.sessions() as s:
        st = run_status(s, run_id, stall_after_s=600)
    assert (st["state"], st["finish_reason"], st["final_step"]) == ("finished", "completed", final_step), st
