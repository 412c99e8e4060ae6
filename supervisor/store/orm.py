"""ORM models of the supervisor's database (one class per table; queries live in store/<entity>.py).

The ORM is used for the schema, migrations and the small tables; the hot thermometer path
goes through Core inserts on `ThermometerChunk.__table__` (no per-row ORM objects).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from thermowatch.monitors.commands import ActionOrigin, ActionState, CommandKind, Word

# Deterministic constraint names, so migrations can drop/alter them on both dialects.
NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC on the Python side on both dialects (SQLite drops tzinfo)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value, dialect):
        if value is not None and value.tzinfo is not None:
            value = value.astimezone(dt.timezone.utc)
            if dialect.name == "sqlite":
                value = value.replace(tzinfo=None)
        return value

    def process_result_value(self, value, dialect):
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=dt.timezone.utc)
        return value


class _RawFloat(Float):
    """FLOAT in the DDL, without Float's bind processor (it turns the text 'nan' back into a float)."""

    def bind_processor(self, dialect):
        return None


class ExactFloat(TypeDecorator):
    """A float column that keeps NaN on both dialects: SQLite's driver stores a NaN REAL as NULL,
    so there it is written as the text 'nan' (a REAL column keeps text that is not a number as
    text) and read back as the float. +-Inf are REALs on both; PostgreSQL keeps NaN itself."""

    impl = Float
    cache_ok = True

    def load_dialect_impl(self, dialect):
        return dialect.type_descriptor(_RawFloat() if dialect.name == "sqlite" else Float())

    def process_bind_param(self, value, dialect):
        if value is not None and dialect.name == "sqlite" and value != value:
            return "nan"
        return value

    def process_result_value(self, value, dialect):
        return None if value is None else float(value)


class WordColumn(TypeDecorator):
    """A closed vocabulary (monitors.commands.Word) stored as its word: a VARCHAR the database
    also checks (a CHECK constraint per column, `in_words`), read back as the enum member, and a
    word outside it refused before it reaches the database (ValueError naming it)."""

    impl = String
    cache_ok = True

    def __init__(self, words: type[Word], length: int) -> None:
        super().__init__(length)
        self.words = words

    def process_bind_param(self, value, dialect):
        return None if value is None else self.words(value).value

    def process_result_value(self, value, dialect):
        return None if value is None else self.words(value)


def in_words(column: str, words: type[Word]) -> CheckConstraint:
    """The database's own check of a WordColumn (named ck_<table>_<column>)."""
    return CheckConstraint(f"{column} IN ({', '.join(repr(w.value) for w in words)})", name=column)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dt.datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


def _run_fk(ondelete: str = "CASCADE"):
    return ForeignKey("runs.run_id", ondelete=ondelete)


class Run(Base):
    __tablename__ = "runs"
    run_id: Mapped[str] = mapped_column(String(200), primary_key=True)
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # The actor that opened the run (a token's name; "" for runs from before 0011): the
    # run-creation quota counts a token's recent runs (supervisor.ingest.quota).
    created_by: Mapped[str] = mapped_column(String(200), default="", server_default="")
    # Newest-first keyset pages of the list; a token's runs of the last hour (0011).
    __table_args__ = (Index(None, "created_at", "run_id"), Index(None, "created_by", "created_at"))


class Attempt(Base):
    """One (re)start of a run: attempt 0 is the first launch, each rollback/relaunch adds one."""

    __tablename__ = "attempts"
    run_id: Mapped[str] = mapped_column(_run_fk(), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    started_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    world_size: Mapped[int] = mapped_column(Integer)
    start_step: Mapped[int] = mapped_column(BigInteger, default=0)
    hosts: Mapped[dict[str, Any]] = mapped_column(default=dict)  # {"rank": "host"}
    config: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Set once when the attempt ends of its own accord (contract.RunFinished; 0012): the run
    # reads "finished" with its final loss. NULL: it has not said so (running, crashed, older).
    finished_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    final_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    final_loss: Mapped[float | None] = mapped_column(ExactFloat, nullable=True)  # NaN/Inf are data
    finish_reason: Mapped[str | None] = mapped_column(String(20), nullable=True)
    # The actor (a token's name) that opened the attempt; '' before 0014. The attempts quota counts
    # a run's and a token's attempts of the last hour (supervisor.ingest.quota).
    opened_by: Mapped[str] = mapped_column(String(200), default="", server_default="")
    __table_args__ = (Index(None, "run_id", "started_at"), Index(None, "opened_by", "started_at"))


class Step(Base):
    """What each step consumed: turns an onset step into an absolute sample range to skip."""

    __tablename__ = "steps"
    run_id: Mapped[str] = mapped_column(_run_fk(), primary_key=True)
    step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    sample_lo: Mapped[int] = mapped_column(BigInteger)
    sample_hi: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    wall_time: Mapped[float] = mapped_column(Float, default=0.0)
    # A run's newest attempt with steps, and its last step, as two index seeks (store.steps.latest_steps).
    __table_args__ = (Index(None, "run_id", "attempt", "step"),)


class Series(Base):
    """Dictionary of thermometer series: (metric, module) -> small integer id, shared by runs."""

    __tablename__ = "series"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    metric: Mapped[str] = mapped_column(String(100))
    module: Mapped[str] = mapped_column(String(300), default="")
    __table_args__ = (UniqueConstraint("metric", "module"),)


class RunSeries(Base):
    """Which series a run has (series_keys() without scanning the chunks)."""

    __tablename__ = "run_series"
    run_id: Mapped[str] = mapped_column(_run_fk(), primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"), primary_key=True)


class ThermometerChunk(Base):
    """A run of consecutive points of one series within one attempt, as packed arrays.

    `steps` int64 or NULL when contiguous, `values` float64 (NaN/Inf kept bit-exact), `ranks` int32 or NULL when no
    point of the chunk carried a rank. Layout chosen by measurement, see store/thermometers.py.
    """

    __tablename__ = "thermometer_chunks"
    run_id: Mapped[str] = mapped_column(_run_fk(), primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    last_step: Mapped[int] = mapped_column(BigInteger)
    n: Mapped[int] = mapped_column(Integer)
    steps: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)  # NULL: contiguous
    values: Mapped[bytes] = mapped_column(LargeBinary)
    ranks: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)


class ThermometerRollup(Base):
    """Min/max/last/count buckets of one series within one attempt at one bucket width, for
    one aligned span of `width * SPAN_BUCKETS` steps, as packed arrays (supervisor/store/rollups.py).

    `buckets` int64 (first step of each bucket that holds data), `stats` float64 [4 x n]: min,
    max, last, count. Written at ingest when a span completes; retention never thins them.
    """

    __tablename__ = "thermometer_rollups"
    run_id: Mapped[str] = mapped_column(_run_fk(), primary_key=True)
    series_id: Mapped[int] = mapped_column(ForeignKey("series.id"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    width: Mapped[int] = mapped_column(Integer, primary_key=True)
    first_step: Mapped[int] = mapped_column(BigInteger, primary_key=True)  # the span's first step
    n: Mapped[int] = mapped_column(Integer)
    buckets: Mapped[bytes] = mapped_column(LargeBinary)
    stats: Mapped[bytes] = mapped_column(LargeBinary)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    attempt: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(BigInteger)
    path: Mapped[str] = mapped_column(Text)
    sample_cursor: Mapped[int] = mapped_column(BigInteger)
    healthy: Mapped[bool] = mapped_column(Boolean)
    manifest: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    deleted: Mapped[bool] = mapped_column(Boolean, default=False)
    __table_args__ = (UniqueConstraint("run_id", "attempt", "step"),)


class Incident(Base):
    """Findings grouped by (run, signal, module) while open."""

    __tablename__ = "incidents"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    signal: Mapped[str] = mapped_column(String(50))
    module: Mapped[str] = mapped_column(String(300), default="")
    severity: Mapped[str] = mapped_column(String(20), default="warn")
    onset_step: Mapped[int] = mapped_column(BigInteger)
    detect_step: Mapped[int] = mapped_column(BigInteger)
    state: Mapped[str] = mapped_column(String(20), default="open")  # open | resolved
    opened_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    closed_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    resolution: Mapped[str] = mapped_column(Text, default="")
    # The first incident of its divergence episode (store.incidents.episode_of): the alerts of every
    # incident of the episode share that one's Slack thread (issue 37). None: it is the first.
    episode_id: Mapped[int | None] = mapped_column(Integer, nullable=True)
    __table_args__ = (Index(None, "run_id", "state"),)


class LeaderLease(Base):
    """Who leads this database (supervisor.app.lease): the one replica that judges, decides, acts
    and notifies until `expires_at`; `token` grows at each takeover (the fencing token)."""

    __tablename__ = "leader_lease"
    name: Mapped[str] = mapped_column(String(50), primary_key=True)
    holder: Mapped[str] = mapped_column(String(300))
    token: Mapped[int] = mapped_column(BigInteger)
    acquired_at: Mapped[dt.datetime] = mapped_column()
    expires_at: Mapped[dt.datetime] = mapped_column()


class Silence(Base):
    """A silenced signal of a run until a time (issue 37): its alerts stop paging, its findings
    still act by policy. `signal` "*" silences every signal of the run."""

    __tablename__ = "silences"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    signal: Mapped[str] = mapped_column(String(50))
    until: Mapped[dt.datetime] = mapped_column()
    who: Mapped[str] = mapped_column(String(200))
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    ended_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)  # ended early (unsilence)
    __table_args__ = (Index(None, "run_id", "until"),)


class FindingRow(Base):
    __tablename__ = "findings"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incidents.id", ondelete="SET NULL"), nullable=True)
    signal: Mapped[str] = mapped_column(String(50))
    module: Mapped[str] = mapped_column(String(300), default="")
    metric: Mapped[str] = mapped_column(String(400), default="")
    severity: Mapped[str] = mapped_column(String(20))
    onset_step: Mapped[int] = mapped_column(BigInteger)
    detect_step: Mapped[int] = mapped_column(BigInteger)
    evidence: Mapped[dict[str, Any]] = mapped_column(default=dict)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    # watch | alert | act (contract.Outcome); rows from before outcomes existed read "alert".
    outcome: Mapped[str] = mapped_column(String(10), default="alert", server_default="alert")
    # "<attempt>|<Finding.key>": a batch delivered twice stores its finding once (judged once);
    # NULL for rows from before keys existed (NULLs never collide in a unique constraint).
    key: Mapped[str | None] = mapped_column(String(600), nullable=True)
    __table_args__ = (Index(None, "run_id", "detect_step"), UniqueConstraint("run_id", "key"))


class Action(Base):
    """The command queue and its history: pending -> sent -> acked -> done | failed."""

    __tablename__ = "actions"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    kind: Mapped[CommandKind] = mapped_column(WordColumn(CommandKind, 30))
    args: Mapped[dict[str, Any]] = mapped_column(default=dict)
    state: Mapped[ActionState] = mapped_column(WordColumn(ActionState, 20), default=ActionState.PENDING)
    origin: Mapped[ActionOrigin] = mapped_column(WordColumn(ActionOrigin, 10))
    who: Mapped[str] = mapped_column(String(200), default="")
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    ack_step: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    error: Mapped[str] = mapped_column(Text, default="")
    incident_id: Mapped[int | None] = mapped_column(ForeignKey("incidents.id", ondelete="SET NULL"), nullable=True)
    requires_approval: Mapped[bool] = mapped_column(Boolean, default=False)
    # The trainer's acknowledgement (contract.Ack JSON): what really happened.
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    __table_args__ = (Index(None, "run_id", "state"), in_words("kind", CommandKind), in_words("state", ActionState),
                      in_words("origin", ActionOrigin))


class SkipRange(Base):
    """Absolute sample-index range [lo, hi) that every restart of the run passes over."""

    __tablename__ = "skip_ranges"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    lo: Mapped[int] = mapped_column(BigInteger)
    hi: Mapped[int] = mapped_column(BigInteger)
    action_id: Mapped[int | None] = mapped_column(ForeignKey("actions.id", ondelete="SET NULL"), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class LrChange(Base):
    __tablename__ = "lr_changes"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str] = mapped_column(_run_fk())
    multiplier: Mapped[float] = mapped_column(Float)
    start_step: Mapped[int] = mapped_column(BigInteger)
    steps: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # None = permanent
    rewarmup_steps: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
    seq: Mapped[int | None] = mapped_column(BigInteger, nullable=True)  # position in the trainer's list
    action_id: Mapped[int | None] = mapped_column(ForeignKey("actions.id", ondelete="SET NULL"), nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class Alert(Base):
    """One alert to one channel: the durable outbox (supervisor.notify.outbox). Written pending in
    the transaction that decided it; the sender marks it sent, or keeps it pending with the
    error and the time of the next try, or failed when the channel refuses this message for good."""

    __tablename__ = "alerts"
    __table_args__ = (Index("ix_alerts_state_channel_id", "state", "channel", "id"),
                      Index("ix_alerts_channel_thread_key_id", "channel", "thread_key", "id"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    run_id: Mapped[str | None] = mapped_column(_run_fk("SET NULL"), nullable=True)
    channel: Mapped[str] = mapped_column(String(200))
    text: Mapped[str] = mapped_column(Text)  # the title, for lists and search
    created_at: Mapped[dt.datetime | None] = mapped_column(default=utcnow, nullable=True)
    sent_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)  # None until delivered
    ok: Mapped[bool] = mapped_column(Boolean)  # delivered (state == "sent")
    error: Mapped[str] = mapped_column(Text, default="")  # the last delivery error
    state: Mapped[str] = mapped_column(String(16), default="sent", server_default="sent")  # pending|sent|failed
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    next_attempt_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)
    payload: Mapped[dict[str, Any] | None] = mapped_column(nullable=True)  # the Alert, to send it again
    # The story this row belongs to ("incident:42", "action:7"): later rows of it reply in the
    # thread of the first one that got a `ts` (the channel's message id, Slack's ts) (0009).
    thread_key: Mapped[str | None] = mapped_column(String(100), nullable=True)
    ts: Mapped[str | None] = mapped_column(String(64), nullable=True)


class JudgeMark(Base):
    """How far the detectors have judged each attempt (supervisor.judge.judge): the durable marker of
    "commit, answer, then judge". Steps stored beyond it are judged again after a crash."""

    __tablename__ = "judge_marks"
    run_id: Mapped[str] = mapped_column(_run_fk(), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    through_step: Mapped[int] = mapped_column(BigInteger)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class AuditEntry(Base):
    __tablename__ = "audit"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    run_id: Mapped[str | None] = mapped_column(String(200), nullable=True)  # no FK: audit outlives runs
    actor: Mapped[str] = mapped_column(String(200))
    event: Mapped[str] = mapped_column(String(100))
    detail: Mapped[dict[str, Any]] = mapped_column(default=dict)
    __table_args__ = (Index(None, "run_id", "at"),)


def load_models() -> MetaData:
    """Import every supervisor.store module, so models declared beside their queries (e.g.
    store/detector_state.py) are on Base.metadata too; returns it (Alembic env, schema tests)."""
    import importlib
    import pkgutil

    import thermowatch.supervisor.store as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{pkg.__name__}.{mod.name}")
    return Base.metadata
