"""The data pipeline: deterministic order, skip ledger, curriculum, resumable state.

    source = DataConfig(...).build_source()          # stdlib bytes, text, or .bin shards
    loader = DataLoader(source, config, rank, world_size, state=ckpt_state)
    batch  = loader.next_batch()                      # batch.inputs/targets, ids, state
    loader.skip(lo, hi)                               # absolute sample ids, from the supervisor
"""

from thermowatch.trainer.data.curriculum import Curriculum
from thermowatch.monitors.ledger import SkipLedger
from thermowatch.trainer.data.loader import Batch, DataConfig, DataLoader, DataState
from thermowatch.trainer.data.order import sample_windows
from thermowatch.trainer.data.sources import (
    ArraySource,
    DataError,
    ShardSource,
    TokenSource,
    bin_source,
    open_bin,
    stdlib_source,
    text_source,
)

__all__ = [
    "ArraySource",
    "Batch",
    "Curriculum",
    "DataConfig",
    "DataError",
    "DataLoader",
    "DataState",
    "ShardSource",
    "SkipLedger",
    "TokenSource",
    "bin_source",
    "open_bin",
    "sample_windows",
    "stdlib_source",
    "text_source",
]
