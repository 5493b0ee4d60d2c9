"""Sweeps on a real local stack with logical GPUs (2 spot nodes and 1 on-demand node, 1 GPU each):

1. packing: 4 trials at share 0.25 hold one GPU at once (elastic bench packing, through the real sweep path);
2. out of memory: trials that hit an (injected) OOM at share 0.25 are retried at 0.5 and resume from their
   checkpoint; the trials train sharded (fsdp), and the 2-rank trial's ranks sit on different GPUs, before and
   after;
3. ASHA stops bad trials early, and a sweep whose driver is killed resumes when run again: finished trials
   are not redone, and an interrupted trial resumes from its checkpoint;
4. PBT's exploit copies the donor's checkpoint;
5. `elastic pack`: three different jobs on the two spot GPUs at once, through an OOM and a reclaim (last: it
   replaces a node).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "jobs" / "digits_ddp.yaml"
WORKER_LINE = re.compile(r"worker rank (\d+)/\d+ on node ([0-9a-f]+) market=\S+ device=cpu")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, cli_factory):
    cli = cli_factory(tmp_path_factory.mktemp("elastic-home-sweep"))
    try:
        up = cli.run(
            "local",
            "up",
            "--spot",
            "2",
            "--on-demand",
            "1",
            "--gpus-per-node",
            "1",
            "--cpus-per-node",
            "3",  # a pack's three 2-rank jobs: a CPU each on both spot nodes
            "--json",
            check=True,
            timeout=300,
        )
        info = json.loads(up.stdout)
        info["cli"] = cli
        yield info
    finally:
        cli.run("local", "down", timeout=120)


def write_sweep(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sweep.yaml"
    path.write_text(text)
    return path


def storage(stack):
    """fsspec S3 filesystem on the stack's endpoint (what the trials write to)."""
    import s3fs

    env = stack["env"]
    return s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"],
        secret=env["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": env["AWS_ENDPOINT_URL"], "region_name": "us-east-1"},
    )


def read(fs, path: str):
    fs.invalidate_cache()
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as handle:
        return json.load(handle)


def test_a_run_submitted_on_a_gpu_share_goes_on_at_a_doubled_share_after_running_out_of_memory(stack):
    """`elastic submit` with workers.gpus 0.25: both ranks on a quarter of a spot GPU each (on different GPUs),
    each capped at its share; an (injected) OOM after step 12 below 0.5: the driver goes on from the last
    checkpoint at share 0.5 and the run finishes. The run ledger has both placements.

    It is also the run that shows --gpus-per-node's logical GPUs at work: a job asking for GPUs is scheduled by
    them (its two ranks on the two spot nodes' GPUs) and trains on the CPU over gloo."""
    from elastic.ledger.events import PlacementStarted

    assert [n["gpus"] for n in stack["nodes"] if n["role"] == "worker"] == [1, 1, 1]

    sets = [
        "workers.gpus=0.25",
        "workers.cpus=0.5",
        "config.epochs=1",
        "checkpoint.every_steps=5",
        "runtime_env.env_vars.ELASTIC_INJECT_OOM=12:0.5",
    ]
    args = [arg for value in sets for arg in ("--set", value)]
    proc = stack["cli"].run("submit", str(DIGITS), "--suffix", "share", *args, "--follow", timeout=600)
    assert proc.returncode == 0 and "SUCCEEDED" in proc.stdout, proc.stdout[-4000:]
    assert "out of memory at step 12 with GPU share 0.25" in proc.stdout
    # Each start of the worker group (at 0.25, then at 0.5) logs its two ranks: on two nodes, so two GPUs.
    starts = [(m[1], m[2]) for m in WORKER_LINE.finditer(proc.stdout)]
    groups = [dict(starts[i : i + 2]) for i in range(0, len(starts), 2)]
    assert len(groups) >= 2 and all(set(g) == {"0", "1"} and len(set(g.values())) == 2 for g in groups), starts
    events = read_ledger_of(stack, "s3://elastic/runs/digits-ddp-share")
    shares = [e.gpus_per_worker for e in events if isinstance(e, PlacementStarted)]
    assert shares[0] == 0.25 and shares[-1] == 0.5, shares
    restored = [e.step for e in events if e.kind == "restored"]
    assert restored and restored[-1] in (5, 10), restored  # from a checkpoint before the OOM
    assert "going on at GPU share 0.5" in proc.stdout


@pytest.mark.extended  # bench packing; the pack test below holds three jobs' trials on shared GPUs at once
def test_four_trials_share_one_gpu_at_once(stack):
    proc = stack["cli"].run(
        "bench", "packing", "--market", "on-demand", "--share", "0.25", "--no-floor", "--json", timeout=420
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["gpus"] == 1 and result["trials"] == 4 and result["requested_concurrency"] == 4
    assert result["reached_concurrency"] == 4, result
    assert list(result["trials_per_gpu"].values()) == [4] and result["errors"] == 0
    # memory and start of our trials, measured as the floor's are (the floor itself: bench packing without --no-floor)
    assert result["ours"]["ram_per_trial_mb"] > 0 and result["ours"]["driver_to_worker_seconds"] > 0, result["ours"]


@pytest.mark.extended  # make test: a Ray Train function in test_local_lifecycle, the job API path in the digits_augment verify-resume
def test_a_sweep_of_a_ray_train_function_runs_from_a_laptop_through_the_job_api(stack, monkeypatch):
    """`elastic sweep --address`: the sweep's driver runs as a Ray job on the cluster (the project directory as
    its working dir) and the client prints the trials and best config that job found. The trials run a plain Ray
    Train function (api: ray-train): its reported checkpoints are Tune's iterations and land in each trial's
    run folder, committed."""
    from ray.job_submission import JobSubmissionClient

    name = f"remote-{uuid.uuid4().hex[:6]}"
    proc = stack["cli"].run(
        "sweep",
        "jobs/raytrain_sweep.yaml",
        "--address",
        stack["dashboard_url"],
        "--set",
        "num_samples=2",
        "--set",
        f"name={name}",
        "--json",
        timeout=420,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert len(result["trials"]) == 2 and result["errors"] == 0, result
    # ASHA may stop the worse trial at a rung (STOPPED); every trial ran and reported, none errored.
    assert all(t["state"] in ("TERMINATED", "STOPPED") and t["metric"] is not None for t in result["trials"])
    assert all(t["state"] == "TERMINATED" and t["iterations"] == 3 for t in result["trials"]), result["trials"]
    assert set(result["best_config"]) == {"lr", "width"}
    assert "[sweep]" in proc.stderr  # its progress streamed from the job
    fs = storage(stack)
    for trial in result["trials"]:  # one committed checkpoint per epoch; retention kept the newest, with its files
        steps = sorted(fs.glob(f"{stack['bucket']}/runs/{name}/train/{name}-{trial['trial_id']}/step-*/COMMITTED.json"))
        assert steps and fs.exists(steps[-1].replace("COMMITTED.json", "files/checkpoint.pt")), steps
    monkeypatch.setenv("RAY_AUTH_MODE", stack["env"]["RAY_AUTH_MODE"])  # the stack's auth mode
    drivers = [
        j
        for j in JobSubmissionClient(stack["dashboard_url"]).list_jobs()
        if (j.metadata or {}).get("elastic_run") == f"sweep {name}"
    ]
    assert [str(j.status.value) for j in drivers] == ["SUCCEEDED"], drivers
    assert "elastic sweep jobs/raytrain_sweep.yaml" in drivers[0].entrypoint


@pytest.mark.extended  # make test has the Trainer's checkpoints in test_preemption_e2e and Tune's in the PBT sweep
def test_a_sweep_of_hugging_face_trainers_reports_each_committed_trainer_checkpoint(stack):
    """A sweep over an api transformers job (jobs/hf_sweep.yaml): each trial is a Trainer run by elastic, its
    Trainer checkpoints (every save_steps) committed to the trial's run folder and counted as Tune iterations,
    its logged loss the sweep's metric."""
    name = f"hf-{uuid.uuid4().hex[:6]}"
    proc = stack["cli"].run(
        "sweep", "jobs/hf_sweep.yaml", "--set", "num_samples=2", "--set", f"name={name}", "--json", timeout=420
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert len(result["trials"]) == 2 and result["errors"] == 0, result
    # 60 steps, a Trainer checkpoint every 20: three commits, three iterations, the loss of each reported.
    assert all(t["state"] == "TERMINATED" and t["iterations"] == 3 for t in result["trials"]), result["trials"]
    assert all(t["metric"] is not None and t["step"] == 60 for t in result["trials"]), result["trials"]
    assert set(result["best_config"]) == {"lr", "width"}
    fs = storage(stack)
    for trial in result["trials"]:
        steps = sorted(fs.glob(f"{stack['bucket']}/runs/{name}/train/{name}-{trial['trial_id']}/step-*/COMMITTED.json"))
        assert [int(p.split("step-")[-1].split("/")[0]) for p in steps] == [20, 40, 60], steps
        assert fs.exists(steps[-1].replace("COMMITTED.json", "files/trainer_state.json")), steps[-1]


# make test-extended: the pack test retries a sweep trial's OOM at the doubled share, and the GPU-share submit
# test above puts each start's two ranks on distinct GPUs.
@pytest.mark.extended
def test_out_of_memory_retried_with_bigger_share_and_fsdp_ranks_on_distinct_gpus(stack, tmp_path):
    name = f"oom-{uuid.uuid4().hex[:6]}"
    sweep = write_sweep(
        tmp_path,
        f"""
name: {name}
job: {DIGITS}
overrides:
  workers: {{max: null, cpus: 0.25}}
  config: {{epochs: 1}}
  checkpoint: {{every_steps: 5}}
  train: {{parallelism: fsdp}}   # sharded trials: each resume loads the shards of its own world size
  failure: {{max_failures: 0}}
  runtime_env: {{env_vars: {{ELASTIC_INJECT_OOM: "12:0.5"}}}}   # OOM after step 12 below a 0.5 share
space:
  workers.min: {{grid: [1, 2]}}
metric: mean_loss
mode: min
gpu_share: 0.25
""",
    )
    proc = stack["cli"].run("sweep", str(sweep), "--json", timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    trials = {t["params"]["workers.min"]: t for t in result["trials"]}
    assert set(trials) == {1, 2}
    for trial in trials.values():
        assert trial["state"] == "TERMINATED" and trial["ooms"] == 1, trial
        assert trial["gpu_share"] == 0.5 and trial["restarts"] == 1
        # the retry resumed from a checkpoint before the OOM (step 10's save may still have been in flight)
        assert trial["resumed_from"][0] is None and trial["resumed_from"][1] in (5, 10), trial
    fs = storage(stack)
    gpus = read(fs, f"elastic/runs/{name}/train/{name}-{trials[2]['trial_id']}/gpus.json")
    assert len(gpus) == 2 and len({(g["node"], tuple(g["gpus"])) for g in gpus}) == 2, gpus
    # It trained sharded: its checkpoint holds the model's tensors in two shards, one a rank (ddp: one chunk).
    steps = sorted(fs.glob(f"elastic/runs/{name}/train/{name}-{trials[2]['trial_id']}/step-*/.metadata"))
    with fs.open(steps[-1], "rb") as handle:
        metadata = pickle.load(handle)  # DCP's own metadata file (torch.distributed.checkpoint.Metadata)
    chunks = {k: len(m.chunks) for k, m in metadata.state_dict_metadata.items() if k.startswith("model.")}
    assert chunks and max(chunks.values()) == 2, chunks

    # The sweep's report, from its ledger and its trials' ledgers.
    proc = stack["cli"].run("report", name, "--json", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["trials_by_state"] == {"TERMINATED": 2} and report["gpu_share"] == [0.5]
    assert 0 < report["allocation"] <= 1 and report["trials_per_gpu_hour"] > 0
    assert report["gpu_hours"]["on-demand"] == 0 and report["gpu_hours"]["spot"] > 0  # digits_ddp's spot workers
    # Each trial's ledger: two placements (shares 0.25, then 0.5 after the OOM), and the steps the OOM lost.
    for trial in trials.values():
        run = f"{name}-{trial['trial_id']}"
        proc = stack["cli"].run("report", run, "--root", f"s3://elastic/runs/{name}/train", "--json", timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ledger = json.loads(proc.stdout)
        assert [p["gpus_per_worker"] for p in ledger["placements"]] == [0.25, 0.5], ledger["placements"]
        assert ledger["kind"] == "trial" and ledger["status"] == "SUCCEEDED" and 0 < ledger["goodput"] <= 1
        assert ledger["lost_steps"] == 12 - trial["resumed_from"][1], (ledger["lost_steps"], trial)


@pytest.mark.extended  # four worker-group trials one at a time, then a resume; PBT and the light trial restore in make test
def test_asha_stops_bad_trials_and_a_killed_sweep_resumes(stack, tmp_path):
    name = f"asha-{uuid.uuid4().hex[:6]}"
    sweep = write_sweep(
        tmp_path,
        f"""
name: {name}
job: {DIGITS}
overrides:
  entrypoint: tests/integration/jobs/sweep_slow.py:train
  workers: {{min: 1, max: 1, cpus: 0.25}}
  config: {{epochs: 1, step_delay: 0.4}}
  checkpoint: {{every_steps: 5}}
space:
  lr: {{grid: [0.00002, 0.1, 0.00001, 0.05]}}
metric: mean_loss
mode: min
scheduler: {{type: asha, max_t: 20, grace_period: 2, reduction_factor: 2}}   # rungs at 2, 4, 8 reports
# One at a time, so ASHA's decisions do not depend on which trial reaches a rung first: the first trial meets
# no cutoff and finishes; 0.1 and 0.05 beat the median of those before them at every rung; 0.00001 is below
# it at its first (ASHA's cutoff is the median of the trials recorded at that rung before it).
max_concurrent: 1
gpu_share: 0.25
light_trials: false   # worker-group trials here: with light ones this restore was seen to resume none (open)
""",
    )
    fs = storage(stack)
    train = f"elastic/runs/{name}/train"
    args = [sys.executable, "-m", "elastic", "sweep", str(sweep), "--json"]
    driver = subprocess.Popen(
        args,
        cwd=ROOT,
        env=stack["cli"].env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    finished, interrupted, changed, last = set(), {}, {}, {}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and driver.poll() is None:
            finished, steps, lrs = progress(fs, train)
            now = time.monotonic()
            for run, step in steps.items():
                if last.get(run) != step:
                    changed[run] = now
            last = steps
            # running = checkpointing lately (a trial ASHA stopped keeps its checkpoints but stops advancing)
            interrupted = {run: step for run, step in steps.items() if now - changed.get(run, now) < 5}
            # One the driver's death must interrupt: a good trial (ASHA stops neither, above), far from its last
            # step (~45) whatever a poll under load costs.
            certain = {run: step for run, step in interrupted.items() if lrs[run] >= 0.05 and step <= 25}
            if finished and certain:
                break
            time.sleep(0.5)
        assert driver.poll() is None, "the sweep ended before it could be interrupted"
        assert finished and certain, "no moment with a finished trial and a good one checkpointed mid-run"
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver dies: Tune, its trials and their Train runs with it
        driver.wait()
    proc = stack["cli"].run("sweep", str(sweep), "--resume", "--json", timeout=420)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    by_run = {f"{name}-{t['trial_id']}": t for t in result["trials"]}
    assert len(by_run) == 4
    for run in finished:  # not redone: one attempt, started before the kill
        assert len(by_run[run]["resumed_from"]) == 1, by_run[run]
    for run, step in interrupted.items():  # restarted from the checkpoint it had when the driver died
        # (a light trial may finish its last steps in the moment before Ray reaps it: one attempt, not redone)
        if len(by_run[run]["resumed_from"]) > 1:
            assert by_run[run]["resumed_from"][-1] >= step, (run, step, by_run[run])
    for run, step in certain.items():  # restarted from its checkpoint, not from scratch
        assert len(by_run[run]["resumed_from"]) > 1 and by_run[run]["resumed_from"][-1] >= step, by_run[run]
    stopped = [t for t in result["trials"] if t["state"] == "STOPPED"]
    done = [t for t in result["trials"] if t["state"] == "TERMINATED"]
    assert stopped and done, result["trials"]
    # Stopped early, in training progress: a stopped trial ends before the step every finished trial reached.
    # (Not Tune's iteration count: after a resume it restarts from the experiment snapshot, which can lag
    # the checkpoint the trial resumed from, so a finished trial may show fewer iterations than a stopped one.)
    assert all(t["step"] < min(d["step"] for d in done) for t in stopped), result["trials"]
    assert any(t["params"]["lr"] < 0.001 for t in stopped)
    assert result["best_config"]["lr"] >= 0.05


def progress(fs, train: str) -> tuple[set, dict, dict]:
    """Trials finished, unfinished trials with a committed checkpoint (run name -> latest step), and each
    trial's lr."""
    fs.invalidate_cache()
    finished, interrupted, lrs = set(), {}, {}
    for record_path in fs.glob(f"{train}/*/elastic-trial.json"):
        record = read(fs, record_path) or {}
        run = record_path.split("/")[-2]
        lrs[run] = float((record.get("params") or {}).get("lr", 0.0))
        if record.get("finished"):
            finished.add(run)
            continue
        steps = [int(p.split("step-")[-1].split("/")[0]) for p in fs.glob(f"{train}/{run}/step-*/COMMITTED.json")]
        if steps:
            interrupted[run] = max(steps)
    return finished, interrupted, lrs


def test_pbt_exploit_adopts_the_donors_checkpoint_and_keeps_the_mutated_lr(stack):
    """jobs/digits_pbt.yaml with two trials (the worse half clones the better at every other report): the
    recipient's run holds the donor's checkpoint, byte for byte and tensor for tensor, committed under a marker
    that names it; the recipient resumed from it; it trained on at its own mutated lr (the optimizer's lr after
    the restore is the trial's, not the donor's); the lineage names both trials."""
    import torch

    from elastic.checkpoint.store import CheckpointStore

    name = f"pbt-{uuid.uuid4().hex[:6]}"
    sets = [
        f"name={name}",
        "num_samples=2",
        "scheduler.quantile_fraction=0.5",
        "overrides.entrypoint=tests/integration/jobs/sweep_slow.py:train",  # paced: both trials train at once
        "overrides.config.step_delay=0.2",
        "overrides.config.epochs=2",
        "overrides.checkpoint.keep=20",  # every checkpoint stays, to be compared
    ]
    args = [arg for value in sets for arg in ("--set", value)]
    proc = stack["cli"].run("sweep", str(ROOT / "jobs" / "digits_pbt.yaml"), *args, "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout)
    assert len(result["trials"]) == 2 and result["errors"] == 0, result["trials"]
    runs = {f"{name}-{t['trial_id']}": t for t in result["trials"]}
    exploits = [(run, e) for run, t in runs.items() for e in t["exploits"]]
    assert exploits, result["trials"]
    train = f"s3://elastic/runs/{name}/train"
    env = dict(os.environ)
    os.environ.update(stack["env"])
    try:
        for run, exploit in exploits:
            donor_run = exploit["from"]
            assert donor_run in runs and donor_run != run, exploit
            assert exploit["mutated"].keys() == {"lr"}, exploit
            step = exploit["step"]
            recipient, donor = CheckpointStore(f"{train}/{run}"), CheckpointStore(f"{train}/{donor_run}")
            assert exploit["checkpoint"] == donor.uri(step)
            assert recipient.manifest(step)["adopted_from"] == donor.uri(step)
            assert step in runs[run]["resumed_from"], runs[run]
            mine, theirs = recipient.read_tensors(step), donor.read_tensors(step)
            assert mine.keys() == theirs.keys() and any(k.startswith("optim.state") for k in mine)
            assert all(torch.equal(mine[k], theirs[k]) for k in mine)
            # the copy holds the donor's lr; the recipient trains on at its own, perturbed one
            assert optimizer_lrs(recipient, step) != {exploit["mutated"]["lr"]}, exploit
            after = [s for s in recipient.restorable_steps() if s > step]
            if after and exploit is runs[run]["exploits"][-1]:
                assert optimizer_lrs(recipient, after[0]) == {exploit["mutated"]["lr"]}, exploit
                assert runs[run]["params"]["lr"] == exploit["mutated"]["lr"], runs[run]
        assert any(
            [s for s in CheckpointStore(f"{train}/{run}").restorable_steps() if s > e["step"]] for run, e in exploits
        ), "no recipient trained past its adopted checkpoint"
        # every exploit copied the very checkpoint PBT cloned (pinned until copied), and left no pin behind
        assert all(e["step"] == e["requested_step"] for _, e in exploits), exploits
        assert storage(stack).glob(f"elastic/runs/{name}/train/*/pins/*.json") == []
    finally:
        os.environ.clear()
        os.environ.update(env)


def optimizer_lrs(store, step: int) -> set[float]:
    """The lr of every param group in a checkpoint's optimizer state (DCP keeps them as non-tensor entries)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    reader = FsspecReader(store.uri(step), **store.writer_options())
    keys = [k for k in reader.read_metadata().state_dict_metadata if ".param_groups." in k and k.endswith(".lr")]
    state = dict.fromkeys(keys, 0.0)
    dcp.load(state, storage_reader=FsspecReader(store.uri(step), **store.writer_options()), no_dist=True)
    return set(state.values())


def test_a_light_trial_saves_just_in_time_when_its_node_is_reclaimed_and_resumes_there(stack, tmp_path):
    """A one-worker trial trains in its Tune trainable's own process (a light trial: no Train controller or
    worker group) on a spot node's GPU share. A noticed reclaim of that node: the trial reads the drain, saves a
    just-in-time checkpoint before the deadline, dies with the node, and Tune restarts it on the replacement,
    where it resumes from that checkpoint (the only one: periodic ones are off) and finishes."""
    from elastic.checkpoint.store import CheckpointStore

    name = f"light-{uuid.uuid4().hex[:6]}"
    sweep = write_sweep(
        tmp_path,
        f"""
name: {name}
job: {DIGITS}
overrides:
  entrypoint: tests/integration/jobs/sweep_slow.py:train
  workers: {{min: 1, max: 1, cpus: 0.25, market: spot}}
  config: {{epochs: 3, step_delay: 0.25}}
  checkpoint: {{every_steps: 100000}}
space:
  lr: {{grid: [0.05]}}
metric: mean_loss
mode: min
gpu_share: 0.5
""",
    )
    fs = storage(stack)
    run = f"elastic/runs/{name}/train"
    args = [sys.executable, "-m", "elastic", "sweep", str(sweep), "--json"]
    driver = subprocess.Popen(
        args, cwd=ROOT, env=stack["cli"].env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline, ranks = time.monotonic() + 180, None
        while time.monotonic() < deadline and driver.poll() is None and not ranks:
            fs.invalidate_cache()  # s3fs keeps listings: the first, before the trial started, would stay empty
            found = fs.glob(f"{run}/*/gpus.json")
            ranks = read(fs, found[0]) if found else None
            time.sleep(1)
        assert ranks, "the trial never started training"
        time.sleep(5)  # a few steps in
        node = ranks[0]["node"]
        stack["cli"].run("preempt", "--node", node, "--notice", "15", "--replace-after", "5", check=True)
        out, err = driver.communicate(timeout=420)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, err[-4000:]
    [trial] = json.loads(out)["trials"]
    assert trial["state"] == "TERMINATED" and trial["error"] is None, trial
    resumed = [step for step in trial["resumed_from"] if step]
    fs.invalidate_cache()
    trial_run = fs.glob(f"{run}/*/gpus.json")[0].rsplit("/", 1)[0]
    env = dict(os.environ)
    os.environ.update(stack["env"])
    try:
        store = CheckpointStore(f"s3://{trial_run}")
        reasons = {info.step: info.reason for info in store.list()}
        jit = [step for step, reason in reasons.items() if reason == "just-in-time"]
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert jit and 0 < jit[0] < trial["step"], reasons  # saved before the node died, mid-run
    events = read_ledger_of(stack, f"s3://{trial_run}")
    assert any(e.kind == "restored" and e.step == jit[0] for e in events), events  # resumed from it
    assert resumed == [] or resumed[-1] == jit[0], trial


def read_ledger_of(stack, run_uri: str):
    from elastic.ledger import read_ledger

    env = dict(os.environ)
    os.environ.update(stack["env"])
    try:
        return read_ledger(run_uri)
    finally:
        os.environ.clear()
        os.environ.update(env)


@pytest.mark.extended  # make test holds its parts: the share doubled after an OOM, a shared trial's just-in-time save
@pytest.mark.timeout(2100)  # its own deadlines (above) are sized for a loaded machine
def test_pack_trains_three_jobs_at_once_through_an_oom_and_a_reclaim(stack):
    """`elastic pack` of three different jobs at GPU share 0.25 on the two spot nodes' GPUs: `status --gpus`
    shows both GPUs shared by all three at once; digits-augment's (injected) OOM at 0.25 retries it alone at 0.5
    while the other two train on; a noticed reclaim of a spot node: every job resumes from a checkpoint and
    finishes. The JSON lists each job's share, GPUs (its two ranks on distinct ones), state and restarts, and
    peak_concurrent = 3 from the jobs' own step times."""
    name = f"pack-{uuid.uuid4().hex[:6]}"
    jobs = ["digits-ddp", "charlm", "digits-augment"]
    sets = [
        "runtime_env.env_vars.ELASTIC_CHAOS_STEP_SECONDS=0.5",  # paced: sleeping, so the 2 cores hold three jobs
        # The other two outlast digits-augment's OOM retry (two worker-group starts, minutes on a loaded
        # machine) and the reclaim's notice after it, so that all three are reclaimed mid-run.
        "digits-ddp:config.epochs=20",  # 12 (276 steps) ended before the reclaim in a loaded CI run
        "charlm:config.epochs=6",
        "digits-augment:config.epochs=10",  # and it outlasts its own retry's detection and the notice
        "digits-augment:checkpoint.every_steps=5",
        "digits-augment:runtime_env.env_vars.ELASTIC_INJECT_OOM=7:0.5",  # OOM after step 7 below a 0.5 share
    ]
    files = [str(ROOT / "jobs" / f"{job.replace('-', '_')}.yaml") for job in jobs]
    args = [sys.executable, "-m", "elastic", "pack", *files, "--gpu-share", "0.25", "--name", name, "--json"]
    args += [arg for value in sets for arg in ("--set", value)]
    driver = subprocess.Popen(
        args, cwd=ROOT, env=stack["cli"].env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    runs = {f"{name}-{job}": job for job in jobs}
    at_start = {run: 0.25 for run in runs}
    retried = {**at_start, f"{name}-digits-augment": 0.5}

    def wait_for_both_gpus(want: dict, seconds: float) -> list:
        """Polls `status --gpus` until each of the two spot GPUs holds exactly `want` (run: share)."""
        seen = []
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and driver.poll() is None:
            shared = json.loads(stack["cli"].run("status", "--gpus", "--json", check=True).stdout)
            seen.append([{r["run"]: r["share"] for r in gpu["runs"] if r["run"] in runs} for gpu in shared])
            if len(seen[-1]) == 2 and all(gpu == want for gpu in seen[-1]):
                break
            time.sleep(2)
        assert seen and len(seen[-1]) == 2 and all(gpu == want for gpu in seen[-1]), (want, seen[-3:])
        return seen

    try:
        # Deadlines for a loaded machine; each poll ends early if the pack's driver has exited.
        wait_for_both_gpus(at_start, 600)  # all three share both GPUs
        wait_for_both_gpus(retried, 600)  # digits-augment retried at 0.5 while the other two still train
        stack["cli"].run("preempt", "--market", "spot", "--notice", "20", "--replace-after", "10", check=True)
        out, err = driver.communicate(timeout=900)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, err[-4000:]
    result = json.loads(out)
    by_job = {row["job"]: row for row in result["jobs"]}
    assert set(by_job) == set(jobs) and result["errors"] == 0, result
    assert result["peak_concurrent"] == 3, result
    brief = {
        j: {k: r[k] for k in ("state", "step", "preemptions", "restarts", "resumed_from")} for j, r in by_job.items()
    }
    for row in by_job.values():
        assert row["state"] == "TERMINATED", brief
        assert len(row["gpus"]) == 2 and len({g.split(":")[0] for g in row["gpus"]}) == 2, row  # distinct GPUs
        assert row["preemptions"] == 1 and row["restarts"] >= 1 and row["resumed_from"], brief  # resumed
    assert by_job["digits-augment"]["ooms"] == 1 and by_job["digits-augment"]["share"] == 0.5
    assert by_job["digits-augment"]["resumed_from"][0] >= 5  # the OOM retry resumed from a checkpoint
    for job in ("digits-ddp", "charlm"):
        assert by_job[job]["ooms"] == 0 and by_job[job]["share"] == 0.25, by_job[job]
    # The others went on: while digits-augment was retried, each of them trained (a step window spans it).
    from elastic.ledger import read_ledger
    from elastic.ledger.events import Steps

    env = dict(os.environ)
    os.environ.update(stack["env"])
    try:
        record = read(storage(stack), f"elastic/runs/{name}-digits-augment/elastic-trial.json")
        retried = record["attempts"][1]["started"]
        for job in ("digits-ddp", "charlm"):
            windows = [e for e in read_ledger(f"s3://elastic/runs/{name}-{job}") if isinstance(e, Steps)]
            assert any(w.time <= retried <= w.ended for w in windows), (job, retried)
    finally:
        os.environ.clear()
        os.environ.update(env)
