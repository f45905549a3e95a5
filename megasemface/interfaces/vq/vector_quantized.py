"""VQ-SemFace: a Gumbel-softmax vector-quantised codebook as the interface.

Encoder stage: the encoder output passes through the VQ layer before the MLM output layer,
so every prediction is made from a code vector; the losses add the diversity loss (Eq. 6) and
an L2 penalty on the last activations before the final LayerNorm. Decoder stage: token
embeddings pass through a small Transformer (the feature extractor, trained with the
decoder), whose outputs pick codes of the *fixed* codebook by Eq. 5; the codes' vectors are
the memory the decoder cross-attends to. The VQ weights receive no gradient from the
decoder stage, also when both stages train together (Algorithm 1): the decoder pass calls
the layer with detached weights, so gradients reach only the extractor.

Health (:meth:`VectorQuantizedInterface.health`): the noise-free argmax codes of both passes
are counted over the window since the last call, across ranks, because those are the codes
the connected model's encoder would emit; a collapsed codebook shows there, not in the
Gumbel-sampled codes of one batch.
"""

from __future__ import annotations

from typing import Any

import torch

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.base import (
    EncoderHeadOutput,
    EncoderTargets,
    InterfaceMemory,
    SemanticInterface,
    start_embeddings_from_table,
    tensor_sha256,
)
from megasemface.interfaces.vq.code_probabilities import code_log_probs
from megasemface.interfaces.vq.code_usage import CodeUsage, collapse_warning, usage_figures
from megasemface.interfaces.vq.gumbel_quantizer import GumbelVectorQuantizer, VQOutput
from megasemface.nn.config import ModelConfig
from megasemface.nn.layers import positions
from megasemface.nn.transformer import EncoderOutput, TransformerEncoder

__all__ = ["VectorQuantizedInterface"]


def _scatter_tokens(
    values_ND: torch.Tensor, rows: torch.Tensor, mask_BT: torch.Tensor
) -> torch.Tensor:
    """Places the rows for the real tokens (at ``rows``, :func:`positions` of ``mask_BT``)
    back into a zero-padded [B, T, D] tensor."""
    (batch, length), dim = mask_BT.shape, values_ND.shape[-1]
    out = values_ND.new_zeros(batch * length, dim).index_copy(0, rows, values_ND)
    return out.view(batch, length, dim)


class VectorQuantizedInterface(SemanticInterface):
    kind = "vq"

    def __init__(
        self,
        config: ModelConfig,
        groups: ParallelGroups,
        seed: int,
        input_table: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        # The cross-lingual table the encoder's input embeddings start from (--cl-table-input
        # with --vq-codebook-init table); read once, never a weight of the interface.
        self.input_table = input_table
        self.quantizer = GumbelVectorQuantizer(config.vq, config.d_model, groups, seed)
        self.extractor = TransformerEncoder(config, num_layers=config.extractor_layers)
        self.last_output: VQOutput | None = None
        self.encoder_usage: CodeUsage = self.quantizer.code_usage()
        self.decoder_usage: CodeUsage = self.quantizer.code_usage()

    def initialise_encoder(self, encoder: TransformerEncoder) -> None:
        if self.input_table is not None:
            start_embeddings_from_table(encoder, self.input_table)

    def encoder_head(self, encoded: EncoderOutput, targets_BT: torch.Tensor) -> EncoderHeadOutput:
        mask, rows = encoded.mask_BT, positions(encoded.mask_BT)
        # All real tokens are quantised, so the codebook statistics see the whole batch; only
        # the positions with a target feed the MLM output layer.
        hidden_ND = encoded.hidden_BTD.flatten(0, 1)[rows]
        out = self.quantizer(hidden_ND)
        self.last_output = out
        if self.training:
            self.encoder_usage.update(out.greedy_codes)
        quantized = _scatter_tokens(out.quantized, rows, mask)
        l2 = encoded.pre_norm_BTD.flatten(0, 1)[rows].float().pow(2).mean()
        # Squared distance of each output to its argmax code vector (held fixed): the decoder
        # stage cross-attends to code vectors, the connected decoder to these outputs.
        chosen = self.quantizer.lookup(out.greedy_codes).detach()
        commitment = (hidden_ND.float() - chosen.float()).pow(2).sum(-1).mean()
        losses = {
            "diversity": out.diversity_loss,
            "l2": l2,
            "commitment": commitment,
            "token_entropy": out.token_entropy,
        }
        return EncoderHeadOutput(quantized[targets_BT != -100], losses, out.metrics())

    def output_embeddings(self, encoder: TransformerEncoder) -> torch.Tensor:
        return encoder.embed.tokens.weight  # tied, as for the MLM baseline

    def decoder_memory(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> InterfaceMemory:
        features_BTD = self.extractor(tokens_BT, mask_BT, langs_B).hidden_BTD
        return self.features_memory(features_BTD, mask_BT, tokens_BT)

    def features_memory(
        self, features_BTD: torch.Tensor, mask_BT: torch.Tensor, tokens_BT: torch.Tensor
    ) -> InterfaceMemory:
        """The code vectors the fixed codebook picks for ``features`` by Eq. 5."""
        rows = positions(mask_BT)
        out: VQOutput = self.quantizer(features_BTD.flatten(0, 1)[rows], detach_weights=True)
        if self.training:
            self.decoder_usage.update(out.greedy_codes)
        metrics = {f"dec_{k}": v for k, v in out.metrics().items() if k != "vq_diversity_loss"}
        # With the layer's weights detached, these losses reach only the extractor.
        losses = {"diversity": out.diversity_loss, "token_entropy": out.token_entropy}
        memory = _scatter_tokens(out.quantized, rows, mask_BT)
        return InterfaceMemory(memory, mask_BT, metrics, losses)

    def health(self) -> dict[str, float]:
        """Argmax code usage of the encoder (``vq_*``) and of the decoder stage's extractor
        (``dec_vq_*``) since the last call: codes used, their fraction of K, the histogram's
        perplexity, dead codes and the tokens counted."""
        figures = {}
        for prefix, usage in (("vq_", self.encoder_usage), ("dec_vq_", self.decoder_usage)):
            figures.update({prefix + k: v for k, v in usage.summary().items()})
        return figures

    def health_warnings(
        self, figures: dict[str, float], *, codes_share: float, step: int
    ) -> list[str]:
        warnings = []
        for prefix, part in (("vq_", "encoder"), ("dec_vq_", "decoder-stage extractor")):
            if f"{prefix}codes_used" not in figures:
                continue
            keys = ("tokens", "codes_used", "dead_codes", "code_perplexity")
            warning = collapse_warning(
                {key: figures[f"{prefix}{key}"] for key in keys},
                codes_share=codes_share,
                part=part,
                step=step,
            )
            if warning is not None:
                warnings.append(warning)
        return warnings

    def health_fields(self, figures: dict[str, float]) -> list[str]:
        fields = []
        for prefix, part in (("vq_", "enc"), ("dec_vq_", "dec")):
            if f"{prefix}codes_used" in figures:
                used, dead = figures[f"{prefix}codes_used"], figures[f"{prefix}dead_codes"]
                perplexity = figures[f"{prefix}code_perplexity"]
                fields.append(f"{part} codes {used:,.0f}/{used + dead:,.0f} ppl {perplexity:,.1f}")
        return fields

    def encoder_codes(self) -> torch.Tensor | None:
        return None if self.last_output is None else self.last_output.greedy_codes

    def code_figures(self, codes: torch.Tensor) -> dict[str, float]:
        # The codes that occur, not a [K] histogram: a product layout has billions.
        _, counts = torch.unique(codes.reshape(-1), return_counts=True)
        num_codes = self.encoder_usage.num_codes
        usage = usage_figures(counts, num_codes)
        return {
            "codes_used": usage["codes_used"],
            "code_perplexity": usage["code_perplexity"],
            "code_tokens": usage["tokens"],
            "codewords": float(num_codes),
        }

    def diagnostic_targets(
        self, hidden_ND: torch.Tensor, pre_norm_ND: torch.Tensor, tokens_N: torch.Tensor
    ) -> EncoderTargets:
        out = self.quantizer(hidden_ND, sample=False)
        return EncoderTargets(hidden_ND, out.quantized, out.codes)

    def reading_codes(
        self, tokens_BT: torch.Tensor, mask_BT: torch.Tensor, langs_B: torch.Tensor
    ) -> torch.Tensor:
        features_BTD = self.extractor(tokens_BT, mask_BT, langs_B).hidden_BTD
        return self.quantizer(features_BTD[mask_BT], sample=False).codes

    def code_log_probs(self, features_ND: torch.Tensor) -> torch.Tensor:
        return code_log_probs(self.quantizer, features_ND)

    def set_step(self, step: int) -> None:
        """Advances the Gumbel temperature schedule."""
        self.quantizer.set_step(step)

    def load_trained(self, state: dict[str, torch.Tensor]) -> None:
        self.quantizer.load_state_dict(state)
        self.quantizer.freeze()

    def fingerprint(self) -> dict[str, Any]:
        vq = self.quantizer.config
        return {
            "kind": self.kind,
            "layout": vq.layout,
            "codes": vq.combinations,
            "d_model": self.quantizer.d_model,
            # Over every VQ weight (logit layers and table): the decoder stage depends on all
            # of them. A flat table split over model-parallel ranks hashes the local shard, so
            # stages must be compared at the same model-parallel size (or after gathering).
            "quantizer_sha256": tensor_sha256(
                torch.cat([p.detach().float().reshape(-1) for p in self.quantizer.parameters()])
            ),
            "mp_rank": self.quantizer.groups.mp_rank,
        }
