"""spot-first on a real local stack whose spot capacity is withheld, then returned:

1. a spot-first job with no spot nodes waits `spot_wait_seconds`, says why it falls back, and trains on the
   on-demand nodes;
2. a spot node is added (`elastic local add-node --market spot`); the driver sees the capacity, the on-demand
   placement ends at its next checkpoint, and the run resumes from that checkpoint on spot and finishes, with no
   failure budget spent;
3. nothing was lost: the final model and optimizer are bit-identical to an uninterrupted run's (a spot-first
   job submitted now that spot is there, which goes straight to spot);
4. job drivers ran on the on-demand head;
5. every spot node of a running spot-first job is reclaimed: the run treats it like its first placement (waits
   `spot_wait_seconds` for spot, falls back to on-demand, swaps back to spot at a checkpoint once spot returns),
   says why at each step, and still ends bit-identical to the uninterrupted run.
"""

from __future__ import annotations

import json
import re
import time

import pytest

pytestmark = pytest.mark.integration

WORKER_LINE = re.compile(r"worker rank (\d+)/(\d+) on node ([0-9a-f]+) market=(\S+)")
EPOCHS = 6
FINAL_STEP = EPOCHS * 23  # 1,437 training samples, 2 workers x batches of 32: 23 steps per epoch
COMMON = [
    "--set",
    "workers.market=spot-first",
    "--set",
    f"config.epochs={EPOCHS}",
    "--set",
    "checkpoint.every_steps=20",
    "--set",
    "runtime_env.env_vars.ELASTIC_PLACEMENT_POLL_SECONDS='1'",
]
# Steps sleep while on on-demand, and from step 40 on an on-demand placement waits for a live spot node
# (tests/integration/jobs/slow_on_demand.py), so spot returns mid-run however slow the machine or the node's
# start; the numbers trained are the digits job's own.
SLOW = [
    "--set",
    "entrypoint=tests/integration/jobs/slow_on_demand.py:train",
    "--set",
    "config.on_demand_step_delay=0.4",
    "--set",
    "config.on_demand_hold_from_step=40",
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory, cli_factory):
    """A stack whose spot capacity is withheld: the on-demand head and two on-demand workers, no spot node."""
    cli = cli_factory(tmp_path_factory.mktemp("elastic-home-spot-first"))
    try:
        up = cli.run("local", "up", "--spot", "0", "--on-demand", "2", "--json", check=True, timeout=300)
        info = json.loads(up.stdout)
        info["cli"] = cli
        yield info
    finally:
        cli.run("local", "down", timeout=120)


def jobs_client(stack, monkeypatch):
    from ray.job_submission import JobSubmissionClient

    for key, value in stack["env"].items():
        if key.startswith("RAY_AUTH"):  # the stack's auth mode and token
            monkeypatch.setenv(key, value)
    return JobSubmissionClient(stack["dashboard_url"])


def wait_for_log(jobs, job_id: str, text: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    logs = ""
    while time.monotonic() < deadline:
        logs = jobs.get_job_logs(job_id)
        if text in logs:
            return logs
        time.sleep(1)
    raise AssertionError(f"no {text!r} in the logs of {job_id} within {timeout:.0f} s:\n" + elastic_lines(logs))


def wait_for_end(jobs, job_id: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = str(jobs.get_job_status(job_id).value)
        if status in ("SUCCEEDED", "FAILED", "STOPPED"):
            return status
        time.sleep(1)
    raise AssertionError(f"job {job_id} did not end within {timeout:.0f} s")


def wait_for_idle_workers(stack, timeout: float = 120) -> None:
    """Until no Ray Train worker of an earlier job is alive: a job's end (`--follow` returning) comes a little
    before its worker actors release their CPUs, and the next test's spot-first choice counts free CPUs."""
    from ray.util.state import list_actors, list_placement_groups

    address = stack["dashboard_url"]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = list_actors(address=address, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
        groups = list_placement_groups(address=address, raise_on_missing_output=False)
        workers = [a for a in alive if "RayTrainWorker" in (a.class_name or "")]
        if not workers and all(g.state == "REMOVED" for g in groups):
            return
        time.sleep(1)
    raise AssertionError(f"Ray Train workers of an earlier job still alive after {timeout:.0f} s")


def elastic_lines(logs: str) -> str:
    return "\n".join(line for line in logs.splitlines() if "[elastic]" in line or "FailurePolicy" in line)


def placements(logs: str) -> list[tuple[int, str, str]]:
    """(rank, node id, market) of every worker start, in order."""
    return [(int(m[1]), m[3], m[4]) for m in WORKER_LINE.finditer(logs)]


def test_spot_first_falls_back_to_on_demand_then_swaps_to_spot_at_a_checkpoint(stack, monkeypatch):
    cli, run = stack["cli"], "digits-ddp-swap"
    on_demand = {n["node_id"] for n in stack["nodes"] if n["market"] == "on-demand" and n["role"] == "worker"}
    jobs = jobs_client(stack, monkeypatch)
    submitted = cli.run(
        "submit",
        "jobs/digits_ddp.yaml",
        "--suffix",
        "swap",
        *COMMON,
        *SLOW,
        "--set",
        "workers.spot_wait_seconds=5",
        "--json",
        check=True,
    )
    job_id = json.loads(submitted.stdout)["job_id"]

    # 1. No spot node: after 5 s the driver says why and the workers train on on-demand.
    logs = wait_for_log(jobs, job_id, "checkpoint at step 20 committed", timeout=150)
    assert (
        "placement: on-demand: spot capacity was not granted within 5 s (0 of 2 spot worker slot(s) free); "
        "falling back to on-demand"
    ) in logs
    assert {(rank, market) for rank, _, market in placements(logs)} == {(0, "on-demand"), (1, "on-demand")}
    assert {node for _, node, _ in placements(logs)} <= on_demand

    # 2. Spot capacity returns: one spot node with room for both workers.
    spot = json.loads(
        cli.run("local", "add-node", "--market", "spot", "--cpus", "2", "--json", check=True, timeout=180).stdout
    )
    assert spot["market"] == "spot" and spot["role"] == "worker" and spot["name"] == "spot-0"
    assert wait_for_end(jobs, job_id, timeout=240) == "SUCCEEDED"
    logs = jobs.get_job_logs(job_id)
    trace = elastic_lines(logs)
    assert "placement: swap: spot capacity for 2 worker(s) is back" in logs, trace
    ended = re.search(r"on-demand workers ended at the checkpoint of step (\d+); resuming from it on spot", logs)
    assert ended, trace
    step = int(ended[1])
    assert step % 20 == 0 and 20 <= step < FINAL_STEP, trace
    assert f"resumed from checkpoint at step {step} " in logs, trace
    # Every worker start: both ranks on on-demand nodes, then both on the new spot node; no other restart.
    starts = placements(logs)
    assert {(r, m) for r, _, m in starts[:2]} == {(0, "on-demand"), (1, "on-demand")}, trace
    assert {n for _, n, _ in starts[:2]} <= on_demand, trace
    assert starts[2:] and {(r, n, m) for r, n, m in starts[2:]} == {
        (0, spot["node_id"], "spot"),
        (1, spot["node_id"], "spot"),
    }, trace
    assert len(starts) == 4, trace
    # The swap ended the placement cleanly: Ray Train saw a finished run, not a failure to retry.
    assert "FailurePolicy" not in logs and "RETRY" not in logs, trace

    result = summary(stack["env"], stack["bucket"], run)
    assert result["status"] == "SUCCEEDED" and result["metrics"]["step"] == FINAL_STEP
    assert [(p["market"], p.get("ended_at_step")) for p in result["placements"]] == [
        ("on-demand", step),
        ("spot", None),
    ]

    # The request and acknowledgement objects are gone from the run folder once the driver has acted on them.
    assert not [k for k in run_keys(stack, run) if "elastic-placement" in k]

    # 4. The driver ran on the on-demand head (never on a worker node, let alone a spot one).
    head = next(n["node_id"] for n in stack["nodes"] if n["role"] == "head")
    assert jobs.get_job_info(job_id).driver_node_id == head


def test_the_swapped_run_is_bit_identical_to_an_uninterrupted_one(stack, monkeypatch):
    """Spot is there now: a spot-first job goes straight to spot and runs uninterrupted. Its final state equals
    the swapped run's bit for bit: the swap lost no step and repeated none."""
    import torch

    cli, run = stack["cli"], "digits-ddp-straight"
    proc = cli.run(
        "submit",
        "jobs/digits_ddp.yaml",
        "--suffix",
        "straight",
        *COMMON,
        "--set",
        "workers.spot_wait_seconds=60",
        "--follow",
        check=True,
        timeout=300,
    )
    assert "placement: spot: spot capacity for 2 worker(s) is free (2 slot(s))" in proc.stdout
    assert "placement: wait:" not in proc.stdout  # no waiting when spot is free
    assert {m for _, _, m in placements(proc.stdout)} == {"spot"} and len(placements(proc.stdout)) == 2
    result = summary(stack["env"], stack["bucket"], run)
    assert result["metrics"]["step"] == FINAL_STEP and [p["market"] for p in result["placements"]] == ["spot"]

    from elastic.checkpoint.store import CheckpointStore

    for key, value in stack["env"].items():
        monkeypatch.setenv(key, value)
    root = f"s3://{stack['bucket']}/runs"
    straight = CheckpointStore(f"{root}/{run}").read_tensors(FINAL_STEP)
    swapped = CheckpointStore(f"{root}/digits-ddp-swap").read_tensors(FINAL_STEP)
    assert straight.keys() == swapped.keys() and any(k.startswith("optim.") for k in straight)
    assert [k for k in straight if not torch.equal(straight[k], swapped[k])] == []


@pytest.mark.extended  # the first test of this module falls back and swaps in a run of its own
def test_spot_first_after_every_spot_node_is_reclaimed_falls_back_and_swaps_back(stack, monkeypatch):
    import torch

    cli, run = stack["cli"], "digits-ddp-reclaimed"
    jobs = jobs_client(stack, monkeypatch)
    wait_for_idle_workers(stack)  # spot-0 was the straight run's: its 2 CPUs must be free for "spot at once"
    submitted = cli.run(
        "submit",
        "jobs/digits_ddp.yaml",
        "--suffix",
        "reclaimed",
        *COMMON,
        *SLOW,
        "--set",
        "config.spot_step_delay=0.2",  # the reclaim lands mid-run however fast the machine
        "--set",
        "workers.spot_wait_seconds=5",
        "--json",
        check=True,
    )
    job_id = json.loads(submitted.stdout)["job_id"]
    logs = wait_for_log(jobs, job_id, "checkpoint at step 20 committed", timeout=150)
    assert {m for _, _, m in placements(logs)} == {"spot"}, elastic_lines(logs)

    # Reclaim the only spot node (spot-0, added by the first test) with a 10 s notice.
    cli.run("preempt", "--node", "spot-0", "--notice", "10", check=True, timeout=180)
    # It chooses its market as at the start: no spot within 5 s, so on-demand, with the reason.
    logs = wait_for_log(jobs, job_id, "spot capacity was not granted within 5 s", timeout=180)
    assert "falling back to on-demand" in logs[logs.index("spot capacity was not granted within 5 s") :]
    # Spot comes back (as an autoscaler would replace the node): the run swaps back to it at a checkpoint.
    cli.run("local", "add-node", "--market", "spot", "--cpus", "2", "--json", check=True, timeout=180)
    assert wait_for_end(jobs, job_id, timeout=300) == "SUCCEEDED"
    logs = jobs.get_job_logs(job_id)
    trace = elastic_lines(logs)
    fallback = logs.index("spot capacity was not granted within 5 s")
    assert "placement: swap: spot capacity for 2 worker(s) is back" in logs[fallback:], trace
    result = summary(stack["env"], stack["bucket"], run)
    assert result["status"] == "SUCCEEDED" and result["metrics"]["step"] == FINAL_STEP, trace
    assert [p["market"] for p in result["placements"]] == ["spot", "on-demand", "spot"], result["placements"]
    assert [p.get("ended_by") for p in result["placements"][:2]] == ["preemption", "swap"], result["placements"]

    from elastic.checkpoint.store import CheckpointStore

    for key, value in stack["env"].items():
        monkeypatch.setenv(key, value)
    root = f"s3://{stack['bucket']}/runs"
    straight = CheckpointStore(f"{root}/digits-ddp-straight").read_tensors(FINAL_STEP)
    reclaimed = CheckpointStore(f"{root}/{run}").read_tensors(FINAL_STEP)
    assert straight.keys() == reclaimed.keys()
    assert [k for k in straight if not torch.equal(straight[k], reclaimed[k])] == []


def s3(env: dict):
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )


def summary(env: dict, bucket: str, run: str) -> dict:
    return json.loads(s3(env).get_object(Bucket=bucket, Key=f"runs/{run}/elastic-summary.json")["Body"].read())


def run_keys(stack, run: str) -> list[str]:
    pages = s3(stack["env"]).get_paginator("list_objects_v2").paginate(Bucket=stack["bucket"], Prefix=f"runs/{run}/")
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]
