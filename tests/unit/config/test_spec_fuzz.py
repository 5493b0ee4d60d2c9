"""Property-based fuzzing of the job and sweep specs (hypothesis, hypothesis-jsonschema).

- Documents generated from the shipped JSON Schemas: each is accepted or refused with one SpecError line (the
  schema cannot say everything, e.g. max >= min), and an accepted one round-trips: dumped, it validates against
  the schema and loads back to the same spec.
- Documents the schema does not allow (a valid job with a random value at a random field; random text): one line,
  never a traceback, through `elastic spec check` as users run it.

Runs are bounded (max_examples, no deadline) and derandomized, so the unit suite stays fast and repeatable.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path
from unittest import mock

import jsonschema
import yaml
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from elastic.cli import main
from elastic.config.spec import JobSpec, parse_job_spec
from elastic.config.sweep_spec import SweepSpec, parse_sweep_spec
from elastic.errors import SpecError

ROOT = Path(__file__).resolve().parents[3]
DOCS = ROOT / "docs"
BASE_JOB = yaml.safe_load((ROOT / "jobs" / "digits_ddp.yaml").read_text())
BOUNDED = settings(
    max_examples=25, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow], database=None
)


def shipped(name: str) -> dict:
    """The schema users' editors load (test_spec.py and test_sweep_spec.py keep it equal to the models')."""
    schema = json.loads((DOCS / name).read_text())
    schema.pop("$schema", None)  # hypothesis-jsonschema reads the draft 7 subset these schemas use
    return schema


JOB_SCHEMA, SWEEP_SCHEMA = shipped("job.schema.json"), shipped("sweep.schema.json")


def assert_one_line(err: SpecError) -> None:
    text = str(err)
    assert text and "\n" not in text and len(text) < 400, text
    assert "Traceback" not in text


def as_yaml(doc) -> str:
    return yaml.safe_dump(doc, allow_unicode=True, sort_keys=False)


@BOUNDED
@given(from_schema(JOB_SCHEMA))
def test_job_documents_from_the_schema_load_or_fail_in_one_line_and_round_trip(doc):
    try:
        spec = parse_job_spec(as_yaml(doc), source="fuzz.yaml")
    except SpecError as err:
        assert_one_line(err)
        return
    dumped = spec.model_dump(mode="json")
    jsonschema.validate(dumped, JOB_SCHEMA)
    assert parse_job_spec(as_yaml(dumped), source="again.yaml") == spec


@BOUNDED
@given(from_schema(SWEEP_SCHEMA))
@example({"job": "0", "metric": "0", "mode": "max", "name": "0", "space": {"\n": {}}})  # a newline in a key
def test_sweep_documents_from_the_schema_load_or_fail_in_one_line_and_round_trip(doc):
    try:
        spec = parse_sweep_spec(as_yaml(doc), source="fuzz.yaml")
    except SpecError as err:
        assert_one_line(err)
        return
    dumped = spec.model_dump(mode="json")
    jsonschema.validate(dumped, SWEEP_SCHEMA)
    assert parse_sweep_spec(as_yaml(dumped), source="again.yaml") == spec


# Anything YAML can say, including what JSON cannot: NaN, infinities, huge integers, dates.
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.dates(),
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
)
FIELD_PATHS = [
    ("name",),
    ("entrypoint",),
    ("config",),
    ("workers",),
    ("workers", "min"),
    ("workers", "max"),
    ("workers", "cpus"),
    ("workers", "gpus"),
    ("workers", "market"),
    ("workers", "spot_wait_seconds"),
    ("checkpoint",),
    ("checkpoint", "uri"),
    ("checkpoint", "every_steps"),
    ("checkpoint", "every_seconds"),
    ("checkpoint", "keep"),
    ("failure", "max_failures"),
    ("train", "precision"),
    ("train", "grad_clip_norm"),
    ("runtime_env", "env_vars"),
    ("runtime_env", "pip"),
    ("nonsense",),
]


def with_value(path: tuple[str, ...], value) -> dict:
    doc = json.loads(json.dumps(BASE_JOB))
    target = doc
    for part in path[:-1]:
        target = target.setdefault(part, {})
    target[path[-1]] = value
    return doc


@BOUNDED
@given(path=st.sampled_from(FIELD_PATHS), value=values)
def test_any_value_at_any_field_is_accepted_or_one_line_through_spec_check(path, value, tmp_path_factory):
    file = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    file.write_text(as_yaml(with_value(path, value)))
    code, err = spec_check(file)
    assert code in (0, 2), err
    assert "Traceback" not in err
    if code == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(file) in lines[0], lines


def spec_check(file: Path) -> tuple[int, str]:
    """`elastic spec check FILE` in this process, as the console script runs it (hypothesis calls the test many
    times within one pytest test, so no function-scoped fixture: the streams are redirected here)."""
    out, err = io.StringIO(), io.StringIO()
    argv = ["elastic", "spec", "check", str(file), "--working-dir", str(ROOT)]
    with mock.patch.object(sys, "argv", argv), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main()
            code = 0
        except SystemExit as exited:
            code = exited.code
    return code, err.getvalue()


@BOUNDED
@given(st.text(max_size=300))
def test_any_text_is_a_job_or_one_line(text):
    try:
        spec = parse_job_spec(text, source="text.yaml")
    except SpecError as err:
        assert_one_line(err)
        return
    assert isinstance(spec, JobSpec)


@BOUNDED
@given(st.dictionaries(st.sampled_from(list(SweepSpec.model_fields)), values, max_size=6))
def test_any_sweep_mapping_is_a_sweep_or_one_line(doc):
    try:
        spec = parse_sweep_spec(as_yaml(doc), source="sweep.yaml")
    except SpecError as err:
        assert_one_line(err)
        return
    assert parse_sweep_spec(as_yaml(spec.model_dump(mode="json")), source="again.yaml") == spec
