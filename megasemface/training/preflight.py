"""Checks of a run's options that need no process group, no data and no model.

``train.py`` runs them before distributed start-up, so a mistake in the options costs a
one-line error at once, not a traceback from every rank after start-up and data loading.
"""

from __future__ import annotations

import os
import socket
from typing import Any
from urllib.parse import urlsplit

from megasemface.checkpoints.manager import CheckpointManager
from megasemface.checkpoints.universal import check_parallel_sizes
from megasemface.interfaces.registry import interface
from megasemface.nn import cpu_gemm
from megasemface.tracking.mlflow_names import redact_uri
from megasemface.tracking.mlflow_refusal import refusal_line
from megasemface.training.options import TrainConfig, user_model_config
from megasemface.training.units import unit_class, unit_of

__all__ = ["check_before_start", "lr_schedule_of", "preset_warning", "tracking_server_problem"]

TRACKING_CONNECT_S = 5.0
"""How long the start waits for the MLflow server to accept a connection: a server that
is up answers in milliseconds, even across a cluster's network."""
TRACKING_PROBE = "/api/2.0/mlflow/experiments/search"
"""The API call the start makes: a read every user of a tracking server may make."""


def tracking_server_problem(config: TrainConfig) -> str | None:
    """Why the run's MLflow server (``--tracking-uri`` or ``MLFLOW_TRACKING_URI``, http or
    https) cannot take the run's records, or None when it can or the store is not a server.

    Once a run is going, the tracker rides out a server's outage (it spools and retries).
    At the start, a server that nobody answers for is most often a mistyped URI, or one the
    nodes cannot route to, and one that refuses (a host name its ``--allowed-hosts`` does not
    list, wrong credentials, a wrong path) refuses every later request too: the run would
    train for hours with nothing tracked. So the start connects, then makes one API call with
    the run's credentials (MLflow's own environment variables, read by MLflow's client), and
    stops in one line on either failure, before the cluster's time is spent. A server that
    accepts the connection but answers nothing, or an error of its own (5xx), is an outage the
    tracker rides out."""
    uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if config.no_tracking or not uri:
        return None
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=TRACKING_CONNECT_S):
            pass
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
        return (
            f"the MLflow tracking server {redact_uri(uri)} is unreachable ({reason}): start "
            "it, correct --tracking-uri, or pass --no-tracking"
        )
    refusal = _api_refusal(uri)
    return f"{refusal}, or pass --no-tracking" if refusal else None


def _api_refusal(uri: str) -> str | None:
    """The refusal of one read of the server's experiments, as MLflow's client makes it."""
    from mlflow.utils.credentials import get_default_host_creds
    from mlflow.utils.rest_utils import http_request

    try:
        response = http_request(
            get_default_host_creds(uri),
            TRACKING_PROBE,
            "GET",
            max_retries=0,
            timeout=TRACKING_CONNECT_S,
            params={"max_results": 1},
        )
    except Exception:  # connected, then no answer: an outage, not a refusal
        return None
    return refusal_line(uri, response.status_code, response.text)


def preset_warning(config: TrainConfig, device_type: str) -> str | None:
    """A line for a GPU run of the ``tiny`` preset, the default: it is the tests' and the
    demo's model, and a GPU run that forgot ``--preset`` would train it for days."""
    if config.preset != "tiny" or device_type != "cuda":
        return None
    return (
        "--preset tiny (the default) is the tests' and the demo's model, about a million "
        "parameters; on GPUs pass --preset paper (or small) for the paper's model"
    )


def lr_schedule_of(config: TrainConfig, ds_config: dict[str, Any]) -> str:
    """The learning-rate schedule megasemface runs: ``deepspeed`` (the config's optimizer
    and scheduler), ``constant`` (``--lr`` replaces the config's rate) or ``inverse_sqrt``;
    without ``--lr-schedule``, the stage's own default."""
    schedule = config.lr_schedule or unit_class(unit_of(config)).lr_schedule
    has_scheduler = bool(ds_config.get("scheduler"))
    if schedule != "deepspeed" and has_scheduler:
        raise ValueError(
            f"--lr-schedule {schedule} replaces DeepSpeed's scheduler; remove "
            "'scheduler' from the DeepSpeed config or pass --lr-schedule deepspeed"
        )
    if schedule == "deepspeed" and config.lr is not None:
        if has_scheduler:
            raise ValueError("--lr would fight the DeepSpeed config's scheduler; set it there")
        return "constant"
    return schedule


def check_before_start(config: TrainConfig, ds_config: dict[str, Any], world_size: int = 1) -> None:
    """Raises ValueError for options that cannot work together, or with the ``world_size``
    processes the launcher started."""
    if world_size % config.mp_size:
        raise ValueError(
            f"--mp-size {config.mp_size} does not divide the {world_size} processes launched: "
            "launch a multiple of --mp-size processes (deepspeed --num_gpus N), or change "
            "--mp-size"
        )
    if config.output_dir.exists() and not config.output_dir.is_dir():
        raise ValueError(f"--output-dir {config.output_dir} is a file; name a directory")
    lr_schedule_of(config, ds_config)
    cpu_gemm.check_setting()
    if config.compile and ds_config.get("zero_optimization", {}).get("stage", 0) == 3:
        # ZeRO-3's hooks gather each layer's weights inside the compiled forward.
        raise ValueError(
            "--compile works under ZeRO stage 1 or 2; leave it out with a stage-3 config"
        )
    newest = CheckpointManager(config.output_dir, config.keep_last, rank=0).newest()
    if newest is not None:  # a resume: the model-parallel size must be the checkpoint's
        check_parallel_sizes(config.output_dir / "checkpoints" / newest[1], config.mp_size)
    model = user_model_config(config)
    if model.bridge != "none":
        raise ValueError(
            "the codebook bridge belongs to a connected translation model and starts from its "
            "VQ-SemFace pre-training: connect with tools/merge_checkpoints.py connect --bridge "
            "codebook, then fine-tune with --init-from that model directory"
        )
    flat = interface(config.interface).codebook and model.vq.layout == "flat"
    if flat and model.vq.num_codes % config.mp_size:
        raise ValueError(
            f"vq.num_codes {model.vq.num_codes} is not divisible by --mp-size "
            f"{config.mp_size}: the flat codebook is split evenly over the model-parallel ranks"
        )
