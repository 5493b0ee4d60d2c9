"""A sweep's own run ledger (elastic.ledger) in its experiment folder: when it started, the GPUs its trials
could share, and at the end every trial's state and share (`elastic report SWEEP` reads it with the trials'
own ledgers)."""

from __future__ import annotations

import time

from elastic.ledger import LedgerWriter
from elastic.ledger.events import SweepEnded, SweepStarted


def start_sweep_ledger(experiment: str, name: str, gpus_available: float, share: float, num_samples: int):
    ledger = LedgerWriter(experiment, "sweep")
    ledger.record(
        SweepStarted(time.time(), sweep=name, gpus_available=gpus_available, share=share, num_samples=num_samples)
    )
    return ledger


def end_sweep_ledger(ledger: LedgerWriter, name: str, summary: dict | None) -> None:
    """Record each trial's end state (when the sweep got as far as its summary), then write it all now."""
    if summary is not None:
        ledger.record(
            SweepEnded(
                time.time(),
                trials=[
                    {
                        "trial_id": t["trial_id"],
                        "run_name": f"{name}-{t['trial_id']}",
                        "state": t["state"],
                        "gpu_share": t["gpu_share"],
                        "metric": t["metric"],
                    }
                    for t in summary["trials"]
                ],
            )
        )
    ledger.close()
