"""The model FLOPs of a training step from its shapes (megasemface/training/model_flops.py)
equal what torch's FlopCounterMode counts (megasemface/flop_count.py) when the tiny models run
that step: every stage, both VQ layouts and both kinds of logits, the connected model's
bridge. Where a shape is drawn on the device (a noised copy), noise is off, or the formula's
bound is checked.
"""

from __future__ import annotations

import pytest
import torch

from megasemface.flop_count import flop_counter
from megasemface.interfaces.factory import build_interface
from megasemface.models.denoising import DenoisingSeq2Seq
from megasemface.models.semface import SemFaceModel
from megasemface.models.translation import TranslationModel
from megasemface.models.veco import VecoSeq2Seq
from megasemface.nn.config import ModelConfig, build_model_config
from megasemface.objectives.objective import ObjectiveConfig, StageOutput
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.training import model_flops

SPECIAL = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))


def tiny(*overrides: str) -> ModelConfig:
    return build_model_config("tiny", ["vocab_size=160", "vq.num_codes=96", *overrides])


def sentences(config: ModelConfig, seed: int, batch: int = 5, length: int = 11) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(7, config.vocab_size, (batch, length), generator=g)
    lengths = torch.randint(3, length + 1, (batch,), generator=g)
    lengths[0] = length  # the padded width is the longest sentence's
    tokens[torch.arange(length)[None] >= lengths[:, None]] = SPECIAL.pad
    return SequenceBatch(tokens, lengths, torch.randint(0, 2, (batch,), generator=g))


def counted(step) -> tuple[float, StageOutput]:  # type: ignore[no-untyped-def]
    """FlopCounterMode's count of ``step()``'s forward and backward, and its output."""
    with flop_counter() as counter:
        out = step()
        out.loss.backward()
    return float(counter.get_total_flops()), out


@pytest.mark.parametrize(
    ("interface", "stage", "codes", "overrides"),
    [
        ("none", "encoder", "extractor", ()),
        ("cl", "encoder", "extractor", ()),
        ("vq", "encoder", "extractor", ()),
        ("vq", "encoder", "extractor", ("vq.logits=mlp",)),
        ("vq", "encoder", "extractor", ("vq.layout=product", "vq.entries=12")),
        ("vq", "decoder", "extractor", ()),
        ("cl", "decoder", "extractor", ()),
        ("vq", "joint", "encoder-trained", ()),
        ("vq", "joint", "encoder", ("vq.logits=mlp",)),
        ("vq", "joint", "extractor", ()),
        ("cl", "joint", "encoder-trained", ()),
    ],
)
def test_semface_steps(interface: str, stage: str, codes: str, overrides: tuple[str, ...]) -> None:
    config = tiny(*overrides)
    torch.manual_seed(0)
    table = torch.randn(config.vocab_size, config.d_model) * 0.3
    built = build_interface(interface, config, cl_table=table if interface == "cl" else None)
    # CL on the encoder's outputs: all of them (train.py's default) or half, the rows at the
    # rest; a share below 1 costs the same, as the rows' gradient is zero, not absent.
    shares = (1.0, 0.5) if interface == "cl" and codes != "extractor" else (0.0,)
    for share in shares:
        objective = ObjectiveConfig(
            decoder_noise=False,
            decoder_codes=codes,  # type: ignore[arg-type]
            decoder_continuous=share,
        )
        model = SemFaceModel(config, built, SPECIAL, objective).train()
        model.stage = stage  # type: ignore[assignment]
        if stage == "decoder" and interface == "vq":
            model.interface.quantizer.freeze()  # as the decoder stage's unit loads it
        batch = sentences(config, 1)
        flops, out = counted(lambda m=model, b=batch: m(b, torch.Generator().manual_seed(2)))
        formula = model_flops.semface_step(
            config,
            interface=interface,
            stage=stage,
            decoder_codes=codes,
            batch=batch.tokens_BT.shape[0],
            length=batch.tokens_BT.shape[1],
            tokens=int(batch.lengths_B.sum()),
        ) + model_flops.output_layer(config, out.num_targets)
        assert formula == flops, share


@pytest.mark.parametrize(
    "overrides", [(), ("bridge=codebook",), ("bridge=codebook", "vq.logits=mlp")]
)
def test_translation_step(overrides: tuple[str, ...]) -> None:
    config = tiny(*overrides)
    torch.manual_seed(0)
    model = TranslationModel(config, SPECIAL, label_smoothing=0.1).train()
    src, tgt = sentences(config, 3, length=9), sentences(config, 4, length=12)
    flops, out = counted(lambda: model.translation_loss(src, tgt))
    formula = model_flops.seq2seq_body(config, 5, 9, 12)
    assert formula + model_flops.output_layer(config, out.num_targets) == flops


def test_unsupervised_step_without_noise() -> None:
    config = tiny()
    torch.manual_seed(0)
    model = TranslationModel(
        config, SPECIAL, label_smoothing=0.1, word_drop=0.0, shuffle_window=0
    ).train()
    mono, back = sentences(config, 5, length=10), sentences(config, 6, length=7)
    generator = torch.Generator().manual_seed(0)
    flops, out = counted(lambda: model.unsupervised_loss(mono, generator, back, 0.5))
    body = model_flops.seq2seq_body(config, 5, 10, 10) + model_flops.seq2seq_body(config, 5, 7, 10)
    assert body + model_flops.output_layer(config, out.num_targets) == flops


def test_veco_step() -> None:
    config = tiny()
    torch.manual_seed(0)
    model = VecoSeq2Seq(config, SPECIAL).train()
    x, y = sentences(config, 7, length=8), sentences(config, 8, length=10)
    flops, out = counted(lambda: model(x, y, torch.Generator().manual_seed(0)))
    formula = model_flops.veco_body(config, 5, 10)
    assert formula + model_flops.output_layer(config, out.num_targets) == flops


def test_mbart_step_is_bounded_by_the_source_width() -> None:
    """Span infilling shortens the source on the device: the formula takes the sentence's
    width, an upper bound a few percent above the count."""
    config = tiny()
    torch.manual_seed(0)
    model = DenoisingSeq2Seq(config, SPECIAL).train()
    batch = sentences(config, 9, length=12)
    flops, out = counted(lambda: model(batch, torch.Generator().manual_seed(0)))
    formula = model_flops.seq2seq_body(config, 5, 12, 12)
    formula += model_flops.output_layer(config, out.num_targets)
    assert flops < formula < 1.3 * flops
