"""VECO's pre-training objectives on the sequence-to-sequence model.

VECO (Luo et al.) trains on pairs of sequences (x, y), adjacent segments of monolingual text
or the two sides of a parallel pair, each masked as BERT masks (``x̂``, ``ŷ``):

- in-sequence MLM, IS(x): the encoder reads ``x̂ </s>`` with bidirectional self-attention
  and predicts x's masked tokens from its own final states;
- cross-sequence MLM, CS(x, y): the decoder reads ``<lang y> ŷ`` with causal self-attention,
  cross-attends to the encoder's final states of ``x̂ </s>`` (detached: no gradient from the
  "virtual decoder" into the encoder, as VECO stops it) and predicts y's masked tokens,
  each from x̂ and the masked prefix ``ŷ<t`` (the decoder's layout in translation: position
  t reads the token before t, so the token it predicts is never in its input).

The loss of a pair is VECO's sum IS(x) + IS(y) + CS(x, y) + CS(y, x), each term the mean
over its predicted tokens. Both sides take one mask (the one IS and CS both read, as VECO
reuses the IS pass's states for CS), the two encoder passes run as one call and so do the
two decoder passes, so every batch calls the same modules in the same order (ZeRO-3
gathers weights per module call, in lockstep over the ranks).

Output layers: IS predicts through the encoder's token embeddings (tied) plus a bias of
this pre-training alone (``mlm_bias``, dropped when the run is connected, as the XLM and
SemFace encoder stages drop theirs); CS predicts through the decoder's own output layer, the
one translation fine-tuning uses, so it starts from trained weights.

Shapes: B batch, T length, S memory length, N predicted tokens, D model size, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megasemface.nn.config import ModelConfig
from megasemface.nn.transformer import Seq2SeqModel
from megasemface.objectives.noising import IGNORE_INDEX, mask_for_mlm
from megasemface.objectives.objective import ObjectiveConfig, StageOutput, check_languages
from megasemface.objectives.options import PRETRAINING_LABEL_SMOOTHING
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
    append_token,
    lengths_to_mask,
    prepend_tokens,
)
from megasemface.objectives.veco import MaskedSide, VecoTerms, stack_rows

__all__ = ["VecoSeq2Seq"]


class VecoSeq2Seq(nn.Module):
    """The sequence-to-sequence model with VECO's IS-MLM and CS-MLM losses."""

    def __init__(
        self,
        config: ModelConfig,
        special: SpecialTokens,
        objective: ObjectiveConfig | None = None,
    ) -> None:
        super().__init__()
        check_languages(config, special)
        if config.bridge != "none":
            raise ValueError(
                "--model bridge=codebook connects VQ-SemFace's encoder through its codebook; "
                "VECO's cross-attention reads the encoder's output: leave bridge at none"
            )
        self.config = config
        self.special = special
        self.objective = objective or ObjectiveConfig()
        self.model = Seq2SeqModel(config)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        """IS-MLM's output bias (the weights are the encoder's token embeddings)."""

    def forward(
        self, x: SequenceBatch, y: SequenceBatch, generator: torch.Generator
    ) -> StageOutput:
        """The loss of the pairs (x, y): one module call, so ZeRO-3 gathers what it needs."""
        return self.loss(x, y, generator)

    def external_parameters(self) -> list[nn.Parameter]:
        """The tied output layers, read outside the forward of the modules that own them
        (ZeRO-3 registers them)."""
        return [
            self.model.encoder.embed.tokens.weight,
            self.model.decoder.embed.tokens.weight,
            self.model.decoder.output_bias,
        ]

    # Pieces -----------------------------------------------------------------------------

    def mask(self, side: SequenceBatch, generator: torch.Generator) -> MaskedSide:
        """BERT's masking at ``ObjectiveConfig.mlm_prob`` (80% mask, 10% random, 10% kept)."""
        sp = self.special
        inputs, targets = mask_for_mlm(
            side.tokens_BT,
            side.lengths_B,
            mask_id=sp.mask,
            vocab_size=self.config.vocab_size,
            special_ids=sp.all,
            generator=generator,
            prob=self.objective.mlm_prob,
        )
        return MaskedSide(inputs, targets, side.lengths_B, side.langs_B)

    def encoder_inputs(self, side: MaskedSide) -> tuple[torch.Tensor, torch.Tensor]:
        """``x̂ </s>`` and its mask (True for real tokens)."""
        sp = self.special
        tokens, lengths = append_token(side.inputs_BT, side.lengths_B, sp.eos, sp.pad)
        return tokens, lengths_to_mask(lengths, tokens.shape[1])

    def decoder_inputs(self, side: MaskedSide) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``<lang> ŷ``, its mask, and the targets aligned with it: position t predicts
        y's token t when it is masked (the last position, reading ŷ's last token, none)."""
        sp = self.special
        tags = torch.tensor(sp.lang_tags, device=side.langs_B.device)[side.langs_B]
        tokens, lengths = prepend_tokens(side.inputs_BT, side.lengths_B, tags)
        targets = F.pad(side.targets_BT, (0, 1), value=IGNORE_INDEX)
        return tokens, lengths_to_mask(lengths, tokens.shape[1]), targets

    def in_sequence_logits(self, hidden_ND: torch.Tensor) -> torch.Tensor:
        """IS-MLM's output layer: the encoder's token embeddings and ``mlm_bias``."""
        weight_VD = self.model.encoder.embed.tokens.weight
        return hidden_ND @ weight_VD.t().to(hidden_ND.dtype) + self.mlm_bias

    # The loss ---------------------------------------------------------------------------

    def forward_terms(
        self, x: SequenceBatch, y: SequenceBatch, generator: torch.Generator
    ) -> VecoTerms:
        """The four terms of the pairs (x, y), row by row, before they are summed."""
        if x.tokens_BT.shape[0] != y.tokens_BT.shape[0]:
            raise ValueError("x and y must have as many rows (one pair per row)")
        batch = x.tokens_BT.shape[0]
        mx, my = self.mask(x, generator), self.mask(y, generator)

        # Both encoder passes in one call: rows of x̂ then of ŷ.
        (ex, ex_mask), (ey, ey_mask) = self.encoder_inputs(mx), self.encoder_inputs(my)
        tokens = stack_rows(ex, ey, self.special.pad)
        mask = stack_rows(ex_mask, ey_mask, False)
        langs = torch.cat([x.langs_B, y.langs_B])
        hidden = self.model.encoder(tokens, mask, langs).hidden_BTD
        is_targets = stack_rows(
            F.pad(mx.targets_BT, (0, 1), value=IGNORE_INDEX),
            F.pad(my.targets_BT, (0, 1), value=IGNORE_INDEX),
            IGNORE_INDEX,
        )
        is_selected = is_targets != IGNORE_INDEX
        is_logits = self.in_sequence_logits(hidden[is_selected])
        is_wanted = is_targets[is_selected]

        # Both decoder passes in one call: ŷ reading x̂'s states, then x̂ reading ŷ's. The
        # memory is detached: CS-MLM trains the decoder alone (VECO's stop-gradient).
        states = hidden.detach()
        memory = stack_rows(states[:batch, : ex.shape[1]], states[batch:, : ey.shape[1]], 0.0)
        memory_mask = stack_rows(ex_mask, ey_mask, False)
        (dy, dy_mask, ty), (dx, dx_mask, tx) = self.decoder_inputs(my), self.decoder_inputs(mx)
        tokens = stack_rows(dy, dx, self.special.pad)
        mask = stack_rows(dy_mask, dx_mask, False)
        langs = torch.cat([y.langs_B, x.langs_B])
        decoded = self.model.decoder(tokens, mask, langs, memory, memory_mask, causal=True)
        cs_targets = stack_rows(ty, tx, IGNORE_INDEX)
        cs_selected = cs_targets != IGNORE_INDEX
        cs_logits = self.model.decoder.logits(decoded[cs_selected])
        cs_wanted = cs_targets[cs_selected]

        # Which sequence each predicted token belongs to: rows of the second half are y's
        # for IS, x's for CS (the decoder's rows are ŷ's first).
        second = torch.arange(2 * batch, device=tokens.device)[:, None] >= batch
        is_x, is_y = self._term_means(
            is_logits, is_wanted, second.expand_as(is_selected)[is_selected]
        )
        cs_y, cs_x = self._term_means(
            cs_logits, cs_wanted, second.expand_as(cs_selected)[cs_selected]
        )
        with torch.no_grad():
            is_accuracy = (is_logits.argmax(-1) == is_wanted).float().mean().nan_to_num(0.0)
            cs_accuracy = (cs_logits.argmax(-1) == cs_wanted).float().mean().nan_to_num(0.0)
        return VecoTerms(
            is_x,
            is_y,
            cs_x,
            cs_y,
            is_accuracy,
            cs_accuracy,
            int(is_wanted.numel() + cs_wanted.numel()),
        )

    def loss(self, x: SequenceBatch, y: SequenceBatch, generator: torch.Generator) -> StageOutput:
        """VECO's IS(x) + IS(y) + CS(x, y) + CS(y, x)."""
        terms = self.forward_terms(x, y, generator)
        loss = terms.is_x + terms.is_y + terms.cs_x + terms.cs_y
        components = {
            name: value.detach()
            for name, value in (
                ("is_mlm_x", terms.is_x),
                ("is_mlm_y", terms.is_y),
                ("cs_mlm_x", terms.cs_x),
                ("cs_mlm_y", terms.cs_y),
                # Per predicted token, the mean of the two terms of each kind.
                ("is_mlm", (terms.is_x + terms.is_y) / 2),
                ("cs_mlm", (terms.cs_x + terms.cs_y) / 2),
            )
        }
        metrics = {"is_mlm_accuracy": terms.is_accuracy, "cs_mlm_accuracy": terms.cs_accuracy}
        return StageOutput(loss, components, metrics, terms.num_targets)

    def _term_means(
        self, logits_NV: torch.Tensor, wanted_N: torch.Tensor, second_N: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mean cross-entropy of the first sequence's predicted tokens and of the
        second's; 0 for a term without any (one-token sentences leave an empty segment)."""
        # fp32 softmax, as every loss here: a large vocabulary in bf16 loses small probabilities.
        losses = F.cross_entropy(
            logits_NV.float(),
            wanted_N,
            reduction="none",
            label_smoothing=PRETRAINING_LABEL_SMOOTHING,
        )
        term = second_N.long()
        sums = losses.new_zeros(2).index_add(0, term, losses)
        counts = torch.bincount(term, minlength=2).clamp(min=1).to(losses.dtype)
        first, second = (sums / counts).unbind()
        return first, second
