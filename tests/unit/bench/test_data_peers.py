"""`elastic bench data`'s peers on a local folder: Ray Data (in its child process, on a private local Ray) reads
every row of the dataset exactly once, and the MosaicML Streaming peer is reported as skipped, with the command
that fixes it, where its venv does not exist. Nothing here asserts on time."""

from __future__ import annotations

import numpy as np
import pytest

from elastic.bench import data_peers
from elastic.data.prepare import prepare

ROWS = 2000


@pytest.fixture
def dataset_dir(tmp_path):
    source = tmp_path / "rows.npz"
    rng = np.random.default_rng(0)
    np.savez(
        source, id=np.arange(ROWS), label=rng.integers(0, 10, ROWS), payload=rng.random((ROWS, 8), dtype=np.float32)
    )
    dest = tmp_path / "dataset"
    prepare(str(source), str(dest), shard_mb=0.05, row_group_mb=0.01)
    return str(dest)


def test_ray_data_reads_every_row_once_on_a_private_ray(dataset_dir, monkeypatch):
    # A cluster address in the environment must not reach the child: it starts its own local Ray.
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    result = data_peers.ray_data_peer(dataset_dir, batch_size=64, buffer_rows=500)
    assert "failed" not in result, result
    assert result["rows"] == ROWS and result["exactly_once"] is True and result["rows_per_s"] > 0
    assert result["shuffle"].startswith("local buffer of 500 rows")


def test_the_mosaic_peer_is_skipped_cleanly_without_its_venv(dataset_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(data_peers, "MOSAIC_VENV", tmp_path / "no-such-venv")
    assert data_peers.mosaic_peer(dataset_dir, batch_size=64) == {"skipped": data_peers.MOSAIC_SETUP}
    assert data_peers._ratio(1000.0, {"skipped": data_peers.MOSAIC_SETUP}) is None
