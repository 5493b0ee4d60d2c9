"""Verbs that drive work, run from a laptop through a cluster's job API (elastic.driver.remote does the job side).

A verb decorated with `remote_options` takes `--address` and `--detach`. Given an http:// address it rebuilds
its own command line from click's parsed parameters, runs it as a Ray job, streams the job's output and
returns the result the job printed; the verb then shows it exactly as a local run would, through `finish`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import click

from elastic.cli.common import print_json
from elastic.driver import remote
from elastic.driver.submit import resolve_target
from elastic.errors import JobFailed, UserError

SKIPPED = ("address", "detach")


def remote_options(command: Callable) -> Callable:
    """--address and --detach, the same on every verb that can run through the job API."""
    command = click.option(
        "--detach", is_flag=True, help="With --address: return once the job is submitted; it goes on there."
    )(command)
    return click.option(
        "--address",
        metavar="URL",
        help="Run through this Ray job API (e.g. http://127.0.0.1:8265 through `ray dashboard CLUSTER.yaml`; "
        "default: an http:// RAY_ADDRESS, else here).",
    )(command)


def finish(result: dict, as_json: bool, show: Callable[[dict], None]) -> None:
    """Show a verb's result: a table or JSON here, or, inside a remote verb's job, the line its client reads."""
    if remote.is_remote_job():
        click.echo(remote.result_line(result))
    elif as_json:
        print_json(result)
    else:
        show(result)


def run_remotely(address: str, key: str, as_json: bool, detach: bool, attach_running: bool = False) -> dict | None:
    """Run the current verb as a Ray job at `address`; its result, or None when detached.

    `key` names the work (e.g. "sweep digits-sweep"): with attach_running, a job of the same key still running
    is followed instead of starting a second driver (a sweep run again after the laptop disconnected)."""
    context = click.get_current_context()
    target = resolve_target(address)
    argv = command_line(context)
    job = remote.start(target, argv, key, Path.cwd(), attach_running=attach_running)
    say = lambda message: click.echo(f"[elastic] {message}", err=True)  # noqa: E731
    say(f"{'following the running' if job.attached else 'submitted'} Ray job {job.job_id} at {address}")
    later = (
        f"follow it with `elastic logs {job.job_id} --address {address}`, "
        f"stop it with `elastic stop {job.job_id} --address {address}`"
    )
    if detach:
        say(f"detached; {later}")
        return None
    out = sys.stderr if as_json else sys.stdout
    try:
        status, result = remote.follow(target, job.job_id, write=lambda line: (out.write(line), out.flush()))
    except KeyboardInterrupt:
        say(f"interrupted here; the job goes on on the cluster: {later}")
        sys.exit(130)
    if result is None:
        raise JobFailed(job.job_id, status, "it printed no result; its output is above")
    return result


def command_line(context: click.Context) -> list[str]:
    """The verb's words and options as the user gave them (after defaults), minus --address/--detach."""
    words: list[str] = []
    node: click.Context | None = context
    while node is not None and node.parent is not None:  # the root's name is the program's, not a word
        words.insert(0, node.info_name)
        node = node.parent
    for param in context.command.params:
        if param.name in SKIPPED:
            continue
        value = context.params.get(param.name)
        if isinstance(param, click.Argument):
            words += [_portable(v) for v in value] if isinstance(value, tuple) else [_portable(value)]  # nargs=-1
            continue
        if param.is_flag and not param.secondary_opts:
            if value:
                words.append(param.opts[0])
        elif param.is_flag:
            words.append(param.opts[0] if value else param.secondary_opts[0])
        elif param.multiple:
            for item in value or ():
                words += [param.opts[0], _portable(item)]
        elif value is not None:
            words += [param.opts[0], _portable(value)]
    return words


def _portable(value) -> str:
    """Paths travel relative to the working directory, which the job receives as its working_dir."""
    if not isinstance(value, Path):
        return str(value)
    here = Path.cwd().resolve()
    try:
        return str(value.resolve().relative_to(here))
    except ValueError:
        raise UserError(
            f"{value}: a file given to a verb run through --address must be inside the current directory "
            f"({here}), which travels with the job; copy it there or run from its folder"
        ) from None
