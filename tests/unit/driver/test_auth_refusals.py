"""Ray refusing a client's token, as each path reports it, becomes one line naming the fix."""

from __future__ import annotations

from elastic.driver.auth import auth_failure
from elastic.errors import ClusterAuthError


class AuthenticationError(Exception):
    """Stands in for ray.exceptions.AuthenticationError (matched by name: this test imports no Ray)."""


def _raised_from(outer: Exception, inner: Exception) -> Exception:
    try:
        try:
            raise inner
        except Exception as cause:
            raise outer from cause
    except Exception as err:
        return err


def test_gcs_refusal_inside_ray_init_connection_error_names_the_fix():
    err = _raised_from(
        ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379"),
        RuntimeError("Failed to connect to GCS. Unauthenticated: RPC error: InvalidAuthToken: missing or incorrect"),
    )
    refused = auth_failure(err, "the Ray cluster at 10.0.0.1:6379")
    assert isinstance(refused, ClusterAuthError) and refused.exit_code == 2
    text = str(refused)
    assert "\n" not in text and "10.0.0.1:6379" in text
    assert 'eval "$(elastic local env)"' in text and "RAY_AUTH_MODE=token" in text


def test_job_api_missing_token_says_missing():
    refused = auth_failure(RuntimeError("Authentication required: Unauthorized: Missing authentication token"))
    assert refused is not None and "token is missing" in str(refused)


def test_ray_authentication_error_by_type():
    assert auth_failure(AuthenticationError("no token found")) is not None


def test_other_errors_are_not_auth():
    assert auth_failure(ConnectionError("Failed to connect to Ray cluster at 10.0.0.1:6379")) is None
    assert auth_failure(ValueError("bad")) is None
