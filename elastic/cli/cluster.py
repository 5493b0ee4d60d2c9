"""`elastic cluster validate`: check a `ray up` cluster config or a KubeRay manifest."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from elastic.cli.common import print_json
from elastic.errors import UserError


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


@cluster_group.command("rehearse")
@click.argument("config_file", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the report (phases, durations, lost_steps) as JSON.")
@click.option("--keep", is_flag=True, help="Keep the rehearsal's folder (node HOMEs, logs); kept anyway on failure.")
@click.option(
    "--venv",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="A virtualenv (python3 -m venv PATH) that stands in for ~/elastic-venv on every node, as a machine image "
    "with it baked in would: the config's venv command finds it, its pip install of the checkout still runs. "
    "Rehearsing again with the same folder skips reinstalling torch and Ray.",
)
def cluster_rehearse(config_file: Path, as_json: bool, keep: bool, venv: Path | None) -> None:
    """Play a `ray up` config's node life cycle on this machine, everything but `ray up`'s cloud calls: copy its
    file_mounts, run its setup and head commands in a fresh HOME with a fresh venv, start one spot and one
    on-demand worker with their labels (the spot node's watcher against a local metadata server), submit
    jobs/digits_ddp.yaml through the job API with the config's token auth, reclaim the spot node through its
    metadata server, and check that the run finishes with 0 lost steps. Run it from the repository root, where
    `ray up` runs. Exits 1 when a phase fails; everything it started is stopped.

    \b
    Example:
      elastic cluster rehearse cluster-configs/aws-spot-gpu.yaml --json
    """
    import yaml

    from elastic.rehearsal.plan import PlanError
    from elastic.rehearsal.runner import rehearse

    try:
        report = rehearse(
            config_file, keep=keep, venv=venv, progress=lambda line: click.echo(f"[rehearse] {line}", err=True)
        )
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise UserError(
            f"{config_file}: not a YAML cluster config ({type(err).__name__}); pass a `ray up` YAML"
        ) from None
    except PlanError as err:
        raise UserError(f"{config_file}: {err}") from None
    if as_json:
        print_json(report.to_json())
    else:
        click.echo(f"run {report.run}: lost_steps {report.lost_steps}, preemptions {report.preemptions}")
        if report.workdir:
            click.echo(f"logs: {report.workdir}")
    if report.error:
        click.echo(f"rehearsal failed: {report.error}", err=True)
    if not report.ok:
        sys.exit(1)
