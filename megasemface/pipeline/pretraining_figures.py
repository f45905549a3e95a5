"""What the pipeline measures on a finished pre-training: the interface diagnostics of a
SemFace stage and the encoder MLM on validation text of a stage that trains one.

Each is written to a file in the run directory, reused when present (so a pipeline run
again over a work directory measures only the finished runs that lack it), and logged as
metrics of the pre-training's MLflow run; neither changes the run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megasemface.checkpoints.layout import find_checkpoint
from megasemface.evaluation import encoder_mlm as mlm
from megasemface.evaluation.diagnostics import DiagnosticsConfig, diagnose_interface, log_to_run
from megasemface.evaluation.diagnostics.report import FORMAT as DIAGNOSTICS_FORMAT

__all__ = ["DIAGNOSTICS_FILE", "MLM_FILE", "diagnose_run", "encoder_mlm_of_run"]

DIAGNOSTICS_FILE = "diagnostics.json"
MLM_FILE = "valid-mlm.json"


def _reused(path: Path, format: str | None = None) -> dict[str, Any] | None:
    """The figures of an earlier call, unless missing or of another ``format``."""
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    if format is not None and data.get("format") != format:
        return None  # measured by other code: measured again
    print(f"reusing {path}")
    return data


def diagnose_run(config: DiagnosticsConfig, run_dir: Path, tracking_uri: str) -> dict[str, Any]:
    """The diagnostics of the pre-training ``run_dir`` and of the model connected from it
    (code usage, cosine, what cross-attention transfers, the dictionary's code sharing,
    whether the connected model reads a translation), in ``<run>/diagnostics.json`` and as
    ``diag_*`` metrics of the run's MLflow run."""
    path = run_dir / DIAGNOSTICS_FILE
    reused = _reused(path, DIAGNOSTICS_FORMAT)
    if reused is not None:
        return reused
    result = diagnose_interface(config)
    if config.checkpoint is None:  # a connected model alone: the figures are its run's
        checkpoint = find_checkpoint(run_dir)
        result.mlflow_run_id = checkpoint.meta.get("mlflow_run_id") or None
        result.step = checkpoint.step
    print(result.format_table())
    data = result.to_dict()
    if data.get("mlflow_run_id"):
        log_to_run(result, tracking_uri=tracking_uri, run_id=data["mlflow_run_id"])
    path.write_text(json.dumps(data, indent=1))
    return data


def encoder_mlm_of_run(
    run_dir: Path, spm_model: Path, texts: dict[str, Path], max_sentences: int, tracking_uri: str
) -> dict[str, Any]:
    """The encoder MLM of the run's last checkpoint on ``texts`` (the first
    ``max_sentences`` lines of each), in ``<run>/valid-mlm.json`` and as
    ``final_valid_enc_mlm`` metrics of its MLflow run at that step."""
    path = run_dir / MLM_FILE
    reused = _reused(path)
    if reused is not None:
        return reused
    result = mlm.encoder_mlm(run_dir, texts, spm_model=spm_model, max_sentences=max_sentences)
    print(result.format_table())
    if result.mlflow_run_id:
        mlm.log_to_run(result, tracking_uri=tracking_uri, run_id=result.mlflow_run_id)
    data = result.to_dict()
    path.write_text(json.dumps(data, indent=1))
    return data
