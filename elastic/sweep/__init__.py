"""Sweeps: hyperparameter sweeps on Ray Tune (sweep.runner) and the pure GPU packing policy (sweep.packing)."""
