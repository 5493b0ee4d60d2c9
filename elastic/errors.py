"""Typed exceptions. The CLI turns every `UserError` into one line on stderr and exit status 2."""

from __future__ import annotations


class ElasticError(Exception):
    """Base class of every error this package raises on purpose."""


class UserError(ElasticError):
    """Bad input from the user: a wrong field, a missing bucket, an unreachable cluster.

    The message is one line that names the problem and the fix; no traceback is shown.
    """

    exit_code = 2


class SpecError(UserError):
    """A job or sweep spec is invalid."""


class StorageError(UserError):
    """A checkpoint URI cannot be used (missing bucket, no credentials, unreachable endpoint)."""


class ClusterError(UserError):
    """The Ray cluster cannot be reached or the local stack is in the wrong state."""


class ClusterAuthError(ClusterError):
    """The Ray cluster refused this client: Ray token auth is on and the token is missing or wrong."""


class ClusterConfigError(UserError):
    """A cluster config cannot be read at all (missing file, not YAML, not a mapping)."""


class VerifyFailed(UserError):
    """A verification run did not end as planned (not a verdict on the comparison: that is the report)."""

    exit_code = 1


class JobFailed(ElasticError):
    """A submitted job ended in a state other than SUCCEEDED."""

    def __init__(self, job_id: str, status: str, message: str = ""):
        super().__init__(f"job {job_id} ended {status}" + (f": {message}" if message else ""))
        self.job_id = job_id
        self.status = status


class NonFiniteLoss(ElasticError):
    """Training produced NaN/inf losses for `train.max_nonfinite_steps` optimizer steps in a row."""


class MetadataUnavailable(ElasticError):
    """The cloud metadata service did not answer usefully (timeout, connection error, 5xx): retried with backoff."""


class DrainError(ElasticError):
    """A drain could not be requested now (GCS unreachable, this host's node not registered yet): retried."""


class TrialOutOfMemory(ElasticError):
    """A trial ran out of memory at the whole-GPU share, or after max_oom_retries bigger shares."""


class SharedGPUError(ElasticError):
    """Two ranks of one sweep trial were given the same GPU."""


class ProbeDone(Exception):
    """Raised after a packing probe's last step, to leave the job's training loop (control flow, not an error)."""


class PlacementEnded(BaseException):
    """Raised on every rank at the checkpoint a placement ends at; the worker entry returns on it, so Ray Train
    sees the run finish cleanly. A BaseException, like SystemExit: `except Exception` in user code must not
    swallow it."""

    def __init__(self, step: int, reason: str = ""):
        super().__init__(f"placement ended at checkpoint step {step}")
        self.step = step
        self.reason = reason  # why, in words (the run ledger records it)
