"""`elastic watch-preemption`: the preemption watcher (a daemon on each spot node)."""

from __future__ import annotations

import sys

import click

from elastic.errors import UserError


@click.command("watch-preemption")
@click.option(
    "--provider",
    default="auto",
    show_default=True,
    type=click.Choice(["aws", "gcp", "azure", "auto"]),
    help="Whose metadata service to read; auto probes each briefly and exits 0 off-cloud.",
)
@click.option(
    "--metadata-url",
    envvar="ELASTIC_METADATA_URL",
    help="Metadata service base URL (default: http://169.254.169.254; env ELASTIC_METADATA_URL).",
)
@click.option(
    "--node-id",
    envvar="ELASTIC_NODE_ID",
    help="Ray node to drain, hex (default: the Ray node on this host; env ELASTIC_NODE_ID).",
)
@click.option("--address", help="Ray GCS address HOST:PORT (default: RAY_ADDRESS, else the cluster this host joined).")
@click.option("--poll-seconds", default=5.0, show_default=True, type=float, help="Seconds between polls.")
@click.option(
    "--margin-seconds",
    default=2.0,
    show_default=True,
    type=float,
    help="Drain deadline = the cloud's deadline minus this.",
)
@click.option("--once", is_flag=True, help="Poll once, act on what it shows, and exit (1 if the service is down).")
@click.option(
    "--drain-now",
    "drain_now_seconds",
    type=float,
    metavar="SECONDS",
    help="The node is shutting down now (a Kubernetes preStop hook, a VM's shutdown unit): drain it with a "
    "deadline SECONDS - margin from now, hold until then or until Ray ends the node, and exit. Reads no metadata.",
)
def watch_preemption_cmd(
    provider: str,
    metadata_url: str | None,
    node_id: str | None,
    address: str | None,
    poll_seconds: float,
    margin_seconds: float,
    once: bool,
    drain_now_seconds: float | None,
) -> None:
    """Turn this node's spot reclaim notice into a Ray drain (reason PREEMPTION), once per reclaim.

    Reads AWS IMDSv2 (spot/instance-action; rebalance recommendations are only logged), GCP
    (instance/preempted, maintenance-event; ~30 s notice) or Azure Scheduled Events (Preempt, acknowledged once
    drained), and logs one line per event. Runs until stopped; metadata outages are retried with backoff.

    \b
    Example:
      sudo systemd-run --unit elastic-watcher -p Restart=always --uid "$(id -u)" elastic watch-preemption --provider aws
    """
    import re

    from elastic.preemption.drain import RayDrainer
    from elastic.preemption.watcher import WatchConfig, drain_now, watch

    if not poll_seconds > 0:
        raise UserError(f"--poll-seconds must be > 0, got {poll_seconds:g}")
    if not margin_seconds >= 0:
        raise UserError(f"--margin-seconds must be >= 0, got {margin_seconds:g}")
    if node_id is not None and not re.fullmatch(r"[0-9a-f]{56}", node_id):
        raise UserError(f"--node-id must be a Ray node id (56 hex digits, as `ray list nodes` shows), got {node_id!r}")
    if metadata_url is not None and not re.match(r"https?://[^/]+", metadata_url):
        raise UserError(f"--metadata-url must be an http:// URL, got {metadata_url!r}")
    if drain_now_seconds is not None:
        if not drain_now_seconds > margin_seconds:
            raise UserError(
                f"--drain-now must be more than --margin-seconds ({margin_seconds:g}), got {drain_now_seconds:g}"
            )
        sys.exit(drain_now(RayDrainer(address=address, node_id=node_id), drain_now_seconds, margin_seconds))
    config = WatchConfig(poll_seconds=poll_seconds, margin_seconds=margin_seconds)
    sys.exit(watch(provider, metadata_url, address=address, node_id=node_id, config=config, once=once))
