"""`elastic local ...`: the embedded local cluster (up, down, status, env, add-node)."""

from __future__ import annotations

import os
import shlex

import click
from rich.table import Table

from elastic.cli.common import console, err_console, print_json
from elastic.errors import UserError
from elastic.local.state import ENV_MARKER_VARIABLE


@click.group("local")
def local_group() -> None:
    """The embedded local cluster: a Ray head, simulated spot/on-demand nodes and an S3 endpoint."""


@local_group.command("up")
@click.option(
    "--spot",
    default=3,
    show_default=True,
    type=click.IntRange(0),
    help="Spot worker nodes (3: a 2-worker job plus one spare, so a reclaimed node's work goes on at once).",
)
@click.option("--on-demand", default=1, show_default=True, type=click.IntRange(0), help="On-demand worker nodes.")
@click.option("--cpus-per-node", default=1, show_default=True, type=click.IntRange(1), help="CPUs per worker node.")
@click.option(
    "--gpus-per-node",
    default=0,
    show_default=True,
    type=click.IntRange(0),
    help="Logical GPUs per worker node (GPU-requesting paths run on a CPU-only machine).",
)
@click.option(
    "--auth",
    default="token",
    show_default=True,
    type=click.Choice(["token", "none"]),
    help="Ray token auth (a token kept in the stack's home, given to every process), or none (anyone who can "
    "reach this machine's loopback can run code on the cluster).",
)
@click.option(
    "--s3",
    "s3_server",
    default="seaweedfs",
    show_default=True,
    type=click.Choice(["seaweedfs", "moto"]),
    help="The local S3 server: seaweedfs keeps objects on disk under the stack's home across down/up; moto "
    "keeps them in memory.",
)
@click.option(
    "--s3-faults",
    is_flag=True,
    help="Put a fault-injecting proxy in front of the S3 endpoint (steered over HTTP under /_elastic/faults).",
)
@click.option("--s3-fault-seed", default=0, show_default=True, type=int, help="Seed of the proxy's fault draws.")
@click.option("--json", "as_json", is_flag=True, help="Print addresses and nodes as JSON.")
def local_up(
    spot: int,
    on_demand: int,
    cpus_per_node: int,
    gpus_per_node: int,
    auth: str,
    s3_server: str,
    s3_faults: bool,
    s3_fault_seed: int,
    as_json: bool,
) -> None:
    """Start the local stack (or show it if it is already up).

    \b
    Examples:
      elastic local up --spot 2 --on-demand 1 --json
      elastic local up --auth none --s3 moto   # no token; objects in memory
      elastic local up --s3-faults
      curl -X POST "$AWS_ENDPOINT_URL/_elastic/faults/windows" -d '{"kind": "503", "seconds": 10}'
    """
    from elastic.local import stack as local
    from elastic.local.exports import forget_stale

    # On stderr, so --json's stdout stays one document (local.up would log it otherwise).
    forget_stale(
        None,
        'after `up`, run eval "$(elastic local env)" in this shell again',
        warn=lambda line: click.echo(f"warning: {line}", err=True),
    )
    if auth == "none":
        click.echo(
            "warning: --auth none: Ray token auth is off; any process that can reach this machine's loopback "
            "can join the cluster and run code on it",
            err=True,
        )
    # Progress on stderr, so --json's stdout stays one document.
    with err_console.status("starting the local stack") as spinner:
        state = local.up(
            spot=spot,
            on_demand=on_demand,
            gpus_per_node=gpus_per_node,
            cpus_per_node=cpus_per_node,
            auth=auth,
            s3=s3_server,
            s3_faults=s3_faults,
            s3_fault_seed=s3_fault_seed,
            progress=lambda step: spinner.update(f"starting the local stack: {step}"),
        )
    if as_json:
        print_json(state.summary())
    else:
        _show_stack(state.summary())
        console.print(
            'Use it from this shell: [bold]eval "$(elastic local env)"[/]; stop it: [bold]elastic local down[/]'
        )


@local_group.command("down")
def local_down() -> None:
    """Stop exactly what `elastic local up` started. Safe to run twice."""
    from elastic.local import stack as local

    state = local.load_state()
    stopped = local.down()
    click.echo(f"local stack stopped ({stopped} processes)" if stopped else "no local stack running")
    if state is not None and os.environ.get(ENV_MARKER_VARIABLE) == state.marker:
        click.echo('this shell still exports the stack\'s variables: eval "$(elastic local env --unset)"', err=True)


@local_group.command("status")
@click.option("--json", "as_json", is_flag=True)
def local_status(as_json: bool) -> None:
    """Show the local stack's addresses, nodes and processes."""
    from elastic.local import stack as local

    info = local.status()
    if as_json:
        print_json(info)
    elif not info["running"]:
        click.echo("no local stack running (start one with `elastic local up`)")
    else:
        _show_stack(info)
        dead = [role for role, alive in info["processes"].items() if not alive]
        if dead:
            console.print(f"[yellow]not running:[/] {', '.join(dead)}")


@local_group.command("env")
@click.option("--json", "as_json", is_flag=True)
@click.option("--unset", is_flag=True, help="Print the lines that remove what `elastic local env` exported.")
def local_env(as_json: bool, unset: bool) -> None:
    """Print shell exports so Ray's CLI, boto3 and s3fs use the local stack: eval "$(elastic local env)".

    \b
    Examples:
      eval "$(elastic local env)"
      eval "$(elastic local env --unset)"   # after `elastic local down`
    """
    from elastic.local import stack as local
    from elastic.local.exports import unset_lines

    if unset:
        for line in unset_lines():
            click.echo(line)
        return
    state = local.running_state()
    if state is None:
        raise UserError("no local stack running; start one with `elastic local up`")
    if as_json:
        print_json({"env": state.env()})
    else:
        # A token in RAY_AUTH_TOKEN would win over the stack's token file.
        click.echo("unset RAY_AUTH_TOKEN")
        for key, value in state.env().items():
            click.echo(f"export {key}={shlex.quote(value)}")


def _show_stack(info: dict) -> None:
    console.print(f"Ray:        {info['ray_address']}   job API: {info['dashboard_url']}")
    console.print(f"S3:         {info['s3_endpoint']}   bucket: {info['bucket']}   server: {info.get('s3_server')}")
    console.print(f"Ray auth:   {info.get('auth', 'token')}")
    if info.get("s3_upstream"):
        console.print(f"S3 faults:  {info['s3_endpoint']}/_elastic/faults   in front of {info['s3_upstream']}")
    table = Table("node", "market", "role", "cpus", "gpus", "node id")
    for node in info["nodes"]:
        table.add_row(
            node["name"], node["market"], node["role"], str(node["cpus"]), str(node["gpus"]), node["node_id"][:12]
        )
    console.print(table)


# ---------------------------------------------------------------------------------------------------------


@local_group.command("add-node")
@click.option("--market", required=True, type=click.Choice(["spot", "on-demand"]), help="The new node's market.")
@click.option("--cpus", type=click.IntRange(1), help="CPUs (default: as the stack's other worker nodes).")
@click.option("--gpus", type=click.IntRange(0), help="Logical GPUs (default: as the stack's other worker nodes).")
@click.option("--json", "as_json", is_flag=True, help="Print the new node as JSON.")
def local_add_node(market: str, cpus: int | None, gpus: int | None, as_json: bool) -> None:
    """Start one more labeled worker node on the running local stack; `local down` stops it with the rest.

    \b
    Example (spot capacity that is withheld, then returns):
      elastic local up --spot 0 --on-demand 2
      elastic submit jobs/digits_ddp.yaml --set workers.market=spot-first --set workers.spot_wait_seconds=10
      elastic local add-node --market spot --cpus 2
    """
    from elastic.local import stack as local

    node = local.add_node(market, cpus=cpus, gpus=gpus)
    if as_json:
        print_json(node)
    else:
        click.echo(
            f"added {node['name']} ({node['market']}, {node['cpus']} CPUs, {node['gpus']} GPUs): node {node['node_id']}"
        )
