"""Connecting pre-trained stages into the sequence-to-sequence model for fine-tuning.

SemFace: the encoder comes from the encoder stage and the decoder, with its pre-trained
cross-attention, from the decoder stage; the interface (CL table, VQ layer, extractor) and
the MLM head are dropped, unless the model has the codebook bridge, which takes the encoder
stage's VQ layer (nn/bridge.py). XLM-style baseline: the encoder stage's weights initialise both
the encoder and the decoder (embeddings, self-attention, feed-forward, final norm, and the
MLM bias as the output bias), and the cross-attention starts random. Every parameter of the
result is accounted for in a provenance report.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from megasemface.nn.bridge import bridge_sources, bridge_state
from megasemface.nn.config import ModelConfig
from megasemface.nn.transformer import Seq2SeqModel, parameter_shapes

__all__ = ["ConnectError", "connect_stages"]


class ConnectError(ValueError):
    """The two stages cannot be joined; the message says which property differs."""


_SHAPE_KEYS = ("vocab_size", "d_model", "num_heads", "ffn_dim", "num_langs", "max_len")


def _check_compatible(
    config: ModelConfig,
    encoder_meta: Mapping[str, Any],
    decoder_meta: Mapping[str, Any] | None,
) -> None:
    for name, meta in (("encoder", encoder_meta), ("decoder", decoder_meta)):
        if meta is None:
            continue
        for key in _SHAPE_KEYS:
            theirs = meta.get("model", {}).get(key)
            if theirs is not None and theirs != getattr(config, key):
                raise ConnectError(
                    f"{name}-stage checkpoint has {key}={theirs}, the target model "
                    f"{getattr(config, key)}"
                )
    if decoder_meta is None:
        return
    for key in ("languages", "vocab_sha256"):
        mine, theirs = encoder_meta.get(key), decoder_meta.get(key)
        if mine is not None and theirs is not None and mine != theirs:
            raise ConnectError(
                f"the stages were trained with different {key}: encoder {mine!r}, "
                f"decoder {theirs!r}; they must share the SentencePiece model and languages"
            )
    enc_fp, dec_fp = encoder_meta.get("interface"), decoder_meta.get("interface")
    if enc_fp != dec_fp:
        raise ConnectError(
            "the stages were pre-trained against different semantic interfaces:\n"
            f"  encoder stage: {enc_fp}\n  decoder stage: {dec_fp}\n"
            "a decoder stage must use the interface of the encoder stage it is joined with "
            "(the same cross-lingual table, or the codebook of that encoder checkpoint)"
        )


def _strip(state: Mapping[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def connect_stages(
    config: ModelConfig,
    encoder_state: Mapping[str, torch.Tensor],
    encoder_meta: Mapping[str, Any],
    decoder_state: Mapping[str, torch.Tensor] | None = None,
    decoder_meta: Mapping[str, Any] | None = None,
    *,
    encoder_codebook: bool = False,
    seed: int = 0,
) -> tuple[Seq2SeqModel, dict[str, str]]:
    """Builds the translation model; returns it and ``{parameter: where it came from}``.

    ``*_state`` are state dicts of pre-training models (``encoder.*``, ``decoder.*`` keys);
    ``*_meta`` their metadata: ``model`` (the config dict), ``languages``, ``vocab_sha256``
    and ``interface`` (the interface fingerprint). Without a decoder stage (the XLM-style
    baseline) the decoder is initialised from the encoder. ``encoder_codebook``: the
    encoder stage's interface has a codebook (``interfaces/registry.py`` knows which do),
    which the codebook bridge needs.
    """
    _check_compatible(config, encoder_meta, decoder_meta)
    # Every stage tensor is checked against the shapes first; the model is built only once
    # they fit, so a damaged config allocates nothing.
    try:
        shapes = parameter_shapes(config)
    except ValueError as exc:
        raise ConnectError(str(exc)) from None
    taken: dict[str, torch.Tensor] = {}
    provenance = dict.fromkeys(shapes, "random")

    def take(source: dict[str, torch.Tensor], prefix: str, origin: str) -> None:
        for name, value in source.items():
            key = prefix + name
            if key not in shapes:
                continue
            if shapes[key] != tuple(value.shape):
                raise ConnectError(
                    f"{origin}: {name} has shape {tuple(value.shape)}, the model needs "
                    f"{shapes[key]}"
                )
            taken[key] = value
            provenance[key] = f"{origin}:{name}"

    encoder = _strip(encoder_state, "encoder.")
    if not encoder:
        raise ConnectError("the encoder-stage state holds no encoder.* parameters")
    take(encoder, "encoder.", "encoder-stage")
    if config.bridge == "codebook":
        if not encoder_codebook or decoder_state is None:
            raise ConnectError(
                "the codebook bridge joins a VQ-SemFace encoder stage with its decoder stage; "
                f"got a {encoder_meta.get('interface', {}).get('kind')!r} encoder stage"
                + ("" if decoder_state is not None else " and no decoder stage")
            )
        try:
            bridge = bridge_state(encoder_state, config.vq.logits)
        except KeyError as missing:
            raise ConnectError(f"the encoder-stage state lacks its VQ layer ({missing})") from None
        take(bridge, "bridge.", "encoder-stage")
        for name, key in bridge_sources(config.vq.logits).items():
            provenance["bridge." + name] = f"encoder-stage:{key}"
    if decoder_state is None:
        take(encoder, "decoder.", "encoder-stage")  # XLM: encoder weights for the decoder
        if "mlm_bias" in encoder_state:
            take({"output_bias": encoder_state["mlm_bias"]}, "decoder.", "encoder-stage")
            provenance["decoder.output_bias"] = "encoder-stage:mlm_bias"
    else:
        decoder = _strip(decoder_state, "decoder.")
        if not decoder:
            raise ConnectError("the decoder-stage state holds no decoder.* parameters")
        take(decoder, "decoder.", "decoder-stage")
    required = ("encoder.", "decoder.", "bridge.") if decoder_state is not None else ("encoder.",)
    missing = [
        k for k, origin in provenance.items() if origin == "random" and k.startswith(required)
    ]
    if missing:
        raise ConnectError(
            f"{len(missing)} parameter(s) missing from the stage checkpoints, e.g. {missing[:3]}; "
            "were they saved by megasemface with the same model shape?"
        )
    torch.manual_seed(seed)  # the parameters no stage provides start from a known state
    model = Seq2SeqModel(config)
    target = model.state_dict()
    for key, value in taken.items():
        target[key] = value.detach().clone().to(target[key].dtype)
    model.load_state_dict(target)
    return model, provenance
