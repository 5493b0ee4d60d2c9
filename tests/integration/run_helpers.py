"""Runs of the digits job on a real local stack, shared by the integration modules that compare final weights."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

from conftest import ROOT


class Submission:
    """`elastic submit ... --follow` in the background, its output collected as it comes."""

    def __init__(self, cli, *args: str, job: str = "jobs/digits_ddp.yaml"):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "elastic", "submit", job, *args, "--follow"],
            cwd=ROOT,
            env=cli.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self._reader.start()

    def wait_for(self, text: str, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in list(self.lines)):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not seen:\n{self.output[-4000:]}")

    def finish(self, timeout: float = 600) -> str:
        self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        assert self.proc.returncode == 0, self.output[-6000:]
        return self.output

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def worker_node(self) -> str:
        """The node of rank 0 of the run's latest worker group (from each worker's placement line)."""
        nodes = re.findall(r"worker rank 0/\d+ on node ([0-9a-f]+)", self.output)
        assert nodes, f"no worker placement line yet:\n{self.output[-4000:]}"
        return nodes[-1]


def final_tensors(stack, run: str) -> dict:
    """Model and optimizer tensors of the run's latest committed checkpoint, read from the bucket."""
    from elastic.checkpoint.store import CheckpointStore

    saved = dict(os.environ)
    os.environ.update(stack["env"])
    try:
        store = CheckpointStore(f"s3://{stack['bucket']}/runs/{run}")
        latest = store.latest_committed()
        return {"step": latest.step, **store.read_tensors(latest.step)}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def attached_checkpoint(stack, run: str, name: str = "checkpoint.pt") -> dict:
    """A file of the run's latest committed checkpoint's attached folder (what an api ray-train function
    reported, or a Trainer saved), loaded with torch (safetensors for *.safetensors), and the step."""
    import io

    import torch
    from safetensors.torch import load as load_safetensors

    from elastic.checkpoint.store import ATTACHED, CheckpointStore

    saved = dict(os.environ)
    os.environ.update(stack["env"])
    try:
        store = CheckpointStore(f"s3://{stack['bucket']}/runs/{run}")
        latest = store.latest_committed()
        raw = store.fs.cat_file(f"{store.path(latest.step)}/{ATTACHED}/{name}")
        loaded = (
            load_safetensors(raw) if name.endswith(".safetensors") else torch.load(io.BytesIO(raw), weights_only=False)
        )
        return {"step": latest.step, **loaded}
    finally:
        os.environ.clear()
        os.environ.update(saved)


def assert_same_weights(left: dict, right: dict) -> None:
    import torch

    assert left["step"] == right["step"]
    tensors = [k for k in left if k != "step" and isinstance(left[k], torch.Tensor)]
    assert len(tensors) >= 6 and set(tensors) == {k for k in right if isinstance(right[k], torch.Tensor)}
    different = [k for k in tensors if not torch.equal(left[k], right[k])]
    assert not different, f"differ from the uninterrupted run: {different}"
