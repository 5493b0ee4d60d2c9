"""`elastic bench data` on a local folder: every figure is there and consistent (the rows each read once, the
amplification of 2 ranks that each fetch every row group of a window), and the synthetic order's memory does
not grow with rows. Figures are the benchmark's to report; nothing here asserts on time."""

from __future__ import annotations

from elastic.bench import data as bench


def test_a_streamed_epoch_reads_each_row_once_and_reports_every_figure(tmp_path):
    uri = bench.generated_dataset(str(tmp_path / "rows"), rows=3000, row_bytes=256, row_group_mb=0.05)
    result = bench.bench_data(uri, ranks=2, batch_size=64, shuffle_window=4, peers=False)
    assert result["rows"] == 3000 and result["row_groups"] > 8 and result["rows_each_once"] is True
    rates = ("sequential_rows_per_s", "shuffled_rows_per_s", "pyarrow_scan_rows_per_s")
    floors = ("raw_get_mb_per_s", "raw_range_get_mb_per_s", "shuffled_vs_range_get", "fetch_decode_mb_per_s")
    for key in (*rates, *floors, "shuffled_vs_fetch_decode", "train_floor_rows_per_s", "train_vs_floor"):
        assert result[key] > 0, key
    assert result["read_amplification"] <= 1.0  # the 2 ranks share the node's cache: each row group once
    assert 1.5 < result["read_amplification_uncached"] <= 2.05  # each rank fetching every row group itself


def test_the_synthetic_order_holds_memory_per_row_group_not_per_row():
    small = bench.bench_order(10**6, row_groups=100, baseline_rows=10**5)
    large = bench.bench_order(10**9, row_groups=100, baseline_rows=10**5)
    # 16 bytes a row group; the window being read keeps its row order whole only up to 4M rows (here the small
    # set's 16 groups of 1e4 rows, 8 bytes each), so at 1e9 rows nothing grows with the rows.
    assert large["order_state_bytes"] == 16 * 101 - 8
    assert small["order_state_bytes"] == 16 * 101 - 8 + 8 * 16 * 10**4
    assert large["randperm_bytes_at_synthetic_rows"] == 8 * 10**9


def test_the_fetch_and_decode_floor_reads_exactly_the_row_groups_of_the_rows_asked_for(tmp_path):
    from elastic.bench import data_floor
    from elastic.data.manifest import load

    uri = bench.generated_dataset(str(tmp_path / "rows"), rows=3000, row_bytes=256, row_group_mb=0.05)
    manifest = load(uri)
    sizes = manifest.row_group_rows()
    everything = data_floor.row_groups(manifest)
    assert len(everything) == len(sizes) == manifest.num_row_groups
    # The first row of the second group and the last row of the dataset: those two groups, in order, once each.
    rows = [sizes[0], sizes[0] + 1, manifest.rows - 1]
    assert data_floor.groups_of_rows(manifest, rows) == [everything[1], everything[-1]]
    whole = data_floor.fetch_decode(uri, manifest, everything, ["id", "payload"])
    assert whole["rows"] == 3000 and 0 < whole["fetched"] < manifest.bytes  # the two columns' chunks, no label
    beside, floor = data_floor.beside(lambda: "trained", uri, manifest, everything[:2], ["label"])
    assert beside == "trained" and floor["rows"] == sizes[0] + sizes[1]
