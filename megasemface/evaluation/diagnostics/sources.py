"""The models the interface diagnostics read, from a pre-training stage and a model directory.

A pre-training source (a run, checkpoint or ``pretraining`` model directory of an encoder,
decoder or joint stage) is consolidated with :func:`megasemface.checkpoints.load_stage`
(ZeRO partitions merged, a codebook split over model-parallel ranks gathered), so the
diagnostics always work on the whole layer at model-parallel size 1. A ``seq2seq`` model
directory (``tools/merge_checkpoints.py connect``) supplies the connected encoder.

Which part plays which role:

- the *encoder* is the stage's encoder when the stage trained it (encoder or joint): its
  outputs are compared with the interface;
- the *decoder* whose cross-attention is measured is the stage's decoder when the stage
  trained it (decoder or joint: the decoder pre-trained against the interface), else the
  model directory's;
- the *connected encoder*, whose output is the memory of "what fine-tuning feeds the
  pre-trained cross-attention", is the model directory's encoder (through its codebook
  bridge when it has one), else the encoder of a joint stage (the one ``connect`` takes
  from it);
- the *bridge* of a VQ encoder or joint stage is its VQ layer as the codebook bridge
  (:mod:`megasemface.nn.bridge`): the encoder's output through it is what a model
  connected with ``--bridge codebook`` feeds the cross-attention.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from megasemface.checkpoints import load_stage, resolve_spm_model
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.interfaces.base import SemanticInterface
from megasemface.interfaces.factory import build_interface
from megasemface.interfaces.registry import find_interface, recorded_interface, records_codebook
from megasemface.models.model_dir import load_seq2seq
from megasemface.models.semface import SemFaceModel
from megasemface.nn.bridge import CodebookBridge, bridge_state
from megasemface.nn.config import ModelConfig, config_from_dict
from megasemface.nn.cpu_speed import apply_cpu_speed
from megasemface.nn.transformer import (
    EncoderOutput,
    Seq2SeqModel,
    TransformerDecoder,
    TransformerEncoder,
)
from megasemface.objectives.sequences import SpecialTokens
from megasemface.stages import find_stage, stage_names

__all__ = ["DiagnosticModels", "DiagnosticsError", "build_stage_model", "load_models", "stage_step"]

_STAGES = stage_names(lambda spec: spec.semface)
"""The stages whose model has a semantic interface to diagnose."""


class DiagnosticsError(ValueError):
    """The diagnostics cannot run on this input; the message says what to pass instead."""


@dataclasses.dataclass
class DiagnosticModels:
    """The parts the diagnostics use, in eval mode on the CPU, and where they came from."""

    tokenizer: Tokenizer
    special: SpecialTokens
    config: ModelConfig
    interface_kind: str | None
    """vq, cl or none for a pre-training stage; None with a model directory alone."""
    stage: str | None
    interface: SemanticInterface | None
    encoder: TransformerEncoder | None
    """The encoder trained against ``interface`` (encoder and joint stages)."""
    interface_decoder: TransformerDecoder | None
    """The decoder pre-trained on the interface's memory (decoder and joint stages)."""
    decoder: TransformerDecoder | None
    """The decoder whose cross-attention is measured: ``interface_decoder`` or the model
    directory's."""
    connected_encoder: Callable[..., EncoderOutput] | None
    """``(tokens, mask, langs) -> EncoderOutput``: the memory of the connected model."""
    bridge: CodebookBridge | None
    """A VQ stage's VQ layer as the codebook bridge (None without a VQ encoder)."""
    seq2seq: Seq2SeqModel | None
    """The connected model of ``--model-dir``, which translates (None without one)."""
    decoder_codes: str
    """What picked the codes the stage's decoder was pre-trained on: ``extractor`` (the
    paper's feature extractor) or ``encoder`` (``--decoder-codes encoder``)."""
    memory_norm: bool
    """The stage's decoder read its interface memory through the encoder's final LayerNorm
    (``--decoder-memory-norm``)."""
    decoder_continuous: float
    """The share of tokens at which the stage's decoder read the encoder's output instead of
    the interface's memory of it (``--decoder-continuous``)."""
    step: int | None
    """The checkpoint's training step (None when unknown)."""
    mlflow_run_id: str | None
    """The MLflow run of the pre-training stage."""
    sources: dict[str, str]
    """``checkpoint``, ``model_dir`` and ``spm_model`` as resolved paths."""

    @property
    def num_codes(self) -> int | None:
        """K of the VQ layer, None without one."""
        spec = find_interface(self.interface_kind)
        return self.config.vq.combinations if spec is not None and spec.codebook else None


def build_stage_model(
    state: dict[str, torch.Tensor], meta: dict[str, Any], special: SpecialTokens, where: Path
) -> SemFaceModel:
    """The stage's ``SemFaceModel`` holding exactly the checkpoint's weights (``load_stage``'s
    state and meta of ``where``), in eval mode.

    Raises:
        DiagnosticsError: the weights do not fit the model the meta describes.
    """
    config = config_from_dict(meta["model"])
    kind = meta.get("interface", {}).get("kind")
    spec = recorded_interface(meta)
    # Built on the meta device and then given the checkpoint's tensors: no random init of a
    # paper-size codebook only to overwrite it.
    unfit = f"{where}: the weights do not fit a {kind!r} SemFace model of its own config"
    # The scales CL-SemFace's MLM and MSE read the table at are options of the run, not
    # weights; a run recorded before they existed read the rows as they are.
    options = meta.get("train_config", {})
    scales = {name: bool(options.get(name)) for name in ("cl_unit_logits", "cl_unit_mse")}
    try:
        with torch.device("meta"):
            table = torch.empty(config.vocab_size, config.d_model) if spec and spec.table else None
            interface = build_interface(kind, config, cl_table=table, **scales)
            model = SemFaceModel(config, interface, special)
        # A shape that differs raises here (strict=False forgives only names).
        missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
        raise DiagnosticsError(f"{unfit} ({str(exc).splitlines()[-1].strip()})") from None
    if missing or unexpected:
        raise DiagnosticsError(f"{unfit} (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.eval()


def stage_step(meta: dict[str, Any]) -> int | None:
    """The training step of ``load_stage``'s weights (None when unknown)."""
    source = meta.get("source", {})
    if source.get("kind") == "model_dir":  # a pretraining directory: its checkpoint's step
        source = source.get("from") or {}
    return source.get("step")


def _check_spm(tokenizer: Tokenizer, recorded: str | None, where: Path) -> None:
    if recorded is not None and recorded != tokenizer.sha256:
        raise DiagnosticsError(
            f"{where} was trained with another SentencePiece model than {tokenizer.path} "
            f"(sha256 {tokenizer.sha256[:12]}, recorded {recorded[:12]}); pass the run's own "
            "--spm-model"
        )


def load_models(
    checkpoint: str | Path | None,
    model_dir: str | Path | None = None,
    spm_model: str | Path | None = None,
) -> DiagnosticModels:
    """Loads and cross-checks the sources (see the module docstring).

    ``spm_model`` defaults to the SentencePiece model the stage recorded (or the model
    directory's copy); any given one must be the model the weights were trained with.

    Raises:
        DiagnosticsError: nothing to load, a stage without an interface to diagnose, or
            sources that do not fit together.
        CheckpointError, ModelDirError: unreadable or incomplete sources.
    """
    if checkpoint is None and model_dir is None:
        raise DiagnosticsError("nothing to diagnose: pass --checkpoint, --model-dir or both")
    meta: dict[str, Any] = {}
    state: dict[str, torch.Tensor] = {}
    if checkpoint is not None:
        checkpoint = Path(checkpoint)
        state, meta = load_stage(checkpoint)
        if meta.get("stage") not in _STAGES:
            raise DiagnosticsError(
                f"{checkpoint} holds a {meta.get('stage')!r} stage, which has no semantic "
                f"interface; pass an {', '.join(_STAGES)} stage"
            )
        spm = resolve_spm_model(meta, spm_model)
    seq2seq, info = load_seq2seq(model_dir) if model_dir is not None else (None, None)
    if checkpoint is None:
        assert info is not None
        spm = Path(spm_model) if spm_model is not None else info.spm_model
    tokenizer = Tokenizer.load(spm)
    special = SpecialTokens.from_tokenizer(tokenizer)
    sources = {"spm_model": str(spm.resolve())}
    stage_model = None
    if checkpoint is not None:  # resolve_spm_model checked the tokenizer against it
        stage_model = build_stage_model(state, meta, special, checkpoint)
        sources["checkpoint"] = str(checkpoint.resolve())
    if info is not None:
        assert model_dir is not None and seq2seq is not None
        _check_spm(tokenizer, info.vocab_sha256, Path(model_dir))
        sources["model_dir"] = str(Path(model_dir).resolve())
        if stage_model is not None:
            for key in ("vocab_size", "d_model", "num_langs"):
                if getattr(info.model, key) != getattr(stage_model.config, key):
                    raise DiagnosticsError(
                        f"{model_dir} has {key}={getattr(info.model, key)}, {checkpoint} "
                        f"{getattr(stage_model.config, key)}: not connected from this stage"
                    )
    stage = meta.get("stage")
    trained = find_stage(stage)
    encoder = interface_decoder = None
    if stage_model is not None and trained is not None:
        encoder = stage_model.encoder if trained.encoder else None
        interface_decoder = stage_model.decoder if trained.decoder else None
    connected: Callable[..., EncoderOutput] | None = None
    if seq2seq is not None:
        connected = seq2seq.encode
    elif trained is not None and trained.joint:
        connected = encoder
    bridge = None
    if encoder is not None and records_codebook(meta):
        assert stage_model is not None
        bridge_config = dataclasses.replace(stage_model.config, bridge="codebook")
        with torch.device("meta"):
            bridge = CodebookBridge(bridge_config)
        bridge.load_state_dict(bridge_state(state, bridge_config.vq.logits), assign=True)
        bridge.eval()
    decoder = interface_decoder
    if decoder is None and seq2seq is not None:
        decoder = seq2seq.decoder
    for model in (stage_model, seq2seq, bridge):
        if model is not None:  # the diagnostics run on the host
            apply_cpu_speed(model, "cpu")
    return DiagnosticModels(
        tokenizer=tokenizer,
        special=special,
        config=stage_model.config if stage_model is not None else info.model,  # type: ignore[union-attr]
        interface_kind=meta.get("interface", {}).get("kind") if stage_model else None,
        stage=stage,
        interface=stage_model.interface if stage_model is not None else None,
        encoder=encoder,
        interface_decoder=interface_decoder,
        decoder=decoder,
        connected_encoder=connected,
        bridge=bridge,
        seq2seq=seq2seq if isinstance(seq2seq, Seq2SeqModel) else None,
        decoder_codes=meta.get("train_config", {}).get("decoder_codes", "extractor"),
        memory_norm=bool(meta.get("train_config", {}).get("decoder_memory_norm")),
        decoder_continuous=float(meta.get("train_config", {}).get("decoder_continuous") or 0.0),
        step=stage_step(meta),
        mlflow_run_id=meta.get("mlflow_run_id") or None,
        sources=sources,
    )
