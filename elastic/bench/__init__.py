"""Benchmarks behind `elastic bench`: checkpoint (bench.checkpointing), overhead (bench.overhead), recovery
(bench.recovery, with its jobs in bench.jobs) and GPU packing (bench.packing)."""
