"""GPU utilization and memory of this worker's device, read through NVML (nvidia-ml-py). On a node without an
NVIDIA GPU (or a worker on CPU) there is no sampler at all: `gpu_sampler` returns None, so the GPU series and the
low-utilization line never appear there, rather than showing zeros."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import pynvml
import torch

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuSample:
    utilization: float  # 0-1: the fraction of the last sample period the device was running a kernel
    memory_bytes: float  # used by this process on the device (the whole device's use if NVML cannot tell)


class NvmlSampler:
    """Reads one device by its UUID (the CUDA index a worker sees is renumbered by CUDA_VISIBLE_DEVICES;
    NVML numbers every device of the node)."""

    def __init__(self, handle):
        self._handle = handle
        self._pid = os.getpid()

    def sample(self) -> GpuSample:
        utilization = pynvml.nvmlDeviceGetUtilizationRates(self._handle).gpu / 100.0
        used = None
        try:
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
                if process.pid == self._pid and process.usedGpuMemory is not None:
                    used = float(process.usedGpuMemory)
        except pynvml.NVMLError:  # not supported on some devices (MIG, containers without the PID namespace)
            used = None
        if used is None:
            used = float(pynvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        return GpuSample(utilization, used)


def gpu_sampler(device: torch.device) -> NvmlSampler | None:
    """A sampler for `device` when it is a CUDA device NVML can read; None otherwise (CPU, logical GPUs)."""
    if device.type != "cuda":
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
    except (pynvml.NVMLError, RuntimeError, AttributeError) as err:
        _log.info("GPU metrics off: NVML cannot read %s (%s)", device, err)
        return None
    return NvmlSampler(handle)
