"""`elastic bench data`'s peers: the same rows read for one epoch by two other streaming readers, beside ours.

Ray Data: `ray.data.read_parquet` on the dataset's own Parquet files (the manifest's list, so exactly our rows)
through `iter_torch_batches` with a local shuffle buffer holding as many rows as our shuffle window does. It runs
in a child process on a private local Ray (PEER_CPUS CPUs, no dashboard): the CLI's own process may already be a Ray
driver, and RAY_ADDRESS or the local stack's auth in its environment must not send this read to a cluster.

MosaicML Streaming: its own venv (bench/peers/setup_mosaic.sh; mosaicml-streaming pins numpy<2.2 and
transformers<5, which ours does not hold) runs bench/peers/mosaic_read.py, which converts the rows to MDS (a local
temp folder, or a sibling prefix `<uri>-mds` in the bucket) and reads one shuffled epoch through a DataLoader.
Without that venv the peer is reported as skipped, with the command that creates it.

A peer that fails is reported in the result, with its error and no ratio (the peers are context, never the
benchmark's verdict); `-v` logs the child's last stderr line.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from elastic.data.manifest import load
from elastic.data.streaming import DEFAULT_SHUFFLE_WINDOW
from elastic.storage import parse_uri, pyarrow_filesystem

_log = logging.getLogger(__name__)

COLUMNS = ["id", "payload"]  # what our reader reads in bench_data
PEERS_DIR = Path(__file__).resolve().parents[2] / "bench" / "peers"  # in a source checkout only
MOSAIC_VENV = PEERS_DIR / ".venv-mosaic"
MOSAIC_RUNNER = PEERS_DIR / "mosaic_read.py"
MOSAIC_SETUP = "run bench/peers/setup_mosaic.sh to create its venv"
PEER_TIMEOUT_SECONDS = 3600
# One reading process each, as one rank of ours is (ours is timed a rank at a time, alone on the machine): Ray with
# 1 CPU, Mosaic with 1 DataLoader worker. Two processes of a peer on this 2-core machine would share the cores with
# nothing else, which no rank of ours gets, and the ratio would compare parallelism rather than readers.
PEER_CPUS = 1
RESULT_MARKER = "PEER_RESULT "  # Ray writes its own progress to stdout: the result is the line with this mark
# The child's Ray is a private one: nothing that points Ray at a cluster, or at that cluster's auth, goes to it.
_RAY_CLUSTER_VARIABLES = (
    "RAY_ADDRESS",
    "RAY_API_SERVER_ADDRESS",
    "RAY_AUTH_MODE",
    "RAY_AUTH_TOKEN",
    "RAY_AUTH_TOKEN_PATH",
)


def bench_peers(
    uri: str, batch_size: int, ours_rows_per_s: float, shuffle_window: int = DEFAULT_SHUFFLE_WINDOW
) -> dict:
    """Both peers over the rows at `uri`, and ours over each peer's rows/s; `ours_rows_per_s` is one process's
    (bench_data: the epoch's rows over the ranks' summed seconds)."""
    manifest = load(uri)
    # A local buffer the size of our shuffle window: both hold about the same rows to shuffle among.
    group_rows = manifest.rows / max(manifest.num_row_groups, 1)
    buffer_rows = max(batch_size, round(shuffle_window * group_rows))
    ray_data = ray_data_peer(uri, batch_size, buffer_rows)
    mosaic = mosaic_peer(uri, batch_size, shuffle_rows=buffer_rows)
    return {
        "ray_data": ray_data,
        "mosaic_streaming": mosaic,
        "ours_vs_ray_data": _ratio(ours_rows_per_s, ray_data),
        "ours_vs_mosaic": _ratio(ours_rows_per_s, mosaic),
        "ours_rows_per_s": round(ours_rows_per_s),
        "basis": f"rows/s of one reading process: ours a rank's, each peer's with {PEER_CPUS} CPU/worker",
    }


def ray_data_peer(uri: str, batch_size: int, buffer_rows: int) -> dict:
    spec = {"uri": uri, "batch_size": batch_size, "buffer_rows": buffer_rows, "cpus": PEER_CPUS}
    env = {k: v for k, v in os.environ.items() if k not in _RAY_CLUSTER_VARIABLES}
    command = [sys.executable, "-m", "elastic.bench.data_peers", "ray-data"]
    return _run_peer("ray_data", command, spec, env)


def mosaic_peer(uri: str, batch_size: int, shuffle_rows: int | None = None, num_workers: int = PEER_CPUS) -> dict:
    python = MOSAIC_VENV / "bin" / "python"
    if not python.exists() or not MOSAIC_RUNNER.exists():
        return {"skipped": MOSAIC_SETUP}
    manifest = load(uri)
    location = parse_uri(uri)
    with tempfile.TemporaryDirectory(prefix="elastic-mosaic-") as scratch:
        spec = {
            "uri": uri,
            "files": [f.path for f in manifest.files],
            "columns": COLUMNS,
            "batch_size": batch_size,
            "num_workers": num_workers,  # DataLoader worker processes: Mosaic's own parallelism
            "rows": manifest.rows,
            "shuffle_block_size": shuffle_rows,  # py1e's block: as many rows as our window (None: Mosaic's default)
            "scratch": scratch,
            # From a bucket, MDS goes beside the dataset so Mosaic streams it from the same store as ours.
            "remote": f"{uri.rstrip('/')}-mds" if location.is_object_store else None,
        }
        return _run_peer("mosaic_streaming", [str(python), str(MOSAIC_RUNNER)], spec, dict(os.environ))


def _run_peer(name: str, command: list[str], spec: dict, env: dict) -> dict:
    # Debug only: the CLI logs to stdout, where `elastic bench data --json` prints its result.
    _log.debug("bench data: reading the rows with %s", name)
    try:
        done = subprocess.run(
            command,
            input=json.dumps(spec),
            capture_output=True,
            text=True,
            env=env,
            timeout=PEER_TIMEOUT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        return {"failed": f"no result in {PEER_TIMEOUT_SECONDS} s"}
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    _log.debug("bench data: the %s peer failed (exit %s): %s", name, done.returncode, tail)
    return {"failed": f"exit {done.returncode}: {tail}"}


def _ratio(ours: float, peer: dict) -> float | None:
    theirs = peer.get("rows_per_s")
    return round(ours / theirs, 3) if theirs else None


def _ray_data_epoch(spec: dict) -> dict:
    """In the child: one epoch through Ray Data on a private local Ray, timed from read_parquet (lazy; it
    lists the files) to the last batch; Ray's start is reported apart, as our dataset's set-up is not timed."""
    import ray
    import ray.data

    manifest = load(spec["uri"])
    arrow_fs, root = pyarrow_filesystem(spec["uri"])
    paths = [f"{root}/{f.path}" for f in manifest.files]
    started = time.perf_counter()
    ray.init(
        address="local",
        num_cpus=spec["cpus"],
        include_dashboard=False,
        log_to_driver=False,
        object_store_memory=1 << 30,
    )
    try:
        ray.data.DataContext.get_current().enable_progress_bars = False
        init_seconds = time.perf_counter() - started
        started = time.perf_counter()
        dataset = ray.data.read_parquet(paths, filesystem=arrow_fs, columns=COLUMNS)
        seen, first = [], None
        batches = dataset.iter_torch_batches(
            batch_size=spec["batch_size"], local_shuffle_buffer_size=spec["buffer_rows"], local_shuffle_seed=0
        )
        for batch in batches:
            first = first if first is not None else time.perf_counter() - started
            seen.append(batch["id"].numpy())
        seconds = time.perf_counter() - started
    finally:
        ray.shutdown()
    ids = np.concatenate(seen) if seen else np.empty(0, dtype=np.int64)
    return {
        "rows": len(ids),
        "seconds": round(seconds, 3),
        "rows_per_s": round(len(ids) / seconds),
        "first_batch_seconds": round(first or 0.0, 3),
        "ray_init_seconds": round(init_seconds, 3),
        "exactly_once": len(ids) == len(np.unique(ids)) == manifest.rows,
        "shuffle": f"local buffer of {spec['buffer_rows']} rows (iter_torch_batches local_shuffle_buffer_size)",
        "ray_version": ray.__version__,
    }


if __name__ == "__main__":  # the Ray Data child: a spec on stdin, one marked JSON line on stdout
    logging.basicConfig(level=logging.WARNING)
    if sys.argv[1:] != ["ray-data"]:
        sys.exit("usage: python -m elastic.bench.data_peers ray-data < spec.json")
    print(RESULT_MARKER + json.dumps(_ray_data_epoch(json.load(sys.stdin))), flush=True)
