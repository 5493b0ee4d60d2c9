"""`python -m elastic ...` is the `elastic` command (used as the Ray job entrypoint)."""

from elastic.cli import main

main()
