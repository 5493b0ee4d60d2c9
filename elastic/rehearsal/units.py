"""A systemd unit's supervision, for the `systemd-run` shim: run the command, restart it as Restart= says, run
ExecStop= on a stop, then stop the command (SIGTERM, SIGKILL after TimeoutStopSec=).

`python -m elastic.rehearsal.units SPEC.json`: the spec is what the shim parsed ({"unit", "command",
"properties", "env"}). The unit's state (its command's pid, its restarts) goes to <spec>.state.json, which the
rehearsal reads to check that a killed watcher came back.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

log = logging.getLogger("elastic.rehearsal.units")


def _seconds(value: str | None, default: float) -> float:
    if not value:
        return default
    return float(value.removesuffix("s"))


class Unit:
    def __init__(self, spec: dict, state_path: Path):
        self.name = spec["unit"]
        self.command = spec["command"]
        self.env = spec["env"]
        props = spec["properties"]
        self.restart_always = props.get("Restart") == "always"
        self.restart_seconds = _seconds(props.get("RestartSec"), 0.1)
        self.stop_timeout = _seconds(props.get("TimeoutStopSec"), 90.0)
        self.exec_stop = props.get("ExecStop")
        self.state_path = state_path
        self.stopping = threading.Event()
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def _record(self) -> None:
        state = {"unit": self.name, "pid": self.proc.pid if self.proc else None, "starts": self.starts}
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        tmp.replace(self.state_path)

    def run(self) -> int:
        code = 0
        while not self.stopping.is_set():
            self.proc = subprocess.Popen(self.command, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True)
            self.starts += 1
            self._record()
            log.info("%s: started %s (pid %d, start %d)", self.name, self.command[0], self.proc.pid, self.starts)
            code = self.proc.wait()
            if self.stopping.is_set() or not self.restart_always:
                break
            log.info("%s: exited with %s; restarting in %.1f s (Restart=always)", self.name, code, self.restart_seconds)
            self.stopping.wait(self.restart_seconds)
        return code

    def stop(self) -> None:
        """systemctl stop: ExecStop first (the command still runs), then SIGTERM, then SIGKILL at the timeout."""
        self.stopping.set()
        deadline = time.monotonic() + self.stop_timeout
        if self.exec_stop:
            log.info("%s: ExecStop", self.name)
            try:
                subprocess.run(["/bin/sh", "-c", self.exec_stop], env=self.env, timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s: ExecStop ran past TimeoutStopSec", self.name)
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        _signal_group(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s unit %(message)s", stream=sys.stdout)
    spec_path = Path(argv[0])
    unit = Unit(json.loads(spec_path.read_text()), spec_path.with_suffix(".state.json"))
    stopper = threading.Thread(target=unit.stop, daemon=True)
    signal.signal(signal.SIGTERM, lambda *_: None if unit.stopping.is_set() else stopper.start())
    code = unit.run()
    if stopper.is_alive():
        stopper.join()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
