"""Job specs: one YAML file per job, parsed at the edge into frozen, validated config objects.

Every problem becomes a `SpecError` whose one-line message names the file, the line, the field and the fix,
e.g. ``jobs/x.yaml:9: workers.mx: unknown field; did you mean 'max'?``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from elastic.config.documents import load_yaml, read_document
from elastic.config.messages import PATTERN_HINTS, describe
from elastic.errors import SpecError

Market = Literal["spot", "on-demand", "any", "spot-first"]

_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"
_ENTRYPOINT_PATTERN = r"^[^:\s]+:[A-Za-z_][A-Za-z0-9_]*$"
# Environment variables whose names look like credentials: their values are never echoed (JobSpec.redacted).
REDACTED = "<redacted>"
_SECRET_NAME = re.compile(r"KEY|SECRET|TOKEN|PASSW|CREDENTIAL|AUTH|SESSION|PRIVATE", re.IGNORECASE)
# Bounds no real request reaches: past them a number is a typo (an extra zero, a byte count), and refusing it here
# beats a run that waits forever for capacity no cluster has. `submit` also checks against the cluster's nodes.
MAX_WORKERS = 10_000
MAX_CPUS_PER_WORKER = 1024
MAX_GPUS_PER_WORKER = 64


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


class WorkersSpec(_Frozen):
    """How many training workers, what each needs, and which nodes they may run on."""

    min: int = Field(ge=1, le=MAX_WORKERS, description="Fewest workers the run trains with (it waits below this).")
    max: Optional[int] = Field(
        default=None,
        ge=1,
        le=MAX_WORKERS,
        description="Most workers; defaults to min. min < max makes the run elastic.",
    )
    cpus: float = Field(default=1.0, gt=0, le=MAX_CPUS_PER_WORKER, description="CPUs per worker.")
    gpus: Union[float, Literal["auto"]] = Field(
        default=0.0,
        description="GPUs per worker (0 trains on CPU with gloo). A fraction below 1 shares a GPU: the worker caps "
        "its memory at that share and an out-of-memory error goes on at a doubled share. auto: a probe on a "
        "whole GPU measures the peak memory and sizes the share (CUDA only).",
    )
    market: Market = Field(
        default="any",
        description="Nodes the workers may use: spot, on-demand, any worker node, or spot-first (spot when it "
        "can be had within spot_wait_seconds, else on-demand, moving back to spot when it returns).",
    )
    spot_wait_seconds: float = Field(
        default=120.0,
        ge=0,
        description="spot-first: how long to wait for spot capacity for `min` workers before running on on-demand.",
    )
    swap_to_spot: bool = Field(
        default=True,
        description="spot-first: once on on-demand, move the workers to spot at the next checkpoint when spot "
        "capacity returns (no step is lost: the run resumes from that checkpoint).",
    )
    gpu_memory_gb: Optional[float] = Field(
        default=None,
        gt=0,
        le=1024,
        description="GPU memory a worker gets, in GB; with a job that plans its model (a `planned_model(config)` "
        "in its entrypoint's module), `submit` refuses a run whose training state cannot fit it. Without it, "
        "taken from the GPU type Ray reports for the cluster's nodes.",
    )
    regrow_after_seconds: float = Field(
        default=10.0,
        ge=0,
        description="Elastic runs below max: grow at the next checkpoint once free capacity for more workers "
        "has been seen this long (a steady reading, so a node coming and going causes no resize).",
    )

    @field_validator("gpus", mode="before")
    @classmethod
    def _gpus_number_or_auto(cls, value: Any) -> Any:
        # One line for a wrong value, not pydantic's one per member of the union.
        if value == "auto":
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float, str)) or not _is_number(str(value)):
            raise ValueError(f"GPUs per worker: a number (1, or 0.5 to share a GPU) or auto, not {value!r}")
        if float(value) < 0:
            raise ValueError(f"GPUs per worker: at least 0 (or auto), not {value}; raise it")
        if float(value) > MAX_GPUS_PER_WORKER:
            raise ValueError(f"GPUs per worker: at most {MAX_GPUS_PER_WORKER}, not {value}; lower it")
        return float(value)

    @property
    def gpus_at_most(self) -> float:
        """The GPUs a worker may hold: `auto` becomes a share of at most one GPU once probed."""
        return 1.0 if self.gpus == "auto" else self.gpus

    @field_validator("min", "max", mode="before")
    @classmethod
    def _no_booleans(cls, value: Any) -> Any:
        # YAML's `min: true` is a mistake, not one worker (pydantic would take True as 1).
        if isinstance(value, bool):
            raise ValueError(f"a worker count, not {str(value).lower()}; write a number such as 2")
        return value

    @field_validator("max")
    @classmethod
    def _max_not_below_min(cls, value: Optional[int], info: ValidationInfo) -> Optional[int]:
        low = info.data.get("min")
        if value is not None and low is not None and value < low:
            raise ValueError(f"max ({value}) is below min ({low}); set max >= min")
        return value

    @property
    def max_workers(self) -> int:
        return self.max if self.max is not None else self.min

    @property
    def elastic(self) -> bool:
        return self.max_workers > self.min


class CheckpointSpec(_Frozen):
    """Where and how often the run checkpoints."""

    uri: str = Field(
        min_length=1,
        description="Storage root: s3://bucket/runs, gs://bucket/runs (elastic-train[gcp]), az://container/runs "
        "or abfs://container/runs (elastic-train[azure]; account from AZURE_STORAGE_ACCOUNT_NAME); the run writes "
        "under <uri>/<run name>/.",
    )
    every_steps: Optional[int] = Field(default=None, ge=1, description="Save every N optimizer steps.")
    every_seconds: Optional[float] = Field(default=None, gt=0, description="Save every S seconds.")
    keep: int = Field(default=3, ge=1, description="Committed checkpoints to keep.")
    keep_every: Optional[int] = Field(
        default=None,
        ge=1,
        description="Also keep every committed checkpoint whose step is a multiple of N (milestones).",
    )
    just_in_time: bool = Field(
        default=True,
        description="When a node of the run is being reclaimed (a Ray drain, e.g. from a spot notice), keep "
        "training until just before the deadline, save once, and resume elsewhere from that save.",
    )
    jit_margin_seconds: float = Field(
        default=2.0,
        ge=0,
        description="Safety margin: the just-in-time save is planned to commit this long before the deadline.",
    )

    @model_validator(mode="after")
    def _needs_a_cadence(self) -> CheckpointSpec:
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("set every_steps or every_seconds (or both)")
        return self

    @field_validator("uri")
    @classmethod
    def _uri_or_path(cls, uri: str) -> str:
        # A plain path never holds ':' here: 's3:bucket/x' or '::::' is a URL gone wrong, not a folder to create.
        if "://" not in uri and ":" in uri:
            raise ValueError(
                f"{uri!r} is neither a URL nor a plain path; use scheme://BUCKET/PREFIX (s3://, gs://, az://) or a "
                "folder path"
            )
        return uri


class FailureSpec(_Frozen):
    """Restart budgets. Preemptions are counted apart from failures. -1 means unlimited."""

    max_failures: int = Field(default=3, ge=-1, description="Restarts allowed after errors.")
    max_preemptions: int = Field(default=20, ge=-1, description="Restarts allowed after spot preemptions.")
    hang_timeout_seconds: Optional[float] = Field(
        default=None,
        ge=0,
        description="A rank with no step progress this long dumps every thread's stack to the job log and ends "
        "its attempt as a failure (restarted from the last checkpoint). Default: derived from the slowest step "
        "and save measured, at least 180 s. 0 turns the watchdog off.",
    )


Precision = Literal["fp32", "bf16", "fp16"]


Parallelism = Literal["ddp", "fsdp"]


class FsdpMixedPrecisionSpec(_Frozen):
    """FSDP2's MixedPrecisionPolicy: the dtype parameters are gathered in for forward/backward, and the one
    gradients are reduced in. Unset: `train.precision` (fp32 keeps everything in float32)."""

    param_dtype: Optional[Precision] = Field(default=None, description="Default: train.precision.")
    reduce_dtype: Optional[Precision] = Field(
        default="fp32", description="Gradients are reduce-scattered in this dtype (fp32: exact sums)."
    )


class FsdpSpec(_Frozen):
    """How `train.parallelism: fsdp` shards the model (torch.distributed.fsdp.fully_shard)."""

    reshard_after_forward: bool = Field(
        default=True,
        description="Free the gathered parameters after forward (less memory; gathered again in backward).",
    )
    mixed_precision: FsdpMixedPrecisionSpec = Field(default_factory=FsdpMixedPrecisionSpec)
    cpu_offload: bool = Field(default=False, description="Keep sharded parameters and optimizer state in host memory.")


class TrainSpec(_Frozen):
    """How `session.optimize(loss)` turns a loss into an optimizer step."""

    parallelism: Parallelism = Field(
        default="ddp",
        description="ddp: every worker holds the whole model; fsdp: parameters, gradients and optimizer state are "
        "sharded over the workers (FSDP2), for models DDP cannot hold. The training loop is the same.",
    )
    fsdp: FsdpSpec = Field(default_factory=FsdpSpec)

    precision: Precision = Field(
        default="fp32",
        description="fp32; bf16 (autocast); or fp16 (autocast plus a GradScaler whose state is checkpointed).",
    )
    grad_accumulation: int = Field(
        default=1, ge=1, description="Micro-batches per optimizer step (DDP syncs gradients on the last only)."
    )
    grad_clip_norm: Optional[float] = Field(default=None, gt=0, description="Clip the gradient norm to this.")
    max_nonfinite_steps: int = Field(
        default=5,
        ge=1,
        description="A step whose loss is NaN/inf is skipped and counted; this many in a row stop the run.",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Recompute activations in backward instead of storing them (less memory, more compute).",
    )


class TrackingSpec(_Frozen):
    """Experiment tracking from rank 0: the job's settings as parameters, its step metrics every N steps."""

    mlflow: Optional[str] = Field(
        default=None,
        description="MLflow tracking URI (http://host:5000, a sqlite:/// or file path). One MLflow run per elastic "
        "run: a resumed run continues it (its id is kept in the checkpoint).",
    )
    tensorboard: Optional[str] = Field(
        default=None,
        description="Root for TensorBoard event files (a path or s3:// etc.); the run writes under <tensorboard>/<run>/.",
    )
    every_steps: int = Field(default=10, ge=1, description="Log the step's metrics every N optimizer steps.")
    experiment: Optional[str] = Field(default=None, description="MLflow experiment; default: the job's name.")
    parent_run_id: Optional[str] = Field(
        default=None, description="MLflow run to nest this run under (a sweep sets it: one child run per trial)."
    )

    @property
    def enabled(self) -> bool:
        return self.mlflow is not None or self.tensorboard is not None


class RuntimeEnvSpec(_Frozen):
    """Extra Ray runtime_env for the job: packages and environment variables."""

    pip: list[str] = Field(default_factory=list, description="Extra pip requirements for driver and workers.")
    env_vars: dict[str, str] = Field(default_factory=dict, description="Environment variables.")
    excludes: list[str] = Field(default_factory=list, description="Extra paths left out of the uploaded working_dir.")

    @field_validator("env_vars", mode="before")
    @classmethod
    def _scalars_as_strings(cls, value: Any) -> Any:
        # `FOO: 1` in YAML (or --set ...FOO=1) means the string "1" to a process environment.
        if isinstance(value, dict):
            return {
                k: str(v).lower() if isinstance(v, bool) else str(v) if isinstance(v, (int, float)) else v
                for k, v in value.items()
            }
        return value


Api = Literal["session", "ray-train", "transformers"]


class JobSpec(_Frozen):
    """One training job."""

    name: str = Field(pattern=_NAME_PATTERN, description="Job name; the run name derives from it.")
    entrypoint: str = Field(
        pattern=_ENTRYPOINT_PATTERN,
        description="path/to/file.py:function or package.module:function, called with `config` on every worker.",
    )
    api: Api = Field(
        default="session",
        description="How the entrypoint is called on every worker. session: fn(session), elastic's harness. "
        "ray-train: a Ray Train worker function fn(config) (or fn()), run unchanged: ray.train.report and "
        "get_checkpoint go through the run's checkpoints (committed, retained, resumed). transformers: "
        "fn(config) builds a transformers.Trainer and returns it (or calls train()): its checkpoints go to the "
        "run folder, a reclaim notice makes it save, a restart resumes from the newest.",
    )
    config: dict[str, Any] = Field(default_factory=dict, description="Free mapping passed to the function.")
    workers: WorkersSpec
    checkpoint: CheckpointSpec
    failure: FailureSpec = Field(default_factory=FailureSpec)
    train: TrainSpec = Field(default_factory=TrainSpec)
    runtime_env: RuntimeEnvSpec = Field(default_factory=RuntimeEnvSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)

    @model_validator(mode="after")
    def _offload_needs_gpus(self) -> JobSpec:
        if self.train.parallelism == "fsdp" and self.train.fsdp.cpu_offload and self.workers.gpus == 0:
            raise ValueError(
                "train.fsdp.cpu_offload moves the sharded state from GPUs to host memory, and these workers have no "
                "GPU (workers.gpus: 0): set cpu_offload: false, or give the workers GPUs"
            )
        return self

    def run_name(self, suffix: str | None = None) -> str:
        """Deterministic run name: submitting the same job (and suffix) again resumes the same run."""
        if not suffix:
            return self.name
        name = f"{self.name}-{suffix}"
        if not re.fullmatch(_NAME_PATTERN, name):
            raise SpecError(f"--suffix {suffix!r}: {PATTERN_HINTS['name']} (the run name is {name!r})")
        return name

    def redacted(self) -> dict[str, Any]:
        """The spec as JSON for people and files: values of env_vars whose name looks like a credential
        (…KEY…, …SECRET…, …TOKEN…, …PASSWORD…) are replaced, so `spec check`, logs and reports never echo them."""
        data = self.model_dump(mode="json")
        env = data["runtime_env"]["env_vars"]
        data["runtime_env"]["env_vars"] = {k: REDACTED if _SECRET_NAME.search(k) else v for k, v in env.items()}
        return data

    @property
    def entrypoint_target(self) -> str:
        return self.entrypoint.rsplit(":", 1)[0]

    @property
    def entrypoint_function(self) -> str:
        return self.entrypoint.rsplit(":", 1)[1]


# ---------------------------------------------------------------------------------------------------------
# Loading


def load_job_spec(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> JobSpec:
    """Read, override and validate a job YAML. Raises SpecError with one line on any problem."""
    path = Path(path)
    text = read_document(path, "job file")
    return parse_job_spec(text, source=str(path), overrides=overrides)


def parse_job_spec(
    text: str,
    source: str = "<job>",
    overrides: tuple[str, ...] | list[str] = (),
    overrides_where: str = "--set {item}",
) -> JobSpec:
    return parse_spec(
        text,
        JobSpec,
        source,
        overrides,
        "a job file must be a YAML mapping with name, entrypoint, workers, checkpoint",
        overrides_where,
    )


def parse_spec(
    text: str,
    model: type[BaseModel],
    source: str,
    overrides: tuple[str, ...] | list[str],
    not_a_mapping: str,
    overrides_where: str = "--set {item}",
):
    """YAML text -> `model`, with --set overrides; every problem one SpecError line (shared by job and sweep).
    `overrides_where` names an overridden field in that line ({item}: FIELD=VALUE, {field}: FIELD): the flag on a
    command line, the sweep file's `overrides` for a sweep's job."""
    raw, root = load_yaml(text, source)
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: {not_a_mapping}")
    raw = apply_overrides(raw, overrides)
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        raise SpecError(describe(err, model, root, source, overrides, overrides_where)) from None


def apply_overrides(raw: dict[str, Any], overrides: tuple[str, ...] | list[str]) -> dict[str, Any]:
    """Apply `dotted.path=value` overrides (values parsed as YAML) to a copy of the raw mapping."""
    result = json.loads(json.dumps(raw, default=str))
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SpecError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set workers.min=1")
        target = result
        parts = key.strip().split(".")
        for part in parts[:-1]:
            nxt = target.setdefault(part, {})
            if not isinstance(nxt, dict):
                raise SpecError(f"--set {item!r}: {part} is not a mapping")
            target = nxt
        target[parts[-1]] = _override_value(value)
    return result


def _override_value(text: str) -> Any:
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    if isinstance(value, (int, float)) and not isinstance(value, bool) and ":" in text:
        return text.strip()  # YAML 1.1 reads 1:30 as sexagesimal 90; on a command line it means "1:30"
    if isinstance(value, str) and not text.strip().startswith(("'", '"')):  # '1' quoted stays a string
        try:
            return float(value)  # YAML 1.1 reads 1e-3 as a string; on a command line it means a number
        except ValueError:
            return value
    return value


def job_schema() -> dict[str, Any]:
    """JSON Schema of job files, for editors (yaml-language-server) and CI checks."""
    schema = JobSpec.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "elastic job spec"
    return schema


def dump_schema() -> str:
    return json.dumps(job_schema(), indent=2)
