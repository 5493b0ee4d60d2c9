"""`elastic spec ...`: the job spec's JSON schema and a spec file check."""

from __future__ import annotations

from pathlib import Path

import click

from elastic.cli.common import print_json


@click.group("spec")
def spec_group() -> None:
    """Job spec tools."""


@spec_group.command("schema")
def spec_schema() -> None:
    """Print the JSON Schema of job files (for editors: yaml-language-server)."""
    from elastic.config.spec import dump_schema

    click.echo(dump_schema())


@spec_group.command("check")
@click.argument("job_file", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--set", "overrides", multiple=True, metavar="FIELD=VALUE")
@click.option(
    "--working-dir",
    type=click.Path(file_okay=False, exists=True, path_type=Path),
    help="Folder the entrypoint is found in, as `submit` uploads it (default: the current directory).",
)
def spec_check(job_file: Path, overrides: tuple[str, ...], working_dir: Path | None) -> None:
    """Validate a job file, and its entrypoint as `submit` does (the file exists and defines the function),
    and print it with defaults filled in (values of credential-like env_vars shown as <redacted>)."""
    from elastic.config.entrypoint import check_entrypoint
    from elastic.config.spec import load_job_spec
    from elastic.storage import require_filesystem

    spec = load_job_spec(job_file, overrides)
    require_filesystem(spec.checkpoint.uri)
    for line in check_entrypoint(spec, (working_dir or Path.cwd()).resolve(), str(job_file)):
        click.echo(f"warning: {job_file}: {line}", err=True)
    click.echo(f"{job_file}: api {spec.api}, entrypoint {spec.entrypoint}", err=True)
    print_json(spec.redacted())


# ---------------------------------------------------------------------------------------------------------
