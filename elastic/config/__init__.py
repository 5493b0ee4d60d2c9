"""Config: the job spec (config.spec) and the sweep spec (config.sweep_spec): parsing, validation, schemas."""
