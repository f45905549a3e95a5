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

from megasemface.evaluation import encoder_mlm as mlm
from megasemface.evaluation.diagnostics import DiagnosticsConfig, diagnose_interface, log_to_run

__all__ = ["DIAGNOSTICS_FILE", "MLM_FILE", "diagnose_run", "encoder_mlm_of_run"]

DIAGNOSTICS_FILE = "diagnostics.json"
MLM_FILE = "valid-mlm.json"


def _reused(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    print(f"reusing {path}")
    return json.loads(path.read_text())


def diagnose_run(config: DiagnosticsConfig, tracking_uri: str) -> dict[str, Any]:
    """The diagnostics of the run ``config.checkpoint`` (code usage, cosine, what
    cross-attention transfers, the dictionary's code sharing), in ``<run>/diagnostics.json``
    and as ``diag_*`` metrics of its MLflow run."""
    assert config.checkpoint is not None, "the pipeline diagnoses its pre-training runs"
    path = config.checkpoint / DIAGNOSTICS_FILE
    reused = _reused(path)
    if reused is not None:
        return reused
    result = diagnose_interface(config)
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
