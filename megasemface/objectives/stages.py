"""Pre-training units: the SemFace encoder and decoder stages, and the mBART-style baseline.

``SemFaceModel`` holds the encoder, the semantic interface and (except for the XLM-style
baseline) the decoder. Its encoder loss touches only encoder and interface parameters, its
decoder loss only decoder parameters (plus the VQ feature extractor), so one backward pass
over their sum updates each part with its own loss, which is Algorithm 1 of the paper; the
separate stages run either loss alone.

Shapes: B batch, T length, N predicted tokens, D model size, V vocabulary.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
from torch import nn

from megasemface.interfaces.base import InterfaceMemory, SemanticInterface
from megasemface.models.config import ModelConfig
from megasemface.models.layers import positions
from megasemface.models.transformer import Seq2SeqModel, TransformerDecoder, TransformerEncoder
from megasemface.objectives.noising import (
    drop_and_shuffle,
    infill_spans,
    mask_for_mlm,
    permute_sentences,
)
from megasemface.objectives.output_loss import output_cross_entropy
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
    append_token,
    lengths_to_mask,
    prepend_tokens,
)
from megasemface.stages import stage

__all__ = [
    "DenoisingSeq2Seq",
    "ObjectiveConfig",
    "SemFaceModel",
    "StageOutput",
    "check_languages",
    "default_mse_weight",
    "teacher_forced_hidden",
    "teacher_forced_logits",
]


DECODER_CODES = ("extractor", "encoder", "encoder-trained")
"""The values of ``ObjectiveConfig.decoder_codes``."""


@dataclasses.dataclass(kw_only=True)
class ObjectiveConfig:
    """Pre-training objectives and loss weights."""

    mlm_prob: float = 0.15
    """Share of tokens predicted by MLM (80% masked, 10% random, 10% kept)."""
    decoder_objective: Literal["clm", "mlm"] = "clm"
    """Decoder stage loss: causal LM (Eq. 3) or masked LM over a bidirectional decoder (Eq. 2)."""
    decoder_noise: bool = True
    """Feed the interface a noised copy C(x) (word drop, local shuffle) in the decoder stage."""
    word_drop: float = 0.1
    shuffle_window: int = 3
    mse_weight: float | None = None
    """CL-SemFace: weight of the MSE term of Eq. 1 (0 for the 'without MSE' ablation);
    None: :func:`default_mse_weight` of the model's width."""
    diversity_weight: float = 2.0
    """VQ-SemFace: weight of the diversity loss (docs/reproduce.md measures 1 and 2)."""
    l2_weight: float = 1.0
    """VQ-SemFace: weight of the L2 penalty on the encoder's last activations."""
    commitment_weight: float = 0.0
    """VQ-SemFace, not in the paper: weight of a VQ-VAE-style commitment term pulling the
    encoder's output towards its argmax code, which is what the decoder stage was trained
    on and what it reads once the stages are connected. 0: the paper's losses only."""
    token_entropy_weight: float = 0.5
    """VQ-SemFace, not in the paper: weight of the mean entropy of each token's code
    distribution. The diversity loss asks the batch's average distribution to be uniform,
    which per-token distributions spread over many codes satisfy too; then the argmax falls
    on a few codes. Together the two maximise the mutual information between tokens and
    codes. On by default because it measured better on validation (docs/reproduce.md, the
    VQ codebook); 0 with diversity weight 1: the paper's losses only."""
    extractor_diversity: bool = False
    """VQ-SemFace, not in the paper: the decoder stage's feature extractor is trained with
    the diversity and token-entropy terms too (the encoder's weights), on the codes it picks
    from the fixed codebook. Without them only the decoder's loss trains it, and it picks a
    small part of the codebook, so the decoder's cross-attention is pre-trained on few of
    the codes the encoder uses."""
    decoder_codes: Literal["extractor", "encoder", "encoder-trained"] = "extractor"
    """VQ-SemFace: what picks the codes the decoder stage reads (train.py's default is
    ``encoder-trained`` for the joint stage, ``extractor`` for the separate stages, where it
    is the only choice). ``extractor``: the paper's feature extractor, trained by the
    decoder's loss. ``encoder`` (not in the paper): the encoder itself, without gradient,
    through the same VQ layer, so the decoder's cross-attention is pre-trained on the codes
    the encoder emits for the sentence. Each of the two otherwise learns its own assignment
    of the fixed codebook, and they pick the same code for under 1% of the tokens
    (docs/reproduce.md, the study budget).
    ``encoder-trained`` (not in the paper): the same, and the decoder's loss trains the
    encoder too, through the straight-through gradient of its codes (the codebook stays
    the encoder loss's), so the codes carry what the decoder needs to rebuild the sentence:
    the stages are then pre-trained together, as a denoising autoencoder through the codes
    beside the MLM, not separately. CL-SemFace: ``extractor`` is the table's rows of the
    noised copy (the paper's), ``encoder`` and ``encoder-trained`` the encoder's outputs for
    it, as the connected decoder reads them."""
    infill_ratio: float = 0.35
    """mBART baseline: share of tokens masked in Poisson spans."""
    poisson_lambda: float = 3.5
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.decoder_objective not in ("clm", "mlm"):
            raise ValueError(f"decoder_objective must be clm or mlm, got {self.decoder_objective}")
        if self.decoder_codes not in DECODER_CODES:
            raise ValueError(
                f"decoder_codes must be one of {', '.join(DECODER_CODES)}, got {self.decoder_codes}"
            )
        if not 0 < self.mlm_prob < 1:
            raise ValueError(f"mlm_prob must be in (0, 1), got {self.mlm_prob}")

    def for_width(self, d_model: int) -> ObjectiveConfig:
        """This config with the width-dependent defaults resolved for ``d_model``."""
        if self.mse_weight is not None:
            return self
        return dataclasses.replace(self, mse_weight=default_mse_weight(d_model))

    def weight_of(self, loss_name: str) -> float:
        weights = {
            "mse": self.mse_weight,
            "diversity": self.diversity_weight,
            "l2": self.l2_weight,
            "commitment": self.commitment_weight,
            "token_entropy": self.token_entropy_weight,
        }
        weight = weights[loss_name]
        if weight is None:
            raise ValueError(f"{loss_name} weight unresolved: call for_width(d_model) first")
        return weight


MSE_FULL_WIDTH = 128
"""The widest model at which CL-SemFace's MSE term keeps the weight 1 by default."""


def default_mse_weight(d_model: int) -> float:
    """CL-SemFace's MSE weight by default: 1 up to d_model 128 (the demo's and the study's
    widths, where it was chosen), 0.01 wider.

    Eq. 1's squared distance is summed over the dimensions, so it grows with the width while
    the MLM does not: at d 1,024 it is about 1,300 nats a token against the MLM's 9, and
    with weight 1 the encoder's validation MLM stayed above the uniform guess after 100
    steps (10.4 against 8.99; 8.7 with 0.01, 7.8 with 1/1,024, 7.5 without the term; XLM
    6.9). docs/reproduce.md, "The encoders at the paper's scale".
    """
    return 1.0 if d_model <= MSE_FULL_WIDTH else 0.01


@dataclasses.dataclass
class StageOutput:
    """A loss to back-propagate, its detached components and metrics.

    Components and tensor metrics stay on the device until a logging step reads them, so a
    step waits for the device only where its control flow needs a value."""

    loss: torch.Tensor
    components: dict[str, torch.Tensor]
    metrics: dict[str, float | torch.Tensor]
    num_targets: int

    def __add__(self, other: StageOutput) -> StageOutput:
        return StageOutput(
            self.loss + other.loss,
            {**self.components, **other.components},
            {**self.metrics, **other.metrics},
            self.num_targets + other.num_targets,
        )


def check_languages(config: ModelConfig, special: SpecialTokens) -> None:
    """The model has one language embedding per language tag of the tokenizer."""
    if len(special.lang_tags) != config.num_langs:
        raise ValueError(
            f"the tokenizer has {len(special.lang_tags)} languages, the model config "
            f"{config.num_langs}"
        )


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
            self.objective.label_smoothing,
        )
        loss = mlm.loss
        components = {"enc_mlm": mlm.loss.detach()}
        for name, value in head.losses.items():
            loss = loss + self.objective.weight_of(name) * value
            components[f"enc_{name}"] = value.detach()
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
                drop_prob=obj.word_drop,
                shuffle_window=obj.shuffle_window,
            )
        if obj.decoder_codes != "extractor":
            trained = obj.decoder_codes == "encoder-trained"
            memory = self._encoder_codes(source, source_lengths, batch.langs_B, trained)
        else:
            memory = self.interface.decoder_memory(
                source, lengths_to_mask(source_lengths, source.shape[1]), batch.langs_B
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
            obj.label_smoothing,
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
    ) -> InterfaceMemory:
        """The interface's memory of the encoder's own output for ``tokens</s>`` (as the
        encoder reads a sentence): its codes (VQ) or the output itself (CL); the decoder
        stage's gradient reaches the encoder only when ``trained``, and never the VQ layer's
        weights."""
        tokens_BT, lengths_B = append_token(
            tokens_BT, lengths_B, self.special.eos, self.special.pad
        )
        mask_BT = lengths_to_mask(lengths_B, tokens_BT.shape[1])
        with torch.set_grad_enabled(trained and torch.is_grad_enabled()):
            hidden_BTD = self.encoder(tokens_BT, mask_BT, langs_B).hidden_BTD
        return self.interface.features_memory(hidden_BTD, mask_BT)

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


def teacher_forced_hidden(
    model: Seq2SeqModel, special: SpecialTokens, src: SequenceBatch, tgt: SequenceBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoder states [N, D] and targets [N] of ``tgt`` given ``src``: the encoder reads
    ``src </s>``, the decoder ``<tgt lang> tgt`` and predicts ``tgt </s>`` (N: target tokens
    and </s>)."""
    sp = special
    source, source_lengths = append_token(src.tokens_BT, src.lengths_B, sp.eos, sp.pad)
    tags = torch.tensor(sp.lang_tags, device=tgt.langs_B.device)[tgt.langs_B]
    inputs, lengths = prepend_tokens(tgt.tokens_BT, tgt.lengths_B, tags)
    targets, _ = append_token(tgt.tokens_BT, tgt.lengths_B, sp.eos, sp.pad)
    target_mask = lengths_to_mask(lengths, targets.shape[1])
    selected = positions(target_mask)
    hidden = model(
        source,
        lengths_to_mask(source_lengths, source.shape[1]),
        src.langs_B,
        inputs,
        target_mask,
        tgt.langs_B,
    )
    return hidden.flatten(0, 1)[selected], targets.flatten()[selected]


def teacher_forced_logits(
    model: Seq2SeqModel, special: SpecialTokens, src: SequenceBatch, tgt: SequenceBatch
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [N, V] and targets [N] of :func:`teacher_forced_hidden`."""
    hidden, targets = teacher_forced_hidden(model, special, src, tgt)
    return model.decoder.logits(hidden), targets


class DenoisingSeq2Seq(nn.Module):
    """The mBART-style baseline: the whole encoder-decoder trained to reconstruct a sentence
    from a copy with Poisson(3.5) spans over 35% of tokens infilled (one mask per span) and
    sentences permuted, with the language tag starting the decoder."""

    def __init__(
        self,
        config: ModelConfig,
        special: SpecialTokens,
        objective: ObjectiveConfig | None = None,
        boundary_ids: tuple[int, ...] = (),
    ) -> None:
        super().__init__()
        self.config = config
        self.special = special
        self.objective = objective or ObjectiveConfig()
        self.boundary_ids = boundary_ids
        self.model = Seq2SeqModel(config)

    def forward(self, batch: SequenceBatch, generator: torch.Generator) -> StageOutput:
        return self.loss(batch, generator)

    def external_parameters(self) -> list[nn.Parameter]:
        """The tied output layer, read outside the decoder's forward (see SemFaceModel)."""
        return [self.model.decoder.embed.tokens.weight, self.model.decoder.output_bias]

    def loss(self, batch: SequenceBatch, generator: torch.Generator) -> StageOutput:
        sp, obj = self.special, self.objective
        source, source_lengths = batch.tokens_BT, batch.lengths_B
        if self.boundary_ids:
            source, source_lengths = permute_sentences(
                source,
                source_lengths,
                boundary_ids=self.boundary_ids,
                pad_id=sp.pad,
                generator=generator,
            )
        source, source_lengths = infill_spans(
            source,
            source_lengths,
            mask_id=sp.mask,
            pad_id=sp.pad,
            generator=generator,
            ratio=obj.infill_ratio,
            poisson_lambda=obj.poisson_lambda,
        )
        hidden, wanted = teacher_forced_hidden(
            self.model, sp, SequenceBatch(source, source_lengths, batch.langs_B), batch
        )
        out = output_cross_entropy(
            hidden, *self.model.decoder.output_layer(), wanted, obj.label_smoothing
        )
        return StageOutput(
            out.loss,
            {"denoise": out.loss.detach()},
            {"denoise_accuracy": out.accuracy},
            int(wanted.numel()),
        )
