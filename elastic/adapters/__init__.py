"""Adapters that run code written for other training APIs under elastic's harness (the job's `api:`):
ray_train runs a Ray Train worker function unchanged."""
