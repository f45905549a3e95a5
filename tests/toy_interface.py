"""A third interface, defined outside the package: the decoder reads its own embeddings of
the noised sentence. tests/test_registries.py registers it in the test's process;
``toy_interface_plugin`` registers it in a launched run's and a tool's, through
``MEGASEMFACE_PLUGINS``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from megasemface.interfaces.base import (
    EncoderHeadOutput,
    InterfaceMemory,
    SemanticInterface,
    select_targets,
    tensor_sha256,
)
from megasemface.interfaces.registry import BuildOptions, Interface
from megasemface.nn.config import ModelConfig
from megasemface.nn.transformer import EncoderOutput, TransformerEncoder

NAME = "tokens"


class TokenMemoryInterface(SemanticInterface):
    """The decoder reads a table of its own, a row per token of the noised sentence."""

    kind = NAME

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.table = nn.Embedding(config.vocab_size, config.d_model)

    def encoder_head(self, encoded: EncoderOutput, targets_BT: torch.Tensor) -> EncoderHeadOutput:
        return EncoderHeadOutput(select_targets(encoded.hidden_BTD, targets_BT), {}, {})

    def output_embeddings(self, encoder: TransformerEncoder) -> torch.Tensor:
        return encoder.embed.tokens.weight

    def decoder_memory(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> InterfaceMemory:
        return InterfaceMemory(self.table(tokens_BT), mask_BT, {})

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "table": tensor_sha256(self.table.weight)}


def build_tokens(config: ModelConfig, options: BuildOptions) -> SemanticInterface:
    del options
    return TokenMemoryInterface(config)


SPEC = Interface(name=NAME, build=build_tokens)
