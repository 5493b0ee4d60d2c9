"""GPU packing policy for sweeps: pure functions from a probe's measures to decisions, each with its reason.

- `plan_packing`: how many trials fit on one GPU (with headroom), the GPU share each training worker asks Ray
  for, and the memory cap each worker process sets on itself (torch.cuda.set_per_process_memory_fraction), so
  a trial that grows past its share fails alone instead of pushing a neighbour out of memory.
- `bigger_share`: the share an out-of-memory trial is retried with.
- `rank_placement`: Ray placement strategy that keeps two ranks of one DDP trial off one GPU.

The code that carries these out is elsewhere (elastic.worker.sharing on workers, elastic.sweep.runner in the Tune layer).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

GB = 1024**3
# Ray tracks fractional resources to 1e-4; a share is always 1/n so trials tile a GPU exactly.
_SHARE_DIGITS = 4


@dataclass(frozen=True)
class Probe:
    """What a short probe run measured (or, without CUDA, what the sweep declared)."""

    peak_bytes: int  # peak device memory of one training worker (allocator peak)
    device_bytes: int  # memory of the GPU it ran on (or the declared logical GPU size)
    step_seconds: float | None  # mean optimizer step time after warm-up
    source: str  # "measured" (torch.cuda.max_memory_allocated) or "declared" (sweep spec, no CUDA)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PackingPlan:
    trials_per_gpu: int
    share: float  # GPU fraction per training worker, as Ray resources
    memory_fraction: float  # per-process cap of the caching allocator, as a fraction of the device
    reason: str

    def to_json(self) -> dict:
        return asdict(self)


def fixed_plan(share: float, context_bytes: int = 0, device_bytes: int | None = None) -> PackingPlan:
    """A share given in the sweep spec: no probe, the cap follows the share."""
    n = max(1, math.floor(1 / share + 1e-9))
    return PackingPlan(
        n,
        round(share, _SHARE_DIGITS),
        _memory_fraction(share, context_bytes, device_bytes),
        f"gpu_share {share} from the sweep spec",
    )


def plan_packing(
    probe: Probe, headroom: float = 0.15, context_bytes: int = int(0.5 * GB), max_per_gpu: int = 8
) -> PackingPlan:
    """Largest n such that n workers, each needing peak x (1 + headroom) plus its CUDA context, fit on one
    GPU; capped at max_per_gpu. A worker that does not fit even alone gets the whole GPU (and will say so)."""
    if probe.device_bytes <= 0:
        raise ValueError("device_bytes must be positive")
    need = probe.peak_bytes * (1 + headroom) + context_bytes
    fits = math.floor(probe.device_bytes / need) if need > 0 else max_per_gpu
    n = max(1, min(max_per_gpu, fits))
    share = _share(n)
    peak_gb, device_gb = probe.peak_bytes / GB, probe.device_bytes / GB
    if fits < 1:
        reason = (
            f"{probe.source} peak {peak_gb:.2f} GB (+{headroom:.0%} headroom, context) exceeds the "
            f"{device_gb:.1f} GB GPU: one trial per GPU, and it may still run out of memory"
        )
    elif n < fits:
        reason = (
            f"{probe.source} peak {peak_gb:.2f} GB: {fits} would fit on {device_gb:.1f} GB; capped at "
            f"max_per_gpu={max_per_gpu}"
        )
    else:
        reason = (
            f"{probe.source} peak {peak_gb:.2f} GB x (1 + {headroom:.0%}) + {context_bytes / GB:.2f} GB "
            f"context: {n} per {device_gb:.1f} GB GPU"
        )
    return PackingPlan(n, share, _memory_fraction(share, context_bytes, probe.device_bytes), reason)


def bigger_share(share: float) -> float:
    """The share an out-of-memory trial is retried with: half as many trials per GPU (1/4 -> 1/2 -> 1)."""
    per_gpu = max(1, math.floor(1 / share + 1e-9))
    return _share(max(1, per_gpu // 2))


def rank_placement(workers: int, share: float) -> str:
    """Two ranks of one DDP trial must never share a GPU (NCCL fails with two ranks on one device). Ray assigns
    fractional GPUs within a node without a "distinct device" constraint, so ranks on a shared GPU go to
    different nodes (STRICT_SPREAD); whole GPUs are distinct devices by construction (PACK)."""
    if workers > 1 and share < 1:
        return "STRICT_SPREAD"
    return "PACK"


def concurrency_cap(trials_per_gpu: int, gpus: float, workers_per_trial: int) -> int:
    """Trials that can hold GPU shares at once: more would start drivers and controllers (hundreds of MB each)
    whose workers only wait for a GPU."""
    return max(1, math.floor(trials_per_gpu * gpus + 1e-9) // max(1, workers_per_trial))


def memory_cap(plan_fraction: float) -> float:
    """torch.cuda.set_per_process_memory_fraction needs a value in (0, 1]."""
    return min(1.0, max(0.01, plan_fraction))


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """Most intervals open at one instant (an interval's end closes before another's start at the same time)."""
    events = sorted([(a, 1) for a, _ in intervals] + [(b, -1) for _, b in intervals], key=lambda e: (e[0], e[1]))
    best = current = 0
    for _, delta in events:
        current += delta
        best = max(best, current)
    return best


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of intervals as disjoint ones, in order (touching ones join)."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def _share(per_gpu: int) -> float:
    # Round down, so n shares never add up to more than one GPU.
    return math.floor(10**_SHARE_DIGITS / per_gpu) / 10**_SHARE_DIGITS


def _memory_fraction(share: float, context_bytes: int, device_bytes: int | None) -> float:
    """The allocator may use the share minus the context (which lives outside the allocator)."""
    if not device_bytes:
        return memory_cap(share)
    return memory_cap(round(share - context_bytes / device_bytes, _SHARE_DIGITS))
