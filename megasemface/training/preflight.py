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
from megasemface.training.options import TrainConfig, user_model_config
from megasemface.training.units import unit_class, unit_of

__all__ = ["check_before_start", "lr_schedule_of", "tracking_server_problem"]

TRACKING_CONNECT_S = 5.0
"""How long the start waits for the MLflow server to accept a connection: a server that
is up answers in milliseconds, even across a cluster's network."""


def tracking_server_problem(config: TrainConfig) -> str | None:
    """Why the run's MLflow server (``--tracking-uri`` or ``MLFLOW_TRACKING_URI``, http or
    https) does not accept connections, or None when it does or the store is not a server.

    Once a run is going, the tracker rides out a server's outage (it spools and retries).
    At the start, a server that nobody answers for is most often a mistyped URI, or one the
    nodes cannot route to, and the run would train for hours with nothing tracked: so the
    start stops, in one line, before the cluster's time is spent."""
    uri = config.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
    if config.no_tracking or not uri:
        return None
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        with socket.create_connection((parts.hostname, port), timeout=TRACKING_CONNECT_S):
            return None
    except OSError as exc:
        reason = "timed out" if isinstance(exc, TimeoutError) else exc.strerror or str(exc)
    return (
        f"the MLflow tracking server {redact_uri(uri)} is unreachable ({reason}): start it, "
        "correct --tracking-uri, or pass --no-tracking"
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
