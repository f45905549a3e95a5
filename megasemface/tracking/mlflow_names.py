"""MLflow's limits on names and values, and how names, URIs and errors are made safe to send or log.

The limits are copied from ``mlflow.utils.validation`` so that the training thread never needs to
import mlflow: a value over a limit would make the server reject the whole batch.
"""

from __future__ import annotations

import posixpath
import re
from urllib.parse import urlsplit, urlunsplit

__all__ = [
    "MAX_DIGEST_LEN",
    "MAX_KEY_LEN",
    "MAX_METRICS_PER_BATCH",
    "MAX_PARAMS_TAGS_PER_BATCH",
    "MAX_PARAM_VALUE_LEN",
    "MAX_TAG_VALUE_LEN",
    "PARENT_TAG",
    "describe_error",
    "redact_uri",
    "sanitize_name",
    "truncate",
]

MAX_KEY_LEN = 250
MAX_PARAM_VALUE_LEN = 6000
MAX_TAG_VALUE_LEN = 8000
MAX_PARAMS_TAGS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_DIGEST_LEN = 36  # a dataset's digest, as the SQL stores keep it

PARENT_TAG = re.compile(r"^parent_(.+)_run$")
"""A lineage tag: ``parent_<role>_run`` holds the run id of a run this one was made from."""

# Portable subset of MLflow's name rule (POSIX servers also accept ':', Windows ones do not).
_INVALID_NAME_CHARS = re.compile(r"[^/\w.\- ]")


def sanitize_name(name: str) -> str:
    """Make ``name`` a valid MLflow metric/param/tag key (MLflow treats keys as file paths)."""
    clean = _INVALID_NAME_CHARS.sub("_", str(name))
    parts = ["_" if part in (".", "..") else part for part in clean.split("/") if part]
    clean = "/".join(parts)[:MAX_KEY_LEN].rstrip("/")
    return clean if clean and posixpath.normpath(clean) == clean else "_"


def truncate(value: str, limit: int) -> str:
    """Cut ``value`` to ``limit`` characters, ending with '...' to show it was cut."""
    return value if len(value) <= limit else value[: limit - 3] + "..."


def redact_uri(uri: str) -> str:
    """Hide credentials (``user:password@``) in a URI before it is logged."""
    try:
        parts = urlsplit(uri)
    except ValueError:
        return uri
    if "@" not in parts.netloc:
        return uri
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"***@{host}"))


def describe_error(exc: BaseException, limit: int = 300) -> str:
    """One-line description of an exception (MLflow's messages embed whole tracebacks)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {truncate(text, limit)}"
