"""CL-SemFace: a pre-trained cross-lingual subword embedding table as the interface.

Encoder stage (the paper's Eq. 1): the MLM output layer's weights are the table (tied), and
an MSE loss pulls the last layer's activation before the final LayerNorm towards the table
row of the ground-truth token, so that the encoder's outputs land where the decoder stage's
memory is. Decoder stage: the memory is the table rows of a noised copy of the sentence,
E(C(x)), standing in for an encoder that maps every language into that space.

The table's rows have norm sqrt(d_model), the scale of the model's activations. The paper's
VecMap vectors are unit length, so its squared distance ||W_i - h_i||^2, summed over the
dimensions, stays near 2 - 2 cos: ``unit_mse`` takes the rows at that scale, divided by
sqrt(d_model), as the target (the MLM output layer reads them so with ``unit_logits``).
Against the rows as they are the distance grows with the width and outweighs the MLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from megasemface.interfaces.base import (
    EncoderHeadOutput,
    EncoderTargets,
    InterfaceMemory,
    SemanticInterface,
    select_targets,
    start_embeddings_from_table,
    tensor_sha256,
)
from megasemface.nn.transformer import EncoderOutput, TransformerEncoder

__all__ = ["CrossLingualInterface", "load_embedding_table"]


def load_embedding_table(path: str | Path, vocab_size: int, d_model: int) -> torch.Tensor:
    """Reads a [V, D] table from safetensors (one tensor, or one named "embeddings")."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"cross-lingual embedding table not found: {path}")
    try:
        tensors = load_file(str(path))
    except Exception as exc:
        raise ValueError(f"{path} is not a safetensors file: {exc}") from exc
    if "embeddings" in tensors:
        table = tensors["embeddings"]
    elif len(tensors) == 1:
        table = next(iter(tensors.values()))
    else:
        raise ValueError(f"{path} holds {sorted(tensors)}; expected one tensor or 'embeddings'")
    if tuple(table.shape) != (vocab_size, d_model):
        raise ValueError(
            f"{path}: table of shape {tuple(table.shape)}, but the model needs "
            f"[{vocab_size}, {d_model}] (vocabulary x d_model); build it for this "
            "SentencePiece model and hidden size"
        )
    if not torch.isfinite(table).all():
        raise ValueError(f"{path}: the table holds NaN or infinite values")
    return table.to(torch.float32)


class CrossLingualInterface(SemanticInterface):
    kind = "cl"

    def __init__(
        self,
        table_VD: torch.Tensor,
        trainable: bool = False,
        unit_logits: bool = False,
        unit_mse: bool = False,
        table_input: bool = False,
    ) -> None:
        super().__init__()
        # A Parameter (not a buffer) so that it is checkpointed and can be tuned on request;
        # frozen by default and then kept out of the optimizer.
        self.table = nn.Parameter(table_VD.detach().clone(), requires_grad=trainable)
        # The MLM output layer's scale: rows of norm sqrt(d) against LayerNorm outputs of
        # norm about sqrt(d) give logits up to d, a softmax so peaked that the MLM loss stays
        # above a uniform guess; divided by sqrt(d) the rows are unit vectors, as VecMap's.
        self.output_scale = table_VD.shape[1] ** -0.5 if unit_logits else 1.0
        # Eq. 1's target at the unit length of VecMap's vectors (see the module docstring).
        self.mse_scale = table_VD.shape[1] ** -0.5 if unit_mse else 1.0
        self.table_input = table_input

    def initialise_encoder(self, encoder: TransformerEncoder) -> None:
        """With ``table_input``, the encoder's input token embeddings start as the table's
        rows at unit norm, the scale of their own initialisation: XLM's code, which the
        paper builds on, ties them to the output layer the paper initialises with the
        table. The padding row stays zero."""
        if self.table_input:
            start_embeddings_from_table(encoder, self.table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The table rows of ``ids``. Read through this module call rather than by indexing
        the table directly so that ZeRO-3 gathers a trained table for the backward pass
        too: a parameter read only outside a module's forward is partitioned again when its
        gradient arrives."""
        return self.table[ids]

    def encoder_head(self, encoded: EncoderOutput, targets_BT: torch.Tensor) -> EncoderHeadOutput:
        selected = targets_BT != -100
        pre_norm_ND = encoded.pre_norm_BTD[selected]
        wanted_ND = self(targets_BT[selected]) * self.mse_scale
        mse = (pre_norm_ND.float() - wanted_ND.float()).pow(2).sum(dim=-1).mean()
        features = select_targets(encoded.hidden_BTD, targets_BT)
        return EncoderHeadOutput(features, {"mse": mse}, {})

    def output_embeddings(self, encoder: TransformerEncoder) -> torch.Tensor:
        return self.table if self.output_scale == 1.0 else self.table * self.output_scale

    def decoder_memory(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> InterfaceMemory:
        memory = self(tokens_BT).detach()  # the decoder's loss does not train the table
        return InterfaceMemory(memory, mask_BT, {})

    def features_memory(
        self, features_BTD: torch.Tensor, mask_BT: torch.Tensor, tokens_BT: torch.Tensor
    ) -> InterfaceMemory:
        """The table rows of ``tokens``, the targets Eq. 1 pulls the encoder's outputs to
        (``--decoder-codes encoder`` or ``encoder-trained``; ``--decoder-continuous`` sets
        the share of tokens read as the outputs themselves)."""
        return InterfaceMemory(self(tokens_BT).detach(), mask_BT, {})

    def diagnostic_targets(
        self, hidden_ND: torch.Tensor, pre_norm_ND: torch.Tensor, tokens_N: torch.Tensor
    ) -> EncoderTargets:
        # Eq. 1 pulls the encoder's output before its final norm to the token's row.
        return EncoderTargets(pre_norm_ND, self.table[tokens_N])

    def fingerprint(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "vocab_size": self.table.shape[0],
            "d_model": self.table.shape[1],
            "table_sha256": tensor_sha256(self.table),
        }
