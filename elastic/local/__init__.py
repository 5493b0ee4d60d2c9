"""The local stack: a Ray head, simulated spot and on-demand nodes and an S3 endpoint on this machine
(local.stack, local.processes), the fake cloud metadata server (local.metadata_server), simulated reclaims
(local.preempt) and a fault-injecting S3 proxy (local.s3_faults, its seeded plan in local.fault_plan)."""
