"""Data: Parquet datasets from storage and the resumable, exactly-once sampler and loader.

sampler: the global order and a rank's slice of it; loader: the DataLoader whose position moves only when
training receives a batch; parquet: map-style datasets over Parquet shards."""

from elastic.data.loader import ResumableLoader
from elastic.data.parquet import ParquetDataset
from elastic.data.sampler import ResumableSampler, epoch_order, sample_seed, seed_sample

__all__ = ["ParquetDataset", "ResumableLoader", "ResumableSampler", "epoch_order", "sample_seed", "seed_sample"]
