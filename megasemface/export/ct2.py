"""Export to CTranslate2: a ``ctranslate2.Translator`` model directory, float32 or int8.

Built with CTranslate2's specification API (``TransformerSpec``) and its ``Converter``, which
validates the specification, quantises it and writes ``model.bin``: pre-norm layers with
exact GELU, ``layernorm_embedding``, unscaled token embeddings, learned position encodings
(the languages folded in, :mod:`megasemface.export.source`), the decoder's output projection
with megasemface's output bias. CTranslate2 fuses the query, key and value projections of
self-attention into one matrix and keys and values of cross-attention into another, which is
megasemface's own ``kv_proj`` layout.

The model's config makes it translate as megasemface does without options: ``</s>`` is
appended to the source (``add_source_eos``) and the decoder starts with the target
language's tag (``decoder_start_token``). The ids megasemface never generates are passed at
translation time (``suppress_sequences``; the model card shows how).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megasemface.export.source import ExportSource

__all__ = ["QUANTIZATIONS", "ct2_vocabulary", "write_ct2_model"]

QUANTIZATIONS = ("float32", "int8")


def ct2_vocabulary(source: ExportSource) -> list[str]:
    """The SentencePiece pieces in id order, padded to the output layer's size with names
    that no text produces (megasemface never generates those ids either)."""
    processor = source.tokenizer.processor
    pieces = [processor.IdToPiece(i) for i in range(source.tokenizer.vocab_size)]
    return pieces + [f"<unused{i}>" for i in range(len(pieces), source.config.vocab_size)]


def write_ct2_model(source: ExportSource, out: Path, quantization: str) -> None:
    """Converts ``source`` into ``out`` (which exists and is empty)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}")
    from ctranslate2.converters.converter import Converter

    class _Converter(Converter):
        def _load(self) -> Any:
            return _spec(source)

    # The converter writes into a directory it creates itself.
    target = out / "model"
    _Converter().convert(str(target), quantization=quantization)
    for path in target.iterdir():
        path.rename(out / path.name)
    target.rmdir()


def _spec(source: ExportSource) -> Any:
    from ctranslate2.specs import common_spec, transformer_spec

    c, state = source.config, source.state
    spec = transformer_spec.TransformerSpec.from_config(
        (c.encoder_layers, c.decoder_layers),
        c.num_heads,
        pre_norm=True,
        activation=common_spec.Activation.GELU,
        layernorm_embedding=True,
    )
    for stack, stack_spec in (("encoder", spec.encoder), ("decoder", spec.decoder)):
        embeddings = stack_spec.embeddings
        (embeddings[0] if isinstance(embeddings, list) else embeddings).weight = _np(
            state[f"{stack}.embed.tokens.weight"]
        )
        stack_spec.scale_embeddings = False
        stack_spec.position_encodings.encodings = _np(source.positions(stack))
        _norm(stack_spec.layernorm_embedding, state, f"{stack}.embed.norm")
        _norm(stack_spec.layer_norm, state, f"{stack}.final_norm")
        for i, layer in enumerate(stack_spec.layer):
            ours = f"{stack}.layers.{i}"
            _norm(layer.self_attention.layer_norm, state, f"{ours}.self_norm")
            fused = torch.cat([state[f"{ours}.self_attn.q_proj.weight"], _kv(state, ours)[0]])
            fused_bias = torch.cat([state[f"{ours}.self_attn.q_proj.bias"], _kv(state, ours)[1]])
            _set_linear(layer.self_attention.linear[0], fused, fused_bias)
            _linear(layer.self_attention.linear[1], state, f"{ours}.self_attn.out_proj")
            if stack == "decoder":
                _norm(layer.attention.layer_norm, state, f"{ours}.cross_norm")
                _linear(layer.attention.linear[0], state, f"{ours}.cross_attn.q_proj")
                _linear(layer.attention.linear[1], state, f"{ours}.cross_attn.kv_proj")
                _linear(layer.attention.linear[2], state, f"{ours}.cross_attn.out_proj")
            _norm(layer.ffn.layer_norm, state, f"{ours}.ffn_norm")
            _linear(layer.ffn.linear_0, state, f"{ours}.ffn.fc1")
            _linear(layer.ffn.linear_1, state, f"{ours}.ffn.fc2")
    _set_linear(
        spec.decoder.projection,
        state["decoder.embed.tokens.weight"],
        state["decoder.output_bias"],
    )
    vocabulary = ct2_vocabulary(source)
    spec.register_source_vocabulary(vocabulary)
    spec.register_target_vocabulary(vocabulary)
    tokenizer = source.tokenizer
    pieces = vocabulary
    spec.config.unk_token = pieces[tokenizer.unk_id]
    spec.config.bos_token = pieces[tokenizer.bos_id]
    spec.config.eos_token = pieces[tokenizer.eos_id]
    spec.config.decoder_start_token = pieces[source.tgt_tag_id]
    spec.config.add_source_eos = True
    return spec


def _np(tensor: torch.Tensor) -> Any:
    return tensor.detach().to(torch.float32).contiguous().numpy()


def _kv(state: dict, ours: str) -> tuple[torch.Tensor, torch.Tensor]:
    return state[f"{ours}.self_attn.kv_proj.weight"], state[f"{ours}.self_attn.kv_proj.bias"]


def _norm(spec: Any, state: dict, ours: str) -> None:
    spec.gamma = _np(state[f"{ours}.weight"])
    spec.beta = _np(state[f"{ours}.bias"])


def _set_linear(spec: Any, weight: torch.Tensor, bias: torch.Tensor) -> None:
    spec.weight = _np(weight)
    spec.bias = _np(bias)


def _linear(spec: Any, state: dict, ours: str) -> None:
    _set_linear(spec, state[f"{ours}.weight"], state[f"{ours}.bias"])
