"""Unit tests for elastic/config/spec.py: parsing, defaults, overrides, one-line error messages, schema, CLI exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import ValidationError

from elastic.config.spec import (
    CheckpointSpec,
    FailureSpec,
    JobSpec,
    RuntimeEnvSpec,
    WorkersSpec,
    apply_overrides,
    dump_schema,
    job_schema,
    load_job_spec,
    parse_job_spec,
)
from elastic.errors import SpecError

REPO = Path(__file__).resolve().parents[3]
DIGITS = REPO / "jobs" / "digits_ddp.yaml"

# A minimal valid job; line numbers matter for the error-table tests below.
#   1 name / 2 entrypoint / 3 workers: / 4 min / 5 max / 6 checkpoint: / 7 uri / 8 every_steps
MINIMAL = """\
name: demo
entrypoint: jobs/train.py:train
workers:
  min: 2
  max: 3
checkpoint:
  uri: s3://bucket/runs
  every_steps: 10
"""


def _write(tmp_path: Path, text: str, name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _spec_error(path: Path, overrides=()) -> str:
    with pytest.raises(SpecError) as info:
        load_job_spec(path, overrides)
    return str(info.value)


# ---------------------------------------------------------------------------------------------------------
# The example job


def test_digits_example_parses_into_a_frozen_spec():
    spec = load_job_spec(DIGITS)
    assert isinstance(spec, JobSpec)
    assert spec.name == "digits-ddp"
    assert spec.entrypoint == "jobs/digits_ddp.py:train"
    assert spec.entrypoint_target == "jobs/digits_ddp.py"
    assert spec.entrypoint_function == "train"
    assert spec.config == {"epochs": 12, "lr": 0.05, "batch_size": 32, "width": 32, "seed": 0}
    assert spec.workers == WorkersSpec(min=2, max=2, cpus=1, gpus=0, market="spot")
    assert spec.workers.max_workers == 2 and not spec.workers.elastic
    assert spec.checkpoint == CheckpointSpec(uri="s3://elastic/runs", every_steps=50, keep=3)
    assert spec.checkpoint.every_seconds is None
    assert spec.failure == FailureSpec(max_failures=3, max_preemptions=20)

    with pytest.raises(ValidationError, match="frozen"):
        spec.name = "other"
    with pytest.raises(ValidationError, match="frozen"):
        spec.workers.min = 5
    with pytest.raises(ValidationError, match="frozen"):
        spec.checkpoint.uri = "s3://elsewhere"
    assert spec.name == "digits-ddp" and spec.workers.min == 2


def test_parse_job_spec_accepts_text_directly():
    spec = parse_job_spec(MINIMAL, source="inline")
    assert spec.name == "demo" and spec.workers.max == 3


def test_missing_job_file_is_one_line(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = _spec_error(missing)
    assert message == f"{missing}: no such job file; check the path"


# ---------------------------------------------------------------------------------------------------------
# Defaults


def test_defaults_fill_in(tmp_path):
    spec = load_job_spec(
        _write(
            tmp_path,
            """\
            name: demo
            entrypoint: pkg.mod:main
            workers:
              min: 2
            checkpoint:
              uri: /tmp/runs
              every_seconds: 30
            """,
        )
    )
    assert spec.config == {}
    assert spec.workers.max is None
    assert spec.workers.max_workers == 2  # max defaults to min
    assert spec.workers.elastic is False
    assert spec.workers.cpus == 1.0 and spec.workers.gpus == 0.0 and spec.workers.market == "any"
    assert spec.checkpoint.keep == 3 and spec.checkpoint.every_steps is None
    assert spec.checkpoint.every_seconds == 30.0
    assert spec.failure == FailureSpec()
    assert (spec.failure.max_failures, spec.failure.max_preemptions) == (3, 20)
    assert spec.runtime_env == RuntimeEnvSpec()
    assert (spec.runtime_env.pip, spec.runtime_env.env_vars, spec.runtime_env.excludes) == ([], {}, [])


def test_min_below_max_is_elastic():
    workers = WorkersSpec(min=1, max=4)
    assert workers.elastic and workers.max_workers == 4
    assert not WorkersSpec(min=3, max=3).elastic


def test_run_name_with_and_without_suffix():
    spec = parse_job_spec(MINIMAL)
    assert spec.run_name() == "demo"
    assert spec.run_name(None) == "demo"
    assert spec.run_name("") == "demo"
    assert spec.run_name("try2") == "demo-try2"
    # deterministic: the same job and suffix give the same run (that is what makes resubmission resume)
    assert parse_job_spec(MINIMAL).run_name("try2") == spec.run_name("try2")


# ---------------------------------------------------------------------------------------------------------
# Overrides


def test_apply_overrides_sets_values_parsed_as_yaml_on_a_copy():
    raw = {"config": {"epochs": 12, "lr": 0.05}, "workers": {"min": 2, "max": 2}}
    result = apply_overrides(raw, ["config.epochs=2", "workers.min=1", "config.flag=true", "config.tag=abc"])
    assert result["config"] == {"epochs": 2, "lr": 0.05, "flag": True, "tag": "abc"}
    assert result["workers"] == {"min": 1, "max": 2}
    # the input is untouched
    assert raw == {"config": {"epochs": 12, "lr": 0.05}, "workers": {"min": 2, "max": 2}}


def test_apply_overrides_creates_nested_mappings():
    result = apply_overrides({"name": "x"}, ["config.optim.lr=0.1", "runtime_env.env_vars.FOO=bar"])
    assert result["config"] == {"optim": {"lr": 0.1}}
    assert result["runtime_env"] == {"env_vars": {"FOO": "bar"}}
    assert result["name"] == "x"


def test_apply_overrides_quoted_numbers_stay_strings():
    result = apply_overrides({}, ["runtime_env.env_vars.POLL='1'", 'config.tag="2"', "config.lr=1e-3"])
    assert result == {"runtime_env": {"env_vars": {"POLL": "1"}}, "config": {"tag": "2", "lr": 0.001}}


def test_apply_overrides_colon_values_stay_strings_not_sexagesimal_numbers():
    # YAML 1.1 reads 1:3 as 63 and 1:30:00 as 5400; on a command line they are what was typed.
    result = apply_overrides({}, ["env.a=1:3", "env.b=1:30:00", "env.c=2"])
    assert result["env"] == {"a": "1:3", "b": "1:30:00", "c": 2}


def test_apply_overrides_value_may_contain_equals_and_spaces_around_key():
    result = apply_overrides({}, [" config.expr =a=b"])
    assert result == {"config": {"expr": "a=b"}}


@pytest.mark.parametrize("item", ["workers.min", "=3", "  =3", ""])
def test_apply_overrides_rejects_items_without_field_and_equals(item):
    with pytest.raises(SpecError) as info:
        apply_overrides({}, [item])
    message = str(info.value)
    assert repr(item) in message and "FIELD=VALUE" in message
    assert "\n" not in message


def test_apply_overrides_through_a_scalar_is_an_error():
    with pytest.raises(SpecError, match=r"workers is not a mapping"):
        apply_overrides({"workers": 3}, ["workers.min=1"])


def test_load_job_spec_applies_overrides():
    spec = load_job_spec(DIGITS, ["config.epochs=2", "workers.min=1", "checkpoint.every_seconds=5"])
    assert spec.config["epochs"] == 2
    assert spec.config["lr"] == 0.05
    assert spec.workers.min == 1 and spec.workers.max == 2 and spec.workers.elastic
    assert spec.checkpoint.every_seconds == 5.0 and spec.checkpoint.every_steps == 50


def test_invalid_override_is_reported_with_its_field():
    message = _spec_error(DIGITS, ["workers.min=0"])
    assert ": workers.min: " in message and "(got 0)" in message
    assert "\n" not in message


# ---------------------------------------------------------------------------------------------------------
# Bad inputs: one line, the field path, the right line


_BAD = [
    # id, yaml, field path (None: no path), expected line(s) (None: no line), other substrings
    pytest.param(
        MINIMAL + "confg:\n  epochs: 2\n",
        "confg",
        9,
        ["unknown field", "did you mean 'config'?"],
        id="misspelled-top-level-field",
    ),
    pytest.param(
        MINIMAL.replace("  max: 3", "  mx: 3"),
        "workers.mx",
        5,
        ["unknown field", "did you mean 'max'?"],
        id="misspelled-nested-field",
    ),
    pytest.param(
        MINIMAL.replace("  max: 3", "  max: 3\n  colour: red"),
        "workers.colour",
        6,
        ["unknown field", "allowed here: min, max, cpus, gpus, market, spot_wait_seconds, swap_to_spot"],
        id="unknown-nested-field-lists-allowed",
    ),
    pytest.param(
        MINIMAL.replace("name: demo\n", ""),
        "name",
        1,
        ["required field is missing", "add `name:`"],
        id="missing-name",
    ),
    pytest.param(
        MINIMAL.replace("  uri: s3://bucket/runs\n", ""),
        "checkpoint.uri",
        (6, 7),
        ["required field is missing", "add `uri:`"],
        id="missing-checkpoint-uri",
    ),
    pytest.param(
        MINIMAL.replace("min: 2", "min: 0").replace("max: 3", "max: 1"),
        "workers.min",
        4,
        ["greater than or equal to 1", "(got 0)"],
        id="workers-min-zero",
    ),
    pytest.param(
        MINIMAL.replace("min: 2", "min: true"),
        "workers.min",
        4,
        ["a worker count, not true", "(got True)"],
        id="workers-min-a-boolean",
    ),
    pytest.param(
        MINIMAL.replace("uri: s3://bucket/runs", "uri: '::::'"),
        "checkpoint.uri",
        7,
        ["neither a URL nor a plain path", "s3://"],
        id="checkpoint-uri-neither-url-nor-path",
    ),
    pytest.param(
        MINIMAL.replace("uri: s3://bucket/runs", "uri: s3:bucket/runs"),
        "checkpoint.uri",
        7,
        ["neither a URL nor a plain path"],
        id="checkpoint-uri-without-slashes",
    ),
    pytest.param(
        MINIMAL + "api: tensorflow\n",
        "api",
        9,
        ["session", "ray-train"],
        id="unknown-api",
    ),
    pytest.param(
        MINIMAL.replace("min: 2", "min: two"),
        "workers.min",
        4,
        ["valid integer", "(got 'two')"],
        id="workers-min-ill-typed",
    ),
    pytest.param(
        MINIMAL.replace("max: 3", "max: 1"),
        "workers.max",
        5,
        ["max (1) is below min (2)", "set max >= min"],
        id="workers-max-below-min",
    ),
    pytest.param(
        MINIMAL.replace("  max: 3", "  max: 3\n  market: spott"),
        "workers.market",
        6,
        ["'spot', 'on-demand', 'any' or 'spot-first'", "(got 'spott')"],
        id="workers-market-misspelled",
    ),
    pytest.param(
        MINIMAL.replace("  max: 3", "  max: 3\n  market: spot-first\n  spot_wait_seconds: -5"),
        "workers.spot_wait_seconds",
        7,
        ["greater than or equal to 0", "(got -5)"],
        id="workers-spot-wait-negative",
    ),
    pytest.param(
        MINIMAL.replace("  max: 3", "  max: 3\n  market: spot-first\n  swap_to_spot: sometimes"),
        "workers.swap_to_spot",
        7,
        ["valid boolean", "(got 'sometimes')"],
        id="workers-swap-to-spot-not-a-bool",
    ),
    pytest.param(
        MINIMAL.replace("jobs/train.py:train", "jobs/train.py"),
        "entrypoint",
        2,
        ["(got 'jobs/train.py')"],
        id="entrypoint-without-function",
    ),
    pytest.param(
        MINIMAL.replace("name: demo", "name: My Job"),
        "name",
        1,
        ["(got 'My Job')"],
        id="name-with-uppercase-and-space",
    ),
    pytest.param(
        MINIMAL.replace("name: demo", "name: Demo"),
        "name",
        1,
        ["(got 'Demo')"],
        id="name-with-uppercase",
    ),
    pytest.param(
        MINIMAL.replace("  every_steps: 10\n", ""),
        "checkpoint",
        (6, 7),
        ["set every_steps or every_seconds"],
        id="checkpoint-without-cadence",
    ),
    pytest.param(
        MINIMAL + "  keep: 0\n",
        "checkpoint.keep",
        9,
        ["greater than or equal to 1", "(got 0)"],
        id="checkpoint-keep-zero",
    ),
    pytest.param(
        MINIMAL + "  every_seconds: 0\n",
        "checkpoint.every_seconds",
        9,
        ["greater than 0", "(got 0)"],
        id="checkpoint-every-seconds-zero",
    ),
    pytest.param(
        MINIMAL + "failure:\n  max_failures: -2\n",
        "failure.max_failures",
        10,
        ["greater than or equal to -1", "(got -2)"],
        id="failure-max-failures-below-unlimited",
    ),
    pytest.param(
        MINIMAL + "runtime_env:\n  env_vars:\n    A: [1, 2]\n",
        "runtime_env.env_vars.A",
        11,
        ["valid string"],
        id="env-var-not-a-string",
    ),
    pytest.param(
        "name: demo\nentrypoint: a.py:b\nworkers:\n  min: 1\n max: 2\n",
        None,
        5,
        ["not valid YAML", "fix the syntax"],
        id="yaml-syntax-error",
    ),
    pytest.param(
        "- name: demo\n- entrypoint: a.py:b\n",
        None,
        None,
        ["must be a YAML mapping"],
        id="root-is-a-list",
    ),
    pytest.param("", None, None, ["must be a YAML mapping"], id="empty-file"),
]


@pytest.mark.parametrize(("text", "field", "line", "expected"), _BAD)
def test_bad_job_file_gives_one_line_naming_the_field(tmp_path, text, field, line, expected):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    message = _spec_error(path)

    assert "\n" not in message and message == message.strip(), message
    if line is None:
        assert message.startswith(f"{path}: "), message
    else:
        lines = (line,) if isinstance(line, int) else line
        prefixes = [f"{path}:{n}: " for n in lines]
        assert any(message.startswith(p) for p in prefixes), f"{message!r} does not start with one of {prefixes}"
    if field is not None:
        after_location = message.split(": ", 1)[1]
        assert after_location.startswith(f"{field}: "), message
    for part in expected:
        assert part in message, message
    # one problem at a time: these files each have exactly one
    assert "more problem" not in message, message


def test_misspelled_required_top_level_field_names_the_misspelling(tmp_path):
    path = _write(tmp_path, MINIMAL.replace("name: demo", "nmae: demo"))
    message = _spec_error(path)
    assert "\n" not in message
    assert message.startswith(f"{path}:1: ")
    assert "nmae" in message and "did you mean 'name'?" in message


def test_several_problems_are_counted():
    text = MINIMAL.replace("min: 2", "min: 0").replace("  every_steps: 10", "  every_steps: 10\n  keep: 0")
    with pytest.raises(SpecError) as info:
        parse_job_spec(text, source="j.yaml")
    message = str(info.value)
    assert message.endswith("(and 1 more problem)"), message
    assert "\n" not in message


def test_line_numbers_count_leading_comments():
    text = DIGITS.read_text().replace("  max: 2", "  mx: 2")
    expected_line = text.splitlines().index("  mx: 2") + 1
    assert expected_line > 10  # the example starts with comments and config lines
    with pytest.raises(SpecError) as info:
        parse_job_spec(text, source="digits.yaml")
    assert str(info.value) == f"digits.yaml:{expected_line}: workers.mx: unknown field; did you mean 'max'?"


# ---------------------------------------------------------------------------------------------------------
# Schema


def test_job_schema_is_a_json_schema_of_job_files():
    schema = job_schema()
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert schema["type"] == "object"
    assert {"name", "entrypoint", "workers", "checkpoint", "config", "failure", "runtime_env"} <= set(
        schema["properties"]
    )
    assert {"name", "entrypoint", "workers", "checkpoint"} <= set(schema["required"])
    assert "failure" not in schema["required"]
    assert schema["additionalProperties"] is False
    text = json.dumps(schema)
    assert json.loads(text) == schema
    assert json.loads(dump_schema()) == schema


def test_job_schema_validates_the_example_and_rejects_a_misspelling():
    jsonschema = pytest.importorskip("jsonschema")
    import yaml

    schema = job_schema()
    raw = yaml.safe_load(DIGITS.read_text())
    jsonschema.validate(raw, schema)
    raw["workers"]["mx"] = raw["workers"].pop("max")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, schema)


# ---------------------------------------------------------------------------------------------------------
# CLI: user errors are one line on stderr and exit status 2


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["ELASTIC_HOME"] = str(tmp_path / "elastic-home")
    return subprocess.run(
        [sys.executable, "-m", "elastic", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


@pytest.fixture
def misspelled_file(tmp_path) -> Path:
    return _write(tmp_path, MINIMAL.replace("  max: 3", "  mx: 3"), name="bad.yaml")


def test_cli_spec_check_bad_file_is_one_error_line(tmp_path, misspelled_file):
    result = _cli(["spec", "check", str(misspelled_file)], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.endswith("\n"), result.stderr
    assert result.stderr.startswith("error: ")
    assert result.stderr.strip() == f"error: {misspelled_file}:5: workers.mx: unknown field; did you mean 'max'?"
    assert result.stdout == ""


def test_cli_spec_check_good_file_prints_defaults(tmp_path):
    result = _cli(["spec", "check", str(DIGITS), "--set", "workers.min=1"], tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["workers"]["min"] == 1 and data["workers"]["max"] == 2
    assert data["runtime_env"] == {"pip": [], "env_vars": {}, "excludes": []}


def test_cli_spec_schema_prints_json(tmp_path):
    result = _cli(["spec", "schema"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == job_schema()


def test_cli_submit_bad_file_fails_before_any_cluster(tmp_path, misspelled_file):
    result = _cli(["submit", str(misspelled_file)], tmp_path)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ") and "workers.mx" in lines[0] and "did you mean 'max'?" in lines[0]
    # a cluster lookup would have said "no cluster to talk to"
    assert "cluster" not in result.stderr
    assert not (tmp_path / "elastic-home" / "local" / "state.json").exists()


def test_shipped_json_schema_is_current():
    """docs/job.schema.json is what editors load (the example job points at it); regenerate it with
    `elastic spec schema > docs/job.schema.json` when the spec changes."""
    shipped = json.loads((Path(__file__).resolve().parents[3] / "docs" / "job.schema.json").read_text())
    assert shipped == json.loads(json.dumps(job_schema()))


def test_a_suffix_that_would_break_the_run_name_is_refused():
    spec = load_job_spec(Path(__file__).resolve().parents[3] / "jobs" / "digits_ddp.yaml")
    assert spec.run_name("trial-3") == "digits-ddp-trial-3"
    with pytest.raises(SpecError, match="--suffix"):
        spec.run_name("x; rm -rf /")


def test_errors_from_set_name_the_flag_not_a_file_line():
    path = Path(__file__).resolve().parents[3] / "jobs" / "digits_ddp.yaml"
    with pytest.raises(SpecError) as info:
        load_job_spec(path, ["workers.min=0"])
    assert str(info.value).startswith("--set workers.min=0: workers.min:"), str(info.value)


def test_set_reads_exponent_numbers_as_numbers():
    path = Path(__file__).resolve().parents[3] / "jobs" / "digits_ddp.yaml"
    assert load_job_spec(path, ["config.lr=1e-3"]).config["lr"] == pytest.approx(0.001)


def test_scalar_env_vars_become_the_strings_a_process_environment_holds():
    spec = parse_job_spec(MINIMAL + "runtime_env:\n  env_vars:\n    A: 1\n    B: true\n    C: 0.5\n")
    assert spec.runtime_env.env_vars == {"A": "1", "B": "true", "C": "0.5"}


def test_spec_check_never_echoes_credentials(tmp_path):
    secret = "elastic-fake-secret-value-3k9"
    result = _cli(
        [
            "spec",
            "check",
            str(DIGITS),
            f"--set=runtime_env.env_vars.AWS_SECRET_ACCESS_KEY={secret}",
            f"--set=runtime_env.env_vars.RAY_AUTH_TOKEN={secret}",
            "--set=runtime_env.env_vars.NCCL_DEBUG=INFO",
        ],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert secret not in result.stdout + result.stderr
    assert json.loads(result.stdout)["runtime_env"]["env_vars"] == {
        "AWS_SECRET_ACCESS_KEY": "<redacted>",
        "RAY_AUTH_TOKEN": "<redacted>",
        "NCCL_DEBUG": "INFO",  # not a credential: shown
    }


@pytest.mark.parametrize(
    ("uri", "package", "extra"), [("gs://b/runs", "gcsfs", "gcp"), ("az://c/runs", "adlfs", "azure")]
)
def test_cli_spec_check_names_the_extra_a_uri_needs(uri, package, extra, tmp_path):
    """Without the scheme's filesystem package: one line naming the extra, exit 2; with it, the spec passes."""
    ok = _cli(["spec", "check", str(DIGITS), "--set", f"checkpoint.uri={uri}"], tmp_path)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["checkpoint"]["uri"] == uri
    # A package set to None in sys.modules is one Python treats as not installed.
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(f"import sys\nsys.modules[{package!r}] = None\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(ELASTIC_HOME=str(tmp_path / "home"), PYTHONPATH=str(blocker))
    missing = subprocess.run(
        [sys.executable, "-m", "elastic", "spec", "check", str(DIGITS), "--set", f"checkpoint.uri={uri}"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert missing.returncode == 2
    scheme = uri.split(":")[0]
    assert missing.stderr == (
        f"error: {uri}: {scheme}:// needs the {package} package, which is not installed; "
        f"pip install 'elastic-train[{extra}]'\n"
    )
