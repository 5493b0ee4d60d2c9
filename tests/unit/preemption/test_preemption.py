"""Unit tests for the preemption watcher (elastic/preemption/) against our own metadata servers over real
HTTP on 127.0.0.1 (elastic/local/metadata_server.py). The clock and sleep are fakes: a poll interval of 5 s costs
nothing; only the drainer is a recording stand-in for Ray (the real one is exercised in
tests/integration/test_watch_preemption.py)."""

from __future__ import annotations

import email.utils
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from click.testing import CliRunner

from elastic.cli import cli, main
from elastic.errors import ClusterError, DrainError, MetadataUnavailable
from elastic.local.metadata_server import MetadataServer, post_admin
from elastic.preemption.drain import DrainOutcome, NodeView, pick_local_node
from elastic.preemption.notices import AwsSource, AzureSource, GcpSource, detect_provider
from elastic.preemption.watcher import WatchConfig, Watcher, backoff_delay, drain_deadline, drain_now, watch

NODE = "ab" * 28
ACTION = AwsSource.ACTION


class RecordingDrainer:
    """Records every drain request; answers from `answers` (True = accepted) in order, then accepts."""

    def __init__(self, *answers: bool, alive_polls: int | None = None):
        self.answers = list(answers)
        self.calls: list[tuple[float, str]] = []
        self.alive_polls = alive_polls  # is_alive() answers True this many times, then False (None: always)

    def drain(self, deadline_s: float, message: str) -> DrainOutcome:
        self.calls.append((deadline_s, message))
        accepted = self.answers.pop(0) if self.answers else True
        return DrainOutcome(accepted, NODE, "" if accepted else "node is already dead")

    def is_alive(self) -> bool:
        if self.alive_polls is None:
            return True
        self.alive_polls -= 1
        return self.alive_polls >= 0


class FakeClock:
    def __init__(self):
        self.now = time.time()  # the servers stamp notices with real time; the fake starts there
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock():
    return FakeClock()


def serve(provider: str, **kwargs) -> MetadataServer:
    return MetadataServer(provider, **kwargs).start()


@pytest.fixture
def aws():
    with serve("aws") as server:
        yield server


@pytest.fixture
def gcp():
    with serve("gcp") as server:
        yield server


@pytest.fixture
def azure():
    with serve("azure", vm_name="spot-vm-7") as server:
        yield server


def watcher(source, drainer, clock, lines=None, **config) -> Watcher:
    config = WatchConfig(**{"poll_seconds": 5.0, "margin_seconds": 5.0, **config})
    lines = lines if lines is not None else []
    return Watcher(source, drainer, config, clock=clock, sleep=clock.sleep, emit=lines.append, rand=lambda: 0.0)


def matching(lines: list[str], text: str) -> list[str]:
    return [line for line in lines if text in line]


# ---------------------------------------------------------------------------------------------------------
# pure policies


def test_drain_deadline_is_the_cloud_deadline_less_the_margin_never_in_the_past():
    assert drain_deadline(1000.0, now=900.0, margin_s=5.0) == 995.0
    assert drain_deadline(1000.0, now=998.0, margin_s=5.0) == 998.0  # would be in the past: now
    assert drain_deadline(1000.0, now=900.0, margin_s=-3.0) == 1000.0  # a negative margin counts as 0


def test_backoff_doubles_from_the_poll_interval_up_to_the_cap_and_jitter_only_stretches_it():
    assert [backoff_delay(n, 5.0, 30.0, 0.2, 0.0) for n in (1, 2, 3, 4, 5)] == [5.0, 10.0, 20.0, 30.0, 30.0]
    assert backoff_delay(2, 5.0, 30.0, 0.2, 1.0) == pytest.approx(12.0)
    assert backoff_delay(1, 5.0, 2.0, 0.2, 0.0) == 5.0  # a cap below the poll interval never polls faster


# ---------------------------------------------------------------------------------------------------------
# AWS


def test_aws_404_means_no_notice_and_polls_every_interval(aws, clock):
    drainer, lines = RecordingDrainer(), []
    w = watcher(AwsSource(aws.url, timeout_s=0.5, clock=clock), drainer, clock, lines)
    w.run(max_polls=3)
    assert drainer.calls == [] and lines == []
    assert clock.sleeps == [5.0, 5.0]
    assert aws.requests[f"GET {ACTION}"] == 3 and aws.requests["PUT /latest/api/token"] == 1


def test_aws_reclaim_drains_once_with_the_deadline_less_the_margin(aws, clock):
    aws.announce_reclaim(120)
    drainer, lines = RecordingDrainer(), []
    w = watcher(AwsSource(aws.url, timeout_s=0.5, clock=clock), drainer, clock, lines, margin_seconds=7)
    w.run(max_polls=4)
    assert len(drainer.calls) == 1
    deadline, message = drainer.calls[0]
    assert deadline == int(aws.reclaim_at) - 7  # the notice's time has whole seconds
    assert "terminate" in message
    assert len(matching(lines, "reclaim notice (aws)")) == 1 and len(matching(lines, "drain accepted")) == 1
    assert aws.requests[f"GET {ACTION}"] == 4  # it keeps polling after the drain


def test_aws_a_later_reclaim_is_a_new_one_and_drains_again(aws, clock):
    drainer = RecordingDrainer()
    w = watcher(AwsSource(aws.url, timeout_s=0.5, clock=clock), drainer, clock)
    aws.announce_reclaim(120)
    first = aws.reclaim_at
    w.run(max_polls=2)
    aws.clear()
    aws.announce_reclaim(300)
    w.run(max_polls=2)
    assert [d for d, _ in drainer.calls] == [int(first) - 5, int(aws.reclaim_at) - 5]


def test_aws_rejected_drain_is_logged_with_rays_reason_and_retried_next_poll(aws, clock):
    aws.announce_reclaim(120)
    drainer, lines = RecordingDrainer(False), []
    watcher(AwsSource(aws.url, timeout_s=0.5, clock=clock), drainer, clock, lines).run(max_polls=4)
    assert len(drainer.calls) == 2  # rejected, retried once, accepted, never again
    assert matching(lines, "drain rejected")[0].endswith("node is already dead; retrying on the next poll")


def test_aws_token_is_refreshed_before_it_expires(aws, clock):
    source = AwsSource(aws.url, timeout_s=0.5, token_ttl_s=10, clock=clock)
    source.poll()
    clock.now += 5
    source.poll()
    assert aws.requests["PUT /latest/api/token"] == 1
    clock.now += 4  # 9 s: past 80% of the TTL
    source.poll()
    assert aws.requests["PUT /latest/api/token"] == 2
    assert aws.requests[f"GET {ACTION}"] == 3  # no request was refused on the way (a 401 would add one)


def test_aws_token_expired_early_401_fetches_a_new_one_and_retries(aws, clock):
    aws.token_ttl(0.05)  # the service honours less than asked (or restarted): the client learns by a 401
    aws.announce_reclaim(120)
    source = AwsSource(aws.url, timeout_s=0.5, clock=clock)
    source.poll()
    time.sleep(0.1)
    aws.token_ttl(None)
    poll = source.poll()
    assert [n.kind for n in poll.notices] == ["reclaim"]
    assert aws.requests["PUT /latest/api/token"] == 2
    assert aws.requests[f"GET {ACTION}"] == 3  # 1 + (401, retried)


def test_aws_rebalance_is_logged_and_kept_but_never_drains(aws, clock):
    aws.announce_rebalance()
    drainer, lines = RecordingDrainer(), []
    w = watcher(AwsSource(aws.url, timeout_s=0.5, clock=clock), drainer, clock, lines)
    w.run(max_polls=3)
    assert drainer.calls == []
    assert len(matching(lines, "rebalance recommendation")) == 1
    assert w.state.rebalance is not None and "noticeTime" in w.state.rebalance.detail
    aws.announce_reclaim(120)
    w.run(max_polls=1)
    assert len(drainer.calls) == 1


def test_malformed_json_is_logged_once_per_body_and_treated_as_no_notice(aws, clock):
    drainer, lines = RecordingDrainer(), []
    w = watcher(AwsSource(aws.url, timeout_s=0.5, clock=clock), drainer, clock, lines)
    aws.serve_malformed('{"action": "terminate", "time": ')
    w.run(max_polls=3)
    aws.serve_malformed('{"action": "terminate"}')  # valid JSON, no time: malformed too
    w.run(max_polls=2)
    assert drainer.calls == [] and len(matching(lines, "malformed document")) == 2
    assert clock.sleeps == [5.0] * 3  # no backoff: the service answered
    aws.serve_malformed(None)
    aws.announce_reclaim(60)
    w.run(max_polls=1)
    assert len(drainer.calls) == 1


def test_a_hung_metadata_service_times_out_and_backs_off(aws, clock):
    aws.delay(0.6)
    lines = []
    w = watcher(AwsSource(aws.url, timeout_s=0.15, clock=clock), RecordingDrainer(), clock, lines)
    started = time.monotonic()
    assert w.run(max_polls=2) is False
    assert time.monotonic() - started < 0.6
    assert clock.sleeps == [5.0] and w.state.failures == 2
    assert len(matching(lines, "backing off")) == 2 and "timed out" in lines[0]
    aws.delay(0)
    assert w.run(max_polls=1) is True
    assert matching(lines, "answering again after 2 failed poll(s)")


def test_5xx_backs_off_exponentially_and_never_hammers(aws, clock):
    aws.fail_next(5, 503, path=ACTION)
    aws.announce_reclaim(600)
    drainer, lines = RecordingDrainer(), []
    w = watcher(AwsSource(aws.url, timeout_s=0.5, clock=clock), drainer, clock, lines, backoff_cap_seconds=30)
    w.run(max_polls=7)
    assert clock.sleeps == [5.0, 10.0, 20.0, 30.0, 30.0, 5.0]
    assert aws.requests[f"GET {ACTION}"] == 7  # one request per poll: no tight retry loop inside a poll
    assert len(matching(lines, "HTTP 503")) == 5
    assert len(drainer.calls) == 1  # the notice, once the service recovered


def test_a_pending_drain_is_retried_while_the_metadata_service_is_down(aws, clock):
    aws.announce_reclaim(120)
    drainer = RecordingDrainer(False)
    w = watcher(AwsSource(aws.url, timeout_s=0.5, clock=clock), drainer, clock)
    w.run(max_polls=1)
    aws.fail_next(3, 500)
    w.run(max_polls=1)
    assert len(drainer.calls) == 2 and w.state.pending == {}


# ---------------------------------------------------------------------------------------------------------
# GCP


def test_gcp_no_notice_then_wait_for_change_returns_as_soon_as_preempted(gcp, clock):
    drainer = RecordingDrainer()
    w = watcher(GcpSource(gcp.url, timeout_s=0.5, wait_s=1, clock=clock), drainer, clock, poll_seconds=1)
    w.run(max_polls=1)  # a plain read: FALSE, and the ETag to wait on
    assert drainer.calls == []
    threading.Timer(0.2, gcp.announce_reclaim).start()
    started = time.monotonic()
    w.run(max_polls=1)  # the long poll: back on the change, not after its 1 s timeout
    assert time.monotonic() - started < 0.8
    assert len(drainer.calls) == 1
    assert drainer.calls[0][0] == pytest.approx(clock.now + 30 - 5)  # seen now; GCP gives 30 s
    assert gcp.requests["GET /computeMetadata/v1/instance/preempted"] == 2


def test_gcp_stale_etag_returns_at_once_and_preemption_drains_once(gcp, clock):
    drainer = RecordingDrainer()
    w = watcher(GcpSource(gcp.url, timeout_s=0.5, wait_s=1, clock=clock), drainer, clock, poll_seconds=1)
    w.run(max_polls=1)
    gcp.announce_reclaim()  # changes before the long poll starts: last_etag is stale, no waiting
    started = time.monotonic()
    w.run(max_polls=1)
    assert time.monotonic() - started < 0.5
    assert len(drainer.calls) == 1


def test_gcp_terminate_maintenance_drains_and_migration_is_only_logged(gcp, clock):
    drainer, lines = RecordingDrainer(), []
    w = watcher(GcpSource(gcp.url, timeout_s=0.5, wait_s=0, clock=clock), drainer, clock, lines)
    gcp.announce_maintenance("MIGRATE_ON_HOST_MAINTENANCE")
    w.run(max_polls=2)
    assert drainer.calls == [] and len(matching(lines, "MIGRATE_ON_HOST_MAINTENANCE")) == 1
    gcp.announce_maintenance("TERMINATE_ON_HOST_MAINTENANCE")
    w.run(max_polls=2)
    assert len(drainer.calls) == 1


def test_gcp_malformed_value_is_no_notice(gcp, clock):
    gcp.serve_malformed("MAYBE")
    drainer, lines = RecordingDrainer(), []
    watcher(GcpSource(gcp.url, timeout_s=0.5, wait_s=0, clock=clock), drainer, clock, lines).run(max_polls=2)
    assert drainer.calls == [] and len(matching(lines, "malformed document")) == 1


# ---------------------------------------------------------------------------------------------------------
# Azure


def test_azure_preempt_drains_then_acknowledges_once_the_drain_deadline_passed(azure, clock):
    azure.announce_reclaim(20)
    drainer, lines = RecordingDrainer(), []
    source = AzureSource(azure.url, timeout_s=0.5, clock=clock)
    w = watcher(source, drainer, clock, lines)
    w.run(max_polls=1)
    assert source.vm_name == "spot-vm-7"
    not_before = email.utils.parsedate_to_datetime(azure.events[0]["NotBefore"]).timestamp()
    assert [d for d, _ in drainer.calls] == [not_before - 5]
    assert azure.acks == [] and azure.requests["POST /metadata/scheduledevents"] == 0  # not before the drain is due
    w.run(max_polls=4)  # 20 s later: past the drain deadline
    assert azure.acks == [azure.events[0]["EventId"]]
    assert azure.requests["POST /metadata/scheduledevents"] == 1
    w.run(max_polls=2)  # the ack changed the document (new incarnation, event Started): read, nothing repeated
    assert source.incarnation == azure.incarnation and azure.events[0]["EventStatus"] == "Started"
    assert len(drainer.calls) == 1 and len(azure.acks) == 1
    assert len(matching(lines, "acknowledged scheduled event")) == 1


def test_azure_other_vms_and_other_event_types_do_not_drain(azure, clock):
    azure.announce_event(
        {
            "EventId": "A-1",
            "EventType": "Preempt",
            "Resources": ["other-vm"],
            "EventStatus": "Scheduled",
            "NotBefore": email.utils.formatdate(time.time() + 30, usegmt=True),
        }
    )
    azure.announce_event(
        {
            "EventId": "B-2",
            "EventType": "Reboot",
            "Resources": ["spot-vm-7"],
            "EventStatus": "Scheduled",
            "NotBefore": "",
        }
    )
    drainer, lines = RecordingDrainer(), []
    watcher(AzureSource(azure.url, timeout_s=0.5, clock=clock), drainer, clock, lines).run(max_polls=3)
    assert drainer.calls == [] and azure.acks == []
    assert len(matching(lines, "Reboot B-2")) == 1 and not matching(lines, "A-1")


def test_azure_ack_is_not_sent_when_the_drain_was_rejected(azure, clock):
    azure.announce_reclaim(10)
    drainer = RecordingDrainer(False, False, False, False)
    watcher(AzureSource(azure.url, timeout_s=0.5, clock=clock), drainer, clock).run(max_polls=4)
    assert len(drainer.calls) == 4 and azure.acks == []


def test_azure_malformed_document_is_no_notice(azure, clock):
    azure.serve_malformed('{"DocumentIncarnation": 3, "Events": [')
    drainer, lines = RecordingDrainer(), []
    watcher(AzureSource(azure.url, timeout_s=0.5, clock=clock), drainer, clock, lines).run(max_polls=2)
    assert drainer.calls == [] and len(matching(lines, "malformed document")) == 1


# ---------------------------------------------------------------------------------------------------------
# detection, the daemon entry point and the CLI


@pytest.mark.parametrize("provider", ["aws", "gcp", "azure"])
def test_auto_detects_each_provider(provider):
    with serve(provider) as server:
        assert detect_provider(server.url, timeout_s=0.5) == provider


def closed_port_url() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def test_off_cloud_auto_prints_one_line_and_exits_0():
    result = CliRunner().invoke(cli, ["watch-preemption", "--metadata-url", closed_port_url()])
    assert result.exit_code == 0, result.output
    assert len(result.output.strip().splitlines()) == 1 and "nothing to watch" in result.output


def test_watch_once_drains_and_reports_an_unreachable_service(aws):
    aws.announce_reclaim(120)
    drainer, lines = RecordingDrainer(), []
    assert watch("auto", aws.url, drainer=drainer, once=True, emit=lines.append) == 0
    assert len(drainer.calls) == 1 and matching(lines, "detected the aws metadata service")
    assert watch("aws", closed_port_url(), drainer=RecordingDrainer(), once=True, emit=lines.append) == 1
    assert watch("aws", aws.url, drainer=RecordingDrainer(False), once=True, emit=lines.append) == 1  # rejected


@pytest.mark.parametrize(
    "args, message",
    [
        (["--margin-seconds", "-1"], "--margin-seconds must be >= 0"),
        (["--poll-seconds", "0"], "--poll-seconds must be > 0"),
        (["--node-id", "xyz"], "--node-id must be a Ray node id"),
        (["--metadata-url", "169.254.169.254"], "--metadata-url must be an http:// URL"),
    ],
)
def test_bad_flags_exit_2_with_one_line(args, message, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["elastic", "watch-preemption", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


# ---------------------------------------------------------------------------------------------------------
# which Ray node is "this node"


def test_local_node_is_the_one_local_raylet_else_the_one_node_at_this_ip():
    a, b, c = "a" * 56, "b" * 56, "c" * 56
    nodes = [NodeView(a, "10.0.0.1", True), NodeView(b, "10.0.0.2", True), NodeView(c, "10.0.0.2", False)]
    assert pick_local_node(nodes, [b], "10.0.0.9") == b
    assert pick_local_node(nodes, [], "10.0.0.2") == b  # the dead node at that IP does not count
    with pytest.raises(ClusterError, match="pass --node-id"):
        pick_local_node(nodes + [NodeView(c, "10.0.0.2", True)], [], "10.0.0.2")
    with pytest.raises(DrainError, match="no alive Ray node"):
        pick_local_node(nodes, [c], "10.9.9.9")


# ---------------------------------------------------------------------------------------------------------
# the metadata servers themselves


def get(url: str, headers: dict | None = None, method: str = "GET") -> int:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}, method=method), timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def test_servers_enforce_their_protocols(aws, gcp, azure):
    assert get(aws.url + ACTION) == 401  # IMDSv2: no token, no answer
    assert get(aws.url + ACTION, {"X-aws-ec2-metadata-token": "forged"}) == 401
    assert get(aws.url + "/latest/api/token", {"X-aws-ec2-metadata-token-ttl-seconds": "0"}, "PUT") == 400
    assert get(gcp.url + GcpSource.PREEMPTED) == 403
    assert get(gcp.url + GcpSource.PREEMPTED, GcpSource.HEADERS) == 200
    assert get(azure.url + "/metadata/scheduledevents?api-version=2020-07-01") == 400
    assert get(azure.url + "/metadata/scheduledevents", AzureSource.HEADERS) == 400  # no api-version


def test_admin_endpoints_announce_and_clear_and_are_not_counted(aws, clock):
    source = AwsSource(aws.url, timeout_s=0.5, clock=clock)
    assert post_admin(aws.url, "reclaim", notice=20)["reclaim_at"] == pytest.approx(time.time() + 20, abs=2)
    assert [n.kind for n in source.poll().notices] == ["reclaim"]
    post_admin(aws.url, "clear")
    assert source.poll().notices == ()
    assert not any(path.startswith(("GET /_elastic", "POST /_elastic")) for path in aws.requests)


def test_standalone_server_writes_its_port_and_takes_admin_requests(tmp_path: Path, clock):
    port_file = tmp_path / "port"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "elastic.local.metadata_server",
            "--provider",
            "azure",
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--vm-name",
            "local-spot-0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while not port_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port_file.read_text()}"
        post_admin(url, "reclaim", notice=30)
        notices = AzureSource(url, timeout_s=1, clock=clock).poll().notices
        assert [n.kind for n in notices] == ["reclaim"] and notices[0].event_id
        state = json.loads(urllib.request.urlopen(url + "/_elastic/state", timeout=2).read())
        assert state["provider"] == "azure" and state["requests"]["GET /metadata/scheduledevents"] == 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_source_raises_unavailable_on_5xx_not_a_notice(aws, clock):
    aws.fail_next(1, 500, path="/latest/api/token")
    with pytest.raises(MetadataUnavailable, match="HTTP 500"):
        AwsSource(aws.url, timeout_s=0.5, clock=clock).poll()


# ---------------------------------------------------------------------------------------------------------
# --drain-now: a preStop hook or a shutdown unit


def test_drain_now_drains_and_holds_until_the_deadline(clock):
    drainer, lines = RecordingDrainer(), []
    start = clock.now
    status = drain_now(drainer, 13, 2, clock=clock, sleep=clock.sleep, emit=lines.append)
    assert status == 0
    [(deadline, message)] = drainer.calls
    assert deadline == pytest.approx(start + 11)
    assert "node shutting down" in message
    assert clock.now == pytest.approx(start + 11)  # held the shutdown exactly to the deadline
    assert lines[-1].startswith("drain deadline reached")


def test_drain_now_releases_at_once_when_ray_ends_the_node(clock):
    drainer, lines = RecordingDrainer(alive_polls=2), []
    start = clock.now
    assert drain_now(drainer, 30, 2, clock=clock, sleep=clock.sleep, emit=lines.append) == 0
    assert clock.now == pytest.approx(start + 2)  # two polls while alive, released on the third
    assert "has ended" in lines[-1]


def test_drain_now_rejected_still_holds_while_the_node_is_up(clock):
    """A node the spot watcher drained a moment ago: Ray may refuse a second drain, the run still needs it up."""
    lines = []
    start = clock.now
    assert drain_now(RecordingDrainer(False), 13, 2, clock=clock, sleep=clock.sleep, emit=lines.append) == 1
    assert "rejected" in lines[0] and clock.now == pytest.approx(start + 11)


def test_drain_now_without_a_ray_node_does_not_hold(clock):
    lines = []

    class Unreachable(RecordingDrainer):
        def drain(self, deadline_s, message):
            raise DrainError("no alive Ray node runs on this host")

    assert drain_now(Unreachable(), 13, 2, clock=clock, sleep=clock.sleep, emit=lines.append) == 1
    assert clock.sleeps == [] and lines[-1].endswith("not holding the shutdown")


def test_drain_now_must_leave_room_for_the_margin():
    result = CliRunner().invoke(cli, ["watch-preemption", "--drain-now", "2"])
    assert result.exit_code != 0
    assert "--drain-now must be more than --margin-seconds (2), got 2" in str(result.exception or result.output)
