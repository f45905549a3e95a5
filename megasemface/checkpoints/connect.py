"""Sequence-to-sequence initialisations from pre-training runs.

- SemFace: the encoder of an encoder-stage run and the decoder (with its pre-trained
  cross-attention) of a decoder-stage run, through
  :func:`megasemface.models.seq2seq_init.connect_stages`, which drops the interface and refuses
  stages pre-trained against different interfaces, tokenizers or shapes.
- XLM-style: an encoder stage alone initialises encoder and decoder (cross-attention random).
- mBART baseline, mRASP and VECO: the run's model already is a ``Seq2SeqModel`` (under
  ``model.``; VECO's IS-MLM output bias, outside it, is dropped).

Interfaces are compared by the fingerprints :func:`~.consolidate.load_stage` computes from
the gathered weights, so an encoder stage trained with its codebook split over model-parallel
ranks matches a decoder stage that used the gathered codebook. A VQ encoder's fingerprint is
taken in the decoder run's training dtype, the values that run held.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megasemface.checkpoints.consolidate import DTYPES, load_stage
from megasemface.checkpoints.layout import CheckpointError
from megasemface.interfaces.registry import recorded_weights
from megasemface.models.seq2seq_init import ConnectError, connect_stages
from megasemface.nn.config import ModelConfig, config_from_dict
from megasemface.nn.transformer import Seq2SeqModel, parameter_shapes
from megasemface.stages import stage_names

__all__ = ["PARTS", "Connected", "connect_fusion", "connect_mbart", "connect_runs", "keep_part"]


@dataclasses.dataclass
class Connected:
    """A sequence-to-sequence initialisation and where each of its parameters came from."""

    state: dict[str, Tensor]
    """``Seq2SeqModel`` state dict."""
    config: ModelConfig
    mode: str
    """semface, xlm, fusion, mbart, mrasp or veco."""
    sources: dict[str, dict[str, Any]]
    """Per role (encoder, decoder, mbart, mrasp, veco): the stage's meta (with ``source``)."""
    parameters: dict[str, str]
    """Per parameter: ``encoder-stage:KEY``, ``decoder-stage:KEY``, ``mbart:KEY``,
    ``mrasp:KEY`` or ``veco:KEY`` (KEY the tensor's key in that stage's state), or
    ``random``."""


def _stage(path: str | Path, role: str, stages: tuple[str, ...]) -> tuple[dict, dict]:
    state, meta = load_stage(path)
    if meta.get("stage") not in stages:
        raise CheckpointError(
            f"{path} holds a {meta.get('stage')!r} stage; the {role} must come from a "
            f"{' or '.join(stages)} stage"
        )
    return state, meta


def _full_origin(origin: str) -> str:
    """``stage:name`` with the name as the stage's state-dict key (connect_stages strips the
    ``encoder.`` / ``decoder.`` prefix), so provenance points at the tensor in the source."""
    role, sep, name = origin.partition(":")
    prefix = {"encoder-stage": "encoder.", "decoder-stage": "decoder."}.get(role)
    if not sep or prefix is None or name == "mlm_bias" or name.startswith("interface."):
        return origin
    return f"{role}:{prefix}{name}"


def connect_runs(
    encoder: str | Path,
    decoder: str | Path | None = None,
    *,
    seed: int = 0,
    bridge: str = "none",
) -> Connected:
    """Connects an encoder stage with a decoder stage (SemFace), or alone (XLM-style).

    ``bridge="codebook"`` keeps a VQ-SemFace encoder stage's VQ layer between the encoder and
    the cross-attention (:mod:`megasemface.nn.bridge`); ``"none"`` removes the interface,
    as the paper does.

    Each source is a run directory, a checkpoint directory or a ``pretraining`` model
    directory. The model shape is the encoder stage's, with the decoder stage's decoder
    depth. Raises :class:`~megasemface.models.seq2seq_init.ConnectError` when the stages do not
    fit together (the message names both sources and what differs).
    """
    enc_state, enc_meta = _stage(encoder, "encoder", stage_names(lambda spec: spec.encoder))
    config = dataclasses.replace(config_from_dict(enc_meta["model"]), bridge=bridge)
    dec_state = dec_meta = None
    enc_check = dict(enc_meta)
    weights = recorded_weights(enc_meta)
    if decoder is not None:
        dec_state, dec_meta = _stage(decoder, "decoder", stage_names(lambda spec: spec.decoder))
        dec_config = config_from_dict(dec_meta["model"])
        config = dataclasses.replace(config, decoder_layers=dec_config.decoder_layers)
        if weights is not None and weights.own_state(enc_state):
            dtype = DTYPES[dec_meta.get("param_dtype", "float32")]
            enc_check["interface"] = weights.fingerprint(enc_state, config, dtype=dtype)
    try:
        model, parameters = connect_stages(
            config,
            enc_state,
            enc_check,
            dec_state,
            dec_meta,
            encoder_codebook=weights is not None,
            seed=seed,
        )
    except ConnectError as exc:
        pair = f"{encoder} and {decoder}" if decoder is not None else str(encoder)
        raise ConnectError(f"cannot connect {pair}: {exc}") from None
    parameters = {key: _full_origin(origin) for key, origin in parameters.items()}
    sources = {"encoder": enc_meta}
    if dec_meta is not None:
        sources["decoder"] = dec_meta
    mode = "semface" if decoder is not None else "xlm"
    return Connected(model.state_dict(), config, mode, sources, parameters)


SEQ2SEQ_STAGES = stage_names(lambda spec: spec.seq2seq)
"""Pre-training stages that train the whole ``Seq2SeqModel``, connected as it is."""


def connect_mbart(source: str | Path) -> Connected:
    """The ``Seq2SeqModel`` of an mBART, mRASP or VECO pre-training, from its run,
    checkpoint or model directory; the mode and the parameters' origin name the stage."""
    state, meta = _stage(source, "sequence-to-sequence model", SEQ2SEQ_STAGES)
    stage = str(meta["stage"])
    config = config_from_dict(meta["model"])
    prefix = "model."
    seq2seq = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
    try:
        shapes = parameter_shapes(config)  # checked before a model is built: see its doc
    except ValueError as exc:
        raise CheckpointError(f"{source}: {exc}") from None
    missing = sorted(shapes.keys() - seq2seq.keys())
    unexpected = sorted(seq2seq.keys() - shapes.keys())
    reshaped = sorted(k for k in shapes.keys() & seq2seq.keys() if seq2seq[k].shape != shapes[k])
    if missing or unexpected or reshaped:
        raise CheckpointError(
            f"{source}: the {stage} state does not fit its model config (missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}, other shape {reshaped[:3]})"
        )
    torch.manual_seed(0)  # construction only; every parameter is overwritten below
    model = Seq2SeqModel(config)
    model.load_state_dict(seq2seq)
    parameters = {k: f"{stage}:{prefix}{k}" for k in model.state_dict()}
    return Connected(model.state_dict(), config, stage, {stage: meta}, parameters)


def connect_fusion(
    encoder: str | Path, *, part_layers: int | None = None, seed: int = 0
) -> Connected:
    """Deep fusion: a pre-trained encoder as the PTM - an encoder stage's (XLM, CL- or
    VQ-SemFace; the interface dropped) or the encoder of an mBART, mRASP or VECO pre-training
    - its layers split into parts of ``part_layers`` (M) layers, one per decoder layer,
    joined to a random decoder through a random layer-wise coordinator
    (nn/fusion_coordinator.py). M defaults to the encoder's depth over the run's decoder
    depth, so the decoder keeps the depth the other connections have."""
    stages = (*stage_names(lambda spec: spec.encoder), *SEQ2SEQ_STAGES)
    enc_state, meta = _stage(encoder, "encoder", stages)
    origin = "encoder-stage:"
    if meta["stage"] in SEQ2SEQ_STAGES:  # the whole model was trained: keep its encoder
        origin = f"{meta['stage']}:model."
        enc_state = {k[len("model.") :]: v for k, v in enc_state.items() if k.startswith("model.")}
    config = config_from_dict(meta["model"])
    layers = config.encoder_layers
    m = part_layers if part_layers is not None else max(1, layers // config.decoder_layers)
    if m < 1 or layers % m:
        raise ConnectError(
            f"cannot connect {encoder}: its {layers} encoder layers do not split into parts of "
            f"{m} layers (--part-layers must divide {layers})"
        )
    config = dataclasses.replace(
        config, bridge="none", fusion="deep", fusion_part_layers=m, decoder_layers=layers // m
    )
    torch.manual_seed(seed)  # the decoder and the coordinator start random
    model = Seq2SeqModel(config)
    state = model.state_dict()
    parameters = dict.fromkeys(state, "random")
    for key, value in state.items():
        if not key.startswith("encoder."):
            continue
        source = enc_state.get(key)
        if source is None or source.shape != value.shape:
            raise ConnectError(f"cannot connect {encoder}: its encoder lacks {key} as shaped")
        state[key] = source.to(value.dtype)
        parameters[key] = f"{origin}{key}"
    return Connected(state, config, "fusion", {"encoder": meta}, parameters)


PARTS = ("whole", "encoder", "decoder")
"""What of a connected model :func:`keep_part` keeps from pre-training."""


def keep_part(connected: Connected, part: str, *, seed: int = 0) -> Connected:
    """``connected`` with one half kept and the other drawn at random, as a model trained
    from scratch starts: fine-tuning each half alone says which half of a pre-training
    carries its gain. ``encoder`` keeps ``encoder.*`` (its own embeddings included) and draws
    the decoder; ``decoder`` keeps ``decoder.*`` (its cross-attention, embeddings and output
    bias) and draws the encoder; ``whole`` returns ``connected`` as it is. Anything outside
    both (a bridge) stays as connected."""
    if part not in PARTS:
        raise ValueError(f"part {part!r}: choose from {', '.join(PARTS)}")
    if part == "whole":
        return connected
    drawn = "decoder." if part == "encoder" else "encoder."
    torch.manual_seed(seed)
    fresh = Seq2SeqModel(connected.config).state_dict()
    state, parameters = dict(connected.state), dict(connected.parameters)
    for key in state:
        if key.startswith(drawn):
            state[key] = fresh[key].to(state[key].dtype)
            parameters[key] = "random"
    # The drawn half's stage is no longer a source, unless it is the only one (XLM's copy of
    # its encoder into the decoder, or a whole sequence-to-sequence run).
    half = drawn.rstrip(".")
    sources = {role: meta for role, meta in connected.sources.items() if role != half}
    mode = f"{connected.mode}, {part} alone"
    return dataclasses.replace(
        connected,
        state=state,
        parameters=parameters,
        mode=mode,
        sources=sources or connected.sources,
    )
