"""The MosaicML Streaming peer of `elastic bench data`, run by elastic/bench/data_peers.py with the python of
bench/peers/.venv-mosaic (setup_mosaic.sh): Mosaic pins numpy<2.2 and transformers<5, so it cannot share the
project's venv, and this script imports nothing of elastic's.

Reads a spec (JSON) on stdin: the dataset's uri and Parquet files (the manifest's), the columns, batch size,
DataLoader workers, expected rows, a scratch folder, and `remote` (an s3:// prefix for the MDS copy, or null for
a local one). Converts the rows to MDS (MDSWriter; timed apart, as `convert_seconds`), then reads one shuffled
epoch through streaming.StreamingDataset and a torch DataLoader, and prints one line: `PEER_RESULT {json}`.

  echo '{"uri": "/tmp/rows", "files": ["part-00000.parquet"], ...}' | .venv-mosaic/bin/python mosaic_read.py
"""

from __future__ import annotations

import importlib.machinery
import json
import logging
import os
import sys
import time
import types
from urllib.parse import urlparse

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

_log = logging.getLogger("mosaic_read")

RESULT_MARKER = "PEER_RESULT "
READ_BATCH_ROWS = 8192  # Parquet rows decoded at a time while converting: the dataset never sits in memory whole


def _import_streaming():
    """`import streaming` imports streaming.vision, which imports torchvision; PyPI's torchvision wheels are CUDA
    builds that fail to import beside a CPU torch ("operator torchvision::nms does not exist"). MDS writing and
    reading never touch torchvision, so the two names streaming.vision takes from it are stubbed when it fails."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # a broken torchvision raises RuntimeError, a missing one ImportError
        _log.info("torchvision unusable here (%s): stubbing the names streaming.vision imports", err)
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        names = ("torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional")
        stub = {n: types.ModuleType(n) for n in names}
        for name, module in stub.items():  # a spec: transformers looks torchvision up with importlib.util.find_spec
            module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        stub["torchvision.datasets"].VisionDataset = type("VisionDataset", (), {})
        stub["torchvision.transforms.functional"].to_tensor = lambda *_: None
        sys.modules.update(stub)
    import streaming

    return streaming


def _filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    """pyarrow's filesystem for the dataset, S3 endpoint and keys from the standard AWS variables (as
    elastic.storage.pyarrow_filesystem does in the project's venv)."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return pafs.LocalFileSystem(), os.path.abspath(parsed.path if parsed.scheme else uri)
    if parsed.scheme != "s3":
        return pafs.FileSystem.from_uri(uri)
    kwargs: dict = {"region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"}
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        where = urlparse(endpoint)
        kwargs.update(endpoint_override=where.netloc or where.path, scheme=where.scheme or "https")
    if os.environ.get("AWS_ACCESS_KEY_ID") and os.environ.get("AWS_SECRET_ACCESS_KEY"):
        kwargs.update(access_key=os.environ["AWS_ACCESS_KEY_ID"], secret_key=os.environ["AWS_SECRET_ACCESS_KEY"])
        kwargs["session_token"] = os.environ.get("AWS_SESSION_TOKEN")
    return pafs.S3FileSystem(**kwargs), f"{parsed.netloc}/{parsed.path.lstrip('/')}".rstrip("/")


def _encoding(kind: pa.DataType) -> str:
    """The MDS encoding of a numeric column or a fixed-size list of numbers (what `elastic bench data` reads)."""
    if pa.types.is_fixed_size_list(kind):
        return f"ndarray:{kind.value_type.to_pandas_dtype().__name__}:{kind.list_size}"
    if pa.types.is_integer(kind) or pa.types.is_floating(kind):
        return np.dtype(kind.to_pandas_dtype()).name
    raise TypeError(f"no MDS encoding here for a column of {kind}")


def _values(column: pa.Array) -> np.ndarray:
    if pa.types.is_fixed_size_list(column.type):
        return column.flatten().to_numpy(zero_copy_only=False).reshape(len(column), column.type.list_size)
    return column.to_numpy(zero_copy_only=False)


def convert(streaming, spec: dict, out) -> int:
    fs, root = _filesystem(spec["uri"])
    files = [pq.ParquetFile(fs.open_input_file(f"{root}/{path}")) for path in spec["files"]]
    schema = files[0].schema_arrow
    columns = {name: _encoding(schema.field(name).type) for name in spec["columns"]}
    rows = 0
    # exist_ok: a rerun replaces the MDS copy a previous run left.
    with streaming.MDSWriter(out=out, columns=columns, size_limit=1 << 25, exist_ok=True) as writer:
        for parquet in files:
            for batch in parquet.iter_batches(batch_size=READ_BATCH_ROWS, columns=spec["columns"]):
                values = {name: _values(batch.column(name)) for name in spec["columns"]}
                for k in range(batch.num_rows):  # MDSWriter takes one sample dict at a time
                    writer.write({name: column[k] for name, column in values.items()})
                rows += batch.num_rows
    return rows


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    spec = json.load(sys.stdin)
    # Mosaic's boto3 clients take their endpoint from S3_ENDPOINT_URL only; ours is in the standard variables.
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if endpoint:
        os.environ.setdefault("S3_ENDPOINT_URL", endpoint)
    streaming = _import_streaming()
    import torch
    from streaming.base.util import clean_stale_shared_memory
    from torch.utils.data import DataLoader

    scratch, remote = spec["scratch"], spec.get("remote")
    written, cache = os.path.join(scratch, "mds"), os.path.join(scratch, "cache")
    started = time.perf_counter()
    converted = convert(streaming, spec, (written, remote) if remote else written)
    convert_seconds = time.perf_counter() - started

    clean_stale_shared_memory()  # Mosaic's shared memory a killed earlier run left would block this one
    dataset = streaming.StreamingDataset(
        local=cache if remote else written,
        remote=remote,
        shuffle=True,
        shuffle_seed=0,
        shuffle_block_size=spec.get("shuffle_block_size"),
        batch_size=spec["batch_size"],
    )
    loader = DataLoader(dataset, batch_size=spec["batch_size"], num_workers=spec["num_workers"])
    seen, first = [], None
    started = time.perf_counter()
    for batch in loader:
        first = first if first is not None else time.perf_counter() - started
        seen.append(batch["id"].numpy())
    seconds = time.perf_counter() - started
    ids = np.concatenate(seen) if seen else np.empty(0, dtype=np.int64)
    result = {
        "rows": len(ids),
        "seconds": round(seconds, 3),
        "rows_per_s": round(len(ids) / seconds),
        "first_batch_seconds": round(first or 0.0, 3),
        "convert_seconds": round(convert_seconds, 3),
        "converted_rows": converted,
        "exactly_once": len(ids) == len(np.unique(ids)) == spec["rows"],
        "shuffle_algo": dataset.shuffle_algo,
        "shuffle_block_size": dataset.shuffle_block_size,  # rows a shuffle block spans (set by the epoch)
        "num_workers": spec["num_workers"],
        "mds": remote or "local temp folder",
        "streaming_version": streaming.__version__,
        "torch_version": torch.__version__,
    }
    print(RESULT_MARKER + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
