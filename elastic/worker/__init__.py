"""Worker: what runs in every training worker. The Session handed to the job (worker.session), the
optimizer step, just-in-time checkpoints at reclaim notices, the placement watch, a sweep trial's GPU sharing,
the sample ledger and chaos kills, and the entrypoint Ray Train calls (worker.entrypoint)."""
