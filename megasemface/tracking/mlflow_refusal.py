"""What an MLflow server's refusal (HTTP 401, 403, 404) means, and the fix, in one line.

A refusal is not an outage: retrying the same request with the same URI and credentials gets
the same answer, so the start stops on one (:mod:`megasemface.training.preflight`) and the
tracker reports one mid-run at once (:mod:`megasemface.tracking.mlflow_delivery`) instead of
spooling in silence. The lines name MLflow's credential variables, never their values.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from megasemface.tracking.mlflow_names import redact_uri

__all__ = ["REFUSAL_STATUSES", "refusal_line", "refusal_of"]

REFUSAL_STATUSES = (401, 403, 404)

# MLflow 3's answer to a Host header that is neither localhost nor an IP address (its DNS
# rebinding protection), sent as plain text with status 403.
_HOST_CHECK = "Invalid Host header"

# The error codes MLflow's client raises for those statuses (mlflow.exceptions).
_STATUS_OF_CODE = {
    "UNAUTHENTICATED": 401,
    "CUSTOMER_UNAUTHORIZED": 401,
    "PERMISSION_DENIED": 403,
    "ENDPOINT_NOT_FOUND": 404,
}

_CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN")


def _host_port(uri: str) -> str:
    parts = urlsplit(uri)
    host = parts.hostname or ""
    return f"{host}:{parts.port}" if parts.port else host


def refusal_line(uri: str, status: int, body: str) -> str | None:
    """The one-line reason and fix for ``status`` (with the response's ``body``) from the
    MLflow server at ``uri``; None when ``status`` is no refusal."""
    shown = redact_uri(uri)
    if status == 403 and _HOST_CHECK in body:
        return (
            f"the MLflow server at {shown} refuses the host name {urlsplit(uri).hostname!r} "
            "(403 Invalid Host header - possible DNS rebinding attack detected): list it in "
            f"the server's allowed hosts, `mlflow server ... --allowed-hosts {_host_port(uri)}` "
            "(without the option MLflow allows only localhost and IP addresses)"
        )
    given = [name for name in _CREDENTIAL_VARS if os.environ.get(name)]
    if status == 401:
        if given:
            return (
                f"the MLflow server at {shown} refuses the credentials in "
                f"{', '.join(given)} (401): correct them"
            )
        return (
            f"the MLflow server at {shown} asks for credentials (401): set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, "
            "in the run's environment"
        )
    if status == 403:
        who = f"the user of {given[0]}" if given else "an anonymous user"
        return (
            f"the MLflow server at {shown} denies {who} access (403): grant it permission "
            "on the experiment, or use other credentials"
        )
    if status == 404:
        return (
            f"the MLflow server at {shown} has no tracking API there (404): correct the "
            "URI's host, port and path (an MLflow server answers at http://host:port)"
        )
    return None


def refusal_of(exc: BaseException, uri: str) -> str | None:
    """:func:`refusal_line` for an exception MLflow's client raised, or None if it is none."""
    status = _STATUS_OF_CODE.get(str(getattr(exc, "error_code", "")))
    return refusal_line(uri, status, str(exc)) if status is not None else None
