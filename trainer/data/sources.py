"""Token sources: one flat stream of token ids that the sampler cuts windows from.

Three kinds, one `TokenSource` interface:
  * the Python standard library's own sources as bytes (vocab 256): real text on every
    machine that has Python, so the embedded mode and the tests need no download;
  * token shards as written by nanoGPT (`train.bin`: headerless uint16) and llm.c
    (256-int32 header, magic 20240520 / version 1 / uint16 for GPT-2, magic 20240801 /
    version 7 / uint32 for Llama 3; see llm.c `dev/data/data_common.py`), memory-mapped;
  * plain text files or folders a user points at, as bytes.

Several shards read as one concatenated stream; a window may straddle two shards, as in
nanoGPT where `train.bin` is one long stream of documents separated by EOT tokens.
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from pathlib import Path
from typing import Iterable, Protocol, Sequence, runtime_checkable

import numpy as np

LLMC_HEADER_INTS = 256  # llm.c: "header is always 256 int32 values"
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
# magic -> (version, token dtype, default vocab). GPT-2's tokenizer has 50257 ids, Llama 3's 128256.
LLMC_FORMATS = {
    20240520: (1, np.dtype(np.uint16), 50257),
    20240801: (7, np.dtype(np.uint32), 128256),
}
GPT2_VOCAB = 50257  # nanoGPT's headerless train.bin holds GPT-2 (tiktoken) ids
STDLIB_EXCLUDE = ("site-packages", "dist-packages")  # installed packages differ between machines


class DataError(ValueError):
    """A data source or data state that cannot be used. The message says how to fix it."""


@runtime_checkable
class TokenSource(Protocol):
    """A flat stream of token ids."""

    vocab_size: int

    def __len__(self) -> int:
        """Number of tokens."""
        ...

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Tokens [s, s + length) for each start s: an array (len(starts), length)."""
        ...

    @property
    def fingerprint(self) -> str:
        """Cheap identity of the content, stored in checkpoints to catch a changed corpus."""
        ...


class ArraySource:
    """Tokens held in one numpy array (in memory or a memmap)."""

    def __init__(self, tokens: np.ndarray, vocab_size: int, name: str = "array") -> None:
        if tokens.ndim != 1:
            raise DataError(f"{name}: token array must be 1-D, got shape {tokens.shape}")
        self.tokens = tokens
        self.vocab_size = int(vocab_size)
        self.name = name

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.int64)
        _check_bounds(starts, length, len(self), self.name)
        return self.tokens[starts[:, None] + np.arange(length, dtype=np.int64)[None, :]]

    @property
    def fingerprint(self) -> str:
        return f"{self.name}:{len(self)}:{_edge_crc(self.tokens):08x}"

    def __repr__(self) -> str:
        return f"ArraySource({self.name!r}, tokens={len(self)}, vocab={self.vocab_size})"


class ShardSource:
    """Several memory-mapped shards read as one stream (nanoGPT / llm.c `.bin` files)."""

    def __init__(self, shards: Sequence[np.ndarray], vocab_size: int, names: Sequence[str]) -> None:
        if not shards:
            raise DataError("ShardSource needs at least one shard")
        self.shards = list(shards)
        self.names = list(names)
        self.vocab_size = int(vocab_size)
        sizes = np.array([s.shape[0] for s in self.shards], dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(sizes)])  # shard k holds [off[k], off[k+1])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.int64)
        _check_bounds(starts, length, len(self), "shards")
        if len(self.shards) == 1:
            return np.asarray(self.shards[0][starts[:, None] + np.arange(length)[None, :]])
        idx = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
        which = np.searchsorted(self.offsets, idx, side="right") - 1
        out = np.empty(idx.shape, dtype=self.shards[0].dtype)
        for k in np.unique(which):  # loop over the (one or two) shards touched, not tokens
            sel = which == k
            out[sel] = self.shards[k][idx[sel] - self.offsets[k]]
        return out

    @property
    def fingerprint(self) -> str:
        crc = 0
        for shard in self.shards:
            crc = zlib.crc32(_edge_crc(shard).to_bytes(4, "little"), crc)
        return f"shards:{len(self.shards)}:{len(self)}:{crc:08x}"

    def __repr__(self) -> str:
        return f"ShardSource({len(self.shards)} shards, tokens={len(self)}, vocab={self.vocab_size})"


# --- constructors ---------------------------------------------------------------------------


def open_bin(path: str | os.PathLike[str]) -> tuple[np.ndarray, int]:
    """Memory-map one `.bin` shard; returns (tokens, default vocab size).

    An llm.c shard is recognised by its magic number and checked against its header's token
    count; anything else is read as nanoGPT's headerless uint16 stream.
    """
    path = Path(path)
    size = path.stat().st_size
    if size >= LLMC_HEADER_BYTES:
        header = np.fromfile(path, dtype="<i4", count=LLMC_HEADER_INTS)
        magic = int(header[0])
        if magic in LLMC_FORMATS:
            version, dtype, vocab = LLMC_FORMATS[magic]
            if int(header[1]) != version:
                raise DataError(
                    f"{path}: llm.c magic {magic} with version {int(header[1])}, expected {version}; "
                    "re-tokenize with llm.c's dev/data scripts"
                )
            ntok = int(header[2])
            expected = LLMC_HEADER_BYTES + ntok * dtype.itemsize
            if size < expected:
                raise DataError(
                    f"{path}: header says {ntok} tokens ({expected} bytes) but the file has {size} bytes; "
                    "the shard is truncated, re-download or re-tokenize it"
                )
            tokens = np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", offset=LLMC_HEADER_BYTES, shape=(ntok,))
            return tokens, vocab
    if size % 2:
        raise DataError(
            f"{path}: {size} bytes is not a whole number of uint16 tokens and there is no llm.c "
            "header; is this a token shard?"
        )
    return np.memmap(path, dtype="<u2", mode="r"), GPT2_VOCAB


def bin_source(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], vocab_size: int | None = None) -> ShardSource:
    """Token shards: a `.bin` file, a folder of them (sorted by name), or a list of files."""
    files = _expand(paths, suffixes=(".bin",))
    if not files:
        raise DataError(f"no .bin shards found at {paths!r}; point data.path at a .bin file or a folder of them")
    shards, vocabs = zip(*(open_bin(f) for f in files))
    vocab = vocab_size if vocab_size is not None else max(vocabs)
    return ShardSource(list(shards), vocab, [str(f) for f in files])


def text_source(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]],
    max_bytes: int | None = None,
    suffixes: Sequence[str] | None = None,
    name: str = "text",
) -> ArraySource:
    """Plain text as bytes (vocab 256): files or folders (recursively, sorted by path)."""
    files = _expand(paths, suffixes=suffixes)
    if not files:
        raise DataError(f"no text files found at {paths!r} (suffixes {suffixes}); check data.path")
    return ArraySource(_read_bytes(files, max_bytes), vocab_size=256, name=name)


def stdlib_source(max_bytes: int = 8 << 20) -> ArraySource:
    """The standard library's *.py files as bytes: real text, on every machine, no download.

    Sorted by relative path and capped at `max_bytes`, so the stream is the same on every
    machine with the same Python version (the fingerprint differs across versions, and the
    data state check then says so).
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not any(part in STDLIB_EXCLUDE for part in p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise DataError(f"no *.py files under the stdlib path {root}; use a text or .bin source instead")
    return ArraySource(_read_bytes(files, max_bytes), vocab_size=256, name="stdlib")


# --- helpers --------------------------------------------------------------------------------


def _read_bytes(files: Sequence[Path], max_bytes: int | None) -> np.ndarray:
    chunks: list[bytes] = []
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        data = f.read_bytes()
        if max_bytes is not None:
            data = data[: max_bytes - total]
        chunks.append(data)
        total += len(data)
    return np.frombuffer(b"".join(chunks), dtype=np.uint8)


def _expand(paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str]], suffixes: Sequence[str] | None) -> list[Path]:
    items = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    out: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            out.extend(
                sorted(
                    (f for f in p.rglob("*") if f.is_file() and (suffixes is None or f.suffix in suffixes)),
                    key=lambda f: f.relative_to(p).as_posix(),
                )
            )
        elif p.is_file():
            out.append(p)
        else:
            raise DataError(f"data path {str(p)!r} does not exist; check data.path")
    return out


def _edge_crc(arr: np.ndarray, edge: int = 1 << 16) -> int:
    """crc32 of the first and last `edge` elements: cheap even for a 10 GB memmap."""
    head = np.ascontiguousarray(arr[:edge]).tobytes()
    tail = np.ascontiguousarray(arr[-edge:]).tobytes() if len(arr) else b""
    return zlib.crc32(tail, zlib.crc32(head))


def _check_bounds(starts: np.ndarray, length: int, n: int, name: str) -> None:
    if starts.ndim != 1:
        raise DataError(f"{name}: starts must be 1-D, got shape {starts.shape}")
    if starts.size and (starts.min() < 0 or starts.max() + length > n):
        raise DataError(
            f"{name}: window [{int(starts.min())}, {int(starts.max()) + length}) out of range for "
            f"{n} tokens"
        )
