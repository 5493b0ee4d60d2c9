"""The driver's run ledger: node deaths come from Ray's node records, only for nodes the run trained on and
only after the run started; without Ray's state API the run goes on with none recorded."""

from __future__ import annotations

from types import SimpleNamespace

from elastic.driver import run_ledger
from elastic.ledger import LedgerWriter
from elastic.ledger.events import WorkersStarted


def node(node_id: str, state: str, end_ms: int | None) -> SimpleNamespace:
    return SimpleNamespace(node_id=node_id, state=state, end_time_ms=end_ms, state_message="preempted")


def test_only_the_run_s_nodes_that_died_after_it_started(tmp_path, monkeypatch):
    writer = LedgerWriter(str(tmp_path), "worker", flush_seconds=60)
    writer.record(WorkersStarted(100.0, attempt="a", world_size=2, nodes=[{"node_id": "n1"}, {"node_id": "n2"}]))
    writer.close()
    monkeypatch.setattr(
        run_ledger,
        "list_nodes",
        lambda **kwargs: [
            node("n1", "DEAD", 150_000),  # reclaimed during the run
            node("n2", "ALIVE", None),
            node("n3", "DEAD", 160_000),  # another run's
        ],
    )
    deaths = run_ledger.node_deaths(str(tmp_path), since=90.0)
    assert [(d.node_id, d.time, d.message) for d in deaths] == [("n1", 150.0, "preempted")]
    monkeypatch.setattr(run_ledger, "list_nodes", lambda **kwargs: [node("n1", "DEAD", 80_000)])
    assert run_ledger.node_deaths(str(tmp_path), since=90.0) == []  # it died before this job of the run began


def test_no_state_api_records_no_deaths(tmp_path, monkeypatch):
    writer = LedgerWriter(str(tmp_path), "worker", flush_seconds=60)
    writer.record(WorkersStarted(100.0, attempt="a", world_size=1, nodes=[{"node_id": "n1"}]))
    writer.close()

    def unreachable(**kwargs):
        raise ConnectionError("dashboard unreachable")

    monkeypatch.setattr(run_ledger, "list_nodes", unreachable)
    assert run_ledger.node_deaths(str(tmp_path), since=0.0) == []
