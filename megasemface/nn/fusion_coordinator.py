"""The layer-wise coordinator of deep fusion (Eq. 10-14 of the deep-fusion paper).

A pre-trained encoder (the PTM) of N x M layers replaces the NMT encoder; its layers are
split into N parts of M consecutive layers, N the decoder's depth. The coordinator:

- aggregates each part (Eq. 10): ``R_n = LN(FFN(sum of the part's M layer outputs))``;
- gives decoder layer n its own memory (Eq. 11-13): ``C_n = FFN(sum_k alpha_nk R_k)``, with
  ``alpha_n = softmax_k(e_nk)`` and ``e_nk = FFN(mean(R_n) * mean(R_k))``, the means over
  the sentence's real tokens and ``*`` elementwise (the paper's dot is ambiguous: a product
  that keeps the vector lets the scoring FFN weigh the dimensions, a scalar dot product
  would leave it nothing to map);

and decoder layer n cross-attends to ``C_n`` (Eq. 14). One aggregation FFN and LayerNorm,
one scoring FFN and one mapping FFN serve every part, as the equations carry no part index.

It is a building block of ``Seq2SeqModel`` (``ModelConfig.fusion == "deep"``), so search,
translation and checkpoints see the fused model as any translation model. The fine-tuning
losses that read its aggregated parts are in ``objectives/fusion_losses.py``.

Shapes: B batch, N parts (decoder layers), S source length, D model size.
"""

from __future__ import annotations

import torch
from torch import nn

from megasemface.nn.config import ModelConfig
from megasemface.nn.layers import FeedForward

__all__ = ["LayerCoordinator", "masked_mean"]


def masked_mean(x_BSD: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
    """The mean over each row's real positions [..., D] (Eq. 13 and 16's mean pooling)."""
    weights = mask_BS.to(x_BSD.dtype).unsqueeze(-1)
    return (x_BSD * weights).sum(-2) / weights.sum(-2).clamp(min=1.0)


class LayerCoordinator(nn.Module):
    """Aggregation layer and layer-wise attention between the PTM and the decoder."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.d_model
        self.parts = config.decoder_layers
        self.part_layers = config.fusion_part_layers
        self.aggregate = FeedForward(d, config.ffn_dim, config.dropout)
        self.aggregate_norm = nn.LayerNorm(d)
        self.score_hidden = nn.Linear(d, d)
        self.score_out = nn.Linear(d, 1)
        self.mapping = FeedForward(d, config.ffn_dim, config.dropout)

    def aggregated(self, layers: list[torch.Tensor]) -> torch.Tensor:
        """Eq. 10: the N parts' representations [B, N, S, D] from the PTM's N x M layer
        outputs (each [B, S, D], first layer first)."""
        if len(layers) != self.parts * self.part_layers:
            raise ValueError(
                f"the coordinator takes {self.parts} x {self.part_layers} layer outputs, "
                f"got {len(layers)}"
            )
        stacked = torch.stack(layers, dim=1)  # [B, N*M, S, D]
        batch, _, length, dim = stacked.shape
        sums = stacked.view(batch, self.parts, self.part_layers, length, dim).sum(2)
        return self.aggregate_norm(self.aggregate(sums))

    def attention(self, parts_BNSD: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
        """Eq. 12-13: alpha [B, N, N], row n the weights decoder layer n gives the parts."""
        pooled_BND = masked_mean(parts_BNSD, mask_BS.unsqueeze(1))
        products_BNKD = pooled_BND.unsqueeze(2) * pooled_BND.unsqueeze(1)
        scores_BNK = self.score_out(torch.relu(self.score_hidden(products_BNKD))).squeeze(-1)
        return torch.softmax(scores_BNK.float(), dim=-1).to(parts_BNSD.dtype)

    def memories(self, parts_BNSD: torch.Tensor, mask_BS: torch.Tensor) -> torch.Tensor:
        """Eq. 11: every decoder layer's memory C [B, N, S, D]."""
        alpha_BNK = self.attention(parts_BNSD, mask_BS)
        mixed_BNSD = torch.einsum("bnk,bksd->bnsd", alpha_BNK, parts_BNSD)
        return self.mapping(mixed_BNSD)

    def forward(self, layers: list[torch.Tensor], mask_BS: torch.Tensor) -> torch.Tensor:
        """The decoder layers' memories [B, N, S, D] from the PTM's layer outputs."""
        return self.memories(self.aggregated(layers), mask_BS)
