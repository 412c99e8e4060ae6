"""The API's pydantic bodies mirror the contract's JSON (issue 38 item 1): what the contract writes,
with every optional field set, is a body the document allows, and the document has no key the
contract does not write (beside the deprecated names it still reads). The command args are checked
at import (schemas.ARGS_MODELS); these are the other mirrors, which document JSON the contract's
own from_json validates."""

from __future__ import annotations

import pytest

from thermowatch.monitors.contract import (Ack, Bisected, Cause, CheckpointInfo, LRChange, Replay, RunFinished,
                                           RunInfo, SampleRange, StepRecord)
from thermowatch.supervisor.serve.api import schemas

SAME = Replay(False, True, 96, 9.5, 3.1, 20)
WITHOUT = Replay(True, False, 110, 3.0, 3.1, 20)
CAUSE = Cause("data", 95, 9.5, (SAME, WITHOUT), 40, 2.5, rank=1)
BISECTED = Bisected((SampleRange(4, 9),), 3, 30, 1.5, "narrowed", CAUSE)
ACK = Ack(7, True, 31, "rolled back", checkpoint_step=30, checkpoint_path="/ckpt/step30", lr_multiplier=0.5,
          lr_change=LRChange(31, 0.5, 100, 10), lr_seq=2, skip_ranges=(SampleRange(4, 9),),
          ledger_digest="ab" * 8, bisected=BISECTED)

# (body model, the contract object with every optional field set, the deprecated keys it still reads)
MIRRORS = [
    (schemas.AckBody, ACK, {"step", "skipped"}),
    (schemas.BisectedBody, BISECTED, set()),
    (schemas.CauseBody, CAUSE, set()),
    (schemas.ReplayBody, SAME, set()),
    (schemas.LRChangeBody, LRChange(31, 0.5, 100, 10), set()),
    (schemas.RunInfoBody, RunInfo("run-a", 2, 4, config={"lr": 3e-4}, start_step=30, hosts={0: "node-a"}), set()),
    (schemas.CheckpointBody, CheckpointInfo(30, "/ckpt/step30", 960, True, manifest={"attempt": 2}), set()),
    (schemas.RunFinishedBody, RunFinished(120, 2.75, "completed"), set()),
]


@pytest.mark.parametrize("model, obj, deprecated", MIRRORS, ids=[m.__name__ for m, _, _ in MIRRORS])
def test_each_body_documents_exactly_what_the_contract_writes(model, obj, deprecated):
    wire = obj.to_json()
    model.model_validate(wire)  # the document allows what the trainer sends
    assert set(model.model_fields) - deprecated == set(wire), "the document and the contract name other keys"
    assert type(obj).from_json(wire) == obj


def test_a_step_record_is_documented_by_its_fields_and_metric_keys():
    rec = StepRecord(step=5, values={"loss": 2.5, "attn_logit_max/blocks.0.attn": 31.0}, sample_lo=40,
                     sample_hi=48, tokens=512, wall_time=1.7e9, ranks={"attn_logit_max/blocks.0.attn": 1},
                     ledger_digest="ab" * 8)
    wire = rec.to_json()
    schemas.StepRecordBody.model_validate(wire)
    fields = set(schemas.StepRecordBody.model_fields)
    assert {k for k in wire if k not in rec.values} == fields  # every other key is a metric's
