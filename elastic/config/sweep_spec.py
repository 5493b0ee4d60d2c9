"""Sweep specs: one YAML per sweep, naming the job it sweeps, the parameter space, the search and the GPU share.

Validated like job specs (same loader machinery and one-line errors with file:line and a did-you-mean)::

    name: digits-sweep
    job: jobs/digits_ddp.yaml           # the job every trial runs (relative to the working dir or this file)
    overrides: {workers: {min: 1}}      # job fields changed for every trial (a partial job mapping)
    space:                              # keys are job fields; a key without a dot means config.<key>
      lr: {loguniform: [0.001, 0.3]}
      width: {choice: [16, 32]}
      seed: {grid: [0, 1]}
    num_samples: 8                      # per grid point, as in Ray Tune
    metric: accuracy
    mode: max
    scheduler: {type: asha, max_t: 20, grace_period: 2}
    max_concurrent: 16
    gpu_share: auto                     # or a number in (0, 1]: the GPU fraction of each training worker
    packing: {gpu_memory_gb: 2.0, device_memory_gb: 8}   # sizes for `auto` on logical (CPU) GPUs
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal, Optional, Union

from pydantic import Field, ValidationError, field_validator, model_validator

from elastic.config.documents import read_document
from elastic.config.messages import describe
from elastic.config.spec import _NAME_PATTERN, JobSpec, _Frozen, apply_overrides, parse_job_spec, parse_spec
from elastic.errors import SpecError

Mode = Literal["min", "max"]


class ParamSpec(_Frozen):
    """One dimension of the search space: exactly one of choice, uniform, loguniform, grid."""

    choice: Optional[list[Any]] = Field(default=None, min_length=1, description="Sample one of these values.")
    uniform: Optional[tuple[float, float]] = Field(default=None, description="[low, high], uniform.")
    loguniform: Optional[tuple[float, float]] = Field(default=None, description="[low, high], log-uniform; low > 0.")
    grid: Optional[list[Any]] = Field(default=None, min_length=1, description="Every value (times num_samples).")

    @model_validator(mode="after")
    def _exactly_one(self) -> ParamSpec:
        given = [k for k in ("choice", "uniform", "loguniform", "grid") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                "give exactly one of choice, uniform, loguniform, grid"
                + (f" (got {', '.join(given)})" if given else "")
            )
        for kind in ("uniform", "loguniform"):
            bounds = getattr(self, kind)
            if bounds is not None:
                low, high = bounds
                if not low < high:
                    raise ValueError(f"{kind}: low ({low}) must be below high ({high})")
                if kind == "loguniform" and low <= 0:
                    raise ValueError(f"loguniform: low ({low}) must be > 0; use uniform for ranges that include 0")
        return self

    @property
    def kind(self) -> str:
        return next(k for k in ("choice", "uniform", "loguniform", "grid") if getattr(self, k) is not None)


class SchedulerSpec(_Frozen):
    """Ray Tune's trial scheduler. Time is counted in reports (one per committed checkpoint) by default."""

    type: Literal["fifo", "asha", "pbt"] = Field(default="fifo", description="fifo, asha or pbt.")
    time_attr: str = Field(default="training_iteration", description="Result field that measures progress.")
    max_t: int = Field(default=100, ge=1, description="asha: the most time units a trial runs.")
    grace_period: int = Field(default=1, ge=1, description="asha: time units before a trial may be stopped.")
    reduction_factor: float = Field(default=3.0, gt=1, description="asha: keep 1/reduction_factor per rung.")
    perturbation_interval: int = Field(default=2, ge=1, description="pbt: time units between perturbations.")
    mutate: list[str] = Field(
        default_factory=list, description="pbt: space keys to perturb (default: every non-grid key)."
    )
    quantile_fraction: float = Field(
        default=0.25,
        gt=0,
        le=0.5,
        description="pbt: the bottom fraction of trials that clone (exploit) one of the top fraction at each "
        "perturbation (0.5 with two trials).",
    )

    @model_validator(mode="after")
    def _grace_within_max(self) -> SchedulerSpec:
        if self.type == "asha" and self.grace_period > self.max_t:
            raise ValueError(f"grace_period ({self.grace_period}) exceeds max_t ({self.max_t}); lower it")
        return self


class PackingSpec(_Frozen):
    """How `gpu_share: auto` sizes trials. On a real GPU a probe run measures the peak device memory
    (torch.cuda.max_memory_allocated) and the step time; on logical GPUs (a CPU machine) there is no device
    memory to measure, so the peak is the declared gpu_memory_gb and the device is device_memory_gb."""

    gpu_memory_gb: Optional[float] = Field(
        default=None,
        gt=0,
        description="Declared peak device memory of one training worker (used without CUDA, "
        "or instead of the probe's measure when set and probe is false).",
    )
    device_memory_gb: float = Field(
        default=80.0, gt=0, description="Memory of one logical GPU (real GPUs report their own)."
    )
    headroom: float = Field(default=0.15, ge=0, le=1, description="Extra fraction kept free above the peak.")
    context_gb: float = Field(default=0.5, ge=0, description="Per-process CUDA context, outside the allocator.")
    max_per_gpu: int = Field(default=8, ge=1, description="Most trials on one GPU whatever the memory says.")
    probe: bool = Field(default=True, description="Run a short probe trial first (step time; memory on CUDA).")
    probe_steps: int = Field(default=20, ge=2, description="Optimizer steps the probe runs.")
    max_oom_retries: int = Field(
        default=2,
        ge=0,
        description="Retries of an out-of-memory trial, each with a bigger share (the share doubles, up to 1).",
    )


class SweepSpec(_Frozen):
    """One hyperparameter sweep over one job."""

    name: str = Field(pattern=_NAME_PATTERN, description="Sweep name: the experiment folder and trial run names.")
    job: str = Field(min_length=1, description="The job YAML each trial runs.")
    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Job fields set for every trial: a partial job "
        "mapping, e.g. {workers: {min: 1}, config: {epochs: 2}}.",
    )
    space: dict[str, ParamSpec] = Field(min_length=1, description="The parameter space (keys are job fields).")
    num_samples: int = Field(default=1, ge=1, description="Samples (per grid point, as in Ray Tune).")
    metric: str = Field(min_length=1, description="Reported metric to optimize.")
    mode: Mode = Field(description="min or max.")
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    max_concurrent: Optional[int] = Field(default=None, ge=1, description="Most trials running at once.")
    gpu_share: Union[float, Literal["auto"]] = Field(
        default="auto", description="GPU fraction of each training worker, in (0, 1], or auto (planned)."
    )
    packing: PackingSpec = Field(default_factory=PackingSpec)
    light_trials: bool = Field(
        default=True,
        description="A one-worker trial trains in its Tune trainable's own process (Ray Train's local mode: no "
        "Train controller, worker group or helper actors), holding the worker's CPUs and GPU share itself. "
        "false: every trial runs a Ray Train worker group.",
    )
    driver_cpus: float = Field(
        default=0.05, gt=0, le=1, description="CPU of each trial's driver (its Tune trainable and Train controller)."
    )
    max_failures: int = Field(default=2, ge=-1, description="Tune restarts of a failed trial (from its checkpoint).")
    storage: Optional[str] = Field(default=None, description="Experiment root (default: the job's checkpoint.uri).")

    @field_validator("gpu_share", mode="before")
    @classmethod
    def _share(cls, value: Any) -> Any:
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < float(value) <= 1:
            raise ValueError("use a number in (0, 1] (e.g. 0.25) or auto")
        return float(value)

    @field_validator("space")
    @classmethod
    def _keys(cls, value: dict[str, ParamSpec]) -> dict[str, ParamSpec]:
        for key in value:
            if not key or key.startswith(".") or key.endswith(".") or ".." in key:
                raise ValueError(f"key {key!r}: use a job field such as lr or config.lr or train.precision")
        return value

    @model_validator(mode="after")
    def _cross_checks(self) -> SweepSpec:
        unknown = [k for k in self.scheduler.mutate if k not in self.space]
        if unknown:
            raise ValueError(
                f"scheduler.mutate: {unknown[0]!r} is not a key of space; use one of {', '.join(self.space)}"
            )
        if self.scheduler.type == "pbt" and not self.pbt_keys():
            raise ValueError("scheduler pbt needs a non-grid space key to perturb; add one or use asha")
        return self

    def pbt_keys(self) -> list[str]:
        return list(self.scheduler.mutate) or [k for k, p in self.space.items() if p.kind != "grid"]

    @property
    def auto(self) -> bool:
        return self.gpu_share == "auto"


def job_field(key: str) -> str:
    """`lr` -> `config.lr`; dotted keys name any job field (`train.precision`, `workers.cpus`)."""
    return key if "." in key else f"config.{key}"


# ---------------------------------------------------------------------------------------------------------
# Loading


def load_sweep_spec(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> tuple[SweepSpec, JobSpec]:
    """Read and validate a sweep YAML and the job it names (with the sweep's job overrides applied)."""
    path = Path(path)
    text = read_document(path, "sweep file")
    sweep = parse_sweep_spec(text, source=str(path), overrides=overrides)
    return sweep, load_trial_job(sweep, base=path.parent, source=str(path))


def parse_sweep_spec(text: str, source: str = "<sweep>", overrides: tuple[str, ...] | list[str] = ()) -> SweepSpec:
    return parse_spec(
        text, SweepSpec, source, overrides, "a sweep file must be a YAML mapping with name, job, space, metric, mode"
    )


def load_trial_job(sweep: SweepSpec, base: Path = Path("."), source: str = "<sweep>") -> JobSpec:
    """The job the sweep names, with `overrides` applied; checked once more with every space key set to a
    sampled-like value, so a key that is not a job field fails now, not in every trial. Problems name the sweep
    file (`source`) where the sweep is the cause."""
    candidates = [Path(sweep.job), base / sweep.job]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise SpecError(
            f"{source}: job: {sweep.job} not found (looked in the working dir and next to the sweep file); fix the path"
        )
    text = read_document(path, "job file")
    job = parse_job_spec(
        text,
        source=str(path),
        overrides=_as_overrides(_flatten(sweep.overrides)),
        overrides_where=f"{source}: overrides.{{field}}",
    )
    example = {key: _example_value(param) for key, param in sweep.space.items()}
    try:
        trial_job(job, example)
    except SpecError as err:
        raise SpecError(f"{source}: space: {err} (a space key must be a job field)") from None
    return job


def trial_job(job: JobSpec, params: dict[str, Any]) -> JobSpec:
    """The job of one trial: the sweep's job with this trial's sampled parameters set."""
    raw = job.model_dump(mode="json")
    raw = apply_overrides(raw, _as_overrides({job_field(k): v for k, v in params.items()}))
    try:
        return JobSpec.model_validate(raw)
    except ValidationError as err:
        raise SpecError(describe(err, JobSpec, None, "trial")) from None


def _flatten(mapping: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{workers: {min: 1}} -> {"workers.min": 1}: nested (or dotted) job fields as overrides."""
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value and not name.endswith("env_vars"):
            flat.update(_flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _as_overrides(mapping: dict[str, Any]) -> list[str]:
    # JSON is valid YAML flow syntax, so apply_overrides reads each value back exactly (strings stay strings).
    return [f"{key}={json.dumps(value)}" for key, value in mapping.items()]


def _example_value(param: ParamSpec) -> Any:
    if param.choice is not None:
        return param.choice[0]
    if param.grid is not None:
        return param.grid[0]
    return (param.uniform or param.loguniform)[0]


def sweep_schema() -> dict[str, Any]:
    schema = SweepSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "elastic sweep spec"
    return schema
