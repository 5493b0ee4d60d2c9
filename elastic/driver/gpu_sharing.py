"""Which runs share which GPU, at what share: what `elastic status` shows beside the runs.

The training workers of a run on a GPU share carry its name in their runtime environment (set where the
trainer is built, elastic.driver.ray_config), so Ray's state API can tell whose worker holds which fraction of
a node's GPUs; the GPU ids come from the `gpus.json` rank 0 writes into the run folder, when it can be read
from here."""

from __future__ import annotations

import json
import logging
from collections import defaultdict

log = logging.getLogger(__name__)

RUN_VARIABLE = "ELASTIC_SHARED_RUN"  # the run's name, in its shared workers' runtime environment
RUN_URI_VARIABLE = "ELASTIC_SHARED_RUN_URI"  # its folder, where gpus.json names each rank's GPU ids


def current(target) -> list[dict]:
    """The GPUs shared now on the target's cluster (by_gpu's rows); [] when Ray's state API cannot say."""
    import contextlib

    if target.local is not None:
        target.local.use_ray()  # the stack's auth mode and token: Ray reads them when it is imported
    try:
        from ray.util.state import list_actors  # ray only when a cluster is asked: the CLI starts fast

        actors = list_actors(
            address=target.address,
            filters=[("state", "=", "ALIVE")],
            detail=True,
            limit=10_000,
            raise_on_missing_output=False,
        )
    except Exception as err:  # the state API is unavailable: status still lists the runs
        log.debug("state API: %s", err)
        return []
    workers = shared_workers(actors)
    with target.local.environment() if target.local is not None else contextlib.nullcontext():
        return by_gpu(workers, read_gpu_ids(workers))


def shared_workers(actors) -> list[dict]:
    """The alive training workers holding a GPU fraction below 1 (Ray state API actors), one dict each:
    run, run_uri, node, share; a light sweep trial (elastic.sweep.trial.is_light) trains in its Tune trainable."""
    found = []
    for actor in actors:
        light = "ImplicitFunc" in (actor.class_name or "")  # a Tune function trainable: a light trial trains in it
        if not (light or "RayTrainWorker" in (actor.class_name or "")) or actor.state != "ALIVE":
            continue
        share = gpu_share(actor.required_resources or {})
        env = _env_vars(actor.serialized_runtime_env)
        if not 0 < share < 1 or not (light or RUN_VARIABLE in env):
            continue
        if light:  # its runtime env is the sweep's, shared by every trial: no run name to read, its process then
            found.append(
                {"run": f"light trial (pid {actor.pid})", "run_uri": None, "node": actor.node_id, "share": share}
            )
        else:
            found.append(
                {"run": env[RUN_VARIABLE], "run_uri": env.get(RUN_URI_VARIABLE), "node": actor.node_id, "share": share}
            )
    return found


def by_gpu(workers: list[dict], gpu_ids: dict[str, dict[str, list[str]]]) -> list[dict]:
    """Group shared workers by GPU: [{node, gpu, runs: [{run, share}], used}], busiest first. `gpu_ids`:
    {run: {node: [gpu ids]}} from the runs' gpus.json; without an entry a worker is placed on its node ("?")."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for worker in workers:
        ids = gpu_ids.get(worker["run"], {}).get(worker["node"]) or ["?"]
        groups[(worker["node"], ",".join(ids))].append({"run": worker["run"], "share": worker["share"]})
    rows = [
        {
            "node": node,
            "gpu": gpu,
            "runs": sorted(runs, key=lambda r: r["run"]),
            "used": round(sum(r["share"] for r in runs), 4),
        }
        for (node, gpu), runs in groups.items()
    ]
    return sorted(rows, key=lambda r: (-r["used"], r["node"], r["gpu"]))


def read_gpu_ids(workers: list[dict]) -> dict[str, dict[str, list[str]]]:
    """{run: {node: [gpu ids]}} from each shared run's gpus.json (best effort: unreadable ones are left out)."""
    from elastic.storage import fsspec_filesystem, parse_uri
    from elastic.worker.sharing import GPUS_FILE

    ids: dict[str, dict[str, list[str]]] = {}
    for run, uri in {(w["run"], w["run_uri"]) for w in workers if w["run_uri"]}:
        try:
            fs, path = fsspec_filesystem(parse_uri(uri).child(GPUS_FILE).uri)
            with fs.open(path, "r") as handle:
                ranks = json.load(handle)
        except Exception as err:  # a bucket this machine cannot read: the node alone is shown
            log.debug("gpus.json of %s unreadable: %s", run, err)
            continue
        ids[run] = {entry["node"]: entry["gpus"] for entry in ranks}
    return ids


def gpu_share(resources: dict) -> float:
    """A worker's GPU fraction: `GPU`, or inside a placement group (Ray Train's) `GPU_group_<pg>` and
    `GPU_group_<bundle>_<pg>`, each the bundle's amount."""
    amounts = [float(v) for k, v in resources.items() if k == "GPU" or k.startswith("GPU_group_")]
    return max(amounts, default=0.0)


def _env_vars(serialized: str | None) -> dict:
    try:
        return dict((json.loads(serialized or "{}") or {}).get("env_vars") or {})
    except (ValueError, TypeError, AttributeError):
        return {}
