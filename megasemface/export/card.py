"""The model card (README.md) of an export: shape, lineage, scores, data and how to load it.

Everything comes from what the model directory and its run record: ``config.json``'s meta
(stage, step, validation scores, the MLflow run ids of the parent runs),
``provenance.json`` (the fine-tuning run directory, the model it started from and, one level
up, the runs connected into that model), the fine-tuning run's newest checkpoint (its
training options: data, validation set, steps) with the shards' manifest (sentences per
language or pair), and the test scores the pipeline writes beside the run's best model
(``test-scores.json``: BLEU and chrF per direction with sacreBLEU's signatures). What is not
recorded is left out rather than guessed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megasemface.checkpoints.layout import CheckpointError, complete_checkpoints
from megasemface.data.shards.shard_format import Manifest, ShardFormatError
from megasemface.export.source import ExportError, ExportSource

__all__ = ["model_card", "read_test_scores"]


def read_test_scores(source: ExportSource, path: Path | None) -> dict[str, Any]:
    """``path``'s scores, or those of ``test-scores.json`` beside the model directory; {}
    when there are none."""
    candidate = path if path is not None else source.info.path.parent / "test-scores.json"
    if not candidate.is_file():
        return {}
    try:
        scores = json.loads(candidate.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ExportError(f"{candidate} is not valid JSON: {exc}") from None
    numbers = isinstance(scores, dict) and all(
        isinstance(v, (int, float)) and not isinstance(v, bool)
        for k, v in scores.items()
        if k.startswith("test_")
    )
    if not numbers or not isinstance(scores.get("signatures") or {}, dict):
        raise ExportError(
            f"{candidate} is not a test scores file: a JSON object of test_<metric>_<direction> "
            "numbers and signatures, as the pipeline writes test-scores.json"
        )
    return scores


def model_card(source: ExportSource, kind: str, usage: str, scores: dict[str, Any]) -> str:
    """The card's Markdown. ``kind`` names the format, ``usage`` is a fenced code block."""
    c, info = source.config, source.info
    params = sum(t.numel() for k, t in source.state.items() if not k.startswith("bridge."))
    # A fine-tuning run's best model is <run>/best: the run names it.
    name = info.path.parent.name if info.path.name == "best" else info.path.name
    lines = [
        f"# {name}: {source.src_lang} → {source.tgt_lang} ({kind})",
        "",
        f"A megasemface translation model from `{source.src_lang}` to `{source.tgt_lang}`, "
        f"exported for {kind} from the model directory `{info.path}`.",
        "",
        "## Model",
        "",
        f"- Transformer encoder-decoder, pre-norm: {c.encoder_layers} + {c.decoder_layers} "
        f"layers, d_model {c.d_model}, {c.num_heads} heads, feed-forward {c.ffn_dim}, GELU; "
        f"{params / 1e6:.2f}M parameters",
        f"- vocabulary: {source.tokenizer.vocab_size:,} SentencePiece pieces "
        f"(`spm.model`, sha256 `{info.vocab_sha256[:16]}…`); sources of at most "
        f"{c.max_len - 1} tokens, translations of at most {c.max_len - 1}",
        f"- languages of the model: {', '.join(info.languages)}; this export's direction is "
        f"fixed: the language embeddings of `{source.src_lang}` (encoder) and "
        f"`{source.tgt_lang}` (decoder) are folded into the position embeddings, and the "
        f"decoder starts with the tag `__{source.tgt_lang}__`",
        "",
        "## Lineage",
        "",
        *_lineage(source),
        "",
        "## Scores",
        "",
        *_scores(source, scores),
        "",
        "## Data",
        "",
        *_data(source),
        "",
        "## Use",
        "",
        usage.rstrip(),
        "",
    ]
    return "\n".join(lines)


def _lineage(source: ExportSource) -> list[str]:
    meta, provenance = source.info.meta, source.provenance()
    lines = []
    if meta.get("stage"):
        step = f" at step {meta['step']}" if "step" in meta else ""
        lines.append(f"- stage: {meta['stage']}{step}")
    for role, run_id in sorted((meta.get("parent_runs") or {}).items()):
        if run_id:
            lines.append(f"- MLflow run of the {role} stage: `{run_id}`")
    if provenance.get("mode"):
        lines.append(f"- connected ({provenance['mode']}) from:")
        lines += _sources(provenance)
    for key in ("fine-tuned", "init_from"):
        if provenance.get(key):
            lines.append(f"- {key.replace('_', ' ')}: `{provenance[key]}`")
    init = provenance.get("init_from")
    parent = Path(init) / "provenance.json" if init else None
    if parent is not None and parent.is_file():
        started = _sources(json.loads(parent.read_text(encoding="utf-8")))
        if started:
            lines += ["- the model it started from was connected from:", *started]
    return lines or ["- not recorded in the model directory"]


def _sources(provenance: dict[str, Any]) -> list[str]:
    """The stages a connected model was made of (``sources`` of its provenance)."""
    lines = []
    for role, where in sorted((provenance.get("sources") or {}).items()):
        if isinstance(where, dict):
            place = where.get("checkpoint") or where.get("path") or where.get("run")
            run_id = where.get("mlflow_run_id")
            stage = f"{where['stage']} stage, " if where.get("stage") else ""
            lines.append(f"  - {role}: `{place}` ({stage}MLflow run `{run_id}`)")
        else:
            lines.append(f"  - {role}: `{where}`")
    return lines


def _scores(source: ExportSource, scores: dict[str, Any]) -> list[str]:
    direction, meta = source.direction, source.info.meta
    lines = []
    for metric in ("bleu", "chrf"):
        value = scores.get(f"test_{metric}_{direction}")
        if value is not None:
            signature = (scores.get("signatures") or {}).get(metric, "not recorded")
            shown = {"bleu": "BLEU", "chrf": "chrF"}[metric]
            lines.append(f"- test {shown}: {value:.2f} (sacreBLEU `{signature}`)")
    for key in sorted(k for k in meta if k.startswith("valid_")):
        if key in ("valid_bleu", "valid_chrf", f"valid_bleu_{direction}") and isinstance(
            meta[key], (int, float)
        ):
            lines.append(f"- validation {key.removeprefix('valid_')}: {meta[key]:.2f}")
    return lines or ["- no scores recorded"]


def _data(source: ExportSource) -> list[str]:
    run = source.provenance().get("fine-tuned")
    options: dict[str, Any] = {}
    if run:
        try:
            checkpoints = complete_checkpoints(Path(run))
        except CheckpointError:
            checkpoints = []
        if checkpoints:
            meta = json.loads((checkpoints[-1] / "meta.json").read_text(encoding="utf-8"))
            options = meta.get("train_config") or {}
    if not options:
        return ["- not recorded (the fine-tuning run directory is not available)"]
    lines = [
        f"- fine-tuning data: `{options.get('data')}` ({options.get('finetune_mode', '')} "
        f"fine-tuning, {options.get('steps')} steps)",
    ]
    try:
        manifest = Manifest.load(options["data"])
    except (OSError, KeyError, ValueError, ShardFormatError):
        manifest = None
    if manifest is not None:
        for name in sorted(manifest.languages):
            kind = "pairs" if name in manifest.pairs else "sentences"
            lines.append(f"  - {name}: {manifest.sentences(name):,} {kind}")
    if options.get("valid_prefix"):
        lines.append(f"- validation set: `{options['valid_prefix']}`")
    return lines
