"""The front door: a corpus of malformed job specs, sweep specs, cluster configs and --set values, each run through
the real `elastic` command (main(), as the console script runs it). Every one must end in exit status 2 and ONE
line on stderr naming the file (or the --set flag), the field and the fix; never a traceback, never a hang."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from elastic.cli import main
from elastic.config.documents import MAX_DOCUMENT_BYTES

ROOT = Path(__file__).resolve().parents[3]
JOB = (ROOT / "jobs" / "digits_ddp.yaml").read_text()
SWEEP = (
    (ROOT / "jobs" / "digits_sweep.yaml")
    .read_text()
    .replace("job: jobs/digits_ddp.yaml", f"job: {ROOT}/jobs/digits_ddp.yaml")
)

CLUSTER = (ROOT / "cluster-configs" / "aws-spot-gpu.yaml").read_text()
BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
    f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
    for i in range(9)
)  # billion laughs: 10^10 values from ten lines


def job(replace: str = "", by: str = "", add: str = "") -> str:
    assert replace in JOB, replace
    return JOB.replace(replace, by, 1) + add


def job_with(**fields) -> str:
    raw = yaml.safe_load(JOB)
    raw.update(fields)
    return yaml.safe_dump(raw)


def cluster_with(**fields) -> str:
    raw = yaml.safe_load(CLUSTER)
    raw.update(fields)
    return yaml.safe_dump(raw)


def sweep(replace: str = "", by: str = "", add: str = "") -> str:
    assert replace in SWEEP, replace
    return SWEEP.replace(replace, by, 1) + add


@dataclass(frozen=True)
class Case:
    id: str
    verb: tuple[str, ...]  # e.g. ("spec", "check"); the file goes after it
    content: str | bytes
    expect: tuple[str, ...]  # fragments of the one line: the field and the fix
    args: tuple[str, ...] = ()  # after the file (--set ...)
    names_file: bool = True  # False where the line names the --set flag instead
    project: tuple[tuple[str, bytes], ...] = ()  # files of a project folder given as --working-dir


def entry(target: str) -> str:
    return job("entrypoint: jobs/digits_ddp.py:train", f"entrypoint: {target}")


CHECK, SUBMIT, SWEEP_VERB, VALIDATE = ("spec", "check"), ("submit",), ("sweep",), ("cluster", "validate")

CORPUS = [
    # --- files that are not YAML text at all (each verb)
    Case("job-not-utf8", CHECK, JOB.encode() + b"\nname: caf\xe9\n", ("not UTF-8", "save the job file as UTF-8")),
    Case("job-latin1-whole", SUBMIT, "name: café\n".encode("latin-1"), ("not UTF-8",)),
    Case("job-binary", CHECK, bytes(range(256)) * 4, ("not UTF-8",)),
    Case("job-nul-bytes", CHECK, b"name: a\x00b\n", ("not valid YAML", "fix the syntax")),
    Case("job-empty", CHECK, "", ("must be a YAML mapping",)),
    Case("job-only-comments", CHECK, "# nothing here\n", ("must be a YAML mapping",)),
    Case("job-too-large", CHECK, "# x\n" * (MAX_DOCUMENT_BYTES // 4 + 1), ("too large for a job file", "limit 1 MiB")),
    Case("job-alias-bomb", CHECK, BOMB, ("alias bomb", "use fewer aliases")),
    Case("job-undefined-alias", CHECK, job("config:\n", "config:\n  bomb: *j\n"), ("undefined alias",)),
    Case("job-recursive-alias", CHECK, job("config:\n", "config: &c\n  self: *c\n"), ("refers to its own anchor",)),
    Case("job-deep-nesting", CHECK, "a: " + "[" * 3000 + "]" * 3000 + "\n", ("nested too deeply",)),
    Case("job-python-tag", CHECK, job(add="x: !!python/object/apply:os.system [echo hi]\n"), ("not valid YAML",)),
    Case("job-tab-indent", CHECK, job("  min: 2", "\tmin: 2"), ("not valid YAML",)),
    Case("job-unclosed-flow", CHECK, "workers: {min: 1\n", ("not valid YAML",)),
    Case("job-a-list", CHECK, "- name: x\n", ("must be a YAML mapping",)),
    Case("job-a-scalar", SUBMIT, "just words\n", ("must be a YAML mapping",)),
    # --- wrong types and values, field by field
    Case("job-name-int", CHECK, job("name: digits-ddp", "name: 12"), ("name:", "valid string")),
    Case("job-name-upper", CHECK, job("name: digits-ddp", "name: Digits"), ("name:", "use lowercase")),
    Case("job-name-huge", CHECK, job("name: digits-ddp", "name: " + "a" * 5000), ("name:", "use lowercase")),
    Case("job-entrypoint-list", CHECK, job("entrypoint: jobs/digits_ddp.py:train", "entrypoint: [a]"), ("entrypoint",)),
    Case(
        "job-entrypoint-no-fn",
        CHECK,
        job("entrypoint: jobs/digits_ddp.py:train", "entrypoint: x.py"),
        ("file.py:function",),
    ),
    Case("job-config-list", CHECK, job_with(config=[1, 2]), ("config", "valid dictionary")),
    Case("job-workers-scalar", CHECK, job_with(workers=2), ("workers", "valid dictionary")),
    Case("job-min-string", CHECK, job("  min: 2", "  min: two"), ("workers.min", "valid integer")),
    Case("job-min-zero", CHECK, job("  min: 2", "  min: 0"), ("workers.min", "greater than or equal to 1")),
    Case("job-min-float", CHECK, job("  min: 2", "  min: 1.5"), ("workers.min", "integer")),
    Case("job-keep-word", CHECK, job("  keep: 3", "  keep: three"), ("checkpoint.keep", "valid integer")),
    Case("job-max-below-min", CHECK, job("  max: 2", "  max: 1"), ("workers.max", "set max >= min")),
    Case("job-billion-workers", CHECK, job("  max: 2", "  max: 1000000000"), ("workers.max", "10000", "lower it")),
    Case("job-huge-int", CHECK, job("  min: 2", "  min: " + "9" * 400), ("workers.min",)),
    Case("job-cpus-negative", CHECK, job("  cpus: 1", "  cpus: -1"), ("workers.cpus", "greater than 0")),
    Case("job-cpus-nan", CHECK, job("  cpus: 1", "  cpus: .nan"), ("workers.cpus",)),
    Case("job-cpus-inf", CHECK, job("  cpus: 1", "  cpus: .inf"), ("workers.cpus",)),
    Case("job-gpus-absurd", CHECK, job("  gpus: 0", "  gpus: 100000"), ("workers.gpus", "lower it")),
    Case("job-market-typo", CHECK, job("  market: spot", "  market: spott"), ("workers.market", "'spot'")),
    Case("job-field-typo", CHECK, job("  max: 2", "  mx: 2"), ("workers.mx", "did you mean 'max'")),
    Case("job-unknown-top", SUBMIT, job(add="colour: blue\n"), ("colour: unknown field",)),
    Case("job-no-checkpoint", CHECK, job("checkpoint:\n", "x_checkpoint:\n"), ("x_checkpoint: unknown field",)),
    Case("job-missing-workers", CHECK, job("workers:\n", "zzz:\n").replace("zzz:", "# gone:"), ("workers",)),
    Case("job-no-cadence", CHECK, job("  every_steps: 50\n", ""), ("checkpoint", "every_steps or every_seconds")),
    Case("job-uri-empty", CHECK, job("  uri: s3://elastic/runs", '  uri: ""'), ("checkpoint.uri", "at least 1")),
    Case("job-env-list", CHECK, job(add="runtime_env: {env_vars: [A, B]}\n"), ("runtime_env.env_vars", "dictionary")),
    Case("job-env-nested", CHECK, job(add="runtime_env: {env_vars: {A: {b: 1}}}\n"), ("runtime_env.env_vars.A",)),
    Case("job-precision", CHECK, job(add="train: {precision: fp8}\n"), ("train.precision", "'fp32'")),
    Case("job-date-value", CHECK, job("  every_steps: 50", "  every_steps: 2024-01-01"), ("checkpoint.every_steps",)),
    Case("job-newline-key", CHECK, job_with(workers={"min": 1, "a\nb": 1}), ("workers.'a\\nb': unknown field",)),
    Case("job-key-is-int", CHECK, job(add="1: one\n"), ("unknown field",)),
    # --- the entrypoint, resolved as `submit` does (file exists, defines the function; never imported)
    Case("entry-no-file", CHECK, entry("jobs/nope.py:train"), ("entrypoint: jobs/nope.py not found", "fix the path")),
    Case("entry-no-function", CHECK, entry("jobs/digits_ddp.py:trian"), ("defines no function 'trian'", "train")),
    Case("entry-a-folder", CHECK, entry("jobs.py:train"), ("not found",), project=(("jobs.py/x", b""),)),
    Case("entry-syntax", CHECK, entry("t.py:train"), ("t.py:1: syntax error",), project=(("t.py", b"def train(:\n"),)),
    Case(
        "entry-latin1",
        CHECK,
        entry("t.py:train"),
        ("t.py", "fix the file"),
        project=(("t.py", b"x = 'caf\xe9'\ndef train(): pass\n"),),
    ),
    Case("entry-nul", CHECK, entry("t.py:train"), ("t.py",), project=(("t.py", b"def train():\x00\n"),)),
    Case("entry-set", CHECK, JOB, ("defines no function 'x'",), ("--set", "entrypoint=jobs/digits_ddp.py:x")),
    # --- --set values
    Case("set-no-equals", CHECK, JOB, ("expected FIELD=VALUE",), args=("--set", "workers.min"), names_file=False),
    Case("set-empty-key", CHECK, JOB, ("expected FIELD=VALUE",), args=("--set", "=3"), names_file=False),
    Case("set-wrong-type", CHECK, JOB, ("workers.min", "valid integer"), ("--set", "workers.min=lots"), False),
    Case("set-through-scalar", CHECK, JOB, ("min is not a mapping",), ("--set", "workers.min.x=1"), False),
    Case("set-typo", SUBMIT, JOB, ("workers.mx", "did you mean 'max'"), ("--set", "workers.mx=2"), False),
    Case("set-bad-yaml", CHECK, JOB, ("workers.min", "valid integer"), ("--set", "workers.min=[1"), False),
    Case("set-billion", CHECK, JOB, ("workers.min", "lower it"), ("--set", "workers.min=1e9"), False),
    Case("set-python-tag", CHECK, JOB, ("name",), ("--set", "name=!!python/name:os.system"), False),
    Case("set-mapping-over", CHECK, JOB, ("workers", "valid dictionary"), ("--set", "workers=3"), False),
    # --- sweep specs
    Case("sweep-not-utf8", SWEEP_VERB, b"name: sw\xff\n", ("not UTF-8", "save the sweep file as UTF-8")),
    Case("sweep-empty", SWEEP_VERB, "", ("must be a YAML mapping",)),
    Case("sweep-alias-bomb", SWEEP_VERB, BOMB, ("alias bomb",)),
    Case("sweep-space-scalar", SWEEP_VERB, sweep("  lr: {loguniform: [0.001, 0.3]}", "  lr: 5"), ("space.lr",)),
    Case("sweep-two-kinds", SWEEP_VERB, sweep("{choice: [8, 16, 32]}", "{choice: [8], grid: [1]}"), ("exactly one",)),
    Case("sweep-bounds-str", SWEEP_VERB, sweep("[0.001, 0.3]", "[a, b]"), ("space.lr.loguniform",)),
    Case("sweep-bounds-3", SWEEP_VERB, sweep("[0.001, 0.3]", "[1, 2, 3]"), ("space.lr.loguniform",)),
    Case("sweep-share", SWEEP_VERB, sweep("gpu_share: auto", "gpu_share: 2"), ("gpu_share", "(0, 1]")),
    Case("sweep-mode", SWEEP_VERB, sweep("mode: min", "mode: lowest"), ("mode", "'min'")),
    Case("sweep-job-missing", SWEEP_VERB, sweep(f"{ROOT}/jobs/digits_ddp.yaml", "nowhere.yaml"), ("job:", "not found")),
    Case("sweep-job-override", SWEEP_VERB, sweep("min: 1, max: 1", "min: x, max: 1"), ("workers.min",)),
    Case(
        "sweep-scheduler-typo", SWEEP_VERB, sweep("grace_period: 2", "grace_perod: 2"), ("did you mean 'grace_period'",)
    ),
    # --- cluster configs
    Case("cluster-not-utf8", VALIDATE, b"cluster_name: \xfe\n", ("not UTF-8", "save the cluster config as UTF-8")),
    Case("cluster-binary", VALIDATE, bytes(range(128, 256)), ("not UTF-8",)),
    Case("cluster-empty", VALIDATE, "", ("expected a `ray up` config",)),
    Case("cluster-list", VALIDATE, "- a\n- b\n", ("expected a `ray up` config",)),
    Case("cluster-alias-bomb", VALIDATE, BOMB, ("alias bomb",)),
    Case("cluster-too-large", VALIDATE, "#\n" * (MAX_DOCUMENT_BYTES // 2 + 1), ("too large",)),
    Case("cluster-bad-yaml", VALIDATE, "provider: {type: aws\n", ("not valid YAML",)),
    Case("cluster-max-workers-word", VALIDATE, cluster_with(max_workers="lots"), ("max_workers", "not of type")),
    Case("cluster-node-types-list", VALIDATE, cluster_with(available_node_types=["a"]), ("available_node_types",)),
    Case("cluster-head-type-int", VALIDATE, cluster_with(head_node_type=5), ("head_node_type", "not of type")),
    Case("cluster-provider-scalar", VALIDATE, "cluster_name: x\nprovider: aws\n", ("provider",)),
]


def run_elastic(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["elastic", *argv])
    with pytest.raises(SystemExit) as exited:
        main()
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


@pytest.mark.parametrize("case", CORPUS, ids=[c.id for c in CORPUS])
def test_malformed_input_exits_2_with_one_line(case: Case, tmp_path, monkeypatch, capsys):
    path = tmp_path / f"{case.id}.yaml"
    if isinstance(case.content, bytes):
        path.write_bytes(case.content)
    else:
        path.write_text(case.content)
    monkeypatch.chdir(ROOT)  # the entrypoint resolves from the project root, as `submit` run there does
    args = list(case.args)
    if case.project:
        project = tmp_path / "project"
        for name, data in case.project:
            (project / name).parent.mkdir(parents=True, exist_ok=True)
            (project / name).write_bytes(data)
        args += ["--working-dir", str(project)]
    code, out, err = run_elastic([*case.verb, str(path), *args], monkeypatch, capsys)
    lines = err.strip().splitlines()
    assert code == 2, (code, out[-500:], err[-2000:])
    assert "Traceback" not in err + out
    if case.verb == VALIDATE and lines and not lines[0].startswith("error:"):
        # validate lists every problem of a config it could read, one line each: each names the file and a key
        assert all(line.startswith(f"{path}: ") for line in lines), lines
        text = " ".join(lines)
    else:
        assert len(lines) == 1, lines
        text = lines[0]
        assert len(text) < 400, text  # one readable line, even for a 5,000-character value
    if case.names_file:
        assert str(path) in text, text
    else:
        assert "--set" in text, text
    for fragment in case.expect:
        assert fragment in text, (fragment, text)


def test_the_corpus_covers_every_front_door():
    assert len(CORPUS) >= 40
    assert {c.verb for c in CORPUS} == {CHECK, SUBMIT, SWEEP_VERB, VALIDATE}
    assert len({c.id for c in CORPUS}) == len(CORPUS)
