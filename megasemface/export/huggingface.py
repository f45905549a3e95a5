"""Export to Hugging Face transformers: an ``MBartForConditionalGeneration`` directory.

mBART is the transformers architecture whose computation is megasemface's (see
:mod:`megasemface.export.source`): pre-norm layers, ``layernorm_embedding``, a final
LayerNorm per stack, learned positions (mBART's table has two unused rows in front, its
``offset``), exact GELU, biases everywhere, ``final_logits_bias``. With
``scale_embedding=False`` and ``tie_word_embeddings=False`` the encoder, the decoder and the
output layer keep their own matrices, as megasemface's do; the output layer gets a copy of
the decoder's token embeddings. ``transformers`` loads the result without custom code.

``generation_config.json`` makes ``generate()`` search as megasemface does: the decoder starts
with the target language's tag, the ids megasemface bans are suppressed, and ``</s>`` is
forced at the position table's end.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from megasemface.export.hf_tokenizer import build_hf_tokenizer
from megasemface.export.source import ExportSource

__all__ = ["hf_config", "hf_state", "write_hf_model"]

# mBART's position embeddings start at row 2 (its learned positional embedding's offset).
_MBART_OFFSET = 2
_ATTENTION = {"self_attn": "self_attn", "cross_attn": "encoder_attn"}
_NORMS = {"self_norm": "self_attn_layer_norm", "cross_norm": "encoder_attn_layer_norm"}


def hf_config(source: ExportSource) -> dict[str, Any]:
    """The ``MBartConfig`` arguments of the exported model."""
    c = source.config
    tokenizer = source.tokenizer
    return {
        "vocab_size": c.vocab_size,
        "d_model": c.d_model,
        "encoder_layers": c.encoder_layers,
        "decoder_layers": c.decoder_layers,
        "encoder_attention_heads": c.num_heads,
        "decoder_attention_heads": c.num_heads,
        "encoder_ffn_dim": c.ffn_dim,
        "decoder_ffn_dim": c.ffn_dim,
        "activation_function": "gelu",
        "dropout": c.dropout,
        "attention_dropout": c.attention_dropout,
        # megasemface's feed-forward applies its dropout between GELU and the second layer.
        "activation_dropout": c.dropout,
        "max_position_embeddings": c.max_len,
        "scale_embedding": False,
        "tie_word_embeddings": False,
        "pad_token_id": tokenizer.pad_id,
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "decoder_start_token_id": source.tgt_tag_id,
        "forced_eos_token_id": tokenizer.eos_id,
    }


def hf_state(source: ExportSource) -> dict[str, torch.Tensor]:
    """megasemface's weights under ``MBartForConditionalGeneration``'s names, the languages
    folded into the position tables."""
    c, state = source.config, source.state
    out: dict[str, torch.Tensor] = {}
    for stack, layers in (("encoder", c.encoder_layers), ("decoder", c.decoder_layers)):
        prefix = f"model.{stack}"
        positions = source.positions(stack)
        padded = torch.zeros(positions.shape[0] + _MBART_OFFSET, positions.shape[1])
        padded[_MBART_OFFSET:] = positions
        out[f"{prefix}.embed_positions.weight"] = padded
        out[f"{prefix}.embed_tokens.weight"] = state[f"{stack}.embed.tokens.weight"]
        _norm(out, f"{prefix}.layernorm_embedding", state, f"{stack}.embed.norm")
        _norm(out, f"{prefix}.layer_norm", state, f"{stack}.final_norm")
        for i in range(layers):
            ours, theirs = f"{stack}.layers.{i}", f"{prefix}.layers.{i}"
            for attention, name in _ATTENTION.items():
                if f"{ours}.{attention}.q_proj.weight" in state:
                    _attention(out, f"{theirs}.{name}", state, f"{ours}.{attention}")
            for norm, name in _NORMS.items():
                if f"{ours}.{norm}.weight" in state:
                    _norm(out, f"{theirs}.{name}", state, f"{ours}.{norm}")
            _norm(out, f"{theirs}.final_layer_norm", state, f"{ours}.ffn_norm")
            for fc in ("fc1", "fc2"):
                _linear(out, f"{theirs}.{fc}", state, f"{ours}.ffn.{fc}")
    decoder_tokens = state["decoder.embed.tokens.weight"]
    # `shared` is only what get_input_embeddings() answers when embeddings are not tied.
    out["model.shared.weight"] = decoder_tokens
    out["lm_head.weight"] = decoder_tokens
    out["final_logits_bias"] = state["decoder.output_bias"][None, :]
    # safetensors stores no shared memory: every tensor gets its own copy.
    return {name: tensor.detach().to(torch.float32).clone() for name, tensor in out.items()}


def _norm(out: dict, name: str, state: dict, ours: str) -> None:
    out[f"{name}.weight"] = state[f"{ours}.weight"]
    out[f"{name}.bias"] = state[f"{ours}.bias"]


def _linear(out: dict, name: str, state: dict, ours: str) -> None:
    _norm(out, name, state, ours)  # a weight and a bias, like a LayerNorm


def _attention(out: dict, name: str, state: dict, ours: str) -> None:
    _linear(out, f"{name}.q_proj", state, f"{ours}.q_proj")
    _linear(out, f"{name}.out_proj", state, f"{ours}.out_proj")
    # megasemface projects keys and values in one [2D, D] layer: keys first.
    k_weight, v_weight = state[f"{ours}.kv_proj.weight"].chunk(2, dim=0)
    k_bias, v_bias = state[f"{ours}.kv_proj.bias"].chunk(2, dim=0)
    out.update(
        {
            f"{name}.k_proj.weight": k_weight,
            f"{name}.k_proj.bias": k_bias,
            f"{name}.v_proj.weight": v_weight,
            f"{name}.v_proj.bias": v_bias,
        }
    )


def write_hf_model(source: ExportSource, out: Path) -> None:
    """Writes the model, its tokenizer and its generation settings into ``out`` (which
    exists and is empty)."""
    from transformers import GenerationConfig, MBartConfig, MBartForConditionalGeneration

    config = MBartConfig(**hf_config(source))
    state = hf_state(source)
    # Loading into the real class first: a name or shape that does not fit fails here, not
    # in the user's from_pretrained.
    with torch.device("meta"):
        model = MBartForConditionalGeneration(config)
    expected = set(model.state_dict())
    if expected != set(state):
        raise AssertionError(
            f"mBART names differ: missing {sorted(expected - set(state))[:3]}, "
            f"unexpected {sorted(set(state) - expected)[:3]}"
        )
    config.architectures = ["MBartForConditionalGeneration"]
    config.save_pretrained(out)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    c, tokenizer = source.config, source.tokenizer
    GenerationConfig(
        decoder_start_token_id=source.tgt_tag_id,
        bos_token_id=tokenizer.bos_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        forced_eos_token_id=tokenizer.eos_id,
        suppress_tokens=source.suppressed_ids,
        # The decoder's positions hold the tag and max_len - 1 tokens, then </s> is forced.
        max_length=c.max_len + 1,
        num_beams=1,
        do_sample=False,
    ).save_pretrained(out)
    build_hf_tokenizer(tokenizer, c.max_len).save_pretrained(out)
    (out / "spm.model").write_bytes(tokenizer.model_bytes)
    # What megasemface needs to know to compare or re-import the export.
    (out / "megasemface.json").write_text(
        json.dumps(
            {"direction": source.direction, "vocab_sha256": source.info.vocab_sha256}, indent=1
        )
        + "\n",
        encoding="utf-8",
    )
