"""Stand-ins for the few system tools a cluster config's commands call that this host cannot run for real.

A rehearsal runs as an ordinary user on a host without systemd (a container), so `sudo`, `systemd-run`,
`systemctl`, `apt-get` and `cloud-init` come from a folder put first on PATH. Each is a short shell script that
hands its arguments to `python -m elastic.rehearsal.shims NAME ...` (the rehearsal's interpreter):

- `sudo [VAR=VALUE...] CMD`: runs CMD with those variables (the user is the one the nodes would run as);
- `apt-get`, `cloud-init`: logged and skipped; the host's system packages are what they are (python3-venv
  included, which the configs install);
- `systemd-run --unit=U [-p Restart=always -p RestartSec=N -p StandardOutput=append:F -p ExecStop=C
  -p TimeoutStopSec=N --setenv=V=X ...] CMD`: a unit (units.py) that supervises CMD as systemd would: a clean
  environment (the unit's --setenv, plus the host's stand-ins for the cloud, listed in UNIT_PASSTHROUGH),
  restarted after it exits when Restart=always, ExecStop run on a stop;
- `systemctl stop|reset-failed|is-active U...` and `systemctl is-system-running` (`running`: the host is not
  shutting down).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

SHIMS = ("sudo", "systemd-run", "systemctl", "apt-get", "cloud-init")
STATE_VARIABLE = "ELASTIC_REHEARSAL_STATE"  # the rehearsal's folder: units/, shims.log
# Variables a unit keeps from the caller's environment, beside its --setenv: what stands in for the cloud on
# this host (the metadata endpoint, the S3 endpoint and keys an instance profile would give, the Ray node the
# watcher drains, the rehearsal's own bookkeeping). systemd gives a unit none of the caller's environment.
UNIT_PASSTHROUGH = (
    "ELASTIC_METADATA_URL",
    "ELASTIC_NODE_ID",
    "RAY_ADDRESS",
    "AWS_ENDPOINT_URL",
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "ELASTIC_LOGICAL_GPUS",
    STATE_VARIABLE,
    "ELASTIC_REHEARSAL_NODE",  # which rehearsed node the process belongs to (a reclaim kills that node's)
    "ELASTIC_LOCAL_STACK",  # the rehearsal's marker: it finds and stops everything it started
)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def install(bin_dir: Path) -> Path:
    """Write the shims into bin_dir; returns it (put it first on PATH)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name in SHIMS:
        path = bin_dir / name
        path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m elastic.rehearsal.shims {name} "$@"\n')
        path.chmod(0o755)
    return bin_dir


def _state_dir() -> Path:
    return Path(os.environ[STATE_VARIABLE])


def _units_dir() -> Path:
    path = _state_dir() / "units"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _note(line: str) -> None:
    with open(_state_dir() / "shims.log", "a") as out:
        out.write(f"{time.strftime('%H:%M:%S')} {line}\n")


def sudo(args: list[str]) -> int:
    env = dict(os.environ)
    while args and (args[0].startswith("-") or re.match(r"[A-Za-z_][A-Za-z0-9_]*=", args[0])):
        if args[0] in ("-u", "-g", "-C", "-h", "-p", "-U"):  # options with a value
            args = args[1:]
        elif not args[0].startswith("-"):
            key, _, value = args[0].partition("=")
            env[key] = value
        args = args[1:]
    if not args:
        return 0
    return subprocess.call(args, env=env)


def skipped(name: str, args: list[str]) -> int:
    _note(f"{name} {' '.join(args)}: skipped (the host's own packages stand in)")
    return 0


def systemd_run(args: list[str]) -> int:
    unit, properties, setenv, command = None, {}, {}, []
    it = iter(args)
    for arg in it:
        if command or not arg.startswith("-"):
            command.append(arg)
            command.extend(it)
            break
        name, _, value = arg.partition("=")
        if name in ("-p", "--property"):
            value = value or next(it)
            key, _, prop = value.partition("=")
            properties[key] = prop
        elif name == "--unit":
            unit = value or next(it)
        elif name == "--setenv":
            key, _, var = (value or next(it)).partition("=")
            setenv[key] = var
        elif name in ("--uid", "--gid", "--description", "--slice"):
            value or next(it)
        # --collect, --quiet, --no-block...: no effect on a supervised process here
    if not unit or not command:
        print("systemd-run (rehearsal): --unit and a command are required", file=sys.stderr)
        return 1
    env = {k: os.environ[k] for k in UNIT_PASSTHROUGH if k in os.environ}
    env.update(HOME=os.environ["HOME"], USER=os.environ.get("USER", "root"), LANG="C.UTF-8")
    env["PATH"] = _unit_path()
    env.update(setenv)
    spec = {"unit": unit, "command": command, "properties": properties, "env": env}
    spec_path = _units_dir() / f"{unit}.json"
    spec_path.write_text(json.dumps(spec))
    stdout = properties.get("StandardOutput", "")
    log_path = stdout.split(":", 1)[1] if stdout.startswith(("append:", "file:")) else str(_units_dir() / f"{unit}.log")
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "elastic.rehearsal.units", str(spec_path)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    (_units_dir() / f"{unit}.pid").write_text(str(proc.pid))
    _note(f"systemd-run --unit={unit}: started (pid {proc.pid})")
    return 0


def _unit_path() -> str:
    """The shims, then the system's PATH: a unit's own `systemctl` calls (an ExecStop) reach the shim."""
    shim_dir = next((p for p in os.environ.get("PATH", "").split(os.pathsep) if (Path(p) / "systemd-run").exists()), "")
    return os.pathsep.join([p for p in (shim_dir, SYSTEM_PATH) if p])


def _unit_pid(unit: str) -> int | None:
    path = _units_dir() / f"{unit.removesuffix('.service')}.pid"
    try:
        pid = int(path.read_text())
        os.kill(pid, 0)
        return pid
    except (OSError, ValueError):
        return None


def systemctl(args: list[str]) -> int:
    verbs = [a for a in args if not a.startswith("-")]
    if not verbs:
        return 1
    verb, units = verbs[0], verbs[1:]
    if verb == "is-system-running":
        print("running")
        return 0
    if verb == "is-active":
        active = all(_unit_pid(u) for u in units)
        print("active" if active else "inactive")
        return 0 if active else 3
    if verb == "reset-failed":
        return 0
    if verb == "stop":
        for unit in units:
            pid = _unit_pid(unit)
            if pid is None:
                continue
            os.kill(pid, signal.SIGTERM)  # the supervisor runs ExecStop, then stops its process
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and _unit_pid(unit):
                time.sleep(0.2)
            _note(f"systemctl stop {unit}")
        return 0
    print(f"systemctl (rehearsal): {verb} is not supported", file=sys.stderr)
    return 1


def main(argv: list[str]) -> int:
    name, args = argv[0], argv[1:]
    if name == "sudo":
        return sudo(args)
    if name in ("apt-get", "cloud-init"):
        return skipped(name, args)
    if name == "systemd-run":
        return systemd_run(args)
    if name == "systemctl":
        return systemctl(args)
    print(f"unknown shim {name}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
