"""The request bodies of the HTTP API as pydantic models, so the OpenAPI document describes them
(and schema-driven fuzzers such as schemathesis can send them).

Routes read their bodies themselves, after the token check and under a byte limit
(supervisor.serve.body), so a model is attached to its route's OpenAPI entry
(`thermowatch.supervisor.serve.api.document_bodies`, openapi_extra) rather than declared as a FastAPI body
parameter, which would parse the body before auth.

Which code validates what:
- the manual-action bodies (supervisor.serve.api.commands.ManualAction, Approval) are validated by
  their models (supervisor.serve.api.commands._parse);
- bodies that are contract types (RunInfo, CheckpointInfo, Ack, and StepRecord inside the
  steps batch, RunFinished) are validated by the contract's `from_json` (monitors.contract,
  monitors.commands: the one validator the trainer's side uses too) plus supervisor.limits, and
  the deleted-checkpoints report by supervisor.ingest.ingestor.deleted_from_json; their models here
  document that JSON. The steps batch is never run through pydantic: reading it already costs ~30 ms of CPU
  per 50 x 781-value batch, and the model would add ~15% (bench/ingest.py --validation) to
  check again what the contract checks.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, RootModel, create_model

from thermowatch.monitors.commands import (COMMAND_TYPES, INT32_MAX, INT64_MAX, MAX_LR_MULTIPLIER, MAX_PAUSE_REASON,
                                           CommandKind)
from thermowatch.monitors.contract import MAX_WALL_TIME
from thermowatch.supervisor.limits import METRIC_CHARS, MODULE_CHARS, PATH_CHARS, RUN_ID_CHARS, Limits

_DEFAULTS = Limits()
# JSON-schema spelling of supervisor.limits' run-id rule (the code also refuses lone surrogates)
# not `.` or `..` either, spelled without look-ahead (pydantic's regex engine has none)
_C = r"[^/\x00-\x1f\x7f]"
_CN = r"[^/\x00-\x1f\x7f.]"
RUN_ID_PATTERN = rf"^(?:{_CN}{_C}*|\.{_CN}{_C}*|\.\.{_C}+)$"
_Sample = Annotated[int, Field(ge=0, le=INT64_MAX)]  # an absolute sample id


# --- bodies validated elsewhere (documentation of their JSON) ---------------------------------------


class CheckpointsDeleted(BaseModel):
    """The trainer deleted these checkpoints (retention): never offer them again."""

    steps: list[Annotated[int, Field(ge=0, le=INT64_MAX)]] = Field(max_length=100_000, description="checkpoint steps")
    reason: str = Field("", max_length=10_000, description="kept to its first 200 characters in the audit trail")


class RunFinishedBody(BaseModel):
    """thermowatch.monitors.contract.RunFinished as JSON: the attempt ended of its own accord."""

    step: int = Field(ge=0, le=INT64_MAX, description="the last step trained")
    final_loss: float | Literal["NaN", "Infinity", "-Infinity"] | None = Field(
        None, description="the loss it ended on; null or left out: none measured. NaN/Infinity are data "
                          "(a diverged run)")
    reason: Literal["completed", "stopped", "closed"]


class RunInfoBody(BaseModel):
    """thermowatch.monitors.contract.RunInfo as JSON: a run, or a new attempt of it, starts."""

    run_id: str = Field(min_length=1, max_length=RUN_ID_CHARS, pattern=RUN_ID_PATTERN)
    attempt: int = Field(ge=0, le=INT32_MAX)
    world_size: int = Field(ge=1, le=INT32_MAX)
    config: dict[str, Any] | None = Field(None, description=(
        f"the run's config: at most {_DEFAULTS.max_config_keys} keys through every level, "
        f"{_DEFAULTS.max_config_bytes} bytes, {_DEFAULTS.max_json_depth} levels, finite numbers (defaults of limits.*)"))
    start_step: int = Field(0, ge=0, le=INT64_MAX)
    hosts: dict[str, Annotated[str, Field(pattern=r"^[^\x00]*$")]] | None = Field(
        None, description="rank (decimal) -> node address", json_schema_extra={"propertyNames": {"pattern": r"^[0-9]{1,9}$"}})


class CheckpointBody(BaseModel):
    """thermowatch.monitors.contract.CheckpointInfo as JSON: the trainer saved a checkpoint."""

    step: int = Field(ge=0, le=INT64_MAX)
    path: str = Field(min_length=1, max_length=PATH_CHARS)
    sample_cursor: int = Field(ge=0, le=INT64_MAX)
    healthy: bool
    manifest: dict[str, Any] | None = Field(None, description=(
        f"the checkpoint's manifest: at most {_DEFAULTS.max_manifest_keys} keys, {_DEFAULTS.max_manifest_bytes} "
        "bytes, finite numbers"))


class StepRecordBody(BaseModel):
    """thermowatch.monitors.contract.StepRecord in its flat JSON shape (DESIGN.md, "Metric names"): every key
    that is not a field below is a metric key (`metric` or `metric/module`) with its value;
    NaN, Infinity and -Infinity literals (or null for NaN) are data."""

    # metric keys as supervisor.limits.check_metric_key takes them (the fields' own names match too)
    model_config = ConfigDict(extra="allow", json_schema_extra={"propertyNames": {
        "pattern": f"^[^/\\x00-\\x1f\\x7f]{{1,{METRIC_CHARS}}}(/[^\\x00-\\x1f\\x7f]{{1,{MODULE_CHARS}}})?$"}})
    __pydantic_extra__: dict[str, float | None] = Field(init=False)
    step: int = Field(ge=0, le=INT64_MAX)
    sample_lo: int = Field(-1, ge=-1, le=INT64_MAX)
    sample_hi: int = Field(-1, ge=-1, le=INT64_MAX)
    tokens: int = Field(0, ge=-1, le=INT64_MAX)
    wall_time: float = Field(0.0, ge=-MAX_WALL_TIME, le=MAX_WALL_TIME,
                             description="when the step ended, seconds on the trainer's clock (time.time())")
    ranks: dict[str, Annotated[int, Field(ge=0, le=INT32_MAX)]] | None = Field(
        None, description="metric key -> the rank that held the extreme")
    ledger_digest: str = Field("", max_length=64)


class StepsBody(BaseModel):
    # No maxItems: the limit is the daemon's config (limits.max_records), and a batch over it is a
    # 413 naming it, not a schema violation.
    records: list[StepRecordBody] = Field(description=(
        f"at most {_DEFAULTS.max_records} steps, {_DEFAULTS.max_keys_per_step} metric keys per step and "
        f"{_DEFAULTS.max_values} values per batch; a run holds at most {_DEFAULTS.max_series_per_run} series "
        "(defaults of limits.*; a batch over them is a 413)"))


class LRChangeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")  # LRChange.from_json names an unknown field
    start_step: int = Field(ge=1, le=INT64_MAX)
    multiplier: float = Field(gt=0, le=MAX_LR_MULTIPLIER)
    steps: int | None = Field(None, ge=1, le=INT64_MAX)
    rewarmup_steps: int = Field(0, ge=0, le=INT64_MAX)


# lr_change and lr_seq come together (the change and its place in the trainer's list) or not at all
_LR_CHANGE_WITH_SEQ = {"anyOf": [
    {"required": ["lr_change", "lr_seq"], "properties": {"lr_change": {"type": "object"}, "lr_seq": {"type": "integer"}}},
    {"properties": {"lr_change": {"type": "null"}, "lr_seq": {"type": "null"}}}]}


class ReplayBody(BaseModel):
    """thermowatch.monitors.commands.Replay: one replay of replay triage from the checkpoint."""

    model_config = ConfigDict(extra="forbid")

    suspects_skipped: bool = Field(description="false: the same samples as the abandoned path; true: every suspect skipped")
    spiked: bool
    step: int = Field(ge=0, le=INT64_MAX, description="the step it spiked at, or the last it trained when clean")
    loss: float | None = Field(description="the loss there; null when not finite")
    level: float | None = Field(description="the level it was judged against; null with fewer than 4 losses")
    steps: int = Field(ge=0, le=INT64_MAX)


class CauseBody(BaseModel):
    """thermowatch.monitors.commands.Cause: replay triage's verdict, evidence and cost (issue 39)."""

    model_config = ConfigDict(extra="forbid")

    label: Literal["data", "hardware", "optimizer"]
    recorded_step: int = Field(ge=0, le=INT64_MAX, description="where the abandoned path's loss spiked")
    recorded_loss: float | None = Field(description="its loss there; null when not finite")
    replays: list[ReplayBody] = Field(min_length=1, max_length=2)
    steps: int = Field(ge=0, le=INT64_MAX, description="training steps the replays took")
    seconds: float = Field(ge=0, le=1e9)
    rank: int | None = Field(None, ge=0, le=INT32_MAX, description=(
        "under torchrun, the one rank whose figures went non-finite on the abandoned path; null when every "
        "rank's did or none was named; absent from older clients"))


class BisectedBody(BaseModel):
    """thermowatch.monitors.commands.Bisected: a precise skip's search of a rollback's suspects."""

    model_config = ConfigDict(extra="forbid")

    suspects: list[Annotated[tuple[_Sample, _Sample], Field(description="[lo, hi)")]]
    probes: int = Field(ge=0, le=INT32_MAX)
    steps: int = Field(ge=0, le=INT64_MAX, description="training steps the probes took")
    seconds: float = Field(ge=0, le=1e9)
    outcome: Literal["narrowed", "inseparable", "budget", "cleared"]
    cause: CauseBody | None = Field(None, description="replay triage's verdict; absent from older clients")


class AckBody(BaseModel):
    """thermowatch.monitors.commands.Ack as JSON: what the trainer really did with a command."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=_LR_CHANGE_WITH_SEQ)

    command_id: int = Field(ge=0, le=INT32_MAX)
    ok: bool
    first_step: int = Field(ge=0, le=INT64_MAX, description="the first step trained after the command took effect "
                                                           "(after a rollback to checkpoint T, T + 1)")
    detail: str = ""
    checkpoint_step: int | None = Field(None, ge=0, le=INT64_MAX)
    checkpoint_path: str | None = None
    lr_multiplier: float | None = Field(None, ge=0, le=MAX_LR_MULTIPLIER)
    lr_change: LRChangeBody | None = None
    lr_seq: int | None = Field(None, ge=0, le=INT32_MAX)
    skip_ranges: list[Annotated[tuple[_Sample, _Sample], Field(description="[lo, hi)")]] = Field(
        default_factory=list, description="[lo, hi) sample ranges added to the ledger; an empty one (lo >= hi) is "
                                          "nothing and is dropped")
    ledger_digest: str = ""
    bisected: BisectedBody | None = Field(None, description="a precise skip's search, when one ran")
    # The old names (issue 38: one name per concept), read until the next release; never with the new one.
    step: int | None = Field(None, ge=0, le=INT64_MAX, deprecated=True,
                             description="deprecated: the old name of first_step, read until the next release")
    skipped: list[Annotated[tuple[_Sample, _Sample], Field(description="[lo, hi)")]] | None = Field(
        None, deprecated=True, description="deprecated: the old name of skip_ranges, read until the next release")


# --- manual actions: args per kind (validated by monitors.commands' from_args) -------------------

# [lo, hi) absolute sample ids. lo < hi is the contract's rule too, which JSON Schema cannot state.
SampleRangeBody = Annotated[tuple[_Sample, _Sample], Field(description="[lo, hi): absolute sample ids, lo < hi")]
_Multiplier = Annotated[float, Field(gt=0, le=MAX_LR_MULTIPLIER)]
_WHO = Field("", max_length=90, description="optional: the person behind the token, recorded beside the token's name")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")  # from_args names a key it does not know: 422


class NoArgs(_Strict):
    """resume and stop take no args."""


class PauseArgs(_Strict):
    reason: str | None = Field(None, max_length=MAX_PAUSE_REASON, description=(
        "why, printed by the paused loop (default: who paused it, and the action's reason)"))


class ProfileArgs(_Strict):
    steps: int = Field(5, ge=1, le=100_000, description="trace this many steps")
    out_dir: str | None = Field(None, description="where the traces go (default: the run's profiles/)")


class SkipArgs(_Strict):
    skip_ranges: list[SampleRangeBody] = Field(min_length=1)


class _LRArgs(_Strict):
    lr_multiplier: _Multiplier | None = Field(None, description="absolute multiplier on the LR schedule")
    lr_factor: _Multiplier | None = Field(None, description=(
        "relative: this times the multiplier in force (when lr_multiplier is not given)"))
    lr_base: _Multiplier | None = None
    lr_steps: int | None = Field(None, ge=1, le=INT64_MAX, description="for this many steps (default: the rest)")
    rewarmup_steps: int | None = Field(None, ge=0, le=INT64_MAX)


# set_lr needs lr_multiplier or lr_factor (a number, not null)
_ONE_OF_LR = {"anyOf": [{"required": ["lr_multiplier"], "properties": {"lr_multiplier": {"type": "number"}}},
                        {"required": ["lr_factor"], "properties": {"lr_factor": {"type": "number"}}}]}


class SetLRArgs(_LRArgs):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_ONE_OF_LR)


class RollbackArgs(_LRArgs):
    to_step: int = Field(ge=0, le=INT64_MAX, description="the newest healthy checkpoint at or before this step")
    exact: bool = Field(False, description="exactly the checkpoint at to_step")
    checkpoint: str | None = None
    skip_ranges: list[SampleRangeBody] | None = None
    exclude_rank: int | None = Field(None, ge=0, le=INT32_MAX)
    exclude_node: str | None = None


# Each command's args as the API documents them. The keys are the command's own (its ARGS, which
# its from_args takes): checked below, so the document cannot drift from what the contract accepts
# (it did: a pause's `reason` was taken and documented nowhere).
ARGS_MODELS: dict[CommandKind, type[_Strict]] = {
    CommandKind.PAUSE: PauseArgs, CommandKind.RESUME: NoArgs, CommandKind.STOP: NoArgs,
    CommandKind.PROFILE: ProfileArgs, CommandKind.SKIP: SkipArgs, CommandKind.SET_LR: SetLRArgs,
    CommandKind.ROLLBACK: RollbackArgs}
_drift = {k.value: sorted(set(m.model_fields) ^ COMMAND_TYPES[k].ARGS) for k, m in ARGS_MODELS.items()
          if set(m.model_fields) != COMMAND_TYPES[k].ARGS}
if _drift or set(ARGS_MODELS) != set(CommandKind):
    raise AssertionError(f"the API's command args differ from the commands' (monitors.commands ARGS): {_drift}")


class _Action(_Strict):
    who: str = _WHO
    reason: str = ""


def _action(kind: CommandKind) -> type[_Action]:
    """The body for one kind: {kind, args, who, reason}, args required where the command needs some."""
    args = ARGS_MODELS[kind]
    required = any(f.is_required() for f in args.model_fields.values())
    return create_model(f"{COMMAND_TYPES[kind].__name__}Action", __base__=_Action,
                        kind=(Literal[kind.value], ...),  # type: ignore[valid-type]
                        args=(args, ... if required else Field(default_factory=args)))


class ManualActionBody(RootModel):
    """thermowatch.supervisor.serve.api.commands.ManualAction as the OpenAPI states it: one shape per kind, so a
    body the schema allows is one the contract takes (issue 21). The route parses the plain
    {kind, args} model and lets monitors.commands.parse_command judge the args, so the
    contract stays the one validator; this documents what it checks."""

    root: Annotated[Union[tuple(_action(k) for k in CommandKind)], Field(discriminator="kind")]  # type: ignore[valid-type]


# --- helpers ------------------------------------------------------------------------------------


def body_doc(model: type[BaseModel], description: str = "") -> dict[str, Any]:
    """openapi_extra for a route that reads `model` as its JSON body itself. The schema is inlined
    (no $defs, no components), so it is complete whichever app includes the router."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})
    schema.pop("discriminator", None)  # its mapping names $defs, inlined below; each branch's const says it

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
