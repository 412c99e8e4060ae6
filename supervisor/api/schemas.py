"""The request bodies of the HTTP API as pydantic models, so the OpenAPI document describes them
(and schema-driven fuzzers such as schemathesis can send them).

Routes read their bodies themselves, after the token check and under a byte limit
(supervisor.api.ingest.read_body), so a model is attached to its route's OpenAPI entry
(`supervisor.api.document_bodies`, openapi_extra) rather than declared as a FastAPI body
parameter, which would parse the body before auth.

Which code validates what:
- the manual-action bodies (supervisor.api.commands.ManualAction, Approval) are validated by
  their models (supervisor.api.commands._parse);
- bodies that are contract types (RunInfo, CheckpointInfo, Ack, and StepRecord inside the
  steps batch) are validated by the contract's `from_json` (monitors.contract, monitors.commands:
  the one validator the trainer's side uses too) plus supervisor.limits, and the deleted-
  checkpoints report by supervisor.ingest.deleted_from_json; their models here document that
  JSON. The steps batch is never run through pydantic: reading it already costs ~30 ms of CPU
  per 50 x 781-value batch, and the model would add ~15% (bench/ingest.py --validation) to
  check again what the contract checks.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from monitors.commands import INT32_MAX, INT64_MAX, MAX_LR_MULTIPLIER
from supervisor.limits import PATH_CHARS, RUN_ID_CHARS, Limits

_DEFAULTS = Limits()
# JSON-schema spelling of supervisor.limits' run-id rule (the code also refuses lone surrogates)
RUN_ID_PATTERN = r"^[^/\x00-\x1f\x7f]+$"


# --- bodies validated elsewhere (documentation of their JSON) ---------------------------------------


class CheckpointsDeleted(BaseModel):
    """The trainer deleted these checkpoints (retention): never offer them again."""

    steps: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(max_length=100_000, description="checkpoint steps")
    reason: str = Field("", max_length=10_000, description="kept to its first 200 characters in the audit trail")


class RunInfoBody(BaseModel):
    """monitors.contract.RunInfo as JSON: a run, or a new attempt of it, starts."""

    run_id: str = Field(min_length=1, max_length=RUN_ID_CHARS, pattern=RUN_ID_PATTERN)
    attempt: int = Field(ge=0, le=INT32_MAX)
    world_size: int = Field(ge=1, le=INT32_MAX)
    config: dict[str, Any] | None = Field(None, description=(
        f"the run's config: at most {_DEFAULTS.max_config_keys} keys through every level, "
        f"{_DEFAULTS.max_config_bytes} bytes, {_DEFAULTS.max_json_depth} levels, finite numbers (defaults of limits.*)"))
    start_step: int = Field(0, ge=0, le=INT64_MAX)
    hosts: dict[str, str] | None = Field(None, description="rank -> node address")


class CheckpointBody(BaseModel):
    """monitors.contract.CheckpointInfo as JSON: the trainer saved a checkpoint."""

    step: int = Field(ge=0, le=INT64_MAX)
    path: str = Field(min_length=1, max_length=PATH_CHARS)
    sample_cursor: int = Field(ge=0, le=INT64_MAX)
    healthy: bool
    manifest: dict[str, Any] | None = Field(None, description=(
        f"the checkpoint's manifest: at most {_DEFAULTS.max_manifest_keys} keys, {_DEFAULTS.max_manifest_bytes} "
        "bytes, finite numbers"))


class StepRecordBody(BaseModel):
    """monitors.contract.StepRecord in its flat JSON shape (DESIGN.md, "Metric names"): every key
    that is not a field below is a metric key (`metric` or `metric/module`) with its value;
    NaN, Infinity and -Infinity literals (or null for NaN) are data."""

    model_config = ConfigDict(extra="allow")
    __pydantic_extra__: dict[str, float | None] = Field(init=False)
    step: int = Field(ge=0, le=INT64_MAX)
    sample_lo: int = Field(-1, ge=-1, le=INT64_MAX)
    sample_hi: int = Field(-1, ge=-1, le=INT64_MAX)
    tokens: int = Field(0, ge=-1, le=INT64_MAX)
    wall_time: float = Field(0.0, description="seconds the step took; finite")
    ranks: dict[str, int] | None = Field(None, description="metric key -> the rank that held the extreme")
    ledger_digest: str = Field("", max_length=64)


class StepsBody(BaseModel):
    records: list[StepRecordBody] = Field(max_length=_DEFAULTS.max_records, description=(
        f"at most {_DEFAULTS.max_keys_per_step} metric keys per step and {_DEFAULTS.max_values} values per batch; "
        f"a run holds at most {_DEFAULTS.max_series_per_run} series (defaults of limits.*)"))


class LRChangeBody(BaseModel):
    start_step: int = Field(ge=1, le=INT64_MAX)
    multiplier: float = Field(gt=0, le=MAX_LR_MULTIPLIER)
    steps: int | None = Field(None, ge=1, le=INT64_MAX)
    rewarmup_steps: int = Field(0, ge=0, le=INT64_MAX)


class AckBody(BaseModel):
    """monitors.commands.Ack as JSON: what the trainer really did with a command."""

    command_id: int = Field(ge=0, le=INT32_MAX)
    ok: bool
    step: int = Field(ge=0, le=INT64_MAX, description="the first step trained after the command took effect")
    detail: str = ""
    checkpoint_step: int | None = Field(None, ge=0, le=INT64_MAX)
    checkpoint_path: str | None = None
    lr_multiplier: float | None = Field(None, ge=0, le=MAX_LR_MULTIPLIER)
    lr_change: LRChangeBody | None = None
    lr_seq: int | None = Field(None, ge=0, le=INT32_MAX)
    skipped: list[tuple[int, int]] = Field(default_factory=list, description="[lo, hi) sample ranges added to the ledger")
    ledger_digest: str = ""


# --- helpers ------------------------------------------------------------------------------------


def body_doc(model: type[BaseModel], description: str = "") -> dict[str, Any]:
    """openapi_extra for a route that reads `model` as its JSON body itself. The schema is inlined
    (no $defs, no components), so it is complete whichever app includes the router."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline({**defs[ref.rsplit("/", 1)[1]], **{k: v for k, v in node.items() if k != "$ref"}})
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    body: dict[str, Any] = {"required": True, "content": {"application/json": {"schema": inline(schema)}}}
    if description:
        body["description"] = description
    return {"requestBody": body}
