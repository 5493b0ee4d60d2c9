"""How a worker's model is spread over the workers: DDP (a whole copy each) or FSDP2 (sharded), and what each
costs a rank in memory (elastic.parallel.memory, pure)."""
