"""Transformer building blocks: embeddings, attention through SDPA, pre-norm layers.

Shapes: B batch, T query length, S key length, D model size, H heads, K head size.
Masks are boolean with True for real tokens.

Written with torch's own modules and functions (``nn.Linear``, ``nn.Dropout``, SDPA), as
any device runs them; a CPU process swaps in faster equivalents from outside when it builds
a model (:mod:`megasemface.nn.cpu_speed`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from megasemface.nn.config import ModelConfig

__all__ = [
    "Embeddings",
    "FeedForward",
    "KVCache",
    "MultiHeadAttention",
    "TransformerLayer",
    "attention_mask",
    "positions",
]


def attention_mask(key_mask_BS: torch.Tensor, query_len: int, causal: bool) -> torch.Tensor:
    """The [B, 1, T, S] boolean mask SDPA takes: True where a query may attend to a key.

    With ``causal`` the T queries are the last T of the S positions (S > T when earlier
    positions come from a key/value cache).
    """
    mask = key_mask_BS[:, None, None, :]
    if causal:
        keys = key_mask_BS.shape[1]
        allowed = torch.ones(query_len, keys, dtype=torch.bool, device=key_mask_BS.device)
        mask = mask & allowed.tril(diagonal=keys - query_len)
    return mask


def positions(mask_BT: torch.Tensor) -> torch.Tensor:
    """Flat indices [N] of the true entries of ``mask_BT``, row by row.

    ``x.flatten(0, 1)[positions(mask)]`` equals ``x[mask]``; a boolean index waits for the
    device to count its true entries each time it is used, forward and backward, where these
    indices count once for every tensor they select from."""
    return mask_BT.flatten().nonzero().squeeze(1)


@dataclasses.dataclass
class KVCache:
    """Keys and values [R, H, S, K] of one attention, kept between incremental decoding steps.

    ``static``: cross-attention, whose keys and values are projected from the encoder memory
    once; otherwise self-attention, which appends the new positions' keys and values.
    """

    static: bool
    k_RHSK: torch.Tensor | None = None
    v_RHSK: torch.Tensor | None = None

    @property
    def complete(self) -> bool:
        """Cross-attention keys and values, once projected, are all there is."""
        return self.static and self.k_RHSK is not None

    def update(
        self, k_RHSK: torch.Tensor, v_RHSK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Stores new keys and values (after the cached ones for self-attention); returns all."""
        if not self.static and self.k_RHSK is not None and self.v_RHSK is not None:
            k_RHSK = torch.cat([self.k_RHSK, k_RHSK], dim=2)
            v_RHSK = torch.cat([self.v_RHSK, v_RHSK], dim=2)
        self.k_RHSK, self.v_RHSK = k_RHSK, v_RHSK
        return k_RHSK, v_RHSK

    def select(self, index_R: torch.Tensor) -> KVCache:
        """The rows ``index_R`` (search reorders and drops hypotheses)."""
        if self.k_RHSK is None or self.v_RHSK is None:
            return KVCache(self.static)
        return KVCache(
            self.static, self.k_RHSK.index_select(0, index_R), self.v_RHSK.index_select(0, index_R)
        )


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
        self,
        x_BTD: torch.Tensor,
        source_BSD: torch.Tensor,
        mask_B1TS: torch.Tensor | None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Attention of ``x`` over ``source``; with a ``cache``, over the cached keys and values
        too (``source`` is then the new positions for self-attention, the memory for
        cross-attention)."""
        batch, length, dim = x_BTD.shape
        heads = self.num_heads
        q_BHTK = self.q_proj(x_BTD).view(batch, length, heads, -1).transpose(1, 2)
        if cache is not None and cache.complete:
            # Projects nothing, yet calls the module: under ZeRO-3 every module call gathers
            # its weights collectively, so a cached step must call the same modules as an
            # uncached one on another rank (lockstep decoding).
            self.kv_proj(source_BSD[:, :0])
            k_BHSK, v_BHSK = cache.k_RHSK, cache.v_RHSK
            assert k_BHSK is not None and v_BHSK is not None
        else:
            kv = self.kv_proj(source_BSD).view(batch, source_BSD.shape[1], 2, heads, -1)
            k_BHSK, v_BHSK = kv.permute(2, 0, 3, 1, 4).unbind(0)
            if cache is not None:
                k_BHSK, v_BHSK = cache.update(k_BHSK, v_BHSK)
        out_BHTK = self.attend(
            q_BHTK, k_BHSK, v_BHSK, mask_B1TS, self.dropout if self.training else 0.0
        )
        return self.out_proj(out_BHTK.transpose(1, 2).reshape(batch, length, dim))

    def attend(
        self,
        q_BHTK: torch.Tensor,
        k_BHSK: torch.Tensor,
        v_BHSK: torch.Tensor,
        mask_B1TS: torch.Tensor | None,
        dropout_p: float,
    ) -> torch.Tensor:
        """The heads' attention itself (a subclass may compute it otherwise)."""
        return F.scaled_dot_product_attention(
            q_BHTK, k_BHSK, v_BHSK, attn_mask=mask_B1TS, dropout_p=dropout_p
        )


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
        self.compiled_block: Callable[..., torch.Tensor] | None = None
        """``block`` through torch.compile, for the uncached forward
        (:func:`megasemface.nn.compile.compile_layers`); None: eager."""

    def forward(
        self,
        x_BTD: torch.Tensor,
        self_mask_B1TT: torch.Tensor,
        memory_BSD: torch.Tensor | None = None,
        memory_mask_B1TS: torch.Tensor | None = None,
        cache: tuple[KVCache, KVCache] | None = None,
    ) -> torch.Tensor:
        """``cache``: self- and cross-attention caches of incremental decoding."""
        if cache is None and self.compiled_block is not None:
            return self.compiled_block(self, x_BTD, self_mask_B1TT, memory_BSD, memory_mask_B1TS)
        return self.block(x_BTD, self_mask_B1TT, memory_BSD, memory_mask_B1TS, cache)

    def block(
        self,
        x_BTD: torch.Tensor,
        self_mask_B1TT: torch.Tensor,
        memory_BSD: torch.Tensor | None = None,
        memory_mask_B1TS: torch.Tensor | None = None,
        cache: tuple[KVCache, KVCache] | None = None,
    ) -> torch.Tensor:
        """The layer itself (``forward`` picks the compiled or the eager one)."""
        self_cache, cross_cache = cache if cache is not None else (None, None)
        h = self.self_norm(x_BTD)
        x_BTD = x_BTD + self.dropout(self.self_attn(h, h, self_mask_B1TT, self_cache))
        if self.cross_attn is not None:
            assert self.cross_norm is not None and memory_BSD is not None
            assert memory_mask_B1TS is not None
            h = self.cross_norm(x_BTD)
            x_BTD = x_BTD + self.dropout(
                self.cross_attn(h, memory_BSD, memory_mask_B1TS, cross_cache)
            )
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

    def forward(
        self, tokens_BT: torch.Tensor, langs_B: torch.Tensor, start: int = 0
    ) -> torch.Tensor:
        """``start``: the position of the first token (after cached ones when decoding)."""
        end = start + tokens_BT.shape[1]
        if end > self.max_len:
            raise ValueError(f"sequence of {end} tokens exceeds max_len={self.max_len}")
        positions = torch.arange(start, end, device=tokens_BT.device)
        x = self.tokens(tokens_BT) + self.positions(positions) + self.languages(langs_B)[:, None]
        return self.dropout(self.norm(x))
