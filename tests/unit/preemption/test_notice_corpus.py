"""Malformed metadata documents, for each notice source, served over real HTTP on 127.0.0.1 by our metadata server
(elastic/local/metadata_server.py). A bad document is logged once (not every poll), means no notice, costs no
backoff (the service did answer), and the watcher acts on the next good document as usual."""

from __future__ import annotations

import json
import time

import pytest

from elastic.local.metadata_server import MetadataServer
from elastic.preemption.drain import DrainOutcome
from elastic.preemption.notices import AwsSource, AzureSource, GcpSource
from elastic.preemption.watcher import WatchConfig, Watcher

POLL_S = 5.0

AWS_BODIES = [
    "",
    "null",
    "[]",
    "42",
    '"terminate"',
    "not json at all",
    "\x00\x01\x02",
    '{"action": "terminate", "time": ',
    '{"action": "terminate"}',
    '{"time": "2026-01-01T00:00:00Z"}',
    '{"action": "terminate", "time": "soon"}',
    '{"action": "terminate", "time": 17}',
    '{"action": "terminate", "time": null}',
    '{"action": "terminate", "time": "2026-13-45T99:00:00Z"}',
    '{"action": "terminate", "time": "9999-12-31T23:59:59-23:59"}',  # past the end of datetime in UTC
    '{"action": "terminate", "time": "' + "9" * 10_000 + '"}',
]
GCP_BODIES = ["", "MAYBE", "null", "{}", "TRUE FALSE", "\x00", "1", "TRUE\nFALSE", "x" * 10_000]
AZURE_BODIES = [
    "",
    "null",
    "[]",
    "42",
    '{"DocumentIncarnation": 3, "Events": [',
    '{"Events": []}',
    '{"DocumentIncarnation": "three", "Events": []}',
    '{"DocumentIncarnation": 3, "Events": 5}',
    '{"DocumentIncarnation": 3, "Events": "Preempt"}',
    '{"DocumentIncarnation": 3, "Events": {"EventId": "e1"}}',
    '{"DocumentIncarnation": 3, "Events": [5]}',
    '{"DocumentIncarnation": 3, "Events": [{"EventType": "Preempt"}]}',
    '{"DocumentIncarnation": 3, "Events": [{"EventId": ["e1"], "EventType": "Preempt"}]}',
    '{"DocumentIncarnation": 3, "Events": [{"EventId": "e1", "EventType": "Preempt", "Resources": 5}]}',
    '{"DocumentIncarnation": 3, "Events": [{"EventId": "e1", "EventType": "Preempt", "Resources": [5]}]}',
    '{"DocumentIncarnation": 3, "Events": [{"EventId": "e1", "EventType": 7}]}',
    '{"DocumentIncarnation": 3, "Events": [{"EventId": "e1", "EventType": "Preempt", "NotBefore": 12}]}',
]
CASES = [("aws", b) for b in AWS_BODIES] + [("gcp", b) for b in GCP_BODIES] + [("azure", b) for b in AZURE_BODIES]


class RecordingDrainer:
    def __init__(self):
        self.calls: list[tuple[float, str]] = []

    def drain(self, deadline_s: float, message: str) -> DrainOutcome:
        self.calls.append((deadline_s, message))
        return DrainOutcome(True, "ab" * 28, "")


class FakeClock:
    def __init__(self):
        self.now = time.time()  # the servers stamp notices with real time
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def source(provider: str, url: str, clock):
    if provider == "aws":
        return AwsSource(url, timeout_s=0.5, clock=clock)
    if provider == "gcp":
        return GcpSource(url, timeout_s=0.5, wait_s=0, clock=clock)  # no long poll: each poll answers at once
    return AzureSource(url, timeout_s=0.5, clock=clock)


def make_watcher(provider: str, url: str):
    clock, drainer, lines = FakeClock(), RecordingDrainer(), []
    config = WatchConfig(poll_seconds=POLL_S, margin_seconds=5.0)
    w = Watcher(source(provider, url, clock), drainer, config, clock=clock, sleep=clock.sleep, emit=lines.append)
    return w, clock, drainer, lines


def malformed_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "malformed document" in line]


@pytest.mark.parametrize("provider, body", CASES, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CASES)])
def test_a_malformed_document_is_logged_once_and_means_no_notice(provider, body):
    with MetadataServer(provider).start() as server:
        w, clock, drainer, lines = make_watcher(provider, server.url)
        server.serve_malformed(body)
        assert w.run(max_polls=4) is True  # the service answered: not an outage
        assert drainer.calls == []
        assert len(malformed_lines(lines)) == 1, lines
        assert all(len(line) < 400 for line in lines)  # a 10 kB body is shown shortened
        assert clock.sleeps == [POLL_S] * 3  # no backoff

        server.serve_malformed(None)
        server.announce_reclaim(60)
        w.run(max_polls=1)
        assert len(drainer.calls) == 1  # the next good document drains as usual


def test_azure_a_broken_event_does_not_hide_a_preempt_next_to_it():
    with MetadataServer("azure").start() as server:
        w, _, drainer, lines = make_watcher("azure", server.url)
        events = [
            {"EventId": "bad", "EventType": "Preempt", "Resources": 5},
            {"EventId": "good", "EventType": "Preempt", "Resources": [], "NotBefore": "", "EventStatus": "Scheduled"},
        ]
        server.serve_malformed(json.dumps({"DocumentIncarnation": 4, "Events": events}))
        w.run(max_polls=3)
        assert len(drainer.calls) == 1 and "good" in drainer.calls[0][1]
        assert len(malformed_lines(lines)) == 1 and "bad" in malformed_lines(lines)[0]
