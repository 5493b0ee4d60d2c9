"""Checkpoints: the run folder in storage (checkpoint.store: listing, commit markers, retention), the
sharded async checkpointer (checkpoint.checkpointer) and its object-store I/O for DCP (checkpoint.dcp_io).

No re-exports here: the store must stay importable without torch (the CLI lists checkpoints)."""
