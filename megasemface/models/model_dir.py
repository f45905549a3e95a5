"""Self-contained model directories: what fine-tuning, translation and the tools exchange.

Layout::

    <dir>/model.safetensors   the weights, fp32 (safetensors: loading runs no pickled code)
    <dir>/config.json         format version, kind, model config, languages, tokenizer hash,
                              interface fingerprint and any tool-specific metadata
    <dir>/spm.model           the SentencePiece model the weights were trained with
    <dir>/provenance.json     where every parameter came from (source runs and checkpoints)

``kind`` is ``seq2seq`` (a translation model: ``Seq2SeqModel`` keys) or ``pretraining`` (a
consolidated pre-training checkpoint: ``SemFaceModel`` or mBART keys, interface included).
A directory is written under a temporary name and renamed into place, so a directory that
exists is complete.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megasemface.files import replace_directory, write_atomically
from megasemface.nn.config import ModelConfig, config_from_dict

__all__ = [
    "FORMAT",
    "ModelDirError",
    "ModelDirInfo",
    "load_model_dir",
    "load_seq2seq",
    "load_seq2seq_state",
    "load_weights",
    "read_model_dir_info",
    "save_model_dir",
]

FORMAT = "megasemface-model"
VERSION = 1
KINDS = ("seq2seq", "pretraining")


class ModelDirError(ValueError):
    """A model directory is missing, incomplete or of another kind than expected."""


@dataclasses.dataclass
class ModelDirInfo:
    """Everything in a model directory but the weights."""

    path: Path
    kind: str
    model: ModelConfig
    languages: list[str]
    vocab_sha256: str
    interface: dict[str, Any]
    meta: dict[str, Any]
    """Free-form metadata: stage, source runs, metrics."""

    @property
    def spm_model(self) -> Path:
        return self.path / "spm.model"


def save_model_dir(
    path: str | os.PathLike[str],
    state: Mapping[str, torch.Tensor],
    *,
    kind: str,
    model_config: ModelConfig,
    languages: list[str],
    spm_model: str | os.PathLike[str] | bytes,
    interface: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Writes a model directory atomically; returns its path."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    path = Path(path)
    if path.exists() and not overwrite:
        raise ModelDirError(f"{path} exists; pass overwrite=True (--overwrite) to replace it")
    spm_bytes = spm_model if isinstance(spm_model, bytes) else Path(spm_model).read_bytes()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}
    write_atomically(
        tmp / "model.safetensors",
        lambda target: save_file(tensors, str(target), metadata={"format": FORMAT}),
    )
    (tmp / "spm.model").write_bytes(spm_bytes)
    config = {
        "format": FORMAT,
        "version": VERSION,
        "kind": kind,
        "model": model_config.to_dict(),
        "languages": list(languages),
        "vocab_sha256": hashlib.sha256(spm_bytes).hexdigest(),
        "interface": dict(interface or {}),
        "meta": dict(meta or {}),
    }
    (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n", encoding="utf-8")
    (tmp / "provenance.json").write_text(
        json.dumps(dict(provenance or {}), indent=1) + "\n", encoding="utf-8"
    )
    replace_directory(tmp, path)
    return path


def _read_config(path: Path) -> dict[str, Any]:
    """config.json as a dict whose fields have the types the format gives them."""
    config_path = path / "config.json"
    if not path.exists():
        raise ModelDirError(f"{path}: no such directory")
    if not config_path.is_file():
        raise ModelDirError(
            f"{path} is not a megasemface model directory (no config.json); make one with "
            "tools/merge_checkpoints.py"
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelDirError(f"{config_path} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ModelDirError(f"{config_path} holds a {type(config).__name__}, not a JSON object")
    if config.get("format") != FORMAT or config.get("version") != VERSION:
        raise ModelDirError(
            f"{config_path}: format {config.get('format')!r} version {config.get('version')!r}, "
            f"expected {FORMAT!r} version {VERSION}"
        )
    fields: dict[str, tuple[type, ...]] = {
        "kind": (str,),
        "model": (dict,),
        "languages": (list,),
        "vocab_sha256": (str,),
        "interface": (dict, type(None)),
        "meta": (dict, type(None)),
    }
    for name, types in fields.items():
        if not isinstance(config.get(name), types):
            wanted = " or ".join("null" if t is type(None) else t.__name__ for t in types)
            raise ModelDirError(
                f"{config_path}: {name} must be a {wanted}, got {config.get(name)!r:.60}; write "
                "the model directory again"
            )
    if not all(isinstance(lang, str) for lang in config["languages"]):
        raise ModelDirError(f"{config_path}: languages must be language codes (strings)")
    return config


def read_model_dir_info(path: str | os.PathLike[str], kind: str | None = None) -> ModelDirInfo:
    """Reads config.json; checks its fields, the format, the kind and the tokenizer's hash."""
    path = Path(path)
    config = _read_config(path)
    if kind is not None and config["kind"] != kind:
        raise ModelDirError(
            f"{path} holds a {config['kind']!r} model, a {kind!r} model is needed"
            + (
                "; connect pre-training stages first (tools/merge_checkpoints.py connect)"
                if kind == "seq2seq"
                else ""
            )
        )
    for name in ("model.safetensors", "spm.model"):
        if not (path / name).is_file():
            raise ModelDirError(f"{path} is incomplete: {name} is missing")
    spm_sha = hashlib.sha256((path / "spm.model").read_bytes()).hexdigest()
    if spm_sha != config["vocab_sha256"]:
        raise ModelDirError(
            f"{path}/spm.model is not the SentencePiece model the weights were trained with "
            "(sha256 differs from config.json)"
        )
    try:
        model = config_from_dict(config["model"])
    except ValueError as exc:
        raise ModelDirError(f"{path}/config.json: model: {exc}") from None
    return ModelDirInfo(
        path=path,
        kind=config["kind"],
        model=model,
        languages=list(config["languages"]),
        vocab_sha256=config["vocab_sha256"],
        interface=dict(config["interface"] or {}),
        meta=dict(config["meta"] or {}),
    )


def load_weights(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """A model directory's ``model.safetensors`` (or another weights file of one), or a
    ModelDirError naming it when it is truncated, damaged or unreadable."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as exc:
        raise ModelDirError(
            f"{path} cannot be read ({exc}); the file is truncated or damaged: write the "
            "model directory again (tools/merge_checkpoints.py, or the run's best model)"
        ) from None


def load_model_dir(
    path: str | os.PathLike[str], kind: str | None = None
) -> tuple[dict[str, torch.Tensor], ModelDirInfo]:
    """The weights (safetensors) and the info of a model directory."""
    info = read_model_dir_info(path, kind)
    return load_weights(info.path / "model.safetensors"), info


def load_seq2seq_state(
    path: str | os.PathLike[str],
) -> tuple[dict[str, torch.Tensor], ModelDirInfo]:
    """The weights and info of a ``seq2seq`` model directory, checked against its config:
    the same parameter names and shapes as a ``Seq2SeqModel`` of that config has.

    The shapes come from a model built on the meta device (:func:`parameter_shapes`), so a
    damaged config is refused before any memory is spent on it.
    """
    from megasemface.nn.transformer import parameter_shapes

    state, info = load_model_dir(path, "seq2seq")
    weights = info.path / "model.safetensors"
    try:
        shapes = parameter_shapes(info.model)
    except ValueError as exc:
        raise ModelDirError(f"{info.path}/config.json: {exc}") from None
    missing = sorted(shapes.keys() - state.keys())
    unexpected = sorted(state.keys() - shapes.keys())
    reshaped = sorted(k for k in shapes.keys() & state.keys() if tuple(state[k].shape) != shapes[k])
    if missing or unexpected or reshaped:
        raise ModelDirError(
            f"{weights} does not match its config.json: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, other shape {reshaped[:3]}; write the model directory again"
        )
    return state, info


def load_seq2seq(path: str | os.PathLike[str]) -> tuple[torch.nn.Module, ModelDirInfo]:
    """A ready ``Seq2SeqModel`` (eval mode, CPU) from a ``seq2seq`` model directory."""
    from megasemface.nn.transformer import Seq2SeqModel

    state, info = load_seq2seq_state(path)
    model = Seq2SeqModel(info.model)
    model.load_state_dict(state)
    return model.eval(), info
