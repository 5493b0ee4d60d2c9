"""Spot reclaims end to end on a real local stack (3 spot nodes, each with its metadata endpoint and watcher):
`elastic preempt` announces the reclaim, the node's watcher drains it, the run writes a just-in-time checkpoint
and ends its placement, and the driver resumes it on what remains. Equivalence, not survival: the final weights
equal an uninterrupted run's, and a shrink sees every sample exactly once."""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import pytest
from conftest import make_cli
from run_helpers import Submission, assert_same_weights, attached_checkpoint, final_tensors

pytestmark = pytest.mark.integration

EPOCHS = 60  # 1,380 steps at 2 workers
# The interrupted digits runs sleep 0.02 s after each step (the chaos hook's pace; no number changes): ~40 s on a
# quiet machine, so both reclaims land mid-run, while the sleeping leaves the CPUs to the other tests.
DIGITS_PACE = ("--set", "runtime_env.env_vars.ELASTIC_CHAOS_STEP_SECONDS=0.02")
HF_STEPS = 200  # optimizer steps of jobs/hf_gpt2.py
HF_JOB = "jobs/hf_gpt2.yaml"
RAYTRAIN_EPOCHS = 60  # 300 reports (steps) of jobs/raytrain_mnist.py
# The interrupted Trainer and Ray Train runs pause after each step (the jobs' pace_seconds; the weights are the
# same): a notice or a hard kill lands mid-run however fast this machine trains (unpaced, a quiet machine ran
# 200 Trainer steps in 9.5 s, while on a loaded one a notice took ~200 Ray Train steps to arrive).
PACE = ("--set", "config.pace_seconds=0.25")
JIT_LINE = re.compile(r"just-in-time checkpoint at step (\d+) committed")
RESUMED_LINE = re.compile(r"resumed from checkpoint at step (\d+) \(\S+, written by (\d+) workers, now (\d+)\)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    cli = make_cli(tmp_path_factory.mktemp("elastic-home"))
    info = json.loads(
        cli.run("local", "up", "--spot", "3", "--on-demand", "1", "--json", check=True, timeout=300).stdout
    )
    info["cli"] = cli
    yield info
    cli.run("local", "down", timeout=120)


def preempt(cli, *args: str) -> dict:
    proc = cli.run("preempt", *args, "--json", timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout)


def summary(stack, run: str) -> dict:
    from elastic.storage import fsspec_filesystem

    saved = dict(os.environ)
    os.environ.update(stack["env"])
    try:
        fs, path = fsspec_filesystem(f"s3://{stack['bucket']}/runs/{run}/elastic-summary.json")
        with fs.open(path, "r") as handle:
            return json.load(handle)
    finally:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def baseline(stack) -> dict:
    """The uninterrupted run (2 workers) every fixed-count recovery must end equal to."""
    stack["cli"].run(
        "submit", "jobs/digits_ddp.yaml", "--suffix", "base", "--set", f"config.epochs={EPOCHS}", "--follow", check=True
    )
    return final_tensors(stack, "digits-ddp-base")


@pytest.mark.timeout(1500)  # with the module's stack and its uninterrupted run (the fixture): two 1,380-step runs
def test_a_noticed_reclaim_loses_no_step_and_a_hard_one_goes_back_to_the_last_periodic_checkpoint(
    stack, baseline, tmp_path
):
    """One run, two reclaims: a noticed one (the node's watcher drains it; a just-in-time checkpoint ends the
    placement, the run resumes from it: 0 steps lost, Ray restarts nothing), then, after a periodic checkpoint
    of the resumed placement, one without notice (back to that checkpoint). The final model and optimizer equal
    the uninterrupted run's, tensor for tensor."""
    cli = stack["cli"]
    run = Submission(cli, "--suffix", "notice", "--set", f"config.epochs={EPOCHS}", *DIGITS_PACE)
    run.wait_for("epoch 2 step")
    reclaim = preempt(cli, "--market", "spot", "--notice", "12", "--replace-after", "0")["reclaims"][0]
    run.wait_for("resumed from checkpoint at step")
    jit = [int(s) for s in JIT_LINE.findall(run.output)]
    assert len(jit) == 1, run.output[-4000:]
    periodic = (jit[0] // 50 + 1) * 50  # every_steps: 50
    run.wait_for(f"checkpoint at step {periodic} committed")
    hard = preempt(cli, "--market", "spot", "--hard", "--replace-after", "0")["reclaims"][0]
    output = run.finish()

    assert reclaim["path"] == "metadata" and reclaim["replacement"] is not None  # via the node's watcher
    assert hard["path"] == "hard"
    assert "preemption notice for node(s) " + reclaim["node_id"][:12] in output
    assert len(JIT_LINE.findall(output)) == 1, output[-4000:]  # none at the hard kill
    resumed = [(int(a), int(b), int(c)) for a, b, c in RESUMED_LINE.findall(output)]
    assert resumed[0] == (jit[0], 2, 2), resumed  # from the just-in-time step: zero steps lost
    # Without notice, back to a periodic checkpoint of the resumed placement: fewer than an interval lost.
    assert len(resumed) == 2 and resumed[1][0] >= periodic and resumed[1][0] % 50 == 0, resumed
    # The noticed reclaim ended its placement cleanly; the hard kill is Ray Train's restart within the next.
    placements = summary(stack, "digits-ddp-notice")["placements"]
    assert [(p["workers"], p.get("ended_by"), p.get("ended_at_step")) for p in placements] == [
        (2, "preemption", jit[0]),
        (2, None, None),
    ]
    assert_same_weights(final_tensors(stack, "digits-ddp-notice"), baseline)
    assert_report_accounts_for_the_reclaims(
        cli, "digits-ddp-notice", jit[0], resumed[1][0], placements, reclaim, tmp_path
    )


def assert_report_accounts_for_the_reclaims(
    cli, run: str, jit: int, back_to: int, placements: list, reclaim: dict, tmp_path
):
    """`elastic report` from the run's ledger alone: two preemptions, the noticed one losing nothing and the
    hard one going back to `back_to`, every second of wall time given to one cause, the placements of the run
    summary, priced by the local nodes' instance type."""
    png = tmp_path / "timeline.png"
    proc = cli.run("report", run, "--json", "--png", str(png), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    # The hard kill is in the report only once Ray has declared its node dead (its health checks, ~15 s): the
    # run may end before that, and the driver reads node deaths when the run ends.
    assert report["preemptions"] in (1, 2), report["preemption_details"]
    assert 0 < report["goodput"] <= 1
    assert abs(report["productive_s"] + sum(report["badput"].values()) - report["wall_s"]) <= 0.01 * report["wall_s"]
    assert [(p["workers"], p["ended_by"], p["ended_at_step"]) for p in report["placements"]] == [
        (p["workers"], p.get("ended_by") or "finished", p.get("ended_at_step")) for p in placements
    ]
    details, *hard = report["preemption_details"]
    assert details["nodes"] == [reclaim["node_id"]]
    assert (details["just_in_time_step"], details["resumed_from_step"], details["steps_lost"]) == (jit, jit, 0)
    for death in hard:
        assert death["notice"] is None and death["resumed_from_step"] == back_to, death
        assert report["lost_steps"] == death["steps_lost"] < 50, report["preemption_details"]
    if reclaim["killed_at"] < report["started"] + report["wall_s"]:  # the node died while the run went on
        assert details["node_died"] is not None and details["node_died"] >= details["notice"]
    assert report["badput"]["checkpoint_stall"] > 0 and report["badput"]["preemption_gap"] > 0
    assert {p for placement in report["placements"] for p in placement["instance_types"]} == {"g5.xlarge"}
    assert report["node_hours"]["spot"] > 0 and report["node_hours"]["on-demand"] == 0
    assert set(report["gpu_hours"]) == {"spot", "on-demand"}  # digits_ddp asks for no GPU: both 0
    assert 0 < report["cost"]["actual"] < report["cost"]["all_on_demand"]
    assert report["unpriced_node_hours"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.extended  # make test: a shrink's exactly-once in the 2-1-2 verify-resume, a reclaim's in this module's first test
def test_two_spot_nodes_reclaimed_at_once_shrink_the_run_and_every_sample_is_seen_once(stack):
    from elastic.storage import fsspec_filesystem
    from elastic.worker.audit import check_exactly_once, read_history

    cli = stack["cli"]
    run = Submission(
        cli,
        "--suffix",
        "shrink",
        "--set",
        f"config.epochs={EPOCHS}",
        "--set",
        "workers.min=1",
        "--set",
        "runtime_env.env_vars.ELASTIC_AUDIT=1",
        *DIGITS_PACE,
    )
    run.wait_for("epoch 2 step")
    # Like nodes come back 5 s after the kill (as an autoscaler would): the run, shrunk to the one spot node
    # left, grows back to 2 at a checkpoint once they have been free for workers.regrow_after_seconds.
    report = preempt(cli, "--market", "spot", "--count", "2", "--notice", "12", "--replace-after", "5")
    output = run.finish()

    assert len(report["reclaims"]) == 2 and {r["path"] for r in report["reclaims"]} == {"metadata"}
    assert abs(report["reclaims"][0]["killed_at"] - report["reclaims"][1]["killed_at"]) < 10
    jit = [int(s) for s in JIT_LINE.findall(output)]
    assert len(jit) == 1, output[-4000:]
    assert (jit[0], 2, 1) in [(int(a), int(b), int(c)) for a, b, c in RESUMED_LINE.findall(output)]
    saved = dict(os.environ)
    os.environ.update(stack["env"])
    try:
        fs, root = fsspec_filesystem(f"s3://{stack['bucket']}/runs/digits-ddp-shrink")
        verdict = check_exactly_once(read_history(fs, root), complete_epochs=EPOCHS)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    assert verdict.ok, verdict


@pytest.mark.extended  # the first test of this module asserts the same losses on a run of its own
def test_recovery_benchmark_runs_side_by_side_and_loses_nothing_to_a_noticed_reclaim(stack):
    """`elastic bench recovery --notice 10 --json` (without the 10-minute goodput run): a noticed reclaim of our run, a hard
    kill of it, and a noticed reclaim of a bare Ray Train loop, one after the other on this stack."""
    import math

    # A 10 s notice (the default is 20): each of the three reclaims waits out its notice; 10 s leave the
    # just-in-time save (about a second here) and the watcher's drain ample room.
    proc = stack["cli"].run("bench", "recovery", "--notice", "10", "--json", timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["lost_steps_notice"] == 0, result  # the just-in-time checkpoint held the last step
    # Without notice the run goes back to its last periodic checkpoint: fewer than an interval lost.
    assert 0 <= result["lost_steps_hard"] < 2 * result["checkpoint_every_steps"], result
    assert result["recovery_s"] > 0 and result["bare_ray_recovery_s"] > 0 and result["hard_recovery_s"] > 0
    assert result["recovery_ratio"] == pytest.approx(result["recovery_s"] / result["bare_ray_recovery_s"], abs=1e-3)
    # The just-in-time commit came before the node died (by about the watcher's and the job's margins).
    assert math.isfinite(result["notice_idle_s"]) and 0 < result["notice_idle_s"] < result["notice_seconds"]
    assert result["goodput"] is None and result["goodput_gaps_s"] is None  # --minutes not given


@pytest.mark.extended  # make test: the notice's save through the Trainer below, a Ray Train function's resume in test_local_lifecycle
def test_a_ray_train_function_loses_no_step_to_a_noticed_reclaim_and_resumes_exactly_after_a_hard_one(stack):
    """api ray-train (jobs/raytrain_mnist.py, a plain Ray Train function that checks
    elastic.train.checkpoint_requested()): a noticed reclaim ends the placement at the checkpoint the function
    reported when asked (0 steps lost), a hard kill resumes from its last reported checkpoint, and the final
    model and optimizer equal an uninterrupted run's, tensor for tensor."""
    import torch

    cli = stack["cli"]
    epochs = ("--set", f"config.epochs={RAYTRAIN_EPOCHS}")
    cli.run("submit", "jobs/raytrain_mnist.yaml", "--suffix", "base", *epochs, "--follow", check=True)
    run = Submission(cli, "--suffix", "spot", *epochs, *PACE, job="jobs/raytrain_mnist.yaml")
    run.wait_for("checkpoint at step 10 committed")
    # A 15 s notice: on a loaded CI machine 8 s once passed before the function saved (the drain timed out).
    preempt(cli, "--market", "spot", "--notice", "15", "--replace-after", "0")
    run.wait_for("ray.train.get_checkpoint() returns the checkpoint of step")
    jit = [int(s) for s in JIT_LINE.findall(run.output)]
    assert len(jit) == 1, run.output[-4000:]
    # After the resume, two epoch-end checkpoints (every 5 reports), then a kill without notice.
    next_epoch_end = (jit[0] // 5 + 2) * 5
    run.wait_for(f"checkpoint at step {next_epoch_end} committed")
    report = preempt(cli, "--market", "spot", "--hard", "--replace-after", "0")
    output = run.finish()

    assert report["reclaims"][0]["path"] == "hard"
    resumed = [(int(a), int(b), int(c)) for a, b, c in RESUMED_LINE.findall(output)]
    assert resumed[0] == (jit[0], 2, 2), resumed  # from the just-in-time step: zero steps lost
    assert len(resumed) == 2 and resumed[1][0] >= next_epoch_end, resumed  # back to its last report
    listed = json.loads(cli.run("checkpoints", "ls", "raytrain-mnist-spot", "--json", check=True).stdout)
    assert all(c["committed"] for c in listed) and listed[-1]["step"] == RAYTRAIN_EPOCHS * 5

    base, spot = attached_checkpoint(stack, "raytrain-mnist-base"), attached_checkpoint(stack, "raytrain-mnist-spot")
    assert spot["step"] == base["step"] == RAYTRAIN_EPOCHS * 5
    assert (spot["epoch"], spot["next_batch"]) == (base["epoch"], base["next_batch"]) == (RAYTRAIN_EPOCHS, 0)
    assert base["model"].keys() == spot["model"].keys() and len(base["model"]) == 6
    different = [k for k in base["model"] if not torch.equal(base["model"][k], spot["model"][k])]
    assert not different, different
    moments = lambda state: [t for s in state["optimizer"]["state"].values() for t in s.values()]  # noqa: E731
    assert all(torch.equal(a, b) for a, b in zip(moments(base), moments(spot), strict=True))

    assert_the_verbs_of_a_run_work(cli, "raytrain-mnist-spot", jit[0], RAYTRAIN_EPOCHS * 5)
    proc = cli.run("report", "raytrain-mnist-spot", "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    details = json.loads(proc.stdout)["preemption_details"]
    assert len(details) == 2, details
    assert (details[0]["just_in_time_step"], details[0]["resumed_from_step"], details[0]["steps_lost"]) == (
        jit[0],
        jit[0],
        0,
    )


def test_a_hugging_face_trainer_saves_at_a_reclaim_notice_and_resumes_to_the_same_model(stack):
    """api transformers (jobs/hf_gpt2.py returns a Trainer): at a reclaim notice the callback makes the Trainer
    save at that step, committed before the deadline; the run resumes from it through resume_from_checkpoint
    (0 steps lost) and ends with the model and optimizer of an uninterrupted run, tensor for tensor."""
    cli = stack["cli"]
    steps = ("--set", f"config.max_steps={HF_STEPS}")
    cli.run("submit", HF_JOB, "--suffix", "base", *steps, "--follow", check=True)
    tensorboard = ("--set", f"tracking.tensorboard=s3://{stack['bucket']}/tensorboard")
    # Paced at 0.4 s a step: 64 s from step 40 to the end, for a notice that takes its time on a loaded machine
    # (at 0.25 s a CI run once ended with no just-in-time checkpoint).
    run = Submission(cli, "--suffix", "spot", *steps, *tensorboard, "--set", "config.pace_seconds=0.4", job=HF_JOB)
    run.wait_for("checkpoint at step 40 committed")
    # 15 s: the notice crosses the metadata server, the watcher, Ray's drain and Ray Train's poll before the
    # Trainer can save; on a loaded CI machine 8 s was seen to pass before it did (the run then lost steps).
    # The node of one of its workers, named: `--market spot` asks Ray which nodes are busy, and under load the
    # answer may not come (it then takes any spot node).
    report = preempt(cli, "--node", run.worker_node(), "--notice", "15", "--replace-after", "0")
    output = run.finish()

    jit = [int(s) for s in JIT_LINE.findall(output)]
    assert len(jit) == 1 and 40 < jit[0] < HF_STEPS, output[-4000:]
    assert "before the deadline" in output.split(f"just-in-time checkpoint at step {jit[0]} committed")[1][:200]
    resumed = [(int(a), int(b), int(c)) for a, b, c in RESUMED_LINE.findall(output)]
    assert resumed == [(jit[0], 2, 2)], resumed  # from the just-in-time step: zero steps lost
    assert f"the Trainer resumes from the checkpoint of step {jit[0]} (resume_from_checkpoint)" in output
    assert report["reclaims"][0]["path"] == "metadata"

    # The Trainer's files (model.safetensors, optimizer.pt with AdamW's moments, scheduler, RNG states), read
    # back as tensors from each run's last committed checkpoint.
    spot, base = final_tensors(stack, "hf-gpt2-spot"), final_tensors(stack, "hf-gpt2-base")
    assert spot["step"] == base["step"] == HF_STEPS
    assert any(k.startswith("files/model.safetensors/") for k in spot)
    assert any(k.startswith("files/optimizer.pt/state.") for k in spot)
    assert_same_weights(spot, base)
    assert_the_verbs_of_a_run_work(cli, "hf-gpt2-spot", jit[0], HF_STEPS)
    # The Trainer's logged loss reached tracking too (every 10 steps), before the reclaim and after the resume.
    tb_steps = tensorboard_steps(stack, "hf-gpt2-spot", "loss")
    assert min(tb_steps) < jit[0] < max(tb_steps) and max(tb_steps) == HF_STEPS, tb_steps


def tensorboard_steps(stack, run: str, tag: str) -> set[int]:
    """The steps of `tag` in the run's TensorBoard event files in the bucket, read with TensorBoard's reader."""
    import s3fs
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    env = stack["env"]
    fs = s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"], "region_name": "us-east-1"},
    )
    local = Path(tempfile.mkdtemp(prefix="elastic-tb-"))
    fs.get(f"{stack['bucket']}/tensorboard/{run}/", str(local / run), recursive=True)
    events = EventMultiplexer().AddRunsFromDirectory(str(local))
    events.Reload()
    return {e.step for e in events.Scalars(run, tag)}


def assert_the_verbs_of_a_run_work(cli, run: str, jit: int, steps: int) -> None:
    """status, logs, report and checkpoints ls of a run whose function saved its own checkpoints (api
    ray-train or transformers) and met one noticed reclaim: as for a session job."""
    rows = [row for row in json.loads(cli.run("status", "--json", check=True).stdout) if row["run"] == run]
    assert [row["status"] for row in rows] == ["SUCCEEDED"], rows
    assert f"just-in-time checkpoint at step {jit} committed" in cli.run("logs", run, check=True).stdout
    report = json.loads(cli.run("report", run, "--json", check=True).stdout)
    assert report["preemptions"] >= 1 and report["preemption_details"][0]["steps_lost"] == 0, report
    # The function's logged loss reached the run ledger (the report's loss curve), up to the last step.
    assert report["loss"] and report["loss"][-1][1] <= steps and report["steps"] == steps, report["loss"][-3:]
    listed = json.loads(cli.run("checkpoints", "ls", run, "--json", check=True).stdout)
    assert listed[-1]["step"] == steps and all(c["committed"] for c in listed), listed
