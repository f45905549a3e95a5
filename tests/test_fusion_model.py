"""Deep fusion's model and losses against direct computations of the paper's equations, and
each fine-tuning loss's gradient confined to its partition of the parameters."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from megasemface.models.fusion import FusionTranslationModel, FusionWeights
from megasemface.nn.config import ModelConfig
from megasemface.nn.transformer import Seq2SeqModel
from megasemface.objectives.fusion_losses import (
    bag_of_words_loss,
    contrastive_loss,
    corrupt_sentences,
)
from megasemface.objectives.noising import IGNORE_INDEX, mask_for_mlm
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens

SPECIAL = SpecialTokens(pad=3, bos=0, eos=2, mask=4, lang_tags=(5, 6))


def tiny_fusion(part_layers: int = 2, decoder_layers: int = 2) -> ModelConfig:
    return ModelConfig(
        vocab_size=40,
        d_model=16,
        num_heads=2,
        ffn_dim=32,
        encoder_layers=part_layers * decoder_layers,
        decoder_layers=decoder_layers,
        dropout=0.0,
        attention_dropout=0.0,
        max_len=32,
        fusion="deep",
        fusion_part_layers=part_layers,
    )


def batch(rows: list[list[int]], lang: int) -> SequenceBatch:
    return SequenceBatch.from_rows(rows, SPECIAL.pad, lang)


SRC = batch([[10, 11, 12, 13], [14, 15], [16, 17, 18]], 0)
TGT = batch([[20, 21, 22], [23, 24, 25, 26, 27], [28, 29]], 1)
MONO = batch([[30, 31, 32, 33, 34, 35], [36, 37, 38, 39], [11, 12, 13, 14, 15]], 0)
"""MLM's monolingual sentences: not the pairs' sides."""


def ffn(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, module.fc1.weight, module.fc1.bias)), module.fc2.weight,
                    module.fc2.bias)  # fmt: skip


def test_coordinator_against_equations_10_to_13() -> None:
    torch.manual_seed(0)
    config = tiny_fusion(part_layers=2, decoder_layers=3)
    model = Seq2SeqModel(config).eval()
    coordinator = model.coordinator
    assert coordinator is not None
    batch_size, length, d = 2, 5, config.d_model
    layers = [torch.randn(batch_size, length, d) for _ in range(6)]
    mask = torch.tensor([[True] * 5, [True, True, True, False, False]])

    parts = coordinator.aggregated(layers)
    alpha = coordinator.attention(parts, mask)
    memories = coordinator.memories(parts, mask)
    for b in range(batch_size):
        real = int(mask[b].sum())
        # Eq. 10, part by part
        direct = []
        for n in range(3):
            summed = layers[2 * n][b] + layers[2 * n + 1][b]
            agg = F.layer_norm(
                ffn(coordinator.aggregate, summed), (d,),
                coordinator.aggregate_norm.weight, coordinator.aggregate_norm.bias,
            )  # fmt: skip
            direct.append(agg)
            torch.testing.assert_close(parts[b, n], agg)
        means = [r[:real].mean(0) for r in direct]
        for n in range(3):
            # Eq. 13 and 12
            e = torch.stack(
                [
                    F.linear(
                        torch.relu(coordinator.score_hidden(means[n] * means[k])),
                        coordinator.score_out.weight, coordinator.score_out.bias,
                    ).squeeze()
                    for k in range(3)
                ]
            )  # fmt: skip
            weights = torch.exp(e) / torch.exp(e).sum()
            torch.testing.assert_close(alpha[b, n], weights)
            # Eq. 11
            mixed = sum(weights[k] * direct[k] for k in range(3))
            torch.testing.assert_close(memories[b, n], ffn(coordinator.mapping, mixed))


def test_decoder_layer_n_reads_memory_n() -> None:
    """Eq. 14: changing C_2 changes nothing before decoder layer 2; a shared memory equals
    a layer-wise one whose entries are all that memory."""
    torch.manual_seed(0)
    config = tiny_fusion(part_layers=1, decoder_layers=2)
    decoder = Seq2SeqModel(config).eval().decoder
    tokens = torch.tensor([[5, 20, 21]])
    mask = torch.ones_like(tokens, dtype=torch.bool)
    memory = torch.randn(1, 4, config.d_model)
    memory_mask = torch.ones(1, 4, dtype=torch.bool)
    langs = torch.tensor([1])
    shared = decoder(tokens, mask, langs, memory, memory_mask)
    layer_wise = decoder(tokens, mask, langs, torch.stack([memory, memory], 1), memory_mask)
    torch.testing.assert_close(shared, layer_wise)
    other = torch.stack([memory, torch.randn_like(memory)], 1)
    assert not torch.allclose(decoder(tokens, mask, langs, other, memory_mask), shared)


def test_fused_model_translates_through_the_coordinator() -> None:
    torch.manual_seed(0)
    model = Seq2SeqModel(tiny_fusion()).eval()
    source = torch.tensor([[10, 11, 2]])
    memory = model.encode(source, torch.ones_like(source, dtype=torch.bool), torch.tensor([0]))
    assert memory.hidden_BTD.shape == (1, 2, 3, 16)
    log_probs = model.decode_step(torch.tensor([[6]]), torch.tensor([1]), memory)
    assert log_probs.shape == (1, 40) and torch.isfinite(log_probs).all()


def test_bag_of_words_loss_against_a_direct_computation() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 10)
    tokens = torch.tensor([[7, 8, 7, 3], [9, 2, 3, 3]])
    lengths = torch.tensor([3, 2])
    loss = bag_of_words_loss(logits, tokens, lengths, ignore_ids=(2, 3))
    log_p = torch.log_softmax(logits, -1)
    # bags: {7, 8} and {9} (2 is special)
    expected = -(log_p[0, 7] + log_p[0, 8] + log_p[1, 9]) / 3
    torch.testing.assert_close(loss, expected)


def test_contrastive_loss_against_a_direct_computation() -> None:
    torch.manual_seed(0)
    source, target, negative = torch.randn(3, 4), torch.randn(3, 4), torch.randn(2, 4)
    loss, accuracy = contrastive_loss(source, target, negative)
    candidates = torch.cat([target, negative])
    total = 0.0
    for i in range(3):
        sims = torch.stack([F.cosine_similarity(source[i], c, dim=0) for c in candidates])
        total += -torch.log(torch.exp(sims[i]) / torch.exp(sims).sum())
    torch.testing.assert_close(loss, total / 3)
    assert 0.0 <= float(accuracy) <= 1.0


def test_negatives_swap_replace_and_delete_half_the_words() -> None:
    tokens = torch.tensor([[10 + i for i in range(10)], [20, 21, 22, 23, 3, 3, 3, 3, 3, 3]])
    lengths = torch.tensor([10, 4])
    generator = torch.Generator().manual_seed(0)
    out, new_lengths = corrupt_sentences(
        tokens, lengths, generator, vocab_size=40, special_ids=SPECIAL.all, pad_id=3
    )
    again = corrupt_sentences(
        tokens, lengths, torch.Generator().manual_seed(0), vocab_size=40,
        special_ids=SPECIAL.all, pad_id=3,
    )  # fmt: skip
    torch.testing.assert_close(out, again[0])  # the step's generator decides
    for row in range(2):
        before, n = tokens[row, : lengths[row]].tolist(), int(lengths[row])
        after = out[row, : new_lengths[row]].tolist()
        # Deleted and replaced words are the only ones lost, and only the chosen half is.
        lost = sum((Counter(before) - Counter(after)).values())
        assert len(after) >= n - round(n / 2) and lost <= round(n / 2)
        assert (out[row, new_lengths[row] :] == 3).all()
        assert not set(after) & set(SPECIAL.all)
    assert out.shape == tokens.shape and (new_lengths <= lengths).all()
    assert not torch.equal(out, tokens)


def fusion_model(weights: FusionWeights | None = None) -> FusionTranslationModel:
    torch.manual_seed(0)
    return FusionTranslationModel(
        tiny_fusion(), SPECIAL, label_smoothing=0.1, weights=weights
    ).eval()


def negatives() -> SequenceBatch:
    return batch([[21, 20, 22], [23, 30]], 1)


@pytest.mark.parametrize(
    ("loss", "partitions"),
    [
        ("translation", {"decoder", "coordinator"}),
        ("words", {"coordinator", "ptm"}),
        ("sentence", {"coordinator", "ptm"}),
        ("mlm", {"ptm"}),
    ],
)
def test_each_loss_updates_only_its_partition(loss: str, partitions: set[str]) -> None:
    only = {field.name: 0.0 for field in dataclasses.fields(FusionWeights)}
    only[loss] = 1.0
    model = fusion_model(FusionWeights(**only))
    out = model.fusion_loss(SRC, TGT, negatives(), MONO, torch.Generator().manual_seed(1))
    out.loss.backward()
    groups = model.partitions()
    owner = {id(p): name for name, params in groups.items() for p in params}
    assert len(owner) == sum(1 for _ in model.parameters())  # every parameter has one
    reached = {
        owner[id(p)] for p in model.parameters() if p.grad is not None and p.grad.abs().sum() > 0
    }
    assert reached == partitions


def test_the_sum_is_the_weighted_direct_losses() -> None:
    """Eq. 18 with weights; the MLM component against a direct masked-LM computation, the
    translation component against the plain model's loss on the same inputs."""
    weights = FusionWeights(translation=1.0, words=0.5, sentence=2.0, mlm=0.25)
    model = fusion_model(weights)
    out = model.fusion_loss(SRC, TGT, negatives(), MONO, torch.Generator().manual_seed(1))
    parts = out.components
    expected = parts["mt"] + 0.5 * parts["twp"] + 2.0 * parts["tsp"] + 0.25 * parts["mlm"]
    torch.testing.assert_close(out.loss.detach(), expected)
    plain = model.translation_loss(SRC, TGT)
    torch.testing.assert_close(parts["mt"], plain.components["mt"])
    # MLM's term is MLM on the monolingual batch (the step's generator draws only its masks).
    mlm, _ = model.mlm_loss(MONO, torch.Generator().manual_seed(1))
    torch.testing.assert_close(parts["mlm"], mlm.detach())
    # TWP against Eq. 15-16 computed from the model's pieces
    layers, mask = model.ptm_layers(SRC)
    top = model.coordinator.aggregated(layers)[:, -1]
    pooled = torch.stack([top[b, : int(mask[b].sum())].mean(0) for b in range(3)])
    logits = pooled @ model.model.encoder.embed.tokens.weight.T + model.heads.words_bias
    log_p = torch.log_softmax(logits, -1)
    words = [set(r) for r in ([20, 21, 22], [23, 24, 25, 26, 27], [28, 29])]
    direct = -sum(log_p[b, w] for b, bag in enumerate(words) for w in bag) / 10
    torch.testing.assert_close(parts["twp"], direct)


def test_mlm_reads_the_monolingual_batch_against_a_direct_computation() -> None:
    """BERT's masking of the monolingual sentences with </s> appended, the PTM's hidden
    states at the masked positions against the tied word outputs plus MLM's bias."""
    model = fusion_model()
    with torch.no_grad():
        model.heads.mlm_bias.normal_()
    loss, _ = model.mlm_loss(MONO, torch.Generator().manual_seed(7))
    inputs, targets = mask_for_mlm(
        MONO.tokens_BT, MONO.lengths_B, mask_id=SPECIAL.mask, vocab_size=40,
        special_ids=SPECIAL.all, generator=torch.Generator().manual_seed(7), prob=0.15,
    )  # fmt: skip
    rows, total, count = MONO.tokens_BT.shape[0], 0.0, 0
    encoder = model.model.encoder
    for b in range(rows):
        n = int(MONO.lengths_B[b])
        tokens = torch.cat([inputs[b, :n], torch.tensor([SPECIAL.eos])])[None]
        hidden = encoder(tokens, torch.ones_like(tokens, dtype=torch.bool), MONO.langs_B[b : b + 1])
        logits = hidden.hidden_BTD[0] @ encoder.embed.tokens.weight.T + model.heads.mlm_bias
        for t in range(n):
            if targets[b, t] != IGNORE_INDEX:
                total = total - torch.log_softmax(logits[t], -1)[targets[b, t]]
                count += 1
    assert count > 0
    torch.testing.assert_close(loss, total / count)
    # The MLM term of the sum is this loss on the monolingual batch, not on the pairs.
    with pytest.raises(ValueError, match="monolingual sentences"):
        model.fusion_loss(SRC, TGT, negatives(), None, torch.Generator().manual_seed(1))


def test_weights_are_checked() -> None:
    with pytest.raises(ValueError, match="not all 0"):
        FusionWeights(0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match=">= 0"):
        FusionWeights(translation=-1.0)


def test_the_config_checks_the_parts() -> None:
    with pytest.raises(ValueError, match="one part of"):
        dataclasses.replace(tiny_fusion(), encoder_layers=3)


def test_the_unit_corrupts_half_the_targets() -> None:
    """TSP's synthetic negatives: ceil(B/2) targets picked by the step's generator, each
    corrupted, in the target language."""
    from megasemface.training.units.fusion import synthetic_negatives

    targets = batch([[20, 21, 22, 23], [24, 25], [26, 27, 28], [29, 30, 31], [32, 33]], 1)

    def made(seed: int) -> SequenceBatch:
        return synthetic_negatives(
            targets, torch.Generator().manual_seed(seed), vocab_size=40,
            special=SPECIAL.all, pad=SPECIAL.pad,
        )  # fmt: skip

    negatives = made(0)
    assert negatives.tokens_BT.shape[0] == 3 and (negatives.langs_B == 1).all()
    torch.testing.assert_close(negatives.tokens_BT, made(0).tokens_BT)
    assert any(not torch.equal(made(0).tokens_BT, made(seed).tokens_BT) for seed in (1, 2, 3))
