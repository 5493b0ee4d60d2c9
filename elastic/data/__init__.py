"""Data: datasets in buckets and the resumable, exactly-once sampler and loader.

sampler: the global order and a rank's slice of it; order and block_order: keyed O(1)-memory permutations
(of samples; of row groups and the rows of windows of them); loader: the DataLoader whose position moves only
when training receives a batch; manifest and prepare: sharded Parquet datasets committed by a manifest;
streaming: StreamingDataset, reading a manifest's row groups in the block order with prefetch; windows: the
per-window column buffers its shuffled batches are gathered from; parquet: map-style datasets over Parquet
shards."""

from elastic.data.loader import ResumableLoader
from elastic.data.parquet import ParquetDataset
from elastic.data.sampler import ResumableSampler, epoch_order, sample_seed, seed_sample
from elastic.data.streaming import StreamingDataset

__all__ = [
    "ParquetDataset",
    "ResumableLoader",
    "ResumableSampler",
    "StreamingDataset",
    "epoch_order",
    "sample_seed",
    "seed_sample",
]
