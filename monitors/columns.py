"""A batch of step records as columns, one array per series per batch (issue 10), so that the
daemon decodes a batch with np.frombuffer instead of building a Python float per value.

Why not the per-step JSON form (`{"records": [{"step": 7, "loss": 2.3, ...}]}`): it names every
metric key again in every step and makes the daemon build one Python float and one dict entry
per value; at 781 series x 50 steps that is ~70 ms of decoding per batch, more than the database
insert. `StepColumns` carries the same batch as arrays, and its wire form is a small JSON header
followed by raw little-endian arrays, so NaN, +-Inf (and the sign of a zero) arrive bit-exact.

Wire form (content type COLUMNS_CONTENT_TYPE), sizes in bytes:

    b"TWC1"                      magic and version
    uint32 LE  h                 header length
    h bytes    header JSON       {"steps": n, "keys": [k...], "ranked": [j...], "present": bool,
                                  "ledger_digest": [str] * n (omitted when every digest is "")}
    int64[n]   step, sample_lo, sample_hi, tokens
    float64[n] wall_time
    float64[len(keys) * n]       values, one series after another (series-major)
    uint8[len(keys) * n]         only when "present": 1 where the step carries the key
    int32[len(ranked) * n]       ranks of the series listed in "ranked", -1 where none

`decode` checks the shape only (sizes, types, a header of bounded size); what a value may be
(ranges, keys, limits) is checked by the supervisor's ingest, exactly as for the JSON form.
Numpy only: importable on both sides without torch.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from thermowatch.monitors.commands import ContractError

COLUMNS_CONTENT_TYPE = "application/vnd.thermowatch.step-columns"
MAGIC = b"TWC1"
MAX_HEADER_BYTES = 16 << 20  # 20,000 keys of 400 characters fit; anything bigger is hostile


@dataclass(slots=True, eq=False)
class StepColumns:
    """Steps x series. `values[i, j]` is key j at step i; `present` (None: every step has every
    key) marks which cells were sent; `ranks` (None: no ranks) holds -1 where no rank was sent."""

    steps: np.ndarray  # int64 [n]
    keys: list[str]
    values: np.ndarray  # float64 [n, len(keys)]
    sample_lo: np.ndarray  # int64 [n]
    sample_hi: np.ndarray  # int64 [n]
    tokens: np.ndarray  # int64 [n]
    wall_time: np.ndarray  # float64 [n]
    present: np.ndarray | None = None  # bool [n, len(keys)]
    ranks: np.ndarray | None = None  # int32 [n, len(keys)]
    ledger_digest: list[str] | None = None  # [n], None when every step's is ""

    def __len__(self) -> int:
        return len(self.steps)

    @property
    def n_values(self) -> int:
        return int(self.values.size if self.present is None else self.present.sum())

    # --- from and to step records ------------------------------------------------------------

    @classmethod
    def from_records(cls, records: Sequence) -> "StepColumns":
        """StepRecords -> columns: per step, never per value, in Python (numpy fills the rows)."""
        n = len(records)
        first = list(records[0].values) if n else []
        if all(list(r.values) == first for r in records):  # one producer: same keys, same order
            keys, present = first, None
            values = np.fromiter((v for r in records for v in r.values.values()), np.float64,
                                 n * len(keys)).reshape(n, len(keys))
        else:
            keys = list(dict.fromkeys(k for r in records for k in r.values))
            col = {k: j for j, k in enumerate(keys)}
            values = np.full((n, len(keys)), np.nan)
            present = np.zeros(values.shape, bool)
            for i, r in enumerate(records):
                js = [col[k] for k in r.values]
                values[i, js] = list(r.values.values())
                present[i, js] = True
        ranks = None
        if any(r.ranks for r in records):
            col = {k: j for j, k in enumerate(keys)}
            ranks = np.full(values.shape, -1, np.int32)
            for i, r in enumerate(records):
                for k, rank in r.ranks.items():
                    if k in col:
                        ranks[i, col[k]] = rank
        digests = [r.ledger_digest for r in records]
        return cls(
            steps=np.fromiter((r.step for r in records), np.int64, n), keys=keys, values=values,
            sample_lo=np.fromiter((r.sample_lo for r in records), np.int64, n),
            sample_hi=np.fromiter((r.sample_hi for r in records), np.int64, n),
            tokens=np.fromiter((r.tokens for r in records), np.int64, n),
            wall_time=np.fromiter((r.wall_time for r in records), np.float64, n),
            present=present, ranks=ranks, ledger_digest=digests if any(digests) else None)

    def to_records(self) -> list:
        """Columns -> StepRecords (what the judge and the consistency check read): one dict per
        step built by zip in C, not a Python statement per value."""
        from thermowatch.monitors.contract import StepRecord

        rows = self.values.tolist()
        keys = self.keys
        steps, lo, hi = self.steps.tolist(), self.sample_lo.tolist(), self.sample_hi.tolist()
        tok, wall = self.tokens.tolist(), self.wall_time.tolist()
        digest = self.ledger_digest or [""] * len(steps)
        pres = self.present.tolist() if self.present is not None else None
        ranked = None
        if self.ranks is not None:
            rk = self.ranks
            has = np.flatnonzero((rk >= 0).any(axis=0))
            ranked = [(keys[j], rk[:, j].tolist()) for j in has.tolist()]
        out = []
        for i, row in enumerate(rows):
            if pres is None:
                values = dict(zip(keys, row))
            else:
                values = {k: v for k, v, p in zip(keys, row, pres[i]) if p}
            ranks = {k: r[i] for k, r in ranked if r[i] >= 0} if ranked else {}
            out.append(StepRecord(step=steps[i], values=values, sample_lo=lo[i], sample_hi=hi[i], tokens=tok[i],
                                  wall_time=wall[i], ranks=ranks, ledger_digest=digest[i]))
        return out

    def only(self, keys: Iterable[str]) -> "StepColumns":
        """The same steps with only these keys (those the batch has), e.g. for a check that reads
        two series of 781: its records cost two values per step, not 781."""
        want = set(keys)
        js = [j for j, k in enumerate(self.keys) if k in want]
        pick = lambda a: None if a is None else a[:, js]  # noqa: E731
        return StepColumns(
            steps=self.steps, keys=[self.keys[j] for j in js], values=self.values[:, js], sample_lo=self.sample_lo,
            sample_hi=self.sample_hi, tokens=self.tokens, wall_time=self.wall_time, present=pick(self.present),
            ranks=pick(self.ranks), ledger_digest=self.ledger_digest)

    def select(self, mask: np.ndarray) -> "StepColumns":
        """The steps where `mask` is true (a re-sent batch cut to its new steps)."""
        return StepColumns(
            steps=self.steps[mask], keys=self.keys, values=self.values[mask], sample_lo=self.sample_lo[mask],
            sample_hi=self.sample_hi[mask], tokens=self.tokens[mask], wall_time=self.wall_time[mask],
            present=None if self.present is None else self.present[mask],
            ranks=None if self.ranks is None else self.ranks[mask],
            ledger_digest=None if self.ledger_digest is None else [d for d, m in zip(self.ledger_digest, mask) if m])

    # --- the wire form -----------------------------------------------------------------------

    def encode(self) -> bytes:
        n, k = self.values.shape
        ranked = [] if self.ranks is None else np.flatnonzero((self.ranks >= 0).any(axis=0)).tolist()
        header = {"steps": n, "keys": self.keys, "ranked": ranked, "present": self.present is not None}
        if self.ledger_digest is not None:
            header["ledger_digest"] = self.ledger_digest
        h = json.dumps(header, separators=(",", ":")).encode()
        parts = [MAGIC, struct.pack("<I", len(h)), h]
        for a in (self.steps, self.sample_lo, self.sample_hi, self.tokens):
            parts.append(np.ascontiguousarray(a, "<i8").tobytes())
        parts.append(np.ascontiguousarray(self.wall_time, "<f8").tobytes())
        parts.append(np.ascontiguousarray(self.values.T, "<f8").tobytes())
        if self.present is not None:
            parts.append(np.ascontiguousarray(self.present.T, np.uint8).tobytes())
        if ranked:
            parts.append(np.ascontiguousarray(self.ranks[:, ranked].T, "<i4").tobytes())
        return b"".join(parts)

    @classmethod
    def decode(cls, body: bytes) -> "StepColumns":
        """Parse the wire form; ContractError names what is malformed. Every array is sized by
        the body it came in (the length check below), so a header cannot make it allocate more
        than ~1.5x the body; the budgets (supervisor.limits) are checked by ingest afterwards."""
        if len(body) < 8 or body[:4] != MAGIC:
            raise ContractError(f"a {COLUMNS_CONTENT_TYPE} body starts with {MAGIC!r} and a 4-byte header length")
        (hlen,) = struct.unpack_from("<I", body, 4)
        if hlen > MAX_HEADER_BYTES or 8 + hlen > len(body):
            raise ContractError(f"columns header of {hlen} bytes does not fit the body of {len(body)} bytes")
        try:
            header = json.loads(body[8:8 + hlen])
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise ContractError(f"columns header is not valid JSON: {str(exc)[:200]}") from None
        if not isinstance(header, dict):
            raise ContractError("columns header must be a JSON object")
        n, keys, ranked = header.get("steps"), header.get("keys"), header.get("ranked", [])
        present, digests = header.get("present", False), header.get("ledger_digest")
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ContractError(f"columns header: 'steps' must be a non-negative integer, got {str(n)[:40]}")
        if not isinstance(keys, list) or not all(isinstance(x, str) for x in keys):
            raise ContractError("columns header: 'keys' must be a list of metric keys (strings)")
        if len(set(keys)) != len(keys):
            seen: set[str] = set()
            dup = next(k for k in keys if k in seen or seen.add(k))
            raise ContractError(f"columns header: metric key {dup[:200]!r} is listed twice")
        if not isinstance(ranked, list) or not all(
                isinstance(j, int) and not isinstance(j, bool) and 0 <= j < len(keys) for j in ranked) \
                or len(set(ranked)) != len(ranked):
            raise ContractError("columns header: 'ranked' must list distinct indices into 'keys'")
        if not isinstance(present, bool):
            raise ContractError("columns header: 'present' must be true or false")
        if digests is not None and (not isinstance(digests, list) or len(digests) != n
                                    or not all(isinstance(d, str) for d in digests)):
            raise ContractError("columns header: 'ledger_digest' must be a list of one string per step")
        k = len(keys)
        want = 8 + hlen + n * (5 * 8 + k * 8 + (k if present else 0) + len(ranked) * 4)
        if len(body) != want:
            raise ContractError(f"columns body is {len(body)} bytes; its header ({n} steps, {k} keys, "
                                f"{len(ranked)} ranked{', present mask' if present else ''}) needs {want}")
        off = 8 + hlen

        def take(dtype: str, count: int) -> np.ndarray:
            nonlocal off
            a = np.frombuffer(body, dtype, count, off)
            off += a.nbytes
            return a

        steps, lo, hi, tok = (take("<i8", n).astype(np.int64) for _ in range(4))
        wall = take("<f8", n).astype(np.float64)
        values = take("<f8", k * n).astype(np.float64).reshape(k, n).T
        pres = None
        if present:
            raw = take("u1", k * n).reshape(k, n).T
            if (raw > 1).any():
                raise ContractError("columns body: the present mask holds bytes other than 0 and 1")
            pres = raw.astype(bool)
        ranks = None
        if ranked:
            ranks = np.full((n, k), -1, np.int32)
            ranks[:, ranked] = take("<i4", len(ranked) * n).reshape(len(ranked), n).T
        return cls(steps=steps, keys=keys, values=values, sample_lo=lo, sample_hi=hi, tokens=tok, wall_time=wall,
                   present=pres, ranks=ranks, ledger_digest=digests if digests is not None and any(digests) else None)


def as_records(batch: "Sequence | StepColumns") -> list:
    """A committed batch as StepRecords, whichever form it came in (ingest hands the judge and
    the state checks the columns it stored; a catch-up reads records back)."""
    return batch.to_records() if isinstance(batch, StepColumns) else list(batch)
