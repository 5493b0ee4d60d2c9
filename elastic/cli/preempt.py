"""`elastic preempt`: a spot reclaim on the local cluster."""

from __future__ import annotations

import click

from elastic.cli.common import print_json
from elastic.errors import UserError


@click.command("preempt")
@click.option("--node", "node", metavar="NAME|ID", help="The worker node to reclaim (name such as spot-0, or node id).")
@click.option("--random", "pick_random", is_flag=True, help="Pick the node(s) at random (of --market, if given).")
@click.option("--market", type=click.Choice(["spot", "on-demand"]), help="Reclaim node(s) of this market.")
@click.option(
    "--count",
    default=1,
    show_default=True,
    type=click.IntRange(1),
    help="Reclaim this many nodes at the same moment (correlated reclaims).",
)
@click.option(
    "--notice",
    type=click.FloatRange(0),
    help="Seconds of notice before the node dies (AWS gives 120, GCP and Azure 30). Default 30.",
)
@click.option("--hard", is_flag=True, help="Kill without notice.")
@click.option(
    "--replace-after",
    type=click.FloatRange(0),
    metavar="SECONDS",
    help="Start a like node this long after the kill, as an autoscaler would.",
)
@click.option("--json", "as_json", is_flag=True)
def preempt_cmd(
    node: str | None,
    pick_random: bool,
    market: str | None,
    count: int,
    notice: float | None,
    hard: bool,
    replace_after: float | None,
    as_json: bool,
) -> None:
    """Simulate a spot reclaim on the local stack: the node's metadata endpoint announces it, its watcher
    drains the Ray node, the run takes a just-in-time checkpoint, and the node dies at the deadline.

    \b
    Examples:
      elastic preempt --market spot --notice 20            # during `elastic submit jobs/digits_ddp.yaml`
      elastic preempt --node spot-1 --hard --replace-after 10
      elastic preempt --market spot --count 2 --notice 30  # two spot nodes at once
    """
    from elastic.local import preempt
    from elastic.local import stack as local

    if hard and notice is not None:
        raise UserError("--hard kills without notice; drop --notice (or drop --hard)")
    if node is not None and (pick_random or market or count > 1):
        raise UserError("--node names one node; drop --random/--market/--count")
    state = local.running_state()
    if state is None:
        raise UserError("no local stack running; start one with `elastic local up`")
    nodes = preempt.select_nodes(state, node=node, pick_random=pick_random, market=market, count=count)
    log = (lambda line: click.echo(line, err=True)) if as_json else click.echo
    report = preempt.preempt(
        nodes,
        notice=None if hard else (30.0 if notice is None else notice),
        hard=hard,
        replace_after=replace_after,
        log=log,
    )
    if as_json:
        print_json(report.to_json())
