"""The run ledger: typed events (placements, checkpoints, preemptions, restores, step timing) that the driver
and rank 0 of each worker group append to the run folder, one writer per process and never the same object,
so they outlive the cluster and `elastic report` can account for the run from them alone."""

from elastic.ledger.events import EVENT_TYPES, Event
from elastic.ledger.writer import LEDGER_FOLDER, LedgerWriter, NoLedger, read_ledger

__all__ = ["EVENT_TYPES", "LEDGER_FOLDER", "Event", "LedgerWriter", "NoLedger", "read_ledger"]
