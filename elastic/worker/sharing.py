"""Carries out the packing plan on each training worker of a sweep trial (the policy is elastic.placement.packing).

Before the job's function runs, every rank:

- checks that no two ranks of this trial hold the same GPU (NCCL fails with two ranks on one device), and
  rank 0 records each rank's node and GPU ids in the run folder (`gpus.json`);
- on CUDA, caps its caching allocator at the plan's memory fraction, so a trial that grows past its share
  gets an out-of-memory error itself instead of pushing a neighbour out of memory.

While it runs, an out-of-memory error is caught and written to the run folder (`oom.json`), so the trial's
driver retries it with a bigger share (a worker group that Ray Train restarts after a rank's OOM finds the
marker and ends at once, rather than running out of memory again at the same share); a probe run stops after `probe_steps` steps and writes what it measured
(`probe.json`). Fault injection for tests: ELASTIC_INJECT_OOM="STEP:SHARE" raises torch.OutOfMemoryError
after optimizer step STEP on every worker whose share is below SHARE (as a real OOM would, every time).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import ray
import torch
import torch.distributed as dist

from elastic.config.spec import JobSpec
from elastic.errors import ProbeDone, SharedGPUError
from elastic.worker.entrypoint import worker_main
from elastic.worker.session import Session

INJECT_OOM_VARIABLE = "ELASTIC_INJECT_OOM"
SHARE_VARIABLE = "ELASTIC_GPU_SHARE"
OOM_FILE = "oom.json"
PROBE_FILE = "probe.json"
GPUS_FILE = "gpus.json"

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrialSharing:
    """A sweep trial's run (elastic.sweep.runner): every worker asks for `share` of a GPU, ranks are placed by
    `strategy`, workers run trial_worker_main below, and (inside Tune) metrics flow to Tune. The driver passes
    it to the workers in Ray Train's train_loop_config."""

    share: float
    memory_fraction: float
    strategy: str = "PACK"
    probe_steps: int | None = None
    adopted_step: int | None = None  # PBT: the run resumes from a checkpoint adopted from another trial
    # The Train callback that carries reports to Tune (elastic.sweep.tune_reports), None outside Tune; the
    # driver keeps it, the workers never see it (worker_payload).
    tune_callback: Any = field(default=None, compare=False, repr=False)

    def worker_payload(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "tune_callback"}


def trial_worker_main(payload: dict) -> None:
    """The train function of a sweep trial's TorchTrainer: the job's worker entry with the packing added."""
    worker_main(payload, TrialSetup(payload["sharing"]))


class TrialSetup:
    """The packing's part of the worker entry (elastic.worker.entrypoint.WorkerSetup)."""

    def __init__(self, sharing: dict):
        self.share = float(sharing["share"])
        self.memory_fraction = sharing["memory_fraction"]
        self.probe_steps = sharing.get("probe_steps")
        self.adopted_step = sharing.get("adopted_step")

    def before_session(self, spec: JobSpec) -> None:
        os.environ.update(spec.runtime_env.env_vars)  # per-trial variables (the sweep's space may set them)
        os.environ[SHARE_VARIABLE] = str(self.share)

    def run(self, session: Session, train: Callable[[Session], Any]) -> None:
        session.report_every_commit = True  # each report is a Tune iteration: schedulers count them
        session.keep_pinned_checkpoints()  # another trial's exploit may be copying one (elastic.sweep.pbt)
        session.adopted_step = self.adopted_step
        fs, root = session.store.fs, session.store.root
        oom = read_marker(fs, f"{root}/{OOM_FILE}")
        if oom is not None and float(oom.get("share", 1)) <= self.share:
            # Ray Train restarted the group after a rank's OOM: at this share it would run out of memory again.
            # End the fit at once, so the trial's driver retries with a bigger share instead of Ray spending its
            # failure budget on the same share.
            session.log(f"out of memory at GPU share {oom.get('share')}: ending for a retry with a bigger share")
            return
        _check_distinct_gpus(session, fs, root)
        _cap_memory(session, self.memory_fraction)
        steps = _StepWatch(session, self.share, self.probe_steps)
        try:
            train(session)
        except ProbeDone:
            _write_probe(session, fs, root, steps)
        except torch.OutOfMemoryError as err:
            _write(
                fs,
                f"{root}/{OOM_FILE}",
                {
                    "share": self.share,
                    "step": session.step_count,
                    "rank": session.rank,
                    "error": str(err).splitlines()[0][:300] if str(err) else "OOM",
                },
            )
            session.log(f"out of memory at step {session.step_count} with GPU share {self.share}", all_ranks=True)
            if session.world_size == 1:
                return  # ends this fit without spending a failure budget; the trial driver retries bigger
            raise  # other ranks may be inside a collective: let Ray Train tear the group down


class _StepWatch:
    """A step hook (Session.add_step_hook): step times for the probe, the probe's stop, and injected
    out-of-memory errors."""

    def __init__(self, session, share: float, probe_steps: int | None):
        self.share, self.probe_steps = share, probe_steps
        self.times: list[float] = []
        self._last = time.perf_counter()
        self._inject = _parse_injection(os.environ.get(INJECT_OOM_VARIABLE, ""))
        session.add_step_hook(self.on_step)

    def on_step(self, step: int, metrics: dict | None) -> None:
        now = time.perf_counter()
        self.times.append(now - self._last)
        self._last = now
        if self._inject and step == self._inject[0] and self.share < self._inject[1]:
            raise torch.OutOfMemoryError(
                f"injected: CUDA out of memory at step {step} with GPU share "
                f"{self.share} (< {self._inject[1]}; {INJECT_OOM_VARIABLE})"
            )
        if self.probe_steps and len(self.times) >= self.probe_steps:
            raise ProbeDone()


def _parse_injection(text: str) -> tuple[int, float] | None:
    if not text.strip():
        return None
    step, _, share = text.partition(":")
    try:
        return int(step), float(share or 1.01)
    except ValueError:
        raise ValueError(f"{INJECT_OOM_VARIABLE}={text!r}: expected STEP:SHARE, e.g. 3:0.5") from None


def _check_distinct_gpus(session, fs, root: str) -> None:
    mine = {
        "rank": session.rank,
        "node": session.node_id,
        "gpus": [str(g) for g in ray.get_gpu_ids()],
        "cuda_visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    everyone = [None] * session.world_size
    if dist.is_initialized():
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    seen: dict[tuple[str, str], int] = {}
    for entry in everyone:
        for gpu in entry["gpus"]:
            other = seen.setdefault((entry["node"], gpu), entry["rank"])
            if other != entry["rank"]:
                raise SharedGPUError(
                    f"ranks {other} and {entry['rank']} of this trial share GPU {gpu} on node "
                    f"{entry['node'][:12]}; DDP ranks need distinct GPUs"
                )
    if session.is_chief:
        _write(fs, f"{root}/{GPUS_FILE}", everyone)


def _cap_memory(session, fraction: float) -> None:
    if session.device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(fraction, session.device)
        torch.cuda.reset_peak_memory_stats(session.device)
        session.log(f"GPU memory capped at {fraction:.2%} of the device", all_ranks=True)


def _write_probe(session, fs, root: str, steps: _StepWatch) -> None:
    cuda = session.device.type == "cuda"
    peak = torch.cuda.max_memory_allocated(session.device) if cuda else 0
    device = torch.cuda.get_device_properties(session.device).total_memory if cuda else 0
    warm = steps.times[len(steps.times) // 2 :] or steps.times  # the first steps include warm-up
    values = torch.tensor([peak, sum(warm) / max(len(warm), 1)], dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    if session.is_chief:
        _write(
            fs,
            f"{root}/{PROBE_FILE}",
            {
                "peak_bytes": int(values[0]),
                "device_bytes": int(device),
                "step_seconds": float(values[1]),
                "cuda": cuda,
                "steps": len(steps.times),
            },
        )
    _log.info(f"probe: {len(steps.times)} steps, peak {int(values[0]) / 2**30:.3f} GB")


def _write(fs, path: str, data) -> None:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    with fs.open(path, "w") as handle:
        json.dump(data, handle)


def read_marker(fs, path: str, clear: bool = False):
    """A JSON marker written by the workers, or None; `clear` deletes it once read."""
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as handle:
        data = json.load(handle)
    if clear:
        fs.rm(path)
    return data
