"""The SemFace pre-training model: the encoder and decoder stages joined by an interface.

``SemFaceModel`` holds the encoder, the semantic interface and (except for the XLM-style
baseline) the decoder. Its encoder loss touches only encoder and interface parameters, its
decoder loss only decoder parameters (plus the VQ feature extractor), so one backward pass
over their sum updates each part with its own loss, which is Algorithm 1 of the paper; the
separate stages run either loss alone.

Shapes: B batch, T length, N predicted tokens, D model size, V vocabulary.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from megasemface.interfaces.base import InterfaceMemory, SemanticInterface
from megasemface.nn.config import ModelConfig
from megasemface.nn.layers import positions
from megasemface.nn.transformer import TransformerDecoder, TransformerEncoder
from megasemface.objectives.language_mean import language_mean_loss
from megasemface.objectives.noising import (
    drop_and_shuffle,
    mask_for_mlm,
)
from megasemface.objectives.objective import ObjectiveConfig, StageOutput, check_languages
from megasemface.objectives.options import PRETRAINING_LABEL_SMOOTHING
from megasemface.objectives.output_loss import output_cross_entropy
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
    append_token,
    lengths_to_mask,
    prepend_tokens,
)
from megasemface.stages import stage

__all__ = ["SemFaceModel", "through_final_norm"]


def through_final_norm(encoder: TransformerEncoder, memory_BSD: torch.Tensor) -> torch.Tensor:
    """``memory`` through the encoder's final LayerNorm, its weights held fixed: the
    normalisation the connected decoder's memory, the encoder's output, comes through."""
    norm = encoder.final_norm
    weight = norm.weight.detach() if norm.weight is not None else None
    bias = norm.bias.detach() if norm.bias is not None else None
    return F.layer_norm(memory_BSD, norm.normalized_shape, weight, bias, norm.eps)


class SemFaceModel(nn.Module):
    """Encoder, semantic interface and decoder for SemFace pre-training."""

    def __init__(
        self,
        config: ModelConfig,
        interface: SemanticInterface,
        special: SpecialTokens,
        objective: ObjectiveConfig | None = None,
    ) -> None:
        super().__init__()
        check_languages(config, special)
        self.config = config
        self.special = special
        self.objective = (objective or ObjectiveConfig()).for_width(config.d_model)
        self.encoder = TransformerEncoder(config)
        interface.initialise_encoder(self.encoder)
        self.mlm_bias = nn.Parameter(torch.zeros(config.vocab_size))
        self.interface = interface
        self.decoder = TransformerDecoder(config) if interface.has_decoder_stage else None
        self.stage = "joint"
        """The SemFace stage (``megasemface/stages.py``) whose loss ``forward`` computes (the
        trainer sets it)."""

    def forward(
        self,
        batch: SequenceBatch,
        generator: torch.Generator,
        substituted: SequenceBatch | None = None,
    ) -> StageOutput:
        """The loss of ``self.stage``; a module call, so ZeRO-3 gathers what it needs.
        ``substituted``: the decoder stage's source before noise, when it is not ``batch``
        (``batch`` with random aligned substitution)."""
        trained = stage(self.stage)
        if not trained.decoder:
            return self.encoder_loss(batch, generator)
        if not trained.encoder:
            return self.decoder_loss(batch, generator, substituted)
        return self.joint_loss(batch, generator, substituted)

    def external_parameters(self) -> list[nn.Parameter]:
        """Parameters read outside the forward of the module that owns them: the tied
        output layers and the interface's weights (read by interface methods). ZeRO-3 must
        gather them for the whole of ``forward``; the engine registers them."""
        params = [self.encoder.embed.tokens.weight, *self.interface.external_parameters()]
        # The decoder stage reads its memory through the encoder's final norm.
        params += [self.encoder.final_norm.weight, self.encoder.final_norm.bias]
        if self.decoder is not None:
            params += [self.decoder.embed.tokens.weight, self.decoder.output_bias]
        return params

    def _masked_with_eos(
        self, batch: SequenceBatch, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLM inputs ``x' </s>``, their lengths, and targets (-100 where not predicted)."""
        sp = self.special
        inputs, targets = mask_for_mlm(
            batch.tokens_BT,
            batch.lengths_B,
            mask_id=sp.mask,
            vocab_size=self.config.vocab_size,
            special_ids=sp.all,
            generator=generator,
            prob=self.objective.mlm_prob,
        )
        inputs, lengths = append_token(inputs, batch.lengths_B, sp.eos, sp.pad)
        targets, _ = append_token(targets, batch.lengths_B, -100, -100)
        return inputs, lengths, targets

    # Encoder stage ------------------------------------------------------------------------

    def encoder_loss(self, batch: SequenceBatch, generator: torch.Generator) -> StageOutput:
        """MLM through the interface, plus the interface's weighted auxiliary losses."""
        inputs, lengths, targets = self._masked_with_eos(batch, generator)
        encoded = self.encoder(inputs, lengths_to_mask(lengths, inputs.shape[1]), batch.langs_B)
        head = self.interface.encoder_head(encoded, targets)
        wanted = targets[targets != -100]
        mlm = output_cross_entropy(
            head.features_ND,
            self.interface.output_embeddings(self.encoder),
            self.mlm_bias,
            wanted,
            PRETRAINING_LABEL_SMOOTHING,
        )
        loss = mlm.loss
        components = {"enc_mlm": mlm.loss.detach()}
        for name, value in head.losses.items():
            loss = loss + self.objective.weight_of(name) * value
            components[f"enc_{name}"] = value.detach()
        if self.objective.language_mean_weight:
            mask = lengths_to_mask(lengths, inputs.shape[1])
            shift = language_mean_loss(
                encoded.pre_norm_BTD, mask, batch.langs_B, self.config.num_langs
            )
            loss = loss + self.objective.language_mean_weight * shift
            components["enc_lang_mean"] = shift.detach()
        metrics = {**head.metrics, "enc_mlm_accuracy": mlm.accuracy}
        return StageOutput(loss, components, metrics, int(wanted.numel()))

    # Decoder stage ------------------------------------------------------------------------

    def decoder_loss(
        self,
        batch: SequenceBatch,
        generator: torch.Generator,
        substituted: SequenceBatch | None = None,
    ) -> StageOutput:
        """Generate the sentence from the interface's memory of a noised copy (Eq. 2 or 3);
        the copy is made from ``substituted`` when given (the sentence with some words in
        another language), else from the sentence."""
        if self.decoder is None:
            raise ValueError(f"interface {self.interface.kind!r} has no decoder stage")
        obj, sp = self.objective, self.special
        copy = batch if substituted is None else substituted
        source, source_lengths = copy.tokens_BT, copy.lengths_B
        if obj.decoder_noise:
            source, source_lengths = drop_and_shuffle(
                source,
                source_lengths,
                pad_id=sp.pad,
                generator=generator,
                drop_prob=obj.decoder_word_drop,
                shuffle_window=obj.shuffle_window,
            )
        if obj.decoder_codes != "extractor":
            trained = obj.decoder_codes == "encoder-trained"
            memory = self._encoder_codes(source, source_lengths, batch.langs_B, trained, generator)
        else:
            memory = self._normed(
                self.interface.decoder_memory(
                    source, lengths_to_mask(source_lengths, source.shape[1]), batch.langs_B
                )
            )
        if obj.decoder_objective == "clm":
            tags = torch.tensor(sp.lang_tags, device=batch.langs_B.device)[batch.langs_B]
            inputs, lengths = prepend_tokens(batch.tokens_BT, batch.lengths_B, tags)
            targets, _ = append_token(batch.tokens_BT, batch.lengths_B, sp.eos, sp.pad)
            targets = targets.masked_fill(~lengths_to_mask(lengths, targets.shape[1]), -100)
            causal = True
        else:
            inputs, lengths, targets = self._masked_with_eos(batch, generator)
            causal = False
        hidden = self.decoder(
            inputs,
            lengths_to_mask(lengths, inputs.shape[1]),
            batch.langs_B,
            memory.memory_BSD,
            memory.mask_BS,
            causal=causal,
        )
        selected = positions(targets != -100)
        wanted = targets.flatten()[selected]
        lm = output_cross_entropy(
            hidden.flatten(0, 1)[selected],
            *self.decoder.output_layer(),
            wanted,
            PRETRAINING_LABEL_SMOOTHING,
        )
        loss = lm.loss
        components = {f"dec_{obj.decoder_objective}": lm.loss.detach()}
        if obj.extractor_diversity:
            for name, value in memory.losses.items():
                loss = loss + obj.weight_of(name) * value
                components[f"dec_{name}"] = value.detach()
        metrics = {**memory.metrics, "dec_accuracy": lm.accuracy}
        return StageOutput(loss, components, metrics, int(wanted.numel()))

    def _encoder_codes(
        self,
        tokens_BT: torch.Tensor,
        lengths_B: torch.Tensor,
        langs_B: torch.Tensor,
        trained: bool,
        generator: torch.Generator,
    ) -> InterfaceMemory:
        """The interface's memory of the encoder's own output for ``tokens</s>`` (as the
        encoder reads a sentence): its codes (VQ) or its table rows (CL); the decoder
        stage's gradient reaches the encoder only when ``trained``, and never the VQ layer's
        weights. With ``decoder_continuous``, that share of the tokens, drawn from
        ``generator``, reads the output itself (all of them at 1, without a draw)."""
        tokens_BT, lengths_B = append_token(
            tokens_BT, lengths_B, self.special.eos, self.special.pad
        )
        mask_BT = lengths_to_mask(lengths_B, tokens_BT.shape[1])
        with torch.set_grad_enabled(trained and torch.is_grad_enabled()):
            hidden_BTD = self.encoder(tokens_BT, mask_BT, langs_B).hidden_BTD
        memory = self._normed(self.interface.features_memory(hidden_BTD, mask_BT, tokens_BT))
        share = self.objective.decoder_continuous
        if share >= 1:
            memory = dataclasses.replace(memory, memory_BSD=hidden_BTD)
        elif share > 0 and self.training:
            drawn = torch.rand(mask_BT.shape, generator=generator, device=generator.device)
            continuous = (drawn < share).to(hidden_BTD.device)[..., None]
            codes = memory.memory_BSD
            mixed = torch.where(continuous, hidden_BTD.to(codes.dtype), codes)
            memory = dataclasses.replace(memory, memory_BSD=mixed)
        return memory

    def _normed(self, memory: InterfaceMemory) -> InterfaceMemory:
        """The interface's memory through the encoder's final norm with
        ``decoder_memory_norm``, as the connected decoder's memory comes."""
        if not self.objective.decoder_memory_norm:
            return memory
        normed = through_final_norm(self.encoder, memory.memory_BSD)
        return dataclasses.replace(memory, memory_BSD=normed)

    def joint_loss(
        self,
        batch: SequenceBatch,
        generator: torch.Generator,
        substituted: SequenceBatch | None = None,
    ) -> StageOutput:
        """Algorithm 1: the same batch through both stages; their parameters are disjoint."""
        encoder = self.encoder_loss(batch, generator)
        return encoder + self.decoder_loss(batch, generator, substituted)

    # Parameter groups ---------------------------------------------------------------------

    def encoder_stage_parameters(self) -> list[nn.Parameter]:
        """What the encoder loss trains: encoder, MLM bias, encoder-side interface."""
        decoder_side = {id(p) for p in self.decoder_stage_parameters()}
        return [
            p
            for name, p in self.named_parameters()
            if not name.startswith("decoder.") and id(p) not in decoder_side
        ]

    def decoder_stage_parameters(self) -> list[nn.Parameter]:
        """What the decoder loss trains: decoder and decoder-side interface (VQ extractor)."""
        params = list(self.decoder.parameters()) if self.decoder is not None else []
        extractor = getattr(self.interface, "extractor", None)
        if extractor is not None:
            params += list(extractor.parameters())
        return params
