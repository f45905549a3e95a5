"""VECO's objectives against a direct computation on tiny inputs: the masking, the four
terms from the model's pieces, cross-sequence MLM reading the other sequence only through
cross-attention, the stop-gradient into the encoder, and the segments of monolingual text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from megasemface.models.veco import VecoSeq2Seq
from megasemface.nn.config import ModelConfig, build_model_config
from megasemface.objectives.noising import mask_for_mlm
from megasemface.objectives.objective import ObjectiveConfig
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.objectives.veco import split_segments

SPECIAL = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))


def tiny() -> ModelConfig:
    return build_model_config("tiny", ["vocab_size=120", "dropout=0.0"])


def sentences(seed: int, batch: int = 5, length: int = 8, lang: int = 0) -> SequenceBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(7, 120, (batch, length), generator=g)
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    tokens[torch.arange(length)[None] >= lengths[:, None]] = SPECIAL.pad
    return SequenceBatch(tokens, lengths, torch.full((batch,), lang, dtype=torch.long))


def pair(seed: int = 0) -> tuple[SequenceBatch, SequenceBatch]:
    return sentences(seed, length=8, lang=0), sentences(seed + 100, length=6, lang=1)


def veco(**objective: object) -> VecoSeq2Seq:
    torch.manual_seed(0)
    return VecoSeq2Seq(tiny(), SPECIAL, ObjectiveConfig(**objective)).eval()  # type: ignore[arg-type]


def masked(side: SequenceBatch, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return mask_for_mlm(
        side.tokens_BT,
        side.lengths_B,
        mask_id=SPECIAL.mask,
        vocab_size=120,
        special_ids=SPECIAL.all,
        generator=generator,
    )


def by_hand(model: VecoSeq2Seq, x: SequenceBatch, y: SequenceBatch, seed: int) -> dict:
    """The four terms from the model's pieces, each sequence through its own calls: the
    encoder reads ``x̂ </s>``; the decoder reads ``<lang y> ŷ`` over the encoder's final
    states of ``x̂ </s>`` and predicts, at position t, y's token t where it was masked."""
    g = torch.Generator().manual_seed(seed)
    sides = {"x": (x, *masked(x, g)), "y": (y, *masked(y, g))}  # x is masked first
    seq2seq, out = model.model, {}
    states = {}
    for name, (side, inputs, targets) in sides.items():
        rows = torch.arange(len(side.lengths_B))
        tokens = torch.cat([inputs, torch.full_like(inputs[:, :1], SPECIAL.pad)], 1)
        tokens[rows, side.lengths_B] = SPECIAL.eos
        mask = torch.arange(tokens.shape[1])[None] <= side.lengths_B[:, None]
        hidden = seq2seq.encoder(tokens, mask, side.langs_B).hidden_BTD
        states[name] = (hidden, mask)
        chosen = hidden[:, :-1][targets != -100]
        logits = chosen @ seq2seq.encoder.embed.tokens.weight.t() + model.mlm_bias
        out[f"is_{name}"] = F.cross_entropy(logits, targets[targets != -100])
    for name, other in (("y", "x"), ("x", "y")):
        side, inputs, targets = sides[name]
        memory, memory_mask = states[other]
        tags = torch.tensor(SPECIAL.lang_tags)[side.langs_B]
        tokens = torch.cat([tags[:, None], inputs], 1)
        mask = torch.arange(tokens.shape[1])[None] <= side.lengths_B[:, None]
        hidden = seq2seq.decoder(
            tokens, mask, side.langs_B, memory.detach(), memory_mask, causal=True
        )
        logits = seq2seq.decoder.logits(hidden[:, :-1][targets != -100])
        out[f"cs_{name}"] = F.cross_entropy(logits, targets[targets != -100])
    out["targets"] = sum(int((t != -100).sum()) for _, _, t in sides.values())
    return out


def test_the_masking_is_bert_s_at_the_configured_rate() -> None:
    """15% of each side's tokens predicted (at least one per sentence), 80% of them
    [MASK], 10% random and 10% kept; IS and CS predict the same tokens (one mask)."""
    model = veco()
    side = sentences(0, batch=400, length=40)
    generator = torch.Generator().manual_seed(1)
    m = model.mask(side, generator)
    predicted = m.targets_BT != -100
    expected = torch.round(side.lengths_B * 0.15).clamp(min=1)
    assert torch.equal(predicted.sum(1), expected)
    chosen = m.inputs_BT[predicted]
    original = m.targets_BT[predicted]
    shares = [
        (chosen == SPECIAL.mask).float().mean().item(),
        ((chosen != SPECIAL.mask) & (chosen != original)).float().mean().item(),
        (chosen == original).float().mean().item(),
    ]
    # About 1,300 predicted tokens: three standard deviations of each share.
    assert shares == pytest.approx([0.8, 0.1, 0.1], abs=0.035)
    assert torch.equal(m.inputs_BT[~predicted], side.tokens_BT[~predicted])
    assert not set(chosen.tolist()) & {SPECIAL.pad, SPECIAL.bos, SPECIAL.eos, *SPECIAL.lang_tags}
    x, y = pair()
    out = model.loss(x, y, torch.Generator().manual_seed(3))
    assert out.num_targets == 2 * by_hand(model, x, y, 3)["targets"]  # IS and CS, same tokens


def test_the_loss_is_the_sum_of_the_four_terms_computed_by_hand() -> None:
    model = veco()
    x, y = pair()
    out = model.loss(x, y, torch.Generator().manual_seed(3))
    expected = by_hand(model, x, y, 3)
    for name in ("is_x", "is_y", "cs_x", "cs_y"):
        key = name.replace("_", "_mlm_")
        torch.testing.assert_close(out.components[key], expected[name].detach(), msg=key)
    total = expected["is_x"] + expected["is_y"] + expected["cs_x"] + expected["cs_y"]
    torch.testing.assert_close(out.loss, total)
    mean_cs = (expected["cs_x"] + expected["cs_y"]).detach() / 2
    torch.testing.assert_close(out.components["cs_mlm"], mean_cs)


def test_cs_mlm_reads_the_other_sequence_only_through_cross_attention() -> None:
    """Another x of the same lengths (so the same masks) changes CS(x, y) through the memory
    alone: the decoder's tokens are y's whatever x is, and with cross-attention switched off
    (its output projection zeroed), or with the memory replaced, x no longer matters."""
    model = veco()
    x, y = pair()
    other = SequenceBatch((x.tokens_BT * 7 + 11) % 113 + 7, x.lengths_B, x.langs_B)
    other.tokens_BT[x.tokens_BT == SPECIAL.pad] = SPECIAL.pad
    assert not torch.equal(other.tokens_BT, x.tokens_BT)

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module: torch.nn.Module, args: tuple) -> None:
        seen.append((args[0][: len(y.lengths_B)].clone(), args[3][: len(y.lengths_B)].clone()))

    handle = model.model.decoder.register_forward_pre_hook(record)
    cs_y = [
        model.loss(s, y, torch.Generator().manual_seed(3)).components["cs_mlm_y"]
        for s in (x, other)
    ]
    handle.remove()
    assert not torch.allclose(cs_y[0], cs_y[1])
    (tokens_a, memory_a), (tokens_b, memory_b) = seen
    assert torch.equal(tokens_a, tokens_b) and not torch.allclose(memory_a, memory_b)

    def zero_memory(module: torch.nn.Module, args: tuple) -> tuple:
        return (*args[:3], torch.zeros_like(args[3]), *args[4:])

    handle = model.model.decoder.register_forward_pre_hook(zero_memory)
    replaced = [model.loss(s, y, torch.Generator().manual_seed(3)) for s in (x, other)]
    handle.remove()
    torch.testing.assert_close(
        replaced[0].components["cs_mlm_y"], replaced[1].components["cs_mlm_y"], rtol=0, atol=0
    )
    assert not torch.allclose(
        replaced[0].components["is_mlm_x"], replaced[1].components["is_mlm_x"]
    )

    with torch.no_grad():
        for layer in model.model.decoder.layers:
            layer.cross_attn.out_proj.weight.zero_()
            layer.cross_attn.out_proj.bias.zero_()
    cut = [
        model.loss(s, y, torch.Generator().manual_seed(3)).components["cs_mlm_y"]
        for s in (x, other)
    ]
    torch.testing.assert_close(cut[0], cut[1], rtol=0, atol=0)


def test_cs_mlm_predicts_only_the_masked_tokens_of_its_sequence() -> None:
    """Changing a token of y that is neither predicted nor before a predicted one leaves
    CS(x, y) as it is; changing a predicted one changes it."""
    model = veco()
    x, y = pair()
    _, targets = masked(y, _after_x(x, 3))
    row = 0
    predicted = (targets[row] != -100).nonzero().flatten().tolist()
    last = int(y.lengths_B[row]) - 1
    assert predicted and last not in predicted, "pick a seed whose row 0 ends unpredicted"

    def cs_y(tokens: torch.Tensor) -> torch.Tensor:
        side = SequenceBatch(tokens, y.lengths_B, y.langs_B)
        return model.loss(x, side, torch.Generator().manual_seed(3)).components["cs_mlm_y"]

    base = cs_y(y.tokens_BT)
    tail = y.tokens_BT.clone()
    tail[row, last] = 7 + (int(tail[row, last]) - 6) % 113  # read by no prediction of y
    torch.testing.assert_close(cs_y(tail), base, rtol=0, atol=0)
    target = y.tokens_BT.clone()
    target[row, predicted[0]] = 7 + (int(target[row, predicted[0]]) - 6) % 113
    assert not torch.allclose(cs_y(target), base)


def _after_x(x: SequenceBatch, seed: int) -> torch.Generator:
    """The step's generator as it is once x is masked (y's mask comes next)."""
    g = torch.Generator().manual_seed(seed)
    masked(x, g)
    return g


def test_no_gradient_reaches_the_encoder_from_cs_mlm() -> None:
    """VECO's stop-gradient: CS-MLM trains the decoder only and IS-MLM the encoder only, so
    the gradients of the summed loss are, part by part, those of its own terms."""
    model = veco()
    x, y = pair()
    terms = model.forward_terms(x, y, torch.Generator().manual_seed(3))
    encoder = list(model.model.encoder.parameters())
    decoder = list(model.model.decoder.parameters())
    cs = torch.autograd.grad(terms.cs_x + terms.cs_y, encoder, allow_unused=True)
    assert all(g is None or not g.any() for g in cs)
    is_grads = torch.autograd.grad(terms.is_x + terms.is_y, decoder, allow_unused=True)
    assert all(g is None or not g.any() for g in is_grads)
    cs_decoder = torch.autograd.grad(terms.cs_x + terms.cs_y, decoder, allow_unused=True)
    trained = [g is not None and bool(g.any()) for g in cs_decoder]
    assert all(trained), "every decoder parameter, cross-attention included, learns from CS"


def test_monolingual_segments_are_the_two_halves_of_each_sentence() -> None:
    tokens = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 3, 3, 3], [30, 3, 3, 3, 3]])
    lengths = torch.tensor([5, 2, 1])
    x, y = split_segments(tokens, lengths, pad_id=3)
    assert x.lengths_B.tolist() == [3, 1, 1] and y.lengths_B.tolist() == [2, 1, 0]
    assert x.tokens_BT.tolist() == [[10, 11, 12], [20, 3, 3], [30, 3, 3]]
    assert y.tokens_BT.tolist() == [[13, 14], [21, 3], [3, 3]]
    # A batch of one-token sentences has nothing for y's terms: they count 0, not NaN.
    x, y = split_segments(tokens[2:], lengths[2:], pad_id=3)
    out = veco().loss(x, y, torch.Generator().manual_seed(0))
    assert torch.isfinite(out.loss) and float(out.components["is_mlm_y"]) == 0.0


def test_both_kinds_of_batch_call_the_same_modules_in_the_same_order() -> None:
    """Under ZeRO-3 every module call gathers weights over the ranks: a rank that drew a
    monolingual batch and one that drew a parallel batch must call the same modules."""
    model = veco()
    calls: list[str] = []
    handles = [
        module.register_forward_pre_hook(lambda m, a, name=name: calls.append(name))
        for name, module in model.named_modules()
    ]
    x, y = pair()
    model(x, y, torch.Generator().manual_seed(0))
    parallel, calls[:] = list(calls), []
    mono = sentences(5, batch=3, length=12)
    halves = split_segments(mono.tokens_BT, mono.lengths_B, SPECIAL.pad)
    model(*halves, torch.Generator().manual_seed(0))
    for handle in handles:
        handle.remove()
    assert calls == parallel and "model.decoder" in calls


def test_the_codebook_bridge_is_refused() -> None:
    config = build_model_config("tiny", ["vocab_size=120", "bridge=codebook"])
    with pytest.raises(ValueError, match="leave bridge at none"):
        VecoSeq2Seq(config, SPECIAL)


def test_the_unit_makes_pairs_of_parallel_batches_and_halves_of_monolingual_ones(
    spm_model: Path, tmp_path: Path
) -> None:
    """A parallel batch's (x, y) are its sides in their languages; a monolingual batch's the
    two halves of each sentence in the batch's language; every side is cut to what the model
    takes (``max_len - 1``: room for ``</s>`` or the language tag)."""
    from megasemface.data.loading.loader import TokenBatch
    from megasemface.data.shards.shard_format import Manifest, PairLayout
    from megasemface.data.text.tokenizer import Tokenizer
    from megasemface.distributed.groups import ParallelGroups
    from megasemface.training.options import TrainConfig
    from megasemface.training.run_data import RunData
    from megasemface.training.units.veco import VecoUnit

    tokenizer = Tokenizer.load(spm_model)
    sep = tokenizer.eos_id
    layout = PairLayout("en", "de", sep, 2 * 150 + 1)
    manifest = Manifest(
        tmp_path, (), tokenizer.vocab_size, tokenizer.sha256, {"en": {}, "de": {}, "en-de": {}},
        {}, {"en-de": layout},
    )  # fmt: skip
    data = RunData(manifest, tokenizer, SpecialTokens.from_tokenizer(tokenizer))
    config = TrainConfig(stage="veco", interface="none", data=tmp_path, spm_model=spm_model,
                         output_dir=tmp_path)  # fmt: skip
    torch.manual_seed(0)
    unit = VecoUnit(config, data, ParallelGroups.single())
    assert unit.loader_max_len() == 301  # the longest pair, never cropped by the loader
    en, de = (tokenizer.languages.index(lang) for lang in ("en", "de"))

    def batch(lang: str, rows: list[list[int]]) -> TokenBatch:
        lengths = torch.tensor([len(r) for r in rows])
        tokens = torch.full((len(rows), int(lengths.max())), tokenizer.pad_id)
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
        ids = torch.zeros(len(rows), dtype=torch.long)
        return TokenBatch(lang, tokens, lengths, ids, ids, 0)

    long_source = list(range(100, 300))  # 200 tokens, over the model's 128
    x, y = unit.pairs(batch("en-de", [[10, 11, sep, 12, 13, 14], [*long_source, sep, 15]]))
    limit = unit.model_config.max_len - 1
    assert x.lengths_B.tolist() == [2, limit] and y.lengths_B.tolist() == [3, 1]
    assert x.tokens_BT[0, :2].tolist() == [10, 11] and y.tokens_BT[0].tolist() == [12, 13, 14]
    assert x.tokens_BT[1].tolist() == long_source[:limit]
    assert x.langs_B.tolist() == [en, en] and y.langs_B.tolist() == [de, de]
    x, y = unit.pairs(batch("de", [[20, 21, 22], [23]]))
    assert x.tokens_BT.tolist() == [[20, 21], [23, tokenizer.pad_id]]
    assert y.lengths_B.tolist() == [1, 0] and y.tokens_BT[0, 0] == 22
    assert x.langs_B.tolist() == y.langs_B.tolist() == [de, de]
