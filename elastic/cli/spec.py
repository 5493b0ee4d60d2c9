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
def spec_check(job_file: Path, overrides: tuple[str, ...]) -> None:
    """Validate a job file and print it with defaults filled in."""
    from elastic.config.spec import load_job_spec
    from elastic.storage import require_filesystem

    spec = load_job_spec(job_file, overrides)
    require_filesystem(spec.checkpoint.uri)
    print_json(spec.model_dump(mode="json"))


# ---------------------------------------------------------------------------------------------------------
