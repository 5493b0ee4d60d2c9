"""The `elastic` command line: the click group (cli.main) and one module per verb group."""

from elastic.cli.main import cli, main

__all__ = ["cli", "main"]
