"""The fault-injecting S3 proxy (elastic.local.s3_faults) in front of moto, driven through s3fs and boto3 as our
checkpoints are: what passes is byte-identical, what it injects is what S3 sends (SlowDown's XML, a reset in
the middle of a body), clients' own retries get through transient faults, and every fault is logged. No Ray."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import boto3
import botocore.config
import pytest
import s3fs
from botocore.exceptions import ClientError, IncompleteReadError, ResponseStreamingError
from moto_helpers import free_port, wait_for_port

from elastic.local.fault_plan import Rates
from elastic.local.s3_faults import FaultControl, running_proxy

pytestmark = pytest.mark.integration

BUCKET = "faults"


@pytest.fixture(scope="module")
def upstream(moto_s3) -> str:
    url = moto_s3["AWS_ENDPOINT_URL"]
    boto3.client("s3", endpoint_url=url, region_name="us-east-1").create_bucket(Bucket=BUCKET)
    return url


@pytest.fixture
def proxy(upstream):
    with running_proxy(upstream, seed=11) as (url, control):
        yield url, control


def filesystem(url: str, retries: int = 5) -> s3fs.S3FileSystem:
    fs = s3fs.S3FileSystem(
        client_kwargs={"endpoint_url": url, "region_name": "us-east-1"},
        config_kwargs={"retries": {"mode": "standard", "total_max_attempts": retries}},
        skip_instance_cache=True,
    )
    fs.retries = retries  # s3fs's own retry loop (a class attribute, not a constructor argument)
    return fs


def no_retry_client(url: str):
    config = botocore.config.Config(retries={"mode": "standard", "total_max_attempts": 1})
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1", config=config)


def test_bodies_pass_through_byte_for_byte(proxy, upstream):
    url, control = proxy
    data = os.urandom(7 * 2**20 + 13)  # several chunks each way
    filesystem(url).pipe_file(f"{BUCKET}/through/big", data)
    assert filesystem(upstream).cat_file(f"{BUCKET}/through/big") == data
    assert filesystem(url).cat_file(f"{BUCKET}/through/big") == data
    assert filesystem(url).ls(f"{BUCKET}/through") == [f"{BUCKET}/through/big"]
    assert sum(control.stats()["injected"].values()) == 0


@pytest.mark.parametrize(
    "kind, status, code", [("503", 503, "SlowDown"), ("500", 500, "InternalError")], ids=["slowdown", "internal"]
)
def test_errors_carry_s3s_status_and_xml_error_code(proxy, kind, status, code, caplog):
    url, control = proxy
    client = no_retry_client(url)
    client.put_object(Bucket=BUCKET, Key="errors/k", Body=b"payload")
    control.open_window(kind, requests=1)
    with caplog.at_level(logging.WARNING, logger="elastic.local.s3_faults"):
        with pytest.raises(ClientError) as raised:
            client.get_object(Bucket=BUCKET, Key="errors/k")
    assert raised.value.response["ResponseMetadata"]["HTTPStatusCode"] == status
    assert raised.value.response["Error"]["Code"] == code
    assert f"{kind} on GET /{BUCKET}/errors/k" in caplog.text
    assert client.get_object(Bucket=BUCKET, Key="errors/k")["Body"].read() == b"payload"  # the window is spent


def test_a_reset_mid_body_reaches_the_client_and_stores_nothing(proxy, upstream):
    url, control = proxy
    client = no_retry_client(url)
    control.open_window("reset", requests=1, match={"methods": ["PUT"]})
    with pytest.raises(Exception) as raised:  # botocore wraps the transport's error by its own name
        client.put_object(Bucket=BUCKET, Key="reset/put", Body=os.urandom(2**20))
    assert "reset" in str(raised.value).lower() or "closed" in str(raised.value).lower()
    assert not filesystem(upstream).exists(f"{BUCKET}/reset/put")  # half a body never became an object

    data = os.urandom(3 * 2**20)
    client.put_object(Bucket=BUCKET, Key="reset/get", Body=data)
    control.open_window("reset", requests=1, match={"methods": ["GET"]})
    response = client.get_object(Bucket=BUCKET, Key="reset/get")  # headers arrive whole; the body does not
    with pytest.raises((ResponseStreamingError, IncompleteReadError)):
        response["Body"].read()
    assert control.stats()["injected"]["reset"] == 2


def test_transient_faults_are_retried_by_s3fs_and_botocore(proxy):
    url, control = proxy
    fs = filesystem(url)
    data = os.urandom(2 * 2**20)
    for kind in ("503", "500", "reset"):
        control.open_window(kind, requests=2)
        fs.pipe_file(f"{BUCKET}/retried/{kind}", data)
        control.open_window(kind, requests=2)
        assert fs.cat_file(f"{BUCKET}/retried/{kind}") == data
    assert control.stats()["injected"] == {"500": 4, "503": 4, "reset": 4, "latency": 0}


def test_an_open_window_fails_every_request_until_closed(proxy):
    url, control = proxy
    fs = filesystem(url, retries=2)
    with control.window("503"):
        with pytest.raises(OSError):
            fs.pipe_file(f"{BUCKET}/outage/k", b"x")
        assert control.stats()["open_windows"] == 1
    fs.pipe_file(f"{BUCKET}/outage/k", b"x")
    assert fs.cat_file(f"{BUCKET}/outage/k") == b"x"


def test_rates_are_seeded_so_a_run_sees_the_same_faults_again(upstream):
    def injected_sequence() -> list[str]:
        with running_proxy(upstream, seed=3, rates=Rates(slow_down=0.3, error_500=0.2)) as (url, control):
            client = no_retry_client(url)
            outcomes = []
            for i in range(30):
                try:
                    client.put_object(Bucket=BUCKET, Key=f"seeded/{i}", Body=b"x")
                    outcomes.append("ok")
                except ClientError as err:
                    outcomes.append(err.response["Error"]["Code"])
            return outcomes

    first = injected_sequence()
    assert first == injected_sequence()
    assert {"ok", "SlowDown", "InternalError"} == set(first)


def test_latency_delays_without_failing_and_rates_can_be_changed_at_runtime(proxy):
    url, control = proxy
    control.set_rates(latency=1.0, latency_seconds=0.05, match={"path_contains": "/slow/"})
    fs = filesystem(url)
    fs.pipe_file(f"{BUCKET}/slow/k", b"late")
    fs.pipe_file(f"{BUCKET}/fast/k", b"on time")
    injected = control.stats()["injected"]
    assert injected["latency"] >= 1 and sum(injected.values()) == injected["latency"]
    assert fs.cat_file(f"{BUCKET}/slow/k") == b"late"
    control.set_rates()
    before = control.stats()["injected"]["latency"]
    fs.cat_file(f"{BUCKET}/slow/k")
    assert control.stats()["injected"]["latency"] == before


def test_the_daemon_serves_and_refuses_bad_control_input(upstream, tmp_path):
    """`python -m elastic.local.s3_faults`, as `elastic local up --s3-faults` starts it."""
    port = free_port()
    with open(tmp_path / "proxy.log", "wb") as log:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "elastic.local.s3_faults", "--upstream", upstream, "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_for_port(port, daemon)
        url = f"http://127.0.0.1:{port}"
        control = FaultControl(url)
        control.open_window("503", requests=1)
        with pytest.raises(ClientError, match="SlowDown"):
            no_retry_client(url).list_objects_v2(Bucket=BUCKET)
        no_retry_client(url).list_objects_v2(Bucket=BUCKET)
        with pytest.raises(Exception, match="400"):
            control.set_rates(reset=2.0)
    finally:
        daemon.terminate()
        daemon.wait(timeout=10)
    logged = (tmp_path / "proxy.log").read_text()
    assert f"503 on GET /{BUCKET}" in logged and "fault window opened" in logged
