"""What a rehearsal reports: each phase with its duration and result, the run's lost steps, every rewrite made
for one host, and what stands in for the cloud."""

from __future__ import annotations

from dataclasses import dataclass, field


class RehearsalFailed(RuntimeError):
    pass


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    ok: bool = False
    detail: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"name": self.name, "seconds": round(self.seconds, 1), "ok": self.ok, **self.detail}


@dataclass
class Report:
    config: str
    provider: str
    phases: list[Phase] = field(default_factory=list)
    run: str | None = None
    lost_steps: int | None = None
    preemptions: int | None = None
    error: str | None = None
    workdir: str | None = None
    rewrites: dict[str, list[str]] = field(default_factory=dict)  # by node role, in the order made

    @property
    def ok(self) -> bool:
        return self.error is None and self.lost_steps == 0 and all(p.ok for p in self.phases)

    def to_json(self) -> dict:
        return {
            "config": self.config,
            "provider": self.provider,
            "ok": self.ok,
            "run": self.run,
            "lost_steps": self.lost_steps,
            "preemptions": self.preemptions,
            "error": self.error,
            "phases": [p.to_json() for p in self.phases],
            "rewrites": self.rewrites,
            "stand_ins": STAND_INS,
            "workdir": self.workdir,
        }


STAND_INS = [
    "sudo, systemd-run, systemctl, apt-get, cloud-init: shims (elastic.rehearsal.shims); units are supervised "
    "processes with systemd's Restart=, ExecStop= and StandardOutput=",
    "the cloud's metadata service: elastic.local.metadata_server on 127.0.0.1 (ELASTIC_METADATA_URL)",
    "the checkpoint bucket: a local S3 endpoint (AWS_ENDPOINT_URL and keys, as an instance profile gives)",
    "three nodes on one host: each has its own HOME and Ray temp dir; the watcher is told its node "
    "(ELASTIC_NODE_ID) and the cluster (RAY_ADDRESS), which a host with one raylet finds itself",
    "no GPU: the node types' GPUs are Ray resources only (ELASTIC_LOGICAL_GPUS=1)",
    "this machine's pip settings (index, wheel folders, cache) in the fresh HOMEs: the install is the config's",
]
