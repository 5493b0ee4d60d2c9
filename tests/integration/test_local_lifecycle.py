"""`elastic local down` stops exactly what `up` started: nothing of the stack survives, nothing else dies. The
stack here runs with `--s3-faults`: its S3 endpoint is the fault proxy, which `down` stops with the rest. And
whole-cluster loss: a run cut by `down` (no notice) resumes after `up` from its last committed checkpoint, which
the on-disk bucket kept, and ends bit-identical to an uninterrupted run; a Ray Train function (api ray-train)
resubmitted after the loss gets its last reported checkpoint back from `ray.train.get_checkpoint()`. The second
`up` is the README's flow in one shell: it meets the first stack's exports, names them and ignores them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import boto3
import botocore.config
import psutil
import pytest
from botocore.exceptions import ClientError
from conftest import Cli
from run_helpers import Submission, assert_same_weights, final_tensors

from elastic.local.processes import MARKER_VARIABLE
from elastic.local.s3_faults import FaultControl

pytestmark = pytest.mark.integration

RESUMED_LINE = re.compile(r"resumed from checkpoint at step (\d+) ")
# digits_ddp at a fixed 2 workers, on whatever nodes are free (the stack has one spot and one on-demand),
# 230 steps with a checkpoint every 10: the cut (seconds after step 20, while `down` stops the stack) lands
# well before the end.
LOSS_JOB = ("--set", "workers.market=any", "--set", "config.epochs=10", "--set", "checkpoint.every_steps=10")
LOSS_STEPS = 230
RAYTRAIN_JOB = ("--set", "workers.market=any")  # jobs/raytrain_mnist.yaml: 2 workers, a report every 5 batches


def stack_pids(marker: str) -> list[int]:
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARKER_VARIABLE) == marker:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def test_down_stops_everything_it_started_and_nothing_else(tmp_path, cli_factory):
    cli = cli_factory(tmp_path / "home")
    # Outlives the test however loaded the machine (it is killed at the end): an exit of its own is not a kill.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    cut: Submission | None = None
    try:
        stack = json.loads(
            cli.run(
                "local", "up", "--spot", "1", "--on-demand", "1", "--s3-faults", "--json", check=True, timeout=300
            ).stdout
        )
        assert stack["auth"] == "token" and stack["s3_server"] == "seaweedfs"  # the defaults
        state = json.loads((tmp_path / "home" / "local" / "state.json").read_text())
        marker = state["marker"]
        pids = stack_pids(marker)
        roles = {r["role"] for r in state["roots"]}
        # a spot node comes with its metadata endpoint and preemption watcher, as on a cloud
        assert roles == {"s3", "s3-faults", "head", "on-demand-0", "spot-0", "metadata-spot-0", "watcher-spot-0"}
        # Every client of the stack talks to the proxy; the bucket was made straight on the server behind it.
        info = stack
        assert info["env"]["AWS_ENDPOINT_URL"] == info["s3_endpoint"] != info["s3_upstream"]
        client = boto3.client(
            "s3",
            endpoint_url=info["s3_endpoint"],
            region_name="us-east-1",
            aws_access_key_id=info["env"]["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=info["env"]["AWS_SECRET_ACCESS_KEY"],
            config=botocore.config.Config(retries={"total_max_attempts": 1}),
        )
        FaultControl(info["s3_endpoint"]).open_window("503", requests=1)
        with pytest.raises(ClientError, match="SlowDown"):
            client.list_objects_v2(Bucket=info["bucket"])
        assert client.list_objects_v2(Bucket=info["bucket"])["KeyCount"] == 0
        spot = [n for n in state["nodes"] if n["name"] == "spot-0"][0]
        assert spot["metadata_url"].startswith("http://127.0.0.1:")
        assert len(pids) >= 8  # ray start x3, gcs, raylets, dashboard, agents, the S3 server...

        status = json.loads(cli.run("local", "status", "--json", check=True).stdout)
        assert status["running"] and all(status["processes"].values())

        # A Ray Train function (api ray-train) reports a checkpoint at its first epoch's end (5 reports) and ends.
        cli.run("submit", "jobs/raytrain_mnist.yaml", *RAYTRAIN_JOB, "--set", "config.epochs=1", "--follow", check=True)

        # Whole-cluster loss, part 1: a run is partway (two checkpoints committed) when the stack goes down.
        # Paced (0.1 s after each step, which changes no numbers): the cut lands mid-run however late the log
        # line reaches this test on a loaded machine (unpaced, the 230 steps were once all done before `down`).
        cut = Submission(
            cli, "--suffix", "loss", *LOSS_JOB, "--set", "runtime_env.env_vars.ELASTIC_CHAOS_STEP_SECONDS=0.1"
        )
        cut.wait_for("checkpoint at step 20 committed")
        down = cli.run("local", "down", check=True, timeout=120)
        assert "local stack stopped" in down.stdout
        assert stack_pids(marker) == []
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)
        assert bystander.poll() is None, "down killed a process it did not start"
        assert not (tmp_path / "home" / "local" / "state.json").exists()

        again = cli.run("local", "down", check=True)
        assert "no local stack running" in again.stdout
        assert json.loads(cli.run("local", "status", "--json", check=True).stdout) == {"running": False}
        cut.proc.kill()  # its `submit --follow` client lost the job API with the stack
        cut.proc.wait(timeout=30)

        # Part 2: up again (the bucket's objects are on disk), submit the same job: it resumes. As in the README's
        # flow, the shell still exports the first stack's variables (`eval "$(elastic local env)"` before the
        # `down`): the new `up` names them, ignores them and starts every node.
        stale_shell = Cli({**cli.env, **info["env"]})
        again_up = stale_shell.run("local", "up", "--spot", "1", "--on-demand", "1", "--json", check=True, timeout=300)
        assert "variables of a local stack that is gone" in again_up.stderr, again_up.stderr[-2000:]
        stack = json.loads(again_up.stdout)
        assert sorted(n["name"] for n in stack["nodes"]) == ["head", "on-demand-0", "spot-0"], stack["nodes"]
        last = final_tensors(stack, "digits-ddp-loss")["step"]  # the last checkpoint committed before the loss
        assert 20 <= last < LOSS_STEPS
        # The Ray Train function, resubmitted with a second epoch, gets its checkpoint back from the bucket.
        raytrain = cli.run(
            "submit", "jobs/raytrain_mnist.yaml", *RAYTRAIN_JOB, "--set", "config.epochs=2", "--follow", check=True
        ).stdout
        assert "ray.train.get_checkpoint() returns the checkpoint of step 5" in raytrain, raytrain[-4000:]
        listed = json.loads(cli.run("checkpoints", "ls", "raytrain-mnist", "--json", check=True).stdout)
        assert [c["step"] for c in listed if c["committed"]] == [5, 10], listed
        resumed = Submission(cli, "--suffix", "loss", *LOSS_JOB).finish()
        assert [int(m) for m in RESUMED_LINE.findall(resumed)][:1] == [last], resumed[-4000:]
        # The uninterrupted run goes through the new stack's exports, as the README's shell does after its eval.
        Submission(Cli({**cli.env, **stack["env"]}), "--suffix", "base", *LOSS_JOB).finish()
        interrupted, baseline = final_tensors(stack, "digits-ddp-loss"), final_tensors(stack, "digits-ddp-base")
        assert baseline["step"] == LOSS_STEPS
        assert_same_weights(interrupted, baseline)
    finally:
        bystander.kill()
        if cut is not None and cut.proc.poll() is None:
            cut.proc.kill()
        cli.run("local", "down", timeout=120)
