"""The codebook bridge: VQ-SemFace's encoder joined to its decoder through the code vectors.

The paper connects the stages by removing the interface, so the connected decoder
cross-attends to the encoder's raw output. VQ-SemFace's decoder, however, was pre-trained on
code vectors, and nothing in the encoder stage pulls the encoder's output towards them (the
MLM head reads the codes): at the demo budget the cosine between an output and its code is
0.03-0.08, and the pre-trained cross-attention starts fine-tuning on inputs it never saw.

The bridge keeps the encoder stage's VQ layer in the translation model, without noise or
argmax: each encoder output ``h`` becomes ``softmax(l(h) / tau) @ codebook``, with ``l`` the
layer's logits (its Linear-ReLU-Linear, or minus the scaled squared distances to the codes for
``vq.logits=distance``). That is a point in the span of the codes the decoder was
trained on (close to the argmax code when the distribution is confident), continuous and
differentiable, so fine-tuning trains the encoder, the logits and the codes as one model.

It is an option of the connected model (``ModelConfig.bridge``), off by default: at the demo
budget it halves validation BLEU after fine-tuning (docs/reproduce.md, system ``vq-bridge``),
as the confident code distributions keep the encoder behind a K-way bottleneck. It costs a
K-way softmax per source token (at K = 102,400, about what a 6-layer encoder costs per token
at d 1024), computed in chunks of ``vq.chunk_tokens`` tokens and recomputed in backward so its
activation memory stays bounded.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from megasemface.nn.code_distance import distance_logit_weights, distance_scale
from megasemface.nn.config import ModelConfig

__all__ = ["BRIDGE_SOURCES", "CodebookBridge", "bridge_sources", "bridge_state"]

BRIDGE_SOURCES: dict[str, str] = {
    "hidden.weight": "interface.quantizer.hidden.weight",
    "hidden.bias": "interface.quantizer.hidden.bias",
    "logits.weight": "interface.quantizer.logits_weight",
    "logits.bias": "interface.quantizer.logits_bias",
    "codebook": "interface.quantizer.codebook",
}
"""Each bridge parameter and the encoder-stage state key it is initialised from."""


def bridge_sources(logits: str) -> dict[str, str]:
    """:data:`BRIDGE_SOURCES` for ``vq.logits`` ``mlp``; the codebook alone for ``distance``
    (the distance logits have no weights of their own)."""
    if logits == "distance":
        return {"codebook": BRIDGE_SOURCES["codebook"]}
    return dict(BRIDGE_SOURCES)


def bridge_state(stage_state: Mapping[str, Tensor], logits: str = "mlp") -> dict[str, Tensor]:
    """The bridge's state from a VQ-SemFace stage's state (gathered, not a model-parallel
    shard) whose VQ layer has ``vq.logits`` ``logits``; KeyError names the first VQ weight
    missing."""
    return {name: stage_state[key] for name, key in bridge_sources(logits).items()}


class CodebookBridge(nn.Module):
    """``h -> softmax(logits(h) / temperature) @ codebook`` per token, for either VQ layout.

    Flat: one softmax over K codes of size d. Product: one softmax per group over its
    ``entries`` codes of size d / groups, the groups' mixtures concatenated (the layout's code
    vector is the concatenation of its groups' entries).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        vq = config.vq
        self.groups = 1 if vq.layout == "flat" else vq.groups
        rows = vq.num_codes if vq.layout == "flat" else vq.groups * vq.entries
        self.entries = rows // self.groups
        self.temperature = config.bridge_temperature
        self.chunk_tokens = vq.chunk_tokens
        self.distance = vq.logits == "distance"
        self.distance_width = vq.distance_width
        self.hidden: nn.Linear | None = None
        self.logits: nn.Linear | None = None
        if not self.distance:
            self.hidden = nn.Linear(config.d_model, vq.hidden_dim)
            self.logits = nn.Linear(vq.hidden_dim, rows)
        # The quantizer's table shape, so its state loads as it is: [K, d] or [G, V, d / G].
        width = config.d_model // self.groups
        shape = (rows, width) if self.groups == 1 else (self.groups, self.entries, width)
        self.codebook = nn.Parameter(torch.randn(shape))

    def _mix(self, h_ND: Tensor) -> Tensor:
        n_tok = h_ND.shape[0]
        table = self.codebook.float().view(self.groups, self.entries, -1)  # [G, V, w]
        if self.logits is None:  # the VQ layer's distance logits
            scale = distance_scale(table.shape[-1], self.distance_width)
            weight, bias = distance_logit_weights(table, scale)
            parts = h_ND.float().view(n_tok, self.groups, -1)
            logits = torch.einsum("ngk,gvk->ngv", parts, weight) + bias.view_as(weight[..., 0])
        else:
            assert self.hidden is not None
            logits = self.logits(F.relu(self.hidden(h_ND))).float()
        scores = logits.view(n_tok, self.groups, self.entries) / self.temperature
        probs = torch.softmax(scores, dim=-1)
        mixed = torch.einsum("ngv,gvk->ngk", probs, table)
        return mixed.reshape(h_ND.shape[0], -1).to(h_ND.dtype)

    def forward(self, hidden_BTD: Tensor) -> Tensor:
        """The bridged memory [B, T, D]; padding positions are mapped too (they are masked)."""
        flat_ND = hidden_BTD.reshape(-1, hidden_BTD.shape[-1])
        if flat_ND.shape[0] <= self.chunk_tokens:
            return self._mix(flat_ND).view_as(hidden_BTD)
        chunks = []
        for start in range(0, flat_ND.shape[0], self.chunk_tokens):
            part = flat_ND[start : start + self.chunk_tokens]
            if torch.is_grad_enabled():
                # Recomputed in backward: the [chunk, K] probabilities are not kept.
                chunks.append(checkpoint(self._mix, part, use_reentrant=False))
            else:
                chunks.append(self._mix(part))
        return torch.cat(chunks).view_as(hidden_BTD)
