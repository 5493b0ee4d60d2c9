"""The CLI starts without torch, Ray or matplotlib (docs/architecture.md): they load only in the verbs that need
them. Importing torch alone costs seconds of CPU, and the tests and users start the CLI hundreds of times."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "ray", "matplotlib")


def test_the_cli_and_its_help_load_no_heavy_library():
    probe = (
        "import json, sys\n"
        "from click.testing import CliRunner\n"
        "from elastic.cli.main import cli\n"
        "result = CliRunner().invoke(cli, ['--help'])\n"
        f"print(json.dumps([result.exit_code, sorted(m for m in {HEAVY!r} if m in sys.modules)]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    exit_code, loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert exit_code == 0 and loaded == [], loaded
