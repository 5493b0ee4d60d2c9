"""Checks of cluster configs (`ray up` YAMLs for AWS and GCP, KubeRay RayCluster manifests) before they cost money.

Every check is a pure function from a loaded config to a list of `Problem`s, each naming the key and the fix.
For `ray up` files Ray's own schema check runs first (on the config as `ray up` prepares it); ours then cover
what this project relies on and what Ray does not check:

- a spot and an on-demand GPU worker type exist, labeled as jobs select them (placement/labels.py);
- the head is on-demand, labeled elastic-role=head, and offers no CPUs or GPUs to training;
- spot types start `elastic watch-preemption` as a systemd unit that restarts it (KubeRay: the Ray container's
  preStop hook drains with `--drain-now`, within the pod's grace period);
- every node installs elastic from a checkout that file_mounts ship, or a pinned release;
- Ray token authentication is on for every node, the token reaches the nodes, the dashboard is not bound to all
  interfaces and no port but SSH is opened to the world;
- checkpoint storage named in the nodes' environment is an object store, not a node's disk;
- cloud fields Ray passes through unchecked: AWS `InstanceMarketOptions` (Ray accepts `MarketType: spott`),
  GCP `scheduling`, and for KubeRay KubeRay's own CRD schema (vendored), spot node selectors and tolerations,
  grace periods, a rate-limited autoscaler, the head's own service account and its affinity off spot nodes.

The policy on open ports: SSH (22) from anywhere is allowed because Ray's AWS bootstrap always adds it to the
security group it creates and nodes accept keys only; any other port open to 0.0.0.0/0 or ::/0 is a problem.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
from pathlib import Path

import jsonschema
import ray.autoscaler
from ray.autoscaler._private.util import fillout_defaults, prepare_config, validate_config  # private: below

from elastic.clusterconfig.kuberay import check_kuberay
from elastic.clusterconfig.problems import Problem, key_path, one_line, unique
from elastic.clusterconfig.rules import check_ray_up
from elastic.config.documents import load_yaml, read_document
from elastic.errors import ClusterConfigError

# ray.autoscaler._private.util is private: it is what `ray up` runs on a config; Ray 2.60 has no public
# validation or defaults-filling API.

__all__ = ["ClusterConfigError", "Problem", "config_kind", "load_config", "validate", "validate_file"]


# ---------------------------------------------------------------------------------------------------------
# entry points


def load_config(path: str | Path) -> dict:
    path = Path(path)
    text = read_document(path, "cluster config", ClusterConfigError)
    data, _ = load_yaml(text, str(path), ClusterConfigError)
    if not isinstance(data, dict):
        raise ClusterConfigError(f"{path}: expected a `ray up` config or a RayCluster manifest (a mapping)")
    return data


def config_kind(config: dict) -> str:
    """'kuberay' for a RayCluster manifest, else the `ray up` provider type ('aws', 'gcp', ...)."""
    if config.get("kind") == "RayCluster" or str(config.get("apiVersion", "")).startswith("ray.io/"):
        return "kuberay"
    provider = config.get("provider")
    if isinstance(provider, dict) and isinstance(provider.get("type"), str):
        return provider["type"]
    return "unknown"


def validate_file(path: str | Path) -> tuple[str, list[Problem]]:
    config = load_config(path)
    return config_kind(config), validate(config)


def validate(config: dict) -> list[Problem]:
    kind = config_kind(config)
    if kind == "kuberay":
        return unique(check_kuberay(config))
    if kind == "unknown":
        return [
            Problem(
                "provider.type",
                "no provider.type and not a RayCluster manifest; this command checks "
                "`ray up` configs (provider.type: aws or gcp) and KubeRay RayClusters",
            )
        ]
    problems = ray_schema_problems(config)
    if problems:  # our checks assume the shape Ray's schema guarantees
        return problems
    if kind not in ("aws", "gcp"):
        return [
            Problem(
                "provider.type",
                f"'{kind}' clusters are not covered by these checks; "
                "use provider.type aws or gcp, or a KubeRay RayCluster",
            )
        ]
    # Check what `ray up` will run: omitted top-level keys come from Ray's defaults for the provider.
    full = fillout_defaults(copy.deepcopy(config))
    return unique(check_ray_up(full, kind))


# ---------------------------------------------------------------------------------------------------------
# Ray's own schema


def ray_schema_problems(config: dict) -> list[Problem]:
    """Ray's schema check, on the config as `ray up` prepares it (the raw YAML lacks fields Ray fills in)."""
    quiet = logging.getLogger("ray.autoscaler._private.util")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # prepare_config logs routine INFO lines ("setting max workers ...")
    # Ray's CLI logger writes its advice to stdout (e.g. that a file in file_mounts would not update inside a docker
    # container); our report, --json included, owns stdout.
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            validate_config(prepare_config(copy.deepcopy(config)))
    except jsonschema.ValidationError as err:
        return [Problem(key_path(err.absolute_path) or "(top level)", f"{one_line(err.message)} (Ray's schema)")]
    except Exception as err:  # Ray raises ValueError, KeyError, NotImplementedError...: report, don't crash
        # Preparing a config of the wrong shape fails before Ray's schema runs (a list where a mapping belongs
        # gives "list indices must be integers"): the schema on the file as written names the field instead.
        shape = _raw_schema_problem(config)
        if shape is not None:
            return [shape]
        return [Problem("(config)", f"{one_line(str(err)) or type(err).__name__} (Ray's config check)")]
    finally:
        quiet.setLevel(level)
    return []


def _raw_schema_problem(config: dict) -> Problem | None:
    """The first type or shape error of Ray's schema on the config as written (missing fields are not errors
    here: `ray up` fills them in)."""
    schema = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
    for err in sorted(jsonschema.Draft7Validator(schema).iter_errors(config), key=lambda e: list(e.absolute_path)):
        if err.validator != "required":
            return Problem(key_path(err.absolute_path) or "(top level)", f"{one_line(err.message)} (Ray's schema)")
    return None
