"""Fine-tuning pieces without the launcher: objectives, schedules, decode steps."""

from __future__ import annotations

import pytest
import torch

from megasemface.models.translation import TranslationModel
from megasemface.nn.config import build_model_config
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.training.schedules import parse_schedule, schedule_value

SPECIAL = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))


def _model(**options: float) -> TranslationModel:
    torch.manual_seed(0)
    config = build_model_config("tiny", ["vocab_size=50", "dropout=0", "attention_dropout=0"])
    return TranslationModel(config, SPECIAL, **options).eval()


def _batch(rows: list[list[int]], lang: int) -> SequenceBatch:
    lengths = torch.tensor([len(r) for r in rows])
    tokens = torch.full((len(rows), int(lengths.max())), SPECIAL.pad)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    return SequenceBatch(tokens, lengths, torch.full((len(rows),), lang))


def test_denoise_schedule_is_the_papers_piecewise_linear_weight() -> None:
    points = parse_schedule("0:1,100000:0.1,300000:0")
    assert schedule_value(points, 0) == 1.0
    assert schedule_value(points, 50_000) == pytest.approx(0.55)
    assert schedule_value(points, 100_000) == pytest.approx(0.1)
    assert schedule_value(points, 200_000) == pytest.approx(0.05)
    assert schedule_value(points, 10**7) == 0.0
    with pytest.raises(ValueError, match="STEP:VALUE"):
        parse_schedule("0:1,100")
    with pytest.raises(ValueError, match="increase"):
        parse_schedule("10:1,5:0")


def test_translation_loss_uses_tag_and_eos_and_padding_does_not_count() -> None:
    model = _model(label_smoothing=0.0)
    src = _batch([[10, 11, 12], [13, 14]], 0)
    tgt = _batch([[20, 21], [22, 23, 24, 25]], 1)
    out = model.translation_loss(src, tgt)
    assert out.num_targets == 2 + 1 + 4 + 1  # every target token and one </s> per row
    # The module's call, as DeepSpeed's engine makes it, runs the method it is given.
    assert torch.equal(model(model.translation_loss, src, tgt).loss, out.loss)
    # The loss of the padded batch equals the mean over the rows computed one by one.
    single = [
        model.translation_loss(_batch([s], 0), _batch([t], 1))
        for s, t in (([10, 11, 12], [20, 21]), ([13, 14], [22, 23, 24, 25]))
    ]
    mean = sum(o.loss * o.num_targets for o in single) / out.num_targets
    torch.testing.assert_close(out.loss, mean, rtol=1e-5, atol=1e-5)
    smoothed = _model(label_smoothing=0.1).translation_loss(src, tgt)
    assert smoothed.components["mt_nll"] == pytest.approx(out.components["mt_nll"].item())
    assert smoothed.loss.item() != pytest.approx(out.loss.item())


def test_decode_step_equals_teacher_forcing_at_the_last_position() -> None:
    model = _model(label_smoothing=0.1)
    src = _batch([[10, 11, 12], [13, 14, 15]], 0)
    mask = src.mask_BT
    memory = model.model.encode(src.tokens_BT, mask, src.langs_B)
    prefix = torch.tensor([[6, 20, 21], [6, 22, 23]])
    langs = torch.ones(2, dtype=torch.long)
    step = model.model.decode_step(prefix, langs, memory)
    hidden = model.model(
        src.tokens_BT, mask, src.langs_B, prefix, torch.ones_like(prefix, dtype=torch.bool), langs
    )
    expected = torch.log_softmax(model.model.decoder.logits(hidden[:, -1]), -1)
    torch.testing.assert_close(step, expected)


def test_unsupervised_loss_weights_denoising_and_adds_back_translation() -> None:
    model = _model(label_smoothing=0.0)
    mono = _batch([[10, 11, 12, 13], [14, 15]], 0)
    back = _batch([[30, 31], [32, 33, 34]], 1)
    gen = torch.Generator().manual_seed(1)
    only_bt = model.unsupervised_loss(mono, gen, back, 0.0)
    assert set(only_bt.components) == {"bt", "bt_nll"}
    both = model.unsupervised_loss(mono, torch.Generator().manual_seed(1), back, 0.5)
    dae = model.denoising_loss(mono, torch.Generator().manual_seed(1))
    torch.testing.assert_close(both.loss, 0.5 * dae.loss + only_bt.loss)
    with pytest.raises(ValueError, match="nothing to train"):
        model.unsupervised_loss(mono, gen, None, 0.0)
