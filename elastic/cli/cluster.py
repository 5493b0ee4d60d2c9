"""`elastic cluster validate`: check a `ray up` cluster config or a KubeRay manifest."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from elastic.cli.common import print_json


@click.group("cluster")
def cluster_group() -> None:
    """Cluster configs: `ray up` YAMLs (AWS, GCP) and KubeRay RayCluster manifests."""


@cluster_group.command("validate")
@click.argument("config_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help='Print {"file", "ok", "problems": [{"key", "message"}]}.')
def cluster_validate(config_file: Path, as_json: bool) -> None:
    """Check a cluster config before it costs money: Ray's own schema, then spot and on-demand GPU worker types,
    an on-demand head without training, the preemption watcher on spot nodes, market labels jobs select,
    token auth, no port open to the world but SSH, remote checkpoint storage, and the cloud fields Ray does not
    check (e.g. MarketType). Prints one line per problem (key and fix) and exits 2 on any.

    \b
    Example:
      elastic cluster validate cluster-configs/aws-spot-gpu.yaml
    """
    from elastic.clusterconfig.validate import validate_file

    kind, problems = validate_file(config_file)
    if as_json:
        print_json(
            {"file": str(config_file), "ok": not problems, "kind": kind, "problems": [p.to_json() for p in problems]}
        )
    elif not problems:
        click.echo(f"{config_file}: ok ({kind})")
    for problem in problems if not as_json else []:
        click.echo(f"{config_file}: {problem.key}: {problem.message}", err=True)
    if problems:
        sys.exit(2)
