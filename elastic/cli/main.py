"""The `elastic` command: thin; every verb calls library functions.

User errors print one line and exit 2; a job that fails exits 1.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from elastic import logs
from elastic.cli import (
    bench,
    chaos,
    checkpoints,
    cluster,
    data,
    demo,
    jobs,
    local,
    pack,
    preempt,
    report,
    spec,
    sweep,
    verify,
    watch,
)
from elastic.driver.auth import auth_failure
from elastic.errors import ElasticError, JobFailed, UserError
from elastic.local import exports
from elastic.local import state as local_state
from elastic.local.processes import MARKER_VARIABLE


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="elastic-train")
@click.option("-v", "--verbose", is_flag=True, help="Debug lines too (also in the jobs and workers started).")
@click.option("-q", "--quiet", is_flag=True, help="Warnings and errors only.")
def cli(verbose: bool, quiet: bool) -> None:
    """Elastic PyTorch training on spot and on-demand Ray clusters.

    \b
    Example:
      elastic local up
      elastic submit jobs/digits_ddp.yaml --follow
      elastic -v submit jobs/digits_ddp.yaml --follow   # with debug lines, Ray Train's per-report ones too
      elastic local down
    """
    if verbose and quiet:
        raise click.UsageError("-v and -q contradict each other; pass one")
    level = logging.DEBUG if verbose else logging.WARNING if quiet else None
    if level is not None:
        # Children (job drivers, workers, local daemons) read it from the environment.
        os.environ[logs.LEVEL_VARIABLE] = logging.getLevelName(level)
    # With --json, stdout holds the JSON document alone: log lines (a retried node start, say) go to stderr.
    logs.configure(level, to_stderr="--json" in sys.argv[1:])
    # Exports of a local stack that is gone (a `down` and a new `up` since this shell's eval) would send the verb
    # to dead ports: dropped, with a warning. `local` verbs go by the stack's state file (`local up` warns itself).
    # Not inside the stack's own processes (its watchers start while `up` is still running) and not for the
    # stack in the state file, complete or not: only exports of another stack are stale.
    if click.get_current_context().invoked_subcommand != "local" and MARKER_VARIABLE not in os.environ:
        exports.forget_stale(
            local_state.load_state(),
            'run eval "$(elastic local env)" again, or eval "$(elastic local env --unset)"',
            warn=lambda line: click.echo(f"warning: {line}", err=True),
        )
    # The local stack's Ray token for the verbs that talk to it, set before any of them imports Ray (Ray reads
    # RAY_AUTH_MODE once, at import); a verb given --address talks to that cluster with its own auth.
    local_state.use_stack_auth(targets_elsewhere="--address" in sys.argv)


for command in (
    local.local_group,
    spec.spec_group,
    data.data_group,
    jobs.submit_cmd,
    jobs.run_cmd,
    jobs.status_cmd,
    jobs.logs_cmd,
    jobs.stop_cmd,
    checkpoints.checkpoints_group,
    report.report_cmd,
    verify.verify_resume_cmd,
    chaos.chaos_group,
    bench.bench_group,
    sweep.sweep_cmd,
    pack.pack_cmd,
    demo.demo_cmd,
    cluster.cluster_group,
    preempt.preempt_cmd,
    watch.watch_preemption_cmd,
):
    cli.add_command(command)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as err:
        err.show()
        sys.exit(err.exit_code)
    except UserError as err:
        # One line whatever the message holds (a value from the user's file may carry a newline).
        click.echo("error: " + " ".join(str(err).splitlines()), err=True)
        sys.exit(err.exit_code)
    except JobFailed as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
    except ElasticError as err:
        click.echo(f"error: {err}", err=True)
        sys.exit(1)
    except KeyboardInterrupt:
        click.echo("interrupted", err=True)
        sys.exit(130)
    except Exception as err:
        # Ray refusing our token can surface from any verb that talks to a cluster (ray.init, the job API, the
        # state API): one line naming the fix, exit 2. Anything else is a bug and keeps its traceback.
        refused = auth_failure(err)
        if refused is None:
            raise
        click.echo(f"error: {refused}", err=True)
        sys.exit(refused.exit_code)


if __name__ == "__main__":
    main()
