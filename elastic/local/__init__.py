"""The local stack: a Ray head, simulated spot and on-demand nodes and an S3 endpoint on this machine
(local.stack, local.processes), the fake cloud metadata server (local.metadata_server) and simulated reclaims
(local.preempt)."""
