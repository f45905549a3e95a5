"""Registering a fine-tuning run's best model in MLflow's model registry, with its lineage.

The model directory (``<run>/best``: ``config.json``, ``model.safetensors``, ``spm.model``,
``provenance.json``) is logged as artifacts of the fine-tuning run that wrote it, under
``model/step-<step>``, and that artifact path becomes a version of a registered model
(``runs:/<run id>/model/step-<step>``). It stays a plain megasemface model directory, with no
``MLmodel`` file and no pickled code: ``mlflow artifacts download --artifact-uri
models:/<name>/<version>`` fetches it and ``tools/translate.py --model-dir`` reads it.

The version's tags carry the lineage: system, interface, seed and setting, the MLflow run ids
of the runs the model was made from (``parent_<role>_run``), the validation BLEU and chrF
from fine-tuning and, when known, test BLEU and chrF with sacreBLEU's signatures (from
``test-scores.json`` beside the model directory, which the pipeline writes). The alias
``best`` follows the version with the highest validation BLEU.

Registering is idempotent: a version of the same run with the same weights (sha256 of
``model.safetensors``) is reused and its tags brought up to date, so the pipeline can
register again once the test scores are known, or on every re-run, without new versions.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megasemface.files import file_sha256
from megasemface.interfaces.registry import NONE, find_interface
from megasemface.models.model_dir import ModelDirInfo, read_model_dir_info

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run
    from mlflow.entities.model_registry import ModelVersion

__all__ = [
    "BEST_ALIAS",
    "RegisteredVersion",
    "RegistryError",
    "default_model_name",
    "register_best_model",
]

BEST_ALIAS = "best"
"""The alias of a registered model's version with the highest validation BLEU."""

_NAME_CHARS = re.compile(r"[^A-Za-z0-9._-]+")


class RegistryError(ValueError):
    """A model directory that cannot be registered (not from a tracked fine-tuning run)."""


@dataclass(frozen=True, slots=True)
class RegisteredVersion:
    """One version of a registered model; ``created`` is False for a reused version."""

    name: str
    version: str
    run_id: str
    source: str
    created: bool

    @property
    def uri(self) -> str:
        """``models:/<name>/<version>``, what MLflow's commands take."""
        return f"models:/{self.name}/{self.version}"


def default_model_name(languages: Iterable[str], system_key: str, suffix: str = "") -> str:
    """``megasemface-<pair>-<system key>``, with ``-<suffix>`` when one is given: the
    pipeline's setting names its models apart (``megasemface-en-de-cl``,
    ``megasemface-en-de-vq-unsupervised``)."""
    parts = ["megasemface", "-".join(languages), system_key]
    if suffix:
        parts.append(suffix)
    return _NAME_CHARS.sub("-", "-".join(p for p in parts if p)).strip("-")


def register_best_model(
    tracking_uri: str,
    model_dir: str | os.PathLike[str],
    *,
    name: str | None = None,
    tags: Mapping[str, str] | None = None,
    scores: Mapping[str, Any] | None = None,
) -> RegisteredVersion:
    """Registers ``model_dir``, a fine-tuning run's best model, as a version of ``name``.

    Args:
        tracking_uri: the MLflow store of the fine-tuning run (its registry too).
        model_dir: the model directory; its ``config.json`` names the fine-tuning run
            (``meta.parent_runs.finetune``).
        name: the registered model (created when missing); None: :func:`default_model_name`
            of the model's languages and the run's ``system_key`` tag (else its run name)
            and ``model_suffix`` tag (the pipeline's setting's, where it has one).
        tags: version tags that replace the derived ones (e.g. the pipeline's ``interface``).
        scores: the test scores (``test-scores.json``'s content); None: that file beside
            ``model_dir`` when there is one.

    Returns:
        The version: a new one, or the one already registered from the same run and weights.

    Raises:
        RegistryError: ``model_dir`` names no fine-tuning run, or a name MLflow filters
            cannot quote.
        ModelDirError: not a complete translation model directory.
        MlflowException: the store refused (an unknown run, a bad name).
    """
    from mlflow import MlflowClient

    info = read_model_dir_info(model_dir, "seq2seq")
    parents = {k: v for k, v in (info.meta.get("parent_runs") or {}).items() if v}
    run_id = parents.pop("finetune", None)
    if not isinstance(run_id, str):
        raise RegistryError(
            f"{info.path} names no fine-tuning run (config.json meta.parent_runs.finetune): "
            "only the best model of a tracked fine-tuning run can be registered"
        )
    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    run_tags = run.data.tags
    if name is None:
        key = run_tags.get("system_key") or run.info.run_name or run_id
        name = default_model_name(info.languages, key, run_tags.get("model_suffix", ""))
    if "'" in name:
        raise RegistryError(f"registered model name {name!r}: leave out the quote")
    if scores is None:
        path = info.path.parent / "test-scores.json"
        scores = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    sha256 = file_sha256(info.path / "model.safetensors")
    version_tags = {
        **_lineage_tags(client, info, run, parents),
        **_score_tags(info.meta, scores),
        "model_sha256": sha256,
        **dict(tags or {}),
    }
    description = _description(info, run, version_tags)
    _ensure_registered_model(client, name)
    existing = [
        v
        for v in client.search_model_versions(f"name = '{name}' AND run_id = '{run_id}'")
        if v.tags.get("model_sha256") == sha256
    ]
    if existing:
        version = min(existing, key=lambda v: int(v.version))
        for key, value in version_tags.items():
            if version.tags.get(key) != value:
                client.set_model_version_tag(name, version.version, key, value)
        if version.description != description:
            client.update_model_version(name, version.version, description=description)
        created = False
    else:
        artifact_path = f"model/step-{info.meta.get('step', 0)}"
        client.log_artifacts(run_id, str(info.path), artifact_path)
        version = client.create_model_version(
            name,
            f"runs:/{run_id}/{artifact_path}",
            run_id=run_id,
            tags=version_tags,
            description=description,
        )
        created = True
    _point_best_alias(client, name)
    return RegisteredVersion(name, str(version.version), run_id, version.source, created)


def _ensure_registered_model(client: MlflowClient, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.create_registered_model(
            name, description="megasemface translation models: one version per fine-tuning run"
        )
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise


def _lineage_tags(
    client: MlflowClient, info: ModelDirInfo, run: Run, parents: Mapping[str, str]
) -> dict[str, str]:
    """Who made the model: the run's system, seed and setting, its interface (the first
    SemFace parent's), and the parent runs' ids."""
    tags, params = run.data.tags, run.data.params
    found = {
        "system": tags.get("system"),
        "system_key": tags.get("system_key"),
        "setting": tags.get("setting") or params.get("train.finetune_mode"),
        "seed": tags.get("seed") or params.get("train.seed"),
        "interface": _parent_interface(client, parents.values()),
        "run_name": run.info.run_name,
        "languages": ",".join(info.languages),
        "step": str(info.meta.get("step", "")),
        "model_dir": str(info.path.resolve()),
    }
    found.update({f"parent_{role}_run": run_id for role, run_id in parents.items()})
    return {key: str(value) for key, value in found.items() if value not in (None, "")}


def _parent_interface(client: MlflowClient, run_ids: Iterable[str]) -> str:
    """``cl`` or ``vq`` when a parent run pre-trained that interface, else ``none``."""
    from mlflow.exceptions import MlflowException

    for run_id in run_ids:
        try:
            interface = client.get_run(run_id).data.tags.get("interface")
        except MlflowException:
            continue  # a parent gone from the store says nothing
        spec = find_interface(interface)
        if spec is not None and spec.semface:
            return spec.name
    return NONE


def _score_tags(meta: Mapping[str, Any], scores: Mapping[str, Any]) -> dict[str, str]:
    """Validation scores of the best step, test scores and their sacreBLEU signatures."""
    tags = {
        key: f"{float(value):.4f}"
        for source, prefix in ((meta, "valid_"), (scores, "test_"))
        for key, value in source.items()
        if key.startswith((f"{prefix}bleu", f"{prefix}chrf")) and isinstance(value, int | float)
    }
    for metric, signature in (scores.get("signatures") or {}).items():
        tags[f"test_{metric}_signature"] = str(signature)
    return tags


def _description(info: ModelDirInfo, run: Run, tags: Mapping[str, str]) -> str:
    who = tags.get("system") or run.info.run_name
    how = ", ".join(
        text
        for text in (tags.get("setting"), f"seed {tags['seed']}" if "seed" in tags else None)
        if text
    )
    lines = [
        f"{who} ({how}), the best model of the fine-tuning run {run.info.run_name} "
        f"({run.info.run_id}) by validation BLEU ({tags.get('valid_bleu', '-')}) at step "
        f"{tags.get('step', '-')}; languages {', '.join(info.languages)}."
    ]
    if "test_bleu" in tags:
        lines.append(f"Test BLEU {tags['test_bleu']}, chrF {tags.get('test_chrf', '-')}.")
    lines.append(
        "A megasemface model directory: download it with `mlflow artifacts download "
        "--artifact-uri models:/<name>/<version>` and translate with `tools/translate.py "
        "--model-dir`."
    )
    return " ".join(lines)


def _point_best_alias(client: MlflowClient, name: str) -> None:
    """Moves the ``best`` alias to the version with the highest validation BLEU."""
    scored: list[tuple[float, int, ModelVersion]] = []
    for version in client.search_model_versions(f"name = '{name}'"):
        try:
            scored.append((float(version.tags["valid_bleu"]), -int(version.version), version))
        except (KeyError, ValueError):
            continue
    if scored:
        best = max(scored, key=lambda item: item[:2])[2]
        client.set_registered_model_alias(name, BEST_ALIAS, str(best.version))
