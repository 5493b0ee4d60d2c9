"""Worker: what runs in every training worker. The entrypoint Ray Train calls (worker.entrypoint, one for jobs
and sweep trials), the Session handed to the job (worker.session) and its collaborators: what a checkpoint
holds (training_state), when one is due (cadence), reports of commits to Ray (reporting), ending a placement
at a checkpoint (ending, placement_watch, jit), the optimizer step, the sample ledger (audit), chaos kills,
and a sweep trial's GPU sharing (sharing, a WorkerSetup and a step hook)."""
