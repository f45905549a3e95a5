"""Writing what the checkpoint tools produce as self-contained model directories.

``pretraining`` directories hold a consolidated (possibly averaged) stage with its meta:
stage, interface fingerprint (of the gathered interface), MLflow run id, parent runs and
training options; ``seq2seq`` directories a connected translation model. Both get the
SentencePiece model the run trained with, found through meta.json's training options
(``spm_model``) and checked against the recorded sha256, and ``provenance.json``: the
source runs and checkpoints, and the origin of every parameter.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors.torch import save_file
from torch import Tensor

from megasemface.checkpoints.connect import Connected
from megasemface.checkpoints.layout import CheckpointError
from megasemface.files import replace_directory, write_atomically
from megasemface.interfaces.registry import recorded_weights
from megasemface.models.model_dir import ModelDirError, save_model_dir
from megasemface.nn.config import config_from_dict

__all__ = ["resolve_spm_model", "write_pretraining_dir", "write_seq2seq_dir"]

# Meta keys a pretraining directory keeps (the rest of meta.json is in config.json already).
_KEPT = (
    "stage",
    "mlflow_run_id",
    "parent_runs",
    "train_config",
    "param_dtype",
    "interface_recorded",
    "averaged",
    "source",
)


def resolve_spm_model(meta: Mapping[str, Any], override: str | Path | None = None) -> Path:
    """The SentencePiece model of a stage: ``override``, the model directory's copy, or the
    file meta.json's training options name; its sha256 must be the recorded one."""
    source = meta.get("source", {})
    if override is not None:
        path = Path(override)
    elif source.get("kind") == "model_dir":
        path = Path(source["spm_model"])
    else:
        named = meta.get("train_config", {}).get("spm_model")
        if not named:
            raise CheckpointError("meta.json names no SentencePiece model; pass --spm-model")
        path = Path(named)
    if not path.is_file():
        raise CheckpointError(
            f"the SentencePiece model {path} (named by the run's options) is missing; pass the "
            "model the run was trained with as --spm-model"
        )
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != meta.get("vocab_sha256"):
        raise CheckpointError(
            f"{path} is not the SentencePiece model the weights were trained with (sha256 "
            f"{digest[:12]}, the run recorded {str(meta.get('vocab_sha256'))[:12]}); pass the "
            "right one as --spm-model"
        )
    return path


def _pretraining_provenance(state: Mapping[str, Tensor], meta: Mapping[str, Any]) -> dict:
    source = meta.get("source", {})
    gathered = set(source.get("gathered", []))
    from_module = set(source.get("from_module_state", []))
    origin = "average" if source.get("kind") == "average" else "checkpoint"
    parameters = {}
    for key in state:
        if key in gathered:
            parameters[key] = f"{origin}:{key} (gathered over {source['mp_size']} mp ranks)"
        elif key in from_module:
            parameters[key] = f"{origin}:{key} (frozen; DeepSpeed module state)"
        else:
            parameters[key] = f"{origin}:{key}"
    return {"sources": {origin: source}, "parameters": parameters}


def _replace_dir(tmp: Path, out: Path, overwrite: bool) -> None:
    if out.exists() and not overwrite:
        shutil.rmtree(tmp, ignore_errors=True)
        raise ModelDirError(f"{out} exists; pass --overwrite to replace it")
    replace_directory(tmp, out)


def write_pretraining_dir(
    out: str | Path,
    state: Mapping[str, Tensor],
    meta: Mapping[str, Any],
    *,
    spm_model: str | Path | None = None,
    mp_size: int | None = None,
    overwrite: bool = False,
) -> Path:
    """A ``pretraining`` model directory of a consolidated or averaged stage.

    ``mp_size``: also write ``codebook-mp<N>-rank<R>.safetensors``, the VQ layer state
    (``quantizer.load_state_dict`` keys) each of N model-parallel ranks loads.
    """
    out = Path(out)
    if out.exists() and not overwrite:
        raise ModelDirError(f"{out} exists; pass --overwrite to replace it")
    config = config_from_dict(meta["model"])
    spm = resolve_spm_model(meta, spm_model)
    kept = {k: meta[k] for k in _KEPT if k in meta}
    shard_files: list[str] = []
    weights = recorded_weights(meta)
    if mp_size is not None and weights is not None:
        shard_files = [f"codebook-mp{mp_size}-rank{r}.safetensors" for r in range(mp_size)]
        kept["codebook_shards"] = {
            "mp_size": mp_size,
            "files": shard_files,
            "split": [k for k in weights.split_keys(config) if k in state],
        }
    elif mp_size is not None:
        raise CheckpointError(f"--mp-size re-splits a VQ codebook; {meta.get('stage')} has none")
    tmp = out.with_name(f".{out.name}.building-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_model_dir(
        tmp,
        state,
        kind="pretraining",
        model_config=config,
        languages=meta["languages"],
        spm_model=spm,
        interface=meta.get("interface"),
        provenance=_pretraining_provenance(state, meta),
        meta=kept,
    )
    if shard_files:
        assert weights is not None
        try:
            parts = weights.resplit(state, config, mp_size or 1)
        except ValueError as exc:
            raise CheckpointError(f"--mp-size {mp_size}: {exc}") from None
        for name, part in zip(shard_files, parts, strict=True):
            tensors = {k: v.contiguous() for k, v in weights.own_state(part).items()}
            write_atomically(
                tmp / name,
                lambda target, t=tensors: save_file(
                    t, str(target), metadata={"mp_size": str(mp_size)}
                ),
            )
    _replace_dir(tmp, out, overwrite)
    return out


def write_seq2seq_dir(
    out: str | Path,
    connected: Connected,
    *,
    spm_model: str | Path | None = None,
    overwrite: bool = False,
) -> Path:
    """A ``seq2seq`` model directory of a connected model, with its provenance."""
    first = next(iter(connected.sources.values()))
    spm = resolve_spm_model(first, spm_model)
    sources = {role: meta.get("source", {}) for role, meta in connected.sources.items()}
    meta = {
        "mode": connected.mode,
        "parent_runs": {
            role: meta.get("mlflow_run_id") or "" for role, meta in connected.sources.items()
        },
        "stages": {role: meta.get("stage") for role, meta in connected.sources.items()},
    }
    return save_model_dir(
        out,
        connected.state,
        kind="seq2seq",
        model_config=connected.config,
        languages=first["languages"],
        spm_model=spm,
        interface=first.get("interface"),
        provenance={"mode": connected.mode, "sources": sources, "parameters": connected.parameters},
        meta=meta,
        overwrite=overwrite,
    )
