"""Data: Parquet datasets from storage and the resumable, exactly-once sampler and loader."""

from elastic.data.loader import (
    ParquetDataset,
    ResumableLoader,
    ResumableSampler,
    epoch_order,
    sample_seed,
    seed_sample,
)

__all__ = ["ParquetDataset", "ResumableLoader", "ResumableSampler", "epoch_order", "sample_seed", "seed_sample"]
