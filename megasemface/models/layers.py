"""Transformer building blocks: embeddings, attention through SDPA, pre-norm layers.

Shapes: B batch, T query length, S key length, D model size, H heads, K head size.
Masks are boolean with True for real tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megasemface.models.config import ModelConfig

__all__ = ["Embeddings", "FeedForward", "MultiHeadAttention", "TransformerLayer", "attention_mask"]


def attention_mask(key_mask_BS: torch.Tensor, query_len: int, causal: bool) -> torch.Tensor:
    """The [B, 1, T, S] boolean mask SDPA takes: True where a query may attend to a key."""
    mask = key_mask_BS[:, None, None, :]
    if causal:
        keys = key_mask_BS.shape[1]
        allowed = torch.ones(query_len, keys, dtype=torch.bool, device=key_mask_BS.device).tril()
        mask = mask & allowed
    return mask


class MultiHeadAttention(nn.Module):
    """Multi-head attention over all heads at once with F.scaled_dot_product_attention."""

    def __init__(self, d_model: int, num_heads: int, dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model)
        self.kv_proj = nn.Linear(d_model, 2 * d_model)
        self.out_proj = nn.Linear(d_model, d_model)

    def forward(
        self, x_BTD: torch.Tensor, source_BSD: torch.Tensor, mask_B1TS: torch.Tensor
    ) -> torch.Tensor:
        batch, length, dim = x_BTD.shape
        heads = self.num_heads
        q_BHTK = self.q_proj(x_BTD).view(batch, length, heads, -1).transpose(1, 2)
        kv = self.kv_proj(source_BSD).view(batch, source_BSD.shape[1], 2, heads, -1)
        k_BHSK, v_BHSK = kv.permute(2, 0, 3, 1, 4).unbind(0)
        out_BHTK = F.scaled_dot_product_attention(
            q_BHTK,
            k_BHSK,
            v_BHSK,
            attn_mask=mask_B1TS,
            dropout_p=self.dropout if self.training else 0.0,
        )
        return self.out_proj(out_BHTK.transpose(1, 2).reshape(batch, length, dim))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int, dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_model, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.dropout(F.gelu(self.fc1(x))))


class TransformerLayer(nn.Module):
    """A pre-norm layer: self-attention, optional cross-attention, feed-forward.

    Pre-norm with one final LayerNorm per stack (not per layer) is what makes "the final
    layer's activation before the last normalisation" of the paper's Eq. 1 well defined.
    """

    def __init__(self, config: ModelConfig, cross_attention: bool) -> None:
        super().__init__()
        d, heads = config.d_model, config.num_heads
        self.self_norm = nn.LayerNorm(d)
        self.self_attn = MultiHeadAttention(d, heads, config.attention_dropout)
        self.cross_norm = nn.LayerNorm(d) if cross_attention else None
        self.cross_attn = (
            MultiHeadAttention(d, heads, config.attention_dropout) if cross_attention else None
        )
        self.ffn_norm = nn.LayerNorm(d)
        self.ffn = FeedForward(d, config.ffn_dim, config.dropout)
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self,
        x_BTD: torch.Tensor,
        self_mask_B1TT: torch.Tensor,
        memory_BSD: torch.Tensor | None = None,
        memory_mask_B1TS: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.self_norm(x_BTD)
        x_BTD = x_BTD + self.dropout(self.self_attn(h, h, self_mask_B1TT))
        if self.cross_attn is not None:
            assert self.cross_norm is not None and memory_BSD is not None
            assert memory_mask_B1TS is not None
            h = self.cross_norm(x_BTD)
            x_BTD = x_BTD + self.dropout(self.cross_attn(h, memory_BSD, memory_mask_B1TS))
        return x_BTD + self.dropout(self.ffn(self.ffn_norm(x_BTD)))


class Embeddings(nn.Module):
    """Token + language + position embeddings (as in XLM), normalised, with dropout."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.tokens = nn.Embedding(config.vocab_size, config.d_model, padding_idx=config.pad_id)
        self.languages = nn.Embedding(config.num_langs, config.d_model)
        self.positions = nn.Embedding(config.max_len, config.d_model)
        self.norm = nn.LayerNorm(config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.max_len = config.max_len
        nn.init.normal_(self.tokens.weight, std=config.d_model**-0.5)
        nn.init.normal_(self.positions.weight, std=config.d_model**-0.5)
        nn.init.normal_(self.languages.weight, std=config.d_model**-0.5)
        with torch.no_grad():
            self.tokens.weight[config.pad_id].zero_()

    def forward(self, tokens_BT: torch.Tensor, langs_B: torch.Tensor) -> torch.Tensor:
        length = tokens_BT.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence of {length} tokens exceeds max_len={self.max_len}")
        positions = torch.arange(length, device=tokens_BT.device)
        x = self.tokens(tokens_BT) + self.positions(positions) + self.languages(langs_B)[:, None]
        return self.dropout(self.norm(x))
