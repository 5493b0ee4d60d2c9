"""The local stack's auth settings and S3 server commands, without starting anything."""

from __future__ import annotations

import itertools
import os
import stat

import pytest

from elastic.errors import ClusterError
from elastic.local import s3servers
from elastic.local import stack as local


def _state(auth: str, token_path: str = "") -> local.LocalState:
    return local.LocalState(
        marker="m",
        temp_dir="/tmp/x",
        ray_address="127.0.0.1:1",
        dashboard_url="http://127.0.0.1:2",
        s3_endpoint="http://127.0.0.1:3",
        bucket="elastic",
        logical_gpus=False,
        auth=auth,
        auth_token_path=token_path,
    )


def test_token_is_made_once_private_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_HOME", str(tmp_path))
    path = local.ensure_token()
    token = path.read_text()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 bits, hex
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert local.ensure_token().read_text() == token  # a second `up` keeps it


def test_token_mode_gives_ray_the_mode_and_the_token_file(tmp_path, monkeypatch):
    token = tmp_path / "auth_token"
    token.write_text("abc\n")
    state = _state("token", str(token))
    assert state.env()["RAY_AUTH_MODE"] == "token"
    assert state.env()["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert state.auth_headers() == {"Authorization": "Bearer abc"}
    monkeypatch.setenv("RAY_AUTH_TOKEN", "someone-elses")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    state.use_ray()
    assert "RAY_AUTH_TOKEN" not in os.environ  # it would win over the stack's token file
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_none_turns_ray_auth_off_everywhere():
    state = _state("none")
    assert state.auth_env() == {"RAY_AUTH_MODE": "disabled"}
    assert "RAY_AUTH_TOKEN_PATH" not in state.env()
    assert state.auth_headers() == {}


def test_state_files_from_before_auth_load_as_token_and_moto():
    old = {k: v for k, v in _state("token").to_json().items() if k not in ("auth", "auth_token_path", "s3_server")}
    state = local.LocalState(**old)
    assert (state.auth, state.s3_server) == ("token", "moto")


@pytest.mark.parametrize("name", sorted(s3servers.SERVERS))
def test_every_s3_server_listens_on_loopback_only_on_ports_it_was_given(name, tmp_path, monkeypatch):
    monkeypatch.setattr(s3servers.processes, "binary", lambda binary, package: f"/bin/{binary}")
    monkeypatch.setattr(s3servers.ports, "port_is_free", lambda port: True)
    ports = itertools.count(40000)
    argv = s3servers.command(name, 9000, tmp_path / "data", lambda: next(ports))
    joined = " ".join(argv)
    assert "127.0.0.1" in joined and "0.0.0.0" not in joined
    assert "9000" in joined
    if s3servers.SERVERS[name].persistent:
        assert f"-dir={tmp_path / 'data'}" in argv and (tmp_path / "data").is_dir()
        # every listening port of `weed mini` is given, none left at its fixed default
        given = {a.split("=")[0].lstrip("-") for a in argv if a.startswith("-") and "=" in a}
        assert set(s3servers._SEAWEED_PORT_FLAGS) | {"admin.port", "admin.port.grpc"} <= given
        ports = dict(a.lstrip("-").split("=") for a in argv if a.startswith("-admin.port"))
        assert int(ports["admin.port.grpc"]) == int(ports["admin.port"]) + 10000  # where mini's worker dials


def test_unknown_s3_server_names_the_choices(tmp_path):
    with pytest.raises(ClusterError, match="seaweedfs, moto"):
        s3servers.command("minio", 9000, tmp_path, lambda: 1)
