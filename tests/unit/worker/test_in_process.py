"""A light trial's stand-ins for Ray Train (elastic/worker/in_process.py): its context, its reports, its node's
drain."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from elastic.worker import in_process
from elastic.worker.in_process import DrainNotices


def test_while_a_run_trains_in_process_the_session_sees_rank_0_of_1_and_its_run_folder():
    assert not in_process.in_process()
    with in_process.running_in_process("/tmp/runs/sw-1", "sw-1", lambda m, p: None) as context:
        assert in_process.in_process() and in_process.train_context() is context
        assert (context.get_world_rank(), context.get_world_size(), context.get_local_rank()) == (0, 1, 0)
        storage = context.get_storage()
        assert storage.experiment_dir_name == "sw-1"
        assert storage.build_checkpoint_path_from_name("step-000000010") == "/tmp/runs/sw-1/step-000000010"
        with pytest.raises(RuntimeError, match="already trains"):  # one per process
            with in_process.running_in_process("/tmp/runs/sw-2", "sw-2", lambda m, p: None):
                pass
    assert not in_process.in_process()


def test_reports_go_to_the_forward_while_in_process_and_to_ray_train_otherwise():
    seen = []
    with in_process.running_in_process("/tmp/runs/sw-1", "sw-1", lambda m, p: seen.append((m, p))):
        assert in_process.report_in_process({"loss": 1.0}, SimpleNamespace(path="elastic/runs/sw-1/step-000000010"))
        assert in_process.report_in_process({"loss": 0.5})
    assert not in_process.report_in_process({"loss": 0.1})  # outside: the caller reports to Ray Train
    assert seen == [({"loss": 1.0}, "elastic/runs/sw-1/step-000000010"), ({"loss": 0.5}, None)]


def test_the_nodes_drain_is_read_at_most_once_a_second_and_kept():
    now, reads, draining = [0.0], [], {}
    notices = DrainNotices("n1", every=1.0, read=lambda: reads.append(now[0]) or draining, clock=lambda: now[0])
    assert notices() is None and reads == [0.0]
    now[0] = 0.5
    assert notices() is None and reads == [0.0]  # not asked again within the second
    draining.update({"n2": 5_000, "n1": 123_456})
    now[0] = 1.2
    notice = notices()
    assert notice.deadline == 123.456 and notice.node_ids == ("n1",)
    draining.clear()
    now[0] = 9.0
    assert notices() is notice and len(reads) == 2  # a drain is not taken back


def test_a_failed_read_is_no_notice():
    def failing():
        raise ConnectionError("GCS")

    assert DrainNotices("n1", read=failing)() is None
