"""Sweeps: hyperparameter sweeps on Ray Tune (sweep.runner: plan, Tuner, report; sweep.trial: one trial's driver;
sweep.layout: the sweep's files in storage; sweep.progress: Tune callbacks; sweep.ledger: the sweep's ledger) and
the pure GPU packing policy (sweep.packing)."""
