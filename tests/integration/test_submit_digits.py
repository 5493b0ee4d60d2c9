"""End to end on a real local stack: the digits DDP job through Ray's job API, checkpoints in the S3 bucket,
placement on spot nodes, resume on resubmission, and one-line errors for bad input. A Prometheus scrapes the
stack through Ray's service discovery for the whole module (our series during a run, every Grafana panel's
query, the alert rules loaded), and the run with kills tracks to a real `mlflow server` and TensorBoard."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
from conftest import ROOT, Cli
from observability_helpers import running_mlflow, running_prometheus

from elastic.local.s3_faults import running_proxy

pytestmark = pytest.mark.integration

# Distinctive fake credentials the first job runs with (in the submitting CLI's environment and the job's):
# none may show up in a log, the run folder or any --json output. Not real keys, and shaped unlike real ones.
SECRETS = {
    "AWS_ACCESS_KEY_ID": "ELASTICFAKEACCESSKEYID7Q2Z",
    "AWS_SECRET_ACCESS_KEY": "elastic-fake-secret-access-key-9xQ2vLk7Tz4Wm",
    "RAY_AUTH_TOKEN": "elastic-fake-ray-auth-token-5h8k2p3d",
}

RUN_SUFFIX = "it"
RUN_NAME = f"digits-ddp-{RUN_SUFFIX}"
WORKER_LINE = re.compile(r"worker rank (\d+)/(\d+) on node ([0-9a-f]+) market=(\S+)")


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    """Started with the module's stack, so it holds every run of the module; `started` is its start time."""
    rules = [ROOT / "deploy" / "prometheus" / "elastic-alerts.yml"]
    with running_prometheus(tmp_path_factory.mktemp("prometheus"), stack["temp_dir"], rules) as server:
        server.started = time.time()
        yield server


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    with running_mlflow(tmp_path_factory.mktemp("mlflow")) as server:
        yield server


def s3(env: dict):
    return boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )


def list_keys(env: dict, bucket: str, prefix: str) -> list[str]:
    pages = s3(env).get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return [obj["Key"] for page in pages for obj in page.get("Contents", [])]


def summary(env: dict, bucket: str, run: str) -> dict:
    body = s3(env).get_object(Bucket=bucket, Key=f"runs/{run}/elastic-summary.json")["Body"].read()
    return json.loads(body)


def test_local_up_reports_labeled_nodes_and_bucket(stack, stack_env, prometheus):
    nodes = stack["nodes"]
    assert [n["market"] for n in nodes].count("spot") == 2
    assert [n["market"] for n in nodes].count("on-demand") == 2  # the head and one worker
    head = [n for n in nodes if n["role"] == "head"]
    assert len(head) == 1 and head[0]["market"] == "on-demand" and head[0]["cpus"] == 0
    for key in ("ray_address", "dashboard_url", "s3_endpoint", "bucket"):
        assert stack[key]
    # The labels jobs select on are on the live Ray nodes, as Ray itself reports them.
    from ray.util.state import list_nodes

    live = {n.node_id: n.labels for n in list_nodes(address=stack["dashboard_url"])}
    for node in nodes:
        assert live[node["node_id"]]["market"] == node["market"]
        assert live[node["node_id"]]["elastic-role"] == node["role"]
    s3(stack_env).head_bucket(Bucket=stack["bucket"])  # raises if the bucket is missing


# Secrets the job itself carries in runtime_env.env_vars. Its AWS keys and Ray token must be the stack's own for
# the job to run (SeaweedFS checks the keys; Ray's token auth the token), so the job's credentials are the
# stack's real Ray token and API keys of services it does not call; the client's are the fake AWS keys above.
JOB_SECRETS = {"HF_TOKEN": "hf_elasticfakehuggingfacetoken3k9", "WANDB_API_KEY": "elastic-fake-wandb-key-8d2m"}


def leaked(text: str | bytes, secrets: dict[str, str] | None = None) -> list[str]:
    data = text.encode() if isinstance(text, str) else text
    return [name for name, value in (secrets or SECRETS).items() if value.encode() in data]


def test_submit_trains_on_spot_nodes_and_checkpoints_to_s3(stack, stack_env):
    cli = stack["cli"]
    # The job runs with credentials in its environment, passed the way a user would (runtime_env.env_vars); the
    # CLI that submits it has them too. No secret may leak: checked at the end of this test.
    with_secrets = Cli({**cli.env, **SECRETS})
    ray_token = (Path(cli.env["ELASTIC_HOME"]) / "local" / "auth_token").read_text().strip()
    job_secrets = {**JOB_SECRETS, "RAY_AUTH_TOKEN": ray_token}
    every_secret = {**SECRETS, **{f"job {k}": v for k, v in job_secrets.items()}}
    secret_vars = [f"--set=runtime_env.env_vars.{name}={value}" for name, value in job_secrets.items()]
    proc = with_secrets.run(
        "submit",
        "jobs/digits_ddp.yaml",
        "--suffix",
        RUN_SUFFIX,
        "--set",
        "config.epochs=3",
        *secret_vars,
        "--follow",
        check=True,
    )
    assert "SUCCEEDED" in proc.stdout
    spot_ids = {n["node_id"] for n in stack["nodes"] if n["market"] == "spot"}
    placements = {(int(m[1]), m[3], m[4]) for m in WORKER_LINE.finditer(proc.stdout)}
    assert {rank for rank, _, _ in placements} == {0, 1}
    assert all(node in spot_ids and market == "spot" for _, node, market in placements), placements

    keys = list_keys(stack_env, stack["bucket"], f"runs/{RUN_NAME}/")
    checkpoints = sorted({k.split("/")[2] for k in keys if k.split("/")[2].startswith("step-")})
    # 3 epochs x 23 steps: saves at 50 and at the end (69); keep=3 keeps both.
    assert checkpoints == ["step-000000050", "step-000000069"], checkpoints
    # Sharded: a shard per rank, DCP metadata, and the commit marker written last.
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "COMMITTED.json"):
        assert f"runs/{RUN_NAME}/step-000000069/{name}" in keys, name
    verify = cli.run("checkpoints", "verify", RUN_NAME, check=True)
    assert "step-000000069: ok (2 shards" in verify.stdout
    listing = json.loads(cli.run("checkpoints", "ls", RUN_NAME, "--json", check=True).stdout)
    assert [(c["step"], c["committed"], c["shards"], c["reason"]) for c in listing] == [
        (50, True, 2, "periodic"),
        (69, True, 2, "final"),
    ]
    result = summary(stack_env, stack["bucket"], RUN_NAME)
    assert result["status"] == "SUCCEEDED"
    assert result["metrics"]["step"] == 69
    assert result["metrics"]["accuracy"] > 0.8

    # No secret in: the job's logs as streamed and as `elastic logs` prints them (our driver's and workers' log
    # lines among them), any file of the run folder (checkpoints, ledgers, summary, control files, Ray Train's
    # run state), or the --json outputs.
    outputs = {
        "submit --follow": proc.stdout + proc.stderr,
        "logs": with_secrets.run("logs", RUN_NAME, check=True).stdout,
        "status --json": with_secrets.run("status", RUN_NAME, "--json", check=True).stdout,
        "checkpoints ls --json": json.dumps(listing),
        "spec check": with_secrets.run("spec", "check", "jobs/digits_ddp.yaml", *secret_vars, check=True).stdout,
    }
    assert {name: leaked(text, every_secret) for name, text in outputs.items() if leaked(text, every_secret)} == {}
    client = s3(stack_env)
    run_keys = list_keys(stack_env, stack["bucket"], f"runs/{RUN_NAME}/")
    objects = {key: client.get_object(Bucket=stack["bucket"], Key=key)["Body"].read() for key in run_keys}
    assert len(objects) > 10
    assert {key: leaked(data, every_secret) for key, data in objects.items() if leaked(data, every_secret)} == {}
    # ... nor in the files of the stack's home: our daemons' logs (watchers, metadata servers), the stack's state.
    home = Path(cli.env["ELASTIC_HOME"])
    # (The token's own file, auth_token, is where the stack keeps it; the bucket's data files are the objects
    # checked above.)
    files = [
        p
        for p in home.rglob("*")
        if p.is_file() and not p.is_symlink() and p.name != "auth_token" and "s3" not in p.relative_to(home).parts
    ]
    assert (
        files
        and {str(p): leaked(p.read_bytes(), every_secret) for p in files if leaked(p.read_bytes(), every_secret)} == {}
    )


def test_resubmitting_the_same_job_resumes_its_run(stack, stack_env):
    cli = stack["cli"]
    proc = cli.run(
        "submit", "jobs/digits_ddp.yaml", "--suffix", RUN_SUFFIX, "--set", "config.epochs=4", "--follow", check=True
    )
    trace = "\n".join(line for line in proc.stdout.splitlines() if "[elastic]" in line or "restore" in line)
    assert "resumed from checkpoint at step 69" in proc.stdout, trace
    result = summary(stack_env, stack["bucket"], RUN_NAME)
    assert result["metrics"]["step"] == 92  # one more epoch of 23 steps, not four from scratch

    status = json.loads(cli.run("status", "--json", check=True).stdout)
    runs = [row for row in status if row["run"] == RUN_NAME]
    assert len(runs) == 2 and all(row["status"] == "SUCCEEDED" for row in runs)
    assert "resumed from checkpoint" in cli.run("logs", RUN_NAME, check=True).stdout


@pytest.mark.extended  # make test: the fallback in test_checkpoint_s3_faults, the resharded resume in the 2-1-2 verify-resume
def test_a_resume_that_cannot_read_the_latest_checkpoint_falls_back_to_the_one_before_at_another_worker_count(
    stack, stack_env
):
    """The same run once more, its job talking to S3 through the fault proxy, which resets every read of the
    latest checkpoint's files, and on 1 worker where 2 wrote it: the worker resumes from the checkpoint before it
    (saying so), retires the unreadable one, reshards model and optimizer, and continues the data from the
    global sample stream's position (an epoch on one worker is 45 steps of 32 samples, not 23 steps of 2 x 32).
    Submitted once more, the finished run trains nothing and rewrites no checkpoint."""
    cli = stack["cli"]
    committed = sorted(
        int(key.split("/")[-2].split("-")[1])
        for key in list_keys(stack_env, stack["bucket"], f"runs/{RUN_NAME}/step-")
        if key.endswith("/COMMITTED.json")
    )
    assert committed[-2:] == [69, 92]  # the previous test's final checkpoints
    one_worker = ["--set", "config.epochs=5", "--set", "workers.min=1", "--set", "workers.max=1", "--follow"]
    with running_proxy(stack_env["AWS_ENDPOINT_URL"], seed=1) as (url, control):
        control.open_window("reset", match={"methods": ["GET"], "path_contains": f"/{RUN_NAME}/step-000000092/"})
        proc = cli.run(
            "submit",
            "jobs/digits_ddp.yaml",
            "--suffix",
            RUN_SUFFIX,
            *one_worker,
            "--set",
            f"runtime_env.env_vars.AWS_ENDPOINT_URL={url}",
            check=True,
        )
        assert control.stats()["injected"]["reset"] > 0
    assert "checkpoint at step 92 cannot be read" in proc.stdout
    assert "resumed from checkpoint at step 69" in proc.stdout and "written by 2 workers, now 1" in proc.stdout
    assert "retired checkpoint at step 92" in proc.stdout
    result = summary(stack_env, stack["bucket"], RUN_NAME)
    assert result["metrics"]["step"] == 69 + 2 * 45  # from 69: two epochs of 1,437 samples in batches of 32
    assert result["metrics"]["accuracy"] > 0.8

    # Submitting a finished run again trains nothing and rewrites no checkpoint, yet reports its result.
    def checkpoint_times() -> dict:
        listing = json.loads(cli.run("checkpoints", "ls", RUN_NAME, "--json", check=True).stdout)
        return {c["step"]: c["time"] for c in listing}

    before = checkpoint_times()
    again = cli.run("submit", "jobs/digits_ddp.yaml", "--suffix", RUN_SUFFIX, *one_worker, check=True)
    assert "resumed from checkpoint at step 159" in again.stdout
    assert checkpoint_times() == before
    assert summary(stack_env, stack["bucket"], RUN_NAME)["metrics"]["accuracy"] == result["metrics"]["accuracy"]


def load_final_state(env: dict, run_uri: str, step: int) -> dict:
    """A committed checkpoint read back in this process (no process group), as plain tensors."""
    import os

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from elastic.checkpoint.store import CheckpointStore

    saved = dict(os.environ)
    os.environ.update(env)
    try:
        store = CheckpointStore(run_uri)
        reader = FsspecReader(store.uri(step), **store.writer_options())
        metadata = reader.read_metadata()
        import torch

        state = {
            key: torch.empty(meta.size, dtype=meta.properties.dtype)
            for key, meta in metadata.state_dict_metadata.items()
            if isinstance(meta, TensorStorageMetadata)
        }
        dcp.load(state, storage_reader=FsspecReader(store.uri(step), **store.writer_options()), no_dist=True)
        return state
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_watching_prometheus(cli, prometheus, run: str, args: list[str]) -> tuple[str, list[float]]:
    """`elastic <args>` to the end, querying Prometheus for the run's step while it runs: (stdout, steps seen)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic", *args], cwd=ROOT, env=cli.env, stdout=subprocess.PIPE, text=True
    )
    seen: list[float] = []
    while proc.poll() is None:
        seen += [float(r["value"][1]) for r in prometheus.query(f'max(ray_elastic_step{{run="{run}"}})')]
        time.sleep(1)
    stdout = proc.stdout.read()
    assert proc.returncode == 0, stdout[-3000:]
    return stdout, seen


# The runs that must end equal: digits_ddp for 2 epochs (46 steps), checkpoints every 10 steps.
EQUIVALENCE_RUN = ["--set", "config.epochs=2", "--set", "checkpoint.every_steps=10", "--follow"]


# 46 steps with checkpoints at 23 and 46: the final step's save is a periodic one, still reporting at finish().
EVERY_23 = ["--set", "config.epochs=2", "--set", "checkpoint.every_steps=23", "--follow"]
CHAOS = "runtime_env.env_vars.ELASTIC_CHAOS"


@pytest.fixture(scope="module")
def clean_run(stack, stack_env) -> dict:
    """The equivalence run trained without a fault: its final state (step 46), what faulted runs must equal
    (checkpoints change no weights). It also settles the final-report race one way round: its last step is a
    periodic checkpoint and rank 0 settles the final report 3 s after rank 1, whose report of that checkpoint
    may still be pending while rank 0's has long been sent; it must end, not hang."""
    clean = stack["cli"].run(
        "submit", "jobs/digits_ddp.yaml", "--suffix", "eq-clean", *EVERY_23, "--set", f"{CHAOS}_FINISH_DELAY=0:3",
        timeout=420, check=True,
    )  # fmt: skip
    assert "chaos: rank 0 waits 3 s before settling the final report" in clean.stdout
    assert "made no step progress" not in clean.stdout  # ended, not caught hanging by the watchdog and restarted
    return load_final_state(stack_env, f"s3://{stack['bucket']}/runs/digits-ddp-eq-clean", 46)


def test_worker_kills_resume_to_bit_identical_weights(stack, stack_env, prometheus, mlflow_server, clean_run):
    """Two runs of the same job, one with two workers killed mid-run (one right after a checkpoint, one
    between checkpoints): after the automatic restarts the final model and optimizer are bit-identical.

    The killed run also tracks to MLflow and TensorBoard (one MLflow run across the restarts, its steps going
    on) and is watched in Prometheus while it runs (its step, the steps its restarts lost)."""
    import torch

    cli = stack["cli"]
    common = EQUIVALENCE_RUN
    tracking = [
        *("--set", f"tracking.mlflow={mlflow_server.url}", "--set", "tracking.every_steps=5"),
        *("--set", f"tracking.tensorboard=s3://{stack['bucket']}/tensorboard"),
    ]
    stdout, steps_seen = run_watching_prometheus(
        cli,
        prometheus,
        "digits-ddp-eq-killed",
        [
            "submit",
            "jobs/digits_ddp.yaml",
            "--suffix",
            "eq-killed",
            *common,
            *tracking,
            "--set",
            "runtime_env.env_vars.ELASTIC_CHAOS_KILL_AT=21:1,37:0",
        ],
    )
    killed = subprocess.CompletedProcess([], 0, stdout=stdout)
    assert killed.stdout.count("chaos: killing rank") == 2
    resumed_at = sorted({int(s) for s in re.findall(r"resumed from checkpoint at step (\d+)", killed.stdout)})
    # A kill lands while the newest checkpoint may still be uploading (an upload takes ~0.3 s, a step ~10 ms):
    # a torn checkpoint is never loaded, the run resumes from the one before. Which one depends on timing.
    assert len(resumed_at) == 2 and resumed_at[0] in (10, 20) and resumed_at[1] in (20, 30), "\n".join(
        line for line in killed.stdout.splitlines() if "[elastic]" in line
    )

    # Retention (keep=3) pruned the older ones, and the run can still be resumed: Ray's run snapshot and
    # the bucket agree (a snapshot naming a deleted checkpoint makes Ray refuse to resume).
    listing = json.loads(cli.run("checkpoints", "ls", "digits-ddp-eq-killed", "--json", check=True).stdout)
    assert [c["step"] for c in listing if c["committed"]] == [30, 40, 46]
    again = cli.run("submit", "jobs/digits_ddp.yaml", "--suffix", "eq-killed", *common, check=True)
    assert "resumed from checkpoint at step 46" in again.stdout

    root = f"s3://{stack['bucket']}/runs"
    clean = clean_run
    resumed = load_final_state(stack_env, f"{root}/digits-ddp-eq-killed", 46)
    assert clean.keys() == resumed.keys() and any(k.startswith("optim.") for k in clean)
    different = [k for k in clean if not torch.equal(clean[k], resumed[k])]
    assert different == []

    # Prometheus saw the run's step while it ran, and counts the steps its restarts lost as the run logged them.
    assert steps_seen and max(steps_seen) > 0, "no ray_elastic_step for the run in Prometheus while it ran"
    # Lost steps are counted from a progress mark written once a second, so a kill within a second of the
    # mark loses steps the count cannot see: Prometheus must agree with what the run logged.
    logged_lost = sum(
        int(n) for n in re.findall(r"(\d+) step\(s\) since the checkpoint of step \d+ were lost", killed.stdout)
    )
    query = 'sum(ray_elastic_lost_steps_total{run="digits-ddp-eq-killed"})'
    deadline = time.time() + 60
    while True:
        lost = sum(float(r["value"][1]) for r in prometheus.query(query))
        if lost == logged_lost or time.time() > deadline:
            break
        time.sleep(2)
    assert lost == logged_lost, (lost, logged_lost)

    # MLflow: one run for the whole elastic run, its parameters, and the loss every 5 steps through the kills
    # and past the last resume point, up to the last step (46), where the final metrics are.
    runs = mlflow_server.runs("digits-ddp", "tags.`elastic.run` = 'digits-ddp-eq-killed'")
    assert len(runs) == 1, [r["info"]["run_id"] for r in runs]
    run = runs[0]
    params = {p["key"]: p["value"] for p in run["data"].get("params", [])}
    assert params["config.epochs"] == "2" and params["checkpoint.every_steps"] == "10"
    assert run["info"]["status"] == "FINISHED"
    loss_steps = sorted({m["step"] for m in mlflow_server.metric_history(run["info"]["run_id"], "loss")})
    # Metrics still queued on a killed rank 0 are gone, and steps up to the checkpoint resumed from are not
    # re-done: those may miss. Before the first kill and everything after the last resume point are there.
    assert set(loss_steps) <= set(range(5, 46, 5)) and loss_steps[0] < resumed_at[0], loss_steps
    assert set(range(resumed_at[-1] + 5, 46, 5)) <= set(loss_steps), (loss_steps, resumed_at)
    assert [m["step"] for m in mlflow_server.metric_history(run["info"]["run_id"], "accuracy")] == [46]

    # TensorBoard: event files under the run's folder in the bucket, one per placement attempt that logged,
    # read back with TensorBoard's own reader.
    import s3fs
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    fs = s3fs.S3FileSystem(
        key=stack_env["AWS_ACCESS_KEY_ID"],
        secret=stack_env["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": stack_env["AWS_ENDPOINT_URL"], "region_name": stack_env["AWS_REGION"]},
    )
    local = Path(stack["temp_dir"]).parent / f"tb-{stack['bucket']}-{int(time.time())}"
    fs.get(f"{stack['bucket']}/tensorboard/digits-ddp-eq-killed/", str(local / "digits-ddp-eq-killed"), recursive=True)
    events = EventMultiplexer().AddRunsFromDirectory(str(local))
    events.Reload()
    tb_steps = {e.step for e in events.Scalars("digits-ddp-eq-killed", "loss")}
    assert max(tb_steps) == 45 and {40, 45} <= tb_steps


def test_a_hung_rank_is_restarted_to_identical_weights_and_the_final_report_race_ends_either_way(
    stack, stack_env, clean_run
):
    """A rank that hangs (alive, no progress) is caught by the hang watchdog: both ranks' stacks in the job's
    log and the run folder, the attempt restarted from the last checkpoint, the final weights bit-identical to
    the run that never failed, the hang its own badput cause in the report. The run ends with the final-report
    race the other way round from the clean run's (rank 1 late), and ends."""
    import torch

    cli = stack["cli"]
    hung = cli.run(
        "submit", "jobs/digits_ddp.yaml", "--suffix", "hang", *EVERY_23,
        "--set", "failure.hang_timeout_seconds=15",
        "--set", f"{CHAOS}_KILL_AT=25:1:hang", "--set", f"{CHAOS}_FINISH_DELAY=1:3",
        timeout=600, check=True,
    )  # fmt: skip
    log = hung.stdout
    assert "chaos: rank 1 hangs after step 25" in log
    assert "chaos: rank 1 waits 3 s before settling the final report" in log
    assert sorted(set(re.findall(r"hang: rank (\d) made no step progress for", log))) == ["0", "1"], log[-4000:]
    # Rank 1's stack shows where it stopped (the chaos hang after its step); rank 0 waits inside a step. Read
    # from the run folder's copies: in the log, a rank's threads interleave with the other rank's lines.
    assert "resumed from checkpoint at step 23" in log
    kept = list_keys(stack_env, stack["bucket"], "runs/digits-ddp-hang/hangs/")
    assert len(kept) == 2, kept
    stacks = {
        key.rsplit("-rank-", 1)[1].removesuffix(".txt"): s3(stack_env)
        .get_object(Bucket=stack["bucket"], Key=key)["Body"]
        .read()
        .decode()
        for key in kept
    }
    assert "in maybe_kill" in stacks["1"] and "in optimize" in stacks["0"], stacks

    resumed = load_final_state(stack_env, f"s3://{stack['bucket']}/runs/digits-ddp-hang", 46)
    assert [k for k in clean_run if not torch.equal(clean_run[k], resumed[k])] == []

    report = json.loads(cli.run("report", "digits-ddp-hang", "--json", check=True).stdout)
    assert report["badput"]["hang"] >= 10, report["badput"]


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--set", "workers.mx=2"], "workers.mx: unknown field; did you mean 'max'?"),
        (["--set", "checkpoint.uri=s3://no-such-bucket/runs"], "bucket 'no-such-bucket' does not exist"),
        (["--address", "http://127.0.0.1:9"], "cannot reach the Ray job API at http://127.0.0.1:9"),
        (["--set", "entrypoint=jobs/digits_ddp.py:no_such_function"], "defines no function 'no_such_function'"),
        # More workers than the stack's nodes can ever hold: refused with the numbers, not left waiting.
        (["--set", "workers.min=50", "--set", "workers.max=50"], "50 workers of 1 CPU each do not fit"),
        (["--set", "workers.gpus=8"], "one worker needs 1 CPU + 8 GPU but the largest"),
    ],
)
def test_bad_input_exits_2_with_one_line(stack, args, expected):
    proc = stack["cli"].run("submit", "jobs/digits_ddp.yaml", "--suffix", "bad", *args, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    "job, kills, overrides, through_job_api",
    [
        # FSDP2 (bf16, activation checkpointing), dropout, AdamW, warmup + cosine LambdaLR, streamed from the
        # bucket: it stands for charlm too (the same corpus, loop and schedule under DDP).
        # 2 kills (the second inside a save) and a notice: each more kill is one more restart of a sharded run.
        # make test-extended (15 minutes in a loaded CI): FSDP's bit-identical resume is make test's in test_fsdp.
        pytest.param("jobs/gpt.yaml", 2, [], False, marks=pytest.mark.extended),
        ("jobs/digits_augment.yaml", 2, ["--set", "config.epochs=2"], True),  # crop/flip/noise in 2 DataLoader workers
    ],
)
def test_verify_resume_is_bit_identical_for_jobs_that_draw_random_numbers(
    stack, job, kills, overrides, through_job_api, monkeypatch, prometheus
):
    """The user-facing verifier on jobs that draw random numbers: kills (every other one inside a checkpoint save)
    and a reclaim notice (a just-in-time end). The random
    streams of the training loop and of the DataLoader workers continue exactly, so the final model and optimizer
    are bit-identical and every sample is seen once per epoch.
    (digits_augment is the digits job plus augmentation: it stands for the plain digits job too. gpt is sharded:
    each rank saves and restores its own shards of the model and optimizer.)

    The digits_augment one runs as a laptop would on a cloud cluster: `--address`, so the verifier itself runs
    as a Ray job on the cluster and the client prints the report that job produced."""
    remote = ["--address", stack["dashboard_url"]] if through_job_api else []
    # Two runs of the job, the second restarted kills + 1 times: 330 s alone here, past 600 s in a CI run at a
    # load of 15-27 on 2 cores; under pytest's own 900 s.
    proc = stack["cli"].run(
        "verify-resume", job, "--kills", str(kills), "--notices", "1", "--json", *overrides, *remote,
        check=True, timeout=870,
    )  # fmt: skip
    report = json.loads(proc.stdout)
    if through_job_api:
        from ray.job_submission import JobSubmissionClient

        monkeypatch.setenv("RAY_AUTH_MODE", stack["env"]["RAY_AUTH_MODE"])  # the stack's auth mode
        drivers = [
            j
            for j in JobSubmissionClient(stack["dashboard_url"]).list_jobs()
            if (j.metadata or {}).get("elastic_command") == "verify-resume"
        ]
        assert [str(j.status.value) for j in drivers] == ["SUCCEEDED"], drivers
        assert f"submitted Ray job {drivers[0].submission_id}" in proc.stderr
    assert report["identical"] is True and report["max_abs_diff"] == 0.0, report["problems"]
    assert report["first_loss_divergence"] is None
    assert report["samples_exactly_once"] is True and report["passed"] is True
    assert report["kills_fired"] == kills and report["notices_fired"] == 1
    assert report["interrupted"]["just_in_time_ends"] == 1  # the notice ended a placement just in time
    plan = report["interrupted"]["kill_plan"]
    assert any(k.endswith(":save") for k in plan) and any(k.endswith(":notice") for k in plan)
    # Restarts are counted from the sample ledgers' attempts (the kills and the notice); seen one fewer once on a
    # machine loaded by a second test run. The faults themselves are counted above.
    assert report["interrupted"]["restarts"] >= kills
    assert report["tensors_compared"] >= 6  # model and optimizer (momentum, Adam's moments) tensors
    # The reclaim notice's just-in-time end reached Prometheus as a preemption, from the run's driver.
    deadline = time.time() + 60
    while not prometheus.query("sum(ray_elastic_preemptions_total) > 0") and time.time() < deadline:
        time.sleep(2)
    assert prometheus.query("sum(ray_elastic_preemptions_total) > 0"), "no preemption in Prometheus"


def test_verify_resume_across_2_1_2_workers_sees_every_sample_once(stack):
    """Resharding 2 -> 1 -> 2: model, optimizer and data position move across worker counts, and the sample
    ledger of the resumed run has every sample of every epoch exactly once. The job streams its data from the
    bucket (jobs/digits_stream.yaml: the training split stored sorted by label, written on first use, read by
    row group), so the streaming path is what resumes mid-epoch at each new worker count."""
    proc = stack["cli"].run(
        "verify-resume",
        "jobs/digits_stream.yaml",
        "--kills",
        "2",
        "--workers",
        "2,1,2",
        "--json",
        "--set",
        "config.epochs=2",
        "--set",
        "checkpoint.every_steps=10",
        check=True,
    )
    report = json.loads(proc.stdout)
    assert report["samples_exactly_once"] is True, report["problems"]
    assert report["interrupted"]["workers"] == [2, 1, 2] and report["kills_fired"] == 2
    assert report["loss_within_tolerance"] is True and report["passed"] is True
    assert report["identical"] is False  # a different global batch trains a different (healthy) trajectory
    inspected = json.loads(
        stack["cli"]
        .run("data", "inspect", f"s3://{stack['bucket']}/datasets/digits-sorted", "--json", check=True)
        .stdout
    )
    assert inspected["rows"] == 1437 and inspected["row_groups"] > 64
    assert set(inspected["columns"]) == {"image", "label"}


@pytest.mark.extended  # make test: the final-state check that catches it, tests/unit/diagnostics/test_final_comparison.py
def test_verify_resume_catches_a_job_that_forgets_its_scheduler(stack):
    proc = stack["cli"].run("verify-resume", "tests/integration/jobs/forgetful.yaml", "--kills", "1", "--json")
    assert proc.returncode == 1, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["identical"] is False and report["passed"] is False
    assert report["samples_exactly_once"] is True  # the data resumed fine; the learning rate did not
    assert any("final state differs" in p for p in report["problems"])


GPU_ROW = "GPU (NVML; GPU nodes only)"  # the dashboard's row of panels over NVML series (absent on CPU nodes)


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(row, panel title, PromQL) of every panel of the shipped dashboard, Grafana's variables filled in as
    Grafana would for "All runs" and a short range."""
    dashboard = json.loads((ROOT / "deploy" / "grafana" / "elastic.json").read_text())
    queries, row = [], ""
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        for target in panel["targets"]:
            expr = target["expr"].replace("$run", ".*").replace("$__rate_interval", "1m")
            queries.append((row, panel["title"], expr))
    return queries


def test_every_dashboard_panel_has_data_and_the_alert_rules_load(stack, prometheus):
    """Every panel's query over the module's runs (the kills run, the verify-resume runs with a reclaim notice)
    returns data, except the GPU row's on a CPU machine, where those series are absent (never zeros)."""
    import torch

    rules = {rule["name"]: rule for rule in prometheus.rules()}
    assert set(rules) == {
        "ElasticLowGpuUtilization",
        "ElasticLowGoodput",
        "ElasticCheckpointOverdue",
        "ElasticFrequentPreemptions",
    }
    assert all(rule["health"] == "ok" for rule in rules.values()), rules

    end = time.time()
    empty = []
    for row, title, expr in dashboard_queries():
        series = prometheus.query_range(expr, prometheus.started, end)
        values = [float(v) for s in series for _, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
        if not values:
            empty.append((row, title))
    gpu_panels = {(row, title) for row, title, _ in dashboard_queries() if row == GPU_ROW}
    assert gpu_panels, "the dashboard has no GPU row"
    expected_empty = set() if torch.cuda.is_available() else gpu_panels
    assert set(empty) == expected_empty, empty
