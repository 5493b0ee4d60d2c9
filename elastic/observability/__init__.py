"""Observability: what a run tells the outside world while it runs. Run metrics through `ray.util.metrics`
(they leave by Ray's own Prometheus export, next to Ray Train's), goodput so far, GPU utilization and memory
through NVML on GPU nodes, the low-utilization watch, and experiment tracking (MLflow, TensorBoard).
Disabled parts are null objects (`NoMetrics`, `NoGpu`, `NoTracking`)."""
