"""Benchmarks behind `elastic bench`: checkpoint and overhead (bench.harness), recovery (bench.recovery, with
its jobs in bench.jobs) and GPU packing (bench.packing)."""
