"""The encoder and decoder stacks, and the sequence-to-sequence model they form.

Shapes: B batch, T target/input length, S source (memory) length, D model size, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from megasemface.nn.bridge import CodebookBridge
from megasemface.nn.config import ModelConfig
from megasemface.nn.fusion_coordinator import LayerCoordinator
from megasemface.nn.layers import Embeddings, KVCache, TransformerLayer, attention_mask

__all__ = [
    "DecoderCache",
    "EncoderOutput",
    "Seq2SeqModel",
    "TransformerDecoder",
    "TransformerEncoder",
    "parameter_shapes",
]


@dataclasses.dataclass
class EncoderOutput:
    hidden_BTD: torch.Tensor
    """After the final LayerNorm: what cross-attention and output heads read. From a
    deep-fusion model's ``encode``, every decoder layer's memory instead, [B, N, T, D]."""
    pre_norm_BTD: torch.Tensor
    """The last layer's activation before the final LayerNorm (the paper's h_i in Eq. 1)."""
    mask_BT: torch.Tensor
    """True for real tokens."""


@dataclasses.dataclass
class DecoderCache:
    """What incremental decoding keeps between steps: every decoder layer's self-attention
    keys and values of the positions decoded so far, and its cross-attention keys and values
    of the encoder memory (projected once).

    Starts empty and fills on the first ``decode_step`` that gets it. Its rows follow the
    decoder rows: whoever reorders or drops rows (beam search) calls ``select`` with the same
    index.
    """

    layers: list[tuple[KVCache, KVCache]] = dataclasses.field(default_factory=list)
    length: int = 0
    """Positions cached."""

    def select(self, index_R: torch.Tensor) -> DecoderCache:
        return DecoderCache(
            [(own.select(index_R), cross.select(index_R)) for own, cross in self.layers],
            self.length,
        )


class TransformerEncoder(nn.Module):
    """Bidirectional stack; also the VQ-SemFace feature extractor with fewer layers."""

    def __init__(self, config: ModelConfig, num_layers: int | None = None) -> None:
        super().__init__()
        layers = config.encoder_layers if num_layers is None else num_layers
        self.embed = Embeddings(config)
        self.layers = nn.ModuleList(TransformerLayer(config, False) for _ in range(layers))
        self.final_norm = nn.LayerNorm(config.d_model)

    def forward(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> EncoderOutput:
        return self.with_layers(tokens_BT, mask_BT, langs_B)[0]

    def with_layers(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> tuple[EncoderOutput, list[torch.Tensor]]:
        """The output and every layer's output, first layer first (deep fusion reads them).

        Not the forward, yet safe under ZeRO-3: the stack has no parameters of its own, and
        each submodule it calls gathers its own."""
        x = self.embed(tokens_BT, langs_B)
        self_mask = attention_mask(mask_BT, tokens_BT.shape[1], causal=False)
        layers = []
        for layer in self.layers:
            x = layer(x, self_mask)
            layers.append(x)
        return EncoderOutput(self.final_norm(x), x, mask_BT), layers


class TransformerDecoder(nn.Module):
    """Self-attention (causal for CLM, bidirectional for MLM), cross-attention, tied output."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed = Embeddings(config)
        self.layers = nn.ModuleList(
            TransformerLayer(config, True) for _ in range(config.decoder_layers)
        )
        self.final_norm = nn.LayerNorm(config.d_model)
        self.output_bias = nn.Parameter(torch.zeros(config.vocab_size))

    def forward(
        self,
        tokens_BT: torch.Tensor,
        mask_BT: torch.Tensor,
        langs_B: torch.Tensor,
        memory_BSD: torch.Tensor,
        memory_mask_BS: torch.Tensor,
        causal: bool = True,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """Returns the final hidden states [B, T, D]; ``logits`` projects them.

        ``memory_BSD`` [B, S, D] serves every layer; a deep-fusion memory [B, N, S, D] gives
        layer n its own, ``memory[:, n]``.

        With a ``cache`` (causal, unpadded rows only), ``tokens_BT`` are the positions after
        the cached ones; the cache takes their keys and values.
        """
        length = tokens_BT.shape[1]
        start = 0 if cache is None else cache.length
        if cache is not None:
            # Rows are not checked for padding: that would synchronise with the GPU each step.
            if not causal:
                raise ValueError("a decoder cache needs causal attention")
            if not cache.layers:
                cache.layers = [(KVCache(False), KVCache(True)) for _ in self.layers]
            mask_BT = torch.ones(
                tokens_BT.shape[0], start + length, dtype=torch.bool, device=tokens_BT.device
            )
        x = self.embed(tokens_BT, langs_B, start)
        self_mask = attention_mask(mask_BT, length, causal=causal)
        cross_mask = attention_mask(memory_mask_BS, length, causal=False)
        layer_wise = memory_BSD.dim() == 4
        for i, layer in enumerate(self.layers):
            memory = memory_BSD[:, i] if layer_wise else memory_BSD
            x = layer(x, self_mask, memory, cross_mask, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length = start + length
        return self.final_norm(x)

    def output_layer(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Weight [V, D] and bias [V] of the output projection, tied to the input token
        embeddings."""
        return self.embed.tokens.weight, self.output_bias

    def logits(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        """The output projection."""
        weight_VD, bias_V = self.output_layer()
        return torch.nn.functional.linear(hidden_ND, weight_VD, bias_V)


class Seq2SeqModel(nn.Module):
    """The translation model: encoder and decoder joined by the pre-trained cross-attention."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.encoder = TransformerEncoder(config)
        self.bridge = CodebookBridge(config) if config.bridge == "codebook" else None
        self.coordinator = LayerCoordinator(config) if config.fusion == "deep" else None
        self.decoder = TransformerDecoder(config)

    def encode(
        self, src_BS: torch.Tensor, src_mask_BS: torch.Tensor, src_langs_B: torch.Tensor
    ) -> EncoderOutput:
        """The memory the decoder cross-attends to: the encoder's output, through the bridge
        when the model has one, or every decoder layer's memory from the deep-fusion
        coordinator, [B, N, S, D] (``hidden_BTD``; ``pre_norm_BTD`` stays the encoder's)."""
        if self.coordinator is not None:
            encoded, layers = self.encoder.with_layers(src_BS, src_mask_BS, src_langs_B)
            memories = self.coordinator(layers, src_mask_BS)
            return dataclasses.replace(encoded, hidden_BTD=memories)
        encoded = self.encoder(src_BS, src_mask_BS, src_langs_B)
        if self.bridge is not None:
            encoded = dataclasses.replace(encoded, hidden_BTD=self.bridge(encoded.hidden_BTD))
        return encoded

    def decode_step(
        self,
        prefix_BT: torch.Tensor,
        tgt_langs_B: torch.Tensor,
        memory: EncoderOutput,
        cache: DecoderCache | None = None,
    ) -> torch.Tensor:
        """fp32 log-probabilities [B, V] of the token after each prefix.

        Prefixes start with the target language tag and have no padding (search extends every
        row by one token per step). With a ``cache`` only the positions after the cached ones
        are run, and the cache takes them; without, the decoder re-runs the whole prefix.
        """
        new_BT = prefix_BT if cache is None else prefix_BT[:, cache.length :]
        if new_BT.shape[1] == 0:
            raise ValueError("no prefix position to decode: empty, or all already in the cache")
        mask = torch.ones_like(new_BT, dtype=torch.bool)
        hidden = self.decoder(
            new_BT, mask, tgt_langs_B, memory.hidden_BTD, memory.mask_BT, causal=True, cache=cache
        )
        return torch.log_softmax(self.decoder.logits(hidden[:, -1]).float(), dim=-1)

    def forward(
        self,
        src_BS: torch.Tensor,
        src_mask_BS: torch.Tensor,
        src_langs_B: torch.Tensor,
        tgt_in_BT: torch.Tensor,
        tgt_mask_BT: torch.Tensor,
        tgt_langs_B: torch.Tensor,
    ) -> torch.Tensor:
        """Decoder hidden states [B, T, D] for teacher-forced target inputs."""
        memory = self.encode(src_BS, src_mask_BS, src_langs_B)
        return self.decoder(
            tgt_in_BT, tgt_mask_BT, tgt_langs_B, memory.hidden_BTD, src_mask_BS, causal=True
        )


def parameter_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The state-dict shapes of a ``Seq2SeqModel`` of ``config``, from a model built on the
    meta device: nothing is allocated, so weights read from disk can be checked against a
    config (which may be damaged, e.g. a vocabulary a thousand times too large) before any
    memory is spent on it.

    Raises:
        ValueError: no model can be built from ``config``.
    """
    try:
        with torch.device("meta"):
            return {k: tuple(v.shape) for k, v in Seq2SeqModel(config).state_dict().items()}
    except (RuntimeError, ValueError, TypeError, OverflowError) as exc:
        raise ValueError(f"no model can be built from its model config ({exc})") from None
