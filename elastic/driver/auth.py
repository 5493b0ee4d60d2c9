"""Ray token auth as a user meets it: a refusal from the GCS or the job API becomes one line naming the fix."""

from __future__ import annotations

from elastic.errors import ClusterAuthError

# What Ray 2.60 says when a token is missing or wrong (GCS: AuthenticationError; job API: HTTP 401/403 text).
_SIGNS = (
    "authentication token",
    "Authentication required",
    "Authentication failed",
    "InvalidAuthToken",
    "UNAUTHENTICATED",
)
FIX = (
    'for the local stack run eval "$(elastic local env)"; for a cloud cluster export RAY_AUTH_MODE=token and put '
    "the cluster's token in ~/.ray/auth_token (or point RAY_AUTH_TOKEN_PATH at it)"
)


def auth_failure(err: BaseException, where: str = "the Ray cluster") -> ClusterAuthError | None:
    """A ClusterAuthError if `err` (or what it was raised from) is Ray refusing this client's token, else None."""
    seen: BaseException | None = err
    while seen is not None:
        text = str(seen)
        if type(seen).__name__ == "AuthenticationError" or any(sign in text for sign in _SIGNS):
            mode = "missing" if ("find an authentication token" in text or "Missing" in text) else "wrong or missing"
            return ClusterAuthError(f"{where} refused this client: its Ray auth token is {mode}; {FIX}")
        seen = seen.__cause__ or seen.__context__
    return None
