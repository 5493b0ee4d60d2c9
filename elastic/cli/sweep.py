"""`elastic sweep`: a hyperparameter sweep on Ray Tune."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from elastic.cli.common import console
from elastic.cli.remote import finish, remote_options, run_remotely
from elastic.driver.remote import remote_address


@click.command("sweep")
@click.argument("sweep_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "--set",
    "overrides",
    multiple=True,
    metavar="FIELD=VALUE",
    help="Override a sweep field, e.g. --set num_samples=4 --set gpu_share=0.5.",
)
@click.option(
    "--resume",
    is_flag=True,
    help="Require an existing sweep to restore (running it again restores one anyway when there is one).",
)
@click.option("--json", "as_json", is_flag=True, help="Print trials, best_config, plan as JSON (progress on stderr).")
@remote_options
def sweep_cmd(
    sweep_file: Path, overrides: tuple[str, ...], resume: bool, as_json: bool, address: str | None, detach: bool
) -> None:
    """Run a hyperparameter sweep whose trials share GPUs (Ray Tune over Ray Train V2).

    Each trial runs the sweep's job under its own run name; running the same sweep again restores the
    experiment and resumes unfinished trials from their checkpoints.

    \b
    Example:
      elastic local up --spot 2 --on-demand 1 --gpus-per-node 2 --cpus-per-node 2
      elastic sweep jobs/digits_sweep.yaml
      elastic sweep jobs/digits_sweep.yaml --address http://127.0.0.1:8265   # its driver runs as a Ray job
    """
    from elastic.config.sweep_spec import load_sweep_spec

    spec, job = load_sweep_spec(sweep_file, overrides)  # bad input: one line here, before anything is submitted
    if address := remote_address(address):
        # One driver per sweep: run again (e.g. after the laptop disconnected), it follows the running one.
        result = run_remotely(address, f"sweep {spec.name}", as_json, detach, attach_running=True)
        if result is None:
            return
    else:
        from elastic.sweep import runner as sweeps  # Ray Tune: only where the sweep runs

        sweeps.connect(job)
        say = (lambda m: click.echo(f"[sweep] {m}", err=True)) if as_json else (lambda m: click.echo(f"[sweep] {m}"))
        with contextlib.redirect_stdout(sys.stderr) if as_json else contextlib.nullcontext():  # Tune prints too
            result = sweeps.run_sweep(spec, job, resume=resume, say=say)
            sweeps.disconnect()  # inside: Ray's background threads print warnings to stdout until then
    finish(result, as_json, _show_sweep)
    if result["errors"]:
        sys.exit(1)


def _show_sweep(result: dict) -> None:
    keys = sorted({k for t in result["trials"] for k in (t["params"] or {})})
    cloned = any(t.get("exploits") for t in result["trials"])  # PBT: each trial's lineage
    table = Table("trial", *keys, result["metric"], "state", "iters", "share", "restarts", *(["cloned"] * cloned))
    for t in result["trials"]:
        metric = t["metric"]
        lineage = [f"{e['from'].rsplit('-', 1)[-1]}@{e['step']}" for e in t.get("exploits", [])]
        table.add_row(
            t["trial_id"],
            *[_fmt(t["params"].get(k)) for k in keys],
            _fmt(metric),
            t["state"],
            str(t["iterations"]),
            str(t["gpu_share"]),
            str(t["restarts"]),
            *([", ".join(lineage) or "-"] * cloned),
        )
    Console(highlight=False, width=max(console.width, 140)).print(table)  # not folded in a pipe's 80 columns
    plan = result["plan"]
    console.print(f"packing: {plan['trials_per_gpu']} per GPU, share {plan['share']} ({plan['reason']})")
    console.print(
        f"best config ({result['mode']} {result['metric']} = {_fmt(result['best_metric'])}): "
        f"{json.dumps(result['best_config'])}"
    )


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
