"""Deterministic, skippable, curriculum-aware batches, and the state that resumes them.

    step t:  (B, T) = curriculum.at(tokens_consumed)
             ids    = the next B ids >= cursor not in the skip ledger     (global batch)
             rank r of W takes ids[r*B/W : (r+1)*B/W]                      (contiguous slice)
             sample i = tokens [start_i, start_i + T + 1), start_i = perm_{seed}(i) * full_T
             cursor = ids[-1] + 1;  tokens_consumed += B * T

The global batch depends only on (seed, corpus, skip ledger, cursor, tokens consumed), never
on the world size, so W = 1, 2, 4 ... train on the same samples; a DataState taken from a
checkpoint reproduces every later batch bit for bit (DESIGN.md, "Rollback semantics").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping

import numpy as np
import torch

from thermowatch.trainer.data.curriculum import Curriculum
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.trainer.data.order import sample_windows
from thermowatch.trainer.data.sources import DataError, TokenSource, bin_source, stdlib_source, text_source

SOURCES = ("stdlib", "text", "bin")


@dataclass
class DataConfig:
    source: str = "stdlib"  # real text on every machine with Python: no download for tests/embedded
    path: str | None = None  # file or folder, required for "text" and "bin"
    max_bytes: int = 8 << 20  # stdlib/text cap: 8 MB loads in < 1 s and holds ~30k 256-token windows
    vocab_size: int | None = None  # "bin" only; None = the shard format's tokenizer (GPT-2: 50257)
    seq_len: int = 256  # full context length (the model's block size)
    global_batch: int = 8  # samples per optimizer step, summed over ranks
    seed: int = 1337  # nanoGPT's seed; the whole sample order derives from it
    # Curriculum (YaLM; Li et al. 2022). None / 0 = fixed (global_batch, seq_len) throughout.
    start_batch: int | None = None  # e.g. global_batch // 8
    start_seq_len: int | None = None  # e.g. 64
    ramp_tokens: int = 0  # tokens over which both ramp linearly to full
    seq_multiple: int = 8  # seq_len rounding during the ramp (few distinct shapes)
    batch_multiple: int = 8  # batch rounding during the ramp; every world size used must divide it

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise DataError(f"data.source={self.source!r} is not one of {SOURCES}")
        if self.source != "stdlib" and not self.path:
            raise DataError(f"data.source={self.source!r} needs data.path (a file or folder)")
        if self.max_bytes <= 0:
            raise DataError(f"data.max_bytes must be positive, got {self.max_bytes}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise DataError(f"data.seed must be an integer >= 0, got {self.seed!r}")
        # By the names a config uses (Curriculum's messages say full_batch), and fail closed even
        # where a value is unused today (issue 34): the rounding multiples only matter with a
        # ramp, the vocabulary only for "bin", and -1 was accepted for all three.
        for name in ("seq_len", "global_batch", "seq_multiple", "batch_multiple") + (
                ("vocab_size",) if self.vocab_size is not None else ()):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DataError(f"data.{name} must be an integer >= 1, got {v!r}")
        if not self.ramp_tokens and (self.start_batch is not None or self.start_seq_len is not None):
            raise DataError(
                f"data.start_batch={self.start_batch} / start_seq_len={self.start_seq_len} have no effect "
                "with ramp_tokens=0: set ramp_tokens to the ramp's length in tokens, or drop them"
            )
        self.curriculum()  # validates the shape fields, with Curriculum's messages

    def curriculum(self) -> Curriculum:
        if not self.ramp_tokens:
            return Curriculum.constant(self.global_batch, self.seq_len)
        return Curriculum(
            full_batch=self.global_batch,
            full_seq_len=self.seq_len,
            start_batch=self.start_batch,
            start_seq_len=self.start_seq_len,
            ramp_tokens=self.ramp_tokens,
            seq_multiple=self.seq_multiple,
            batch_multiple=self.batch_multiple,
        )

    def build_source(self) -> TokenSource:
        if self.source == "stdlib":
            return stdlib_source(self.max_bytes)
        if self.source == "text":
            return text_source(self.path, max_bytes=self.max_bytes)
        return bin_source(self.path, vocab_size=self.vocab_size)


@dataclass
class DataState:
    """Where the data stream stands; saved in every checkpoint manifest."""

    cursor: int = 0  # next absolute sample id to consider
    tokens_consumed: int = 0  # input tokens trained on so far (drives the curriculum)
    step: int = 0  # batches produced so far
    ledger: SkipLedger = field(default_factory=SkipLedger)
    # What the ids mean: a state is only valid for the same seed, window and corpus.
    seed: int | None = None
    window: int | None = None
    fingerprint: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "cursor": self.cursor,
            "tokens_consumed": self.tokens_consumed,
            "step": self.step,
            "skip_ranges": self.ledger.to_json(),
            "seed": self.seed,
            "window": self.window,
            "fingerprint": self.fingerprint,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "DataState":
        try:
            state = cls(
                cursor=int(obj["cursor"]),
                tokens_consumed=int(obj["tokens_consumed"]),
                step=int(obj.get("step", 0)),
                ledger=SkipLedger.from_json(obj.get("skip_ranges")),
                seed=None if obj.get("seed") is None else int(obj["seed"]),
                window=None if obj.get("window") is None else int(obj["window"]),
                fingerprint=str(obj.get("fingerprint", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"bad data state {obj!r}: {exc}") from exc
        if state.cursor < 0 or state.tokens_consumed < 0:
            raise DataError(f"data state has a negative cursor or token count: {obj!r}")
        return state

    def copy(self) -> "DataState":
        return DataState(
            self.cursor, self.tokens_consumed, self.step, self.ledger.copy(), self.seed, self.window, self.fingerprint
        )


@dataclass
class Batch:
    inputs: torch.Tensor  # (B/W, T) int64, this rank's share
    targets: torch.Tensor  # (B/W, T) int64, inputs shifted by one
    sample_ids: np.ndarray  # this rank's absolute sample ids (int64)
    global_ids: np.ndarray  # the whole step's ids, identical on every rank
    sample_lo: int  # first id consumed by the step
    sample_hi: int  # last id + 1 (skipped ids inside were passed over)
    global_batch: int
    seq_len: int
    step: int  # the step this batch is for (0-based)
    state: DataState  # the state *after* this batch: save it with the step's checkpoint

    @property
    def tokens(self) -> int:
        """Input tokens this step trains on, over all ranks."""
        return self.global_batch * self.seq_len


@dataclass(frozen=True)
class _Windows:
    """Sample id -> corpus window (order.sample_windows): the skip ledger's index, picklable (a
    loader's state crosses Ray)."""

    n_windows: int
    seed: int

    def __call__(self, ids: np.ndarray) -> np.ndarray:
        return sample_windows(ids, self.n_windows, self.seed)


class DataLoader:
    """Batches for one rank. Cheap to build: the order is computed, never stored."""

    def __init__(
        self,
        source: TokenSource,
        config: DataConfig,
        rank: int = 0,
        world_size: int = 1,
        state: DataState | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise DataError(f"rank {rank} is outside world size {world_size}")
        self.source = source
        self.config = config
        self.rank, self.world_size = rank, world_size
        self.curriculum = config.curriculum()
        self._check_world_size()
        self.window = config.seq_len  # stride between windows; each window holds window + 1 tokens
        self.n_windows = (len(source) - 1) // self.window
        if self.n_windows < 1:
            raise DataError(
                f"the corpus has {len(source)} tokens, fewer than one window of seq_len+1={config.seq_len + 1}; "
                "use a larger corpus (data.max_bytes, data.path) or a smaller seq_len"
            )
        self._state = self.fresh_state()
        if state is not None:
            self.load_state(state)

    def _check_world_size(self) -> None:
        cur, w = self.curriculum, self.world_size
        sizes = {cur.full_batch} | ({cur.batch_multiple} if cur.ramps and cur.start_batch else set())
        bad = sorted(s for s in sizes if s % w)
        if bad:
            raise DataError(
                f"world size {w} does not divide the global batch size(s) {bad}: every rank must get "
                f"the same number of samples; pick a world size that divides {cur.full_batch}"
                + (f" and batch_multiple={cur.batch_multiple}" if cur.ramps and cur.start_batch else "")
            )

    # --- state --------------------------------------------------------------------------------

    def fresh_state(self) -> DataState:
        return DataState(seed=self.config.seed, window=self.window, fingerprint=self.source.fingerprint,
                         ledger=self.follow_data(SkipLedger()))

    @property
    def state(self) -> DataState:
        """A copy of the current state (the loader keeps its own)."""
        return self._state.copy()

    def load_state(self, state: DataState, strict: bool = True) -> None:
        """Continue from `state` (e.g. a checkpoint's). With strict, refuse a state whose ids
        meant other text: a different seed, window or corpus."""
        mine = self.fresh_state()
        for what, theirs, ours in (
            ("seed", state.seed, mine.seed),
            ("window (seq_len)", state.window, mine.window),
            ("corpus fingerprint", state.fingerprint or None, mine.fingerprint),
        ):
            if strict and theirs is not None and theirs != ours:
                raise DataError(
                    f"the data state was made with {what} {theirs!r} but this loader has {ours!r}: its sample "
                    "ids would name other text. Use the run's original data config, or load_state(strict=False)"
                )
        new = state.copy()
        new.seed, new.window, new.fingerprint = mine.seed, mine.window, mine.fingerprint
        new.ledger = self.follow_data(new.ledger)
        self._state = new

    def follow_data(self, ledger: SkipLedger) -> SkipLedger:
        """The ledger as this loader reads it: a skipped id stands for its corpus window, skipped in
        every epoch (issue 35: a second pass brought the same poisoned windows back, the ledger
        holding ids, not the data they map to). Each epoch is its own permutation of the windows
        (order.py), so the map from ids to windows is the ledger's `index`."""
        if ledger.period == self.n_windows and isinstance(ledger.index, _Windows):
            return ledger
        return SkipLedger(ledger.ranges, period=self.n_windows, index=_Windows(self.n_windows, self.config.seed))

    def skip(self, lo: int, hi: int) -> None:
        """Never serve absolute sample ids [lo, hi) (idempotent; merges with earlier ranges)."""
        self._state.ledger.add(lo, hi)

    # --- batches ------------------------------------------------------------------------------

    def plan(self, state: DataState) -> tuple[np.ndarray, int, int]:
        """(global ids, global batch, seq_len) of the step that starts at `state` (pure)."""
        batch, seq_len = self.curriculum.at(state.tokens_consumed)
        return self.follow_data(state.ledger).take(state.cursor, batch), batch, seq_len

    def starts(self, sample_ids: np.ndarray) -> np.ndarray:
        """Token offset of each sample's window."""
        return sample_windows(sample_ids, self.n_windows, self.config.seed) * self.window

    def tokens(self, sample_ids: np.ndarray, seq_len: int | None = None) -> np.ndarray:
        """The (len(ids), seq_len + 1) token windows of the given samples (prefixes at short seq_len)."""
        seq_len = self.config.seq_len if seq_len is None else seq_len
        return self.source.read(self.starts(sample_ids), seq_len + 1)

    def batch_at(self, state: DataState) -> Batch:
        """This rank's batch for the step starting at `state` (pure: `state` is not changed)."""
        ids, batch, seq_len = self.plan(state)
        per_rank = batch // self.world_size
        mine = ids[self.rank * per_rank : (self.rank + 1) * per_rank]
        window = self.tokens(mine, seq_len)  # narrow dtype (uint8/16/32) until the one copy below
        nxt = state.copy()
        nxt.cursor = int(ids[-1]) + 1
        nxt.tokens_consumed = state.tokens_consumed + batch * seq_len
        nxt.step = state.step + 1
        return Batch(
            inputs=torch.from_numpy(window[:, :-1].astype(np.int64)),  # astype: contiguous copy
            targets=torch.from_numpy(window[:, 1:].astype(np.int64)),
            sample_ids=mine,
            global_ids=ids,
            sample_lo=int(ids[0]),
            sample_hi=int(ids[-1]) + 1,
            global_batch=batch,
            seq_len=seq_len,
            step=state.step,
            state=nxt,
        )

    def next_batch(self) -> Batch:
        batch = self.batch_at(self._state)
        self._state = batch.state.copy()
        return batch

    def __iter__(self) -> Iterator[Batch]:
        while True:
            yield self.next_batch()

    @classmethod
    def from_config(cls, config: DataConfig, rank: int = 0, world_size: int = 1, state: DataState | None = None) -> "DataLoader":
        return cls(config.build_source(), config, rank=rank, world_size=world_size, state=state)
