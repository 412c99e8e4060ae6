"""torch.distributed.checkpoint directories read as data (issue 33; thermowatch/checkpoint_io.py).

DCP reads its tensors with weights_only=True, but two other things with plain pickle: the
directory's `.metadata` (FileSystemReader.read_metadata, `pickle.load`) and every non-tensor value
of the state dict, such as the optimizer's param groups (DefaultLoadPlanner.load_bytes,
`torch.load(weights_only=False)`). A planted `.metadata` or `.distcp` file would run code on every
rank. The reader and planner here read both as data: the metadata through an unpickler that knows
DCP's own metadata classes and nothing else (torch's weights_only unpickler cannot read it: DCP
pickles with protocol 5 framing, which it refuses), the values through checkpoint_io.load_as_data.
Imported only under torchrun (thermowatch/ranks.py): DCP takes about a second to import.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import ReadItem

from thermowatch.checkpoint_io import CheckpointRefused, load_as_data


def _metadata_globals() -> dict[tuple[str, str], Any]:
    """Every global a `.metadata` that dcp.save wrote names (DDP and FSDP2 state dicts, torch
    2.13): DCP's metadata dataclasses, its per-file storage info, torch.Size, the dtypes, the
    layout rebuild function and the checkpoint id's path. Keyed by this interpreter's names."""
    md = dcp_metadata
    objs = [md.Metadata, md.MetadataIndex, md.StorageMeta, md.TensorProperties, md.TensorStorageMetadata,
            md.BytesStorageMetadata, md.ChunkStorageMetadata, md._MEM_FORMAT_ENCODING, _StorageInfo,
            torch.Size, torch.serialization._get_layout, type(pathlib.Path())]
    out = {(o.__module__, o.__qualname__): o for o in objs}
    out.update({("torch", n): v for n, v in vars(torch).items() if isinstance(v, torch.dtype)})
    return out


_METADATA_GLOBALS = _metadata_globals()


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's own "restricting globals" (the pickle module's documentation): a global that is
    not DCP metadata is refused before it is looked up, so nothing else can be called."""

    def find_class(self, module: str, name: str) -> Any:
        obj = _METADATA_GLOBALS.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(f"Unsupported global: GLOBAL {module}.{name} is not DCP checkpoint metadata")
        return obj


class SafeReader(FileSystemReader):
    """FileSystemReader with its metadata read as data. `refused`: the refusal, when there was
    one (dcp.load wraps a rank's exception in its own CheckpointException)."""

    def __init__(self, path: str | pathlib.Path) -> None:
        super().__init__(path)
        self.refused: CheckpointRefused | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                metadata = _MetadataUnpickler(f).load()
            except pickle.UnpicklingError as exc:
                self.refused = CheckpointRefused(
                    f"{path}: refused to load: it names code or types outside DCP's checkpoint metadata ({exc}); "
                    "nothing in it ran")
                raise self.refused from exc
        if not isinstance(metadata, dcp_metadata.Metadata):
            raise CheckpointRefused(f"{path}: holds a {type(metadata).__name__}, not DCP checkpoint metadata")
        # the rest as FileSystemReader.read_metadata does it
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = dcp_metadata.StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner with the state dict's non-tensor values read by load_as_data.
    `refused`: as SafeReader's."""

    def __init__(self, path: str | pathlib.Path) -> None:
        super().__init__()
        self.path = path
        self.refused: CheckpointRefused | None = None

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            obj = load_as_data(value, allowed=(), name=f"{self.path}: the value {read_item.dest_index.fqn!r}")
        except CheckpointRefused as exc:
            self.refused = exc
            raise
        # the rest as DefaultLoadPlanner.load_bytes does it
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def load(state: dict[str, Any], path: pathlib.Path) -> None:
    """dcp.load(state, path) with both readers above (a collective: every rank gets here and
    raises, whichever failed). A refusal on this rank is raised as CheckpointRefused, any other
    failure as a RuntimeError: DCP's own CheckpointException is a BaseException, which a caller's
    `except Exception` (the loop's fallback to an older checkpoint) would let through."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader, planner = SafeReader(path), SafePlanner(path)
    try:
        dcp.load(state, storage_reader=reader, planner=planner)
    except (Exception, CheckpointException) as exc:
        failures = [(r, w[0]) for r, w in sorted(getattr(exc, "failures", {}).items())]
        refused = reader.refused or planner.refused or next(
            (CheckpointRefused(f"rank {r}: {e}") for r, e in failures if isinstance(e, CheckpointRefused)), None)
        if refused is not None:
            raise refused from exc
        if isinstance(exc, Exception):
            raise
        first = f"rank {failures[0][0]}: {type(failures[0][1]).__name__}: {failures[0][1]}" if failures else str(exc)
        raise RuntimeError(f"{path}: cannot read this checkpoint: {first}") from exc
