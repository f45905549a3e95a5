"""Pre-training stages: losses against their formulas, gradient routing, and smoke runs."""

from __future__ import annotations

import collections
import math
import traceback
from pathlib import Path

import pytest
import torch

from megasemface.data.loading.loader import LoaderConfig, ShardLoader, ShardSource
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.shards.shard_format import Manifest
from megasemface.data.text.textio import parse_lang_path
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.evaluation.diagnostics.figures import teacher_forced_nll
from megasemface.interfaces.factory import build_interface
from megasemface.models.denoising import DenoisingSeq2Seq
from megasemface.models.semface import SemFaceModel
from megasemface.nn.config import ModelConfig, build_model_config
from megasemface.nn.transformer import EncoderOutput
from megasemface.objectives.noising import drop_and_shuffle, mask_for_mlm
from megasemface.objectives.objective import ObjectiveConfig, default_mse_weight
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
    append_token,
    lengths_to_mask,
)

SPECIAL = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))


def tiny(**overrides: object) -> ModelConfig:
    items = [f"{k}={v}" for k, v in {"vocab_size": 120, "dropout": 0.0, **overrides}.items()]
    return build_model_config("tiny", items)


def random_batch(config: ModelConfig, seed: int = 0, batch: int = 6, length: int = 9):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(7, config.vocab_size, (batch, length), generator=g)
    lengths = torch.randint(2, length + 1, (batch,), generator=g)
    tokens[torch.arange(length)[None] >= lengths[:, None]] = SPECIAL.pad
    return SequenceBatch(tokens, lengths, torch.randint(0, 2, (batch,), generator=g))


def model_for(
    kind: str,
    config: ModelConfig,
    cl_unit_logits: bool = False,
    cl_unit_mse: bool = False,
    **objective: object,
) -> SemFaceModel:
    torch.manual_seed(0)
    table = torch.randn(config.vocab_size, config.d_model) * 0.3
    cl_table = table if kind == "cl" else None
    interface = build_interface(
        kind, config, cl_table=cl_table, cl_unit_logits=cl_unit_logits, cl_unit_mse=cl_unit_mse
    )
    return SemFaceModel(config, interface, SPECIAL, ObjectiveConfig(**objective))  # type: ignore[arg-type]


def test_mse_weight_follows_the_width_unless_given() -> None:
    """CL-SemFace's MSE, summed over the dimensions, keeps weight 1 up to d 128 and 0.01
    wider by default; a weight given (0 for the ablation) is kept at any width."""
    assert [default_mse_weight(d) for d in (64, 128, 256, 1024)] == [1.0, 1.0, 0.01, 0.01]
    paper = build_model_config("paper", ["vocab_size=120", "encoder_layers=1"])
    special = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))
    with torch.device("meta"):
        table = torch.empty(paper.vocab_size, paper.d_model)
        interface = build_interface("cl", paper, cl_table=table)
        wide = SemFaceModel(paper, interface, special)
        given = SemFaceModel(paper, interface, special, ObjectiveConfig(mse_weight=0.0))
    assert wide.objective.weight_of("mse") == 0.01 and given.objective.weight_of("mse") == 0.0
    assert model_for("cl", tiny()).objective.weight_of("mse") == 1.0


@pytest.mark.parametrize(("unit_logits", "unit_mse"), [(False, False), (True, False), (True, True)])
def test_cl_encoder_loss_is_eq_1(unit_logits: bool, unit_mse: bool) -> None:
    """MLM on LN(h) with the tied table (divided by sqrt(d) with --cl-unit-logits), plus the
    MSE between h (before LN) and W_target, the table's own row (divided by sqrt(d), a unit
    vector at the VecMap scale, with --cl-unit-mse)."""
    config = tiny()
    model = model_for("cl", config, cl_unit_logits=unit_logits, cl_unit_mse=unit_mse).eval()
    batch = random_batch(config)
    out = model.encoder_loss(batch, torch.Generator().manual_seed(5))

    inputs, targets = mask_for_mlm(
        batch.tokens_BT,
        batch.lengths_B,
        mask_id=SPECIAL.mask,
        vocab_size=config.vocab_size,
        special_ids=SPECIAL.all,
        generator=torch.Generator().manual_seed(5),
    )
    inputs, lengths = append_token(inputs, batch.lengths_B, SPECIAL.eos, SPECIAL.pad)
    targets, _ = append_token(targets, batch.lengths_B, -100, -100)
    mask = torch.arange(inputs.shape[1])[None] < lengths[:, None]
    encoded: EncoderOutput = model.encoder(inputs, mask, batch.langs_B)
    table = model.interface.table
    nll, sq, count = 0.0, 0.0, 0
    for b, t in (targets != -100).nonzero().tolist():
        x = int(targets[b, t])
        output = table / math.sqrt(config.d_model) if unit_logits else table
        logits = encoded.hidden_BTD[b, t] @ output.t() + model.mlm_bias
        nll += -torch.log_softmax(logits, -1)[x]
        wanted = table[x] / math.sqrt(config.d_model) if unit_mse else table[x]
        sq += ((wanted - encoded.pre_norm_BTD[b, t]) ** 2).sum()  # Eq. 1: over dimensions
        count += 1
    torch.testing.assert_close(out.components["enc_mlm"], nll / count)
    torch.testing.assert_close(out.components["enc_mse"], sq / count)
    torch.testing.assert_close(out.loss, (nll + sq) / count)


def test_cl_table_input_starts_the_encoders_input_embeddings_at_the_tables_unit_rows() -> None:
    """With --cl-table-input every row but padding's is the table's row divided by sqrt(d);
    nothing else in the model changes, and without it the table reaches no input row."""
    config = tiny()
    torch.manual_seed(0)
    table = torch.randn(config.vocab_size, config.d_model) * 3
    models = {}
    for table_input in (False, True):
        torch.manual_seed(1)
        interface = build_interface("cl", config, cl_table=table, cl_table_input=table_input)
        models[table_input] = SemFaceModel(config, interface, SPECIAL)
    weight = models[True].encoder.embed.tokens.weight
    others = [i for i in range(config.vocab_size) if i != SPECIAL.pad]
    torch.testing.assert_close(weight[others], table[others] / math.sqrt(config.d_model))
    assert not weight[SPECIAL.pad].any()
    plain = models[False].encoder.embed.tokens.weight
    assert not torch.isclose(plain[others], weight[others]).any()
    for (name, a), (_, b) in zip(
        models[False].named_parameters(), models[True].named_parameters(), strict=True
    ):
        if name != "encoder.embed.tokens.weight":
            assert torch.equal(a, b), name


def test_clm_decoder_loss_is_eq_3_and_causal() -> None:
    """-log p(y_j | y_<j, E(C(x))): each position scored from its prefix alone."""
    config = tiny()
    model = model_for("cl", config, decoder_objective="clm").eval()
    batch = random_batch(config, batch=3)
    out = model.decoder_loss(batch, torch.Generator().manual_seed(9))
    noisy, noisy_lengths = drop_and_shuffle(
        batch.tokens_BT,
        batch.lengths_B,
        pad_id=SPECIAL.pad,
        generator=torch.Generator().manual_seed(9),
    )
    memory = model.interface.table[noisy]
    memory_mask = torch.arange(noisy.shape[1])[None] < noisy_lengths[:, None]
    total, count = 0.0, 0
    for b in range(3):
        n = int(batch.lengths_B[b])
        sentence = batch.tokens_BT[b, :n].tolist()
        inputs = [SPECIAL.lang_tags[int(batch.langs_B[b])], *sentence]
        targets = [*sentence, SPECIAL.eos]
        for j in range(len(targets)):
            prefix = torch.tensor([inputs[: j + 1]])
            hidden = model.decoder(
                prefix,
                torch.ones_like(prefix, dtype=torch.bool),
                batch.langs_B[b : b + 1],
                memory[b : b + 1],
                memory_mask[b : b + 1],
            )
            logits = model.decoder.logits(hidden[0, -1])
            total += -torch.log_softmax(logits, -1)[targets[j]]
            count += 1
    torch.testing.assert_close(out.loss, total / count)


def test_the_decoder_stage_can_read_a_substituted_copy() -> None:
    """With random aligned substitution the interface reads C(x') of the substituted x'
    (same noise draws), and the decoder still predicts x itself."""
    config = tiny()
    model = model_for("cl", config, decoder_objective="clm").eval()
    batch = random_batch(config, batch=3)
    substituted = random_batch(config, seed=1, batch=3)
    substituted.langs_B = batch.langs_B
    out = model.decoder_loss(batch, torch.Generator().manual_seed(9), substituted)
    noisy, noisy_lengths = drop_and_shuffle(
        substituted.tokens_BT,
        substituted.lengths_B,
        pad_id=SPECIAL.pad,
        generator=torch.Generator().manual_seed(9),
    )
    memory = model.interface.table[noisy]
    memory_mask = torch.arange(noisy.shape[1])[None] < noisy_lengths[:, None]
    tags = torch.tensor(SPECIAL.lang_tags)[batch.langs_B]
    inputs = torch.cat([tags[:, None], batch.tokens_BT], 1)
    targets, _ = append_token(batch.tokens_BT, batch.lengths_B, SPECIAL.eos, SPECIAL.pad)
    mask = torch.arange(inputs.shape[1])[None] < (batch.lengths_B + 1)[:, None]
    hidden = model.decoder(inputs, mask, batch.langs_B, memory, memory_mask, causal=True)
    expected = torch.nn.functional.cross_entropy(model.decoder.logits(hidden[mask]), targets[mask])
    torch.testing.assert_close(out.loss, expected)
    plain = model.decoder_loss(batch, torch.Generator().manual_seed(9))
    assert not torch.allclose(plain.loss, out.loss)
    torch.testing.assert_close(
        model.decoder_loss(batch, torch.Generator().manual_seed(9), batch).loss, plain.loss
    )


def _grads(params: list[torch.nn.Parameter]) -> list[bool]:
    return [p.grad is not None and bool(p.grad.abs().sum() > 0) for p in params]


@pytest.mark.parametrize("kind", ["cl", "vq"])
def test_each_stage_only_trains_its_own_parameters(kind: str) -> None:
    config = tiny()
    model = model_for(kind, config)
    batch = random_batch(config)
    decoder_side = model.decoder_stage_parameters()
    encoder_side = model.encoder_stage_parameters()
    assert {id(p) for p in decoder_side}.isdisjoint({id(p) for p in encoder_side})

    model.decoder_loss(batch, torch.Generator().manual_seed(0)).loss.backward()
    assert not any(_grads(encoder_side)), "the decoder pass reached encoder-side parameters"
    assert any(_grads(list(model.decoder.parameters())))
    if kind == "vq":
        assert any(_grads(list(model.interface.extractor.parameters())))
        assert all(p.grad is None for p in model.interface.quantizer.parameters())
    else:
        assert model.interface.table.grad is None

    model.zero_grad(set_to_none=True)
    model.encoder_loss(batch, torch.Generator().manual_seed(0)).loss.backward()
    assert not any(_grads(decoder_side)), "the encoder pass reached decoder-side parameters"
    assert any(_grads(list(model.encoder.parameters())))
    if kind == "vq":
        assert any(_grads(list(model.interface.quantizer.parameters())))


def test_encoder_codes_feed_the_decoder_the_codes_the_encoder_picks() -> None:
    """--decoder-codes encoder: the decoder stage reads the code vectors the encoder's own
    output picks for ``x </s>`` (a direct computation through the diagnostics' teacher-forced
    NLL), the extractor plays no part, and no gradient reaches the encoder or the codebook."""
    config, batch = tiny(), random_batch(tiny())
    model = model_for("vq", config, decoder_codes="encoder", decoder_noise=False).eval()
    out = model.decoder_loss(batch, torch.Generator().manual_seed(0))
    assert set(out.components) == {"dec_clm"}

    src, src_lengths = append_token(batch.tokens_BT, batch.lengths_B, SPECIAL.eos, SPECIAL.pad)
    mask = lengths_to_mask(src_lengths, src.shape[1])
    with torch.no_grad():
        hidden = model.encoder(src, mask, batch.langs_B).hidden_BTD
        codes = model.interface.quantizer(hidden[mask], sample=False).codes
        memory = torch.zeros_like(hidden)
        memory[mask] = model.interface.quantizer.lookup(codes)
        nll, count = teacher_forced_nll(model.decoder, SPECIAL, batch, memory, mask)
    torch.testing.assert_close(out.components["dec_clm"], torch.tensor(nll / count))

    with torch.no_grad():
        for p in model.interface.extractor.parameters():
            p.add_(1.0)
    again = model.decoder_loss(batch, torch.Generator().manual_seed(0))
    torch.testing.assert_close(again.components["dec_clm"], out.components["dec_clm"])
    out.loss.backward()
    assert not any(_grads(list(model.encoder.parameters())))
    assert all(p.grad is None for p in model.interface.quantizer.parameters())
    assert any(_grads(list(model.decoder.parameters())))
    with pytest.raises(ValueError, match="decoder_codes"):
        ObjectiveConfig(decoder_codes="table")  # type: ignore[arg-type]


def test_trained_encoder_codes_are_the_same_memory_and_train_the_encoder() -> None:
    """--decoder-codes encoder-trained: the decoder reads what it reads with ``encoder``, and
    its loss reaches the encoder (through the straight-through codes), not the VQ layer."""
    config, batch = tiny(), random_batch(tiny())
    losses, grads = {}, {}
    for codes in ("encoder", "encoder-trained"):
        torch.manual_seed(0)
        model = model_for("vq", config, decoder_codes=codes, decoder_noise=False).eval()
        out = model.decoder_loss(batch, torch.Generator().manual_seed(0))
        out.loss.backward()
        losses[codes] = out.loss.detach()
        grads[codes] = _grads(list(model.encoder.parameters()))
        assert all(p.grad is None for p in model.interface.quantizer.parameters())
        assert any(_grads(list(model.decoder.parameters())))
    torch.testing.assert_close(losses["encoder-trained"], losses["encoder"], rtol=0, atol=0)
    assert not any(grads["encoder"]) and any(grads["encoder-trained"])


def test_cl_decoder_stage_can_read_the_encoders_output() -> None:
    """CL-SemFace with --decoder-codes encoder / encoder-trained and --decoder-continuous 1 (the
    default with them): the decoder stage reads the
    encoder's own output for ``x </s>``, as the connected model's decoder does (a direct
    computation through the diagnostics' teacher-forced NLL), not the table's rows; its
    loss reaches the encoder only when trained, and never the table."""
    config, batch = tiny(), random_batch(tiny())
    src, src_lengths = append_token(batch.tokens_BT, batch.lengths_B, SPECIAL.eos, SPECIAL.pad)
    mask = lengths_to_mask(src_lengths, src.shape[1])
    for codes in ("encoder", "encoder-trained"):
        model = model_for(
            "cl", config, decoder_codes=codes, decoder_continuous=1.0, decoder_noise=False
        ).eval()
        out = model.decoder_loss(batch, torch.Generator().manual_seed(0))
        with torch.no_grad():
            hidden = model.encoder(src, mask, batch.langs_B).hidden_BTD
            nll, count = teacher_forced_nll(model.decoder, SPECIAL, batch, hidden, mask)
            table_memory = model.interface.decoder_memory(src, mask, batch.langs_B)
            table_nll, _ = teacher_forced_nll(
                model.decoder, SPECIAL, batch, table_memory.memory_BSD, mask
            )
        torch.testing.assert_close(out.components["dec_clm"], torch.tensor(nll / count))
        assert abs(table_nll - nll) > 1e-3  # the two memories differ: the check can fail
        out.loss.backward()
        assert any(_grads(list(model.encoder.parameters()))) == (codes == "encoder-trained")
        assert model.interface.table.grad is None
        assert any(_grads(list(model.decoder.parameters())))


def test_the_memory_norm_feeds_the_decoder_stage_the_table_rows_through_the_encoders_norm() -> None:
    """--decoder-memory-norm: the decoder stage reads LN(E(C(x))) with the encoder's final
    LayerNorm (a direct computation), the normalisation the connected decoder's memory comes
    through; its loss trains neither that norm nor the table."""
    config, batch = tiny(), random_batch(tiny(), batch=3)
    model = model_for("cl", config, decoder_memory_norm=True, decoder_noise=False).eval()
    norm = model.encoder.final_norm
    with torch.no_grad():  # away from LayerNorm's identity affine, so the check can fail
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    out = model.decoder_loss(batch, torch.Generator().manual_seed(0))
    mask = lengths_to_mask(batch.lengths_B, batch.tokens_BT.shape[1])
    with torch.no_grad():
        rows = model.interface.table[batch.tokens_BT]
        normed = torch.nn.functional.layer_norm(
            rows, (config.d_model,), norm.weight, norm.bias, norm.eps
        )
        nll, count = teacher_forced_nll(model.decoder, SPECIAL, batch, normed, mask)
        raw, _ = teacher_forced_nll(model.decoder, SPECIAL, batch, rows, mask)
    torch.testing.assert_close(out.components["dec_clm"], torch.tensor(nll / count))
    assert abs(raw - nll) > 1e-3  # the rows as they are give another loss
    out.loss.backward()
    assert norm.weight.grad is None and norm.bias.grad is None
    assert model.interface.table.grad is None
    assert any(_grads(list(model.decoder.parameters())))


def test_decoder_continuous_reads_the_encoders_output_at_its_share_in_training() -> None:
    """--decoder-continuous: in training, that share of tokens reads the encoder's own
    output instead of its code; at share 1 the decoder stage reads the output alone (a direct
    computation), at 0 the codes alone, and in evaluation the codes at any share below 1."""
    config, batch = tiny(), random_batch(tiny())
    src, src_lengths = append_token(batch.tokens_BT, batch.lengths_B, SPECIAL.eos, SPECIAL.pad)
    mask = lengths_to_mask(src_lengths, src.shape[1])
    model = model_for(
        "vq", config, decoder_codes="encoder", decoder_continuous=1.0, decoder_noise=False
    )
    plain = model.decoder_loss(batch, torch.Generator().manual_seed(0))  # training mode
    with torch.no_grad():
        hidden = model.encoder(src, mask, batch.langs_B).hidden_BTD
        nll, count = teacher_forced_nll(model.decoder, SPECIAL, batch, hidden, mask)
    torch.testing.assert_close(plain.components["dec_clm"], torch.tensor(nll / count))
    codes_only = model_for("vq", config, decoder_codes="encoder", decoder_noise=False).eval()
    mixed = model_for(
        "vq", config, decoder_codes="encoder", decoder_continuous=0.5, decoder_noise=False
    ).eval()
    torch.testing.assert_close(
        mixed.decoder_loss(batch, torch.Generator().manual_seed(0)).loss,
        codes_only.decoder_loss(batch, torch.Generator().manual_seed(0)).loss,
        rtol=0,
        atol=0,
    )
    assert (
        abs(
            float(plain.components["dec_clm"])
            - float(
                mixed.decoder_loss(batch, torch.Generator().manual_seed(0)).components["dec_clm"]
            )
        )
        > 1e-3
    )  # codes and outputs differ: the check can fail


def test_cl_decoder_continuous_mixes_the_encoders_output_with_its_normed_rows() -> None:
    """CL-SemFace with --decoder-codes encoder and --decoder-continuous 0.5: in training the
    decoder stage reads, token by token, the encoder's output or the table's row of the
    token through the encoder's final norm, drawn from the step's generator; a direct
    computation with the same draw gives its loss, and in evaluation it reads the rows."""
    config, batch = tiny(), random_batch(tiny())
    src, src_lengths = append_token(batch.tokens_BT, batch.lengths_B, SPECIAL.eos, SPECIAL.pad)
    mask = lengths_to_mask(src_lengths, src.shape[1])
    model = model_for(
        "cl",
        config,
        decoder_codes="encoder",
        decoder_continuous=0.5,
        decoder_memory_norm=True,
        decoder_noise=False,
    )
    norm = model.encoder.final_norm
    out = model.decoder_loss(batch, torch.Generator().manual_seed(3))
    with torch.no_grad():
        hidden = model.encoder(src, mask, batch.langs_B).hidden_BTD
        rows = torch.nn.functional.layer_norm(
            model.interface.table[src], (config.d_model,), norm.weight, norm.bias, norm.eps
        )
        drawn = torch.rand(mask.shape, generator=torch.Generator().manual_seed(3)) < 0.5
        assert 0 < int(drawn[mask].sum()) < int(mask.sum())  # both kinds are read
        mixed = torch.where(drawn[..., None], hidden, rows)
        nll, count = teacher_forced_nll(model.decoder, SPECIAL, batch, mixed, mask)
        rows_nll, _ = teacher_forced_nll(model.decoder, SPECIAL, batch, rows, mask)
    torch.testing.assert_close(out.components["dec_clm"], torch.tensor(nll / count))
    evaluated = model.eval().decoder_loss(batch, torch.Generator().manual_seed(3))
    torch.testing.assert_close(evaluated.components["dec_clm"], torch.tensor(rows_nll / count))
    assert abs(nll - rows_nll) > 1e-3  # the output and the rows differ: the check can fail


def test_extractor_diversity_trains_the_extractor_with_the_encoders_terms() -> None:
    """With --extractor-diversity the decoder loss adds the extractor's diversity and token
    entropy at the encoder's weights; their gradient reaches the extractor, never the
    (fixed) codebook layer."""
    config, batch = tiny(), random_batch(tiny())
    plain = model_for("vq", config)
    spread = model_for("vq", config, extractor_diversity=True)
    out_plain = plain.decoder_loss(batch, torch.Generator().manual_seed(0))
    out = spread.decoder_loss(batch, torch.Generator().manual_seed(0))
    assert set(out_plain.components) == {"dec_clm"}
    assert set(out.components) == {"dec_clm", "dec_diversity", "dec_token_entropy"}
    torch.testing.assert_close(out.components["dec_clm"], out_plain.components["dec_clm"])
    objective = spread.objective
    expected = (
        out.components["dec_clm"]
        + objective.weight_of("diversity") * out.components["dec_diversity"]
        + objective.weight_of("token_entropy") * out.components["dec_token_entropy"]
    )
    torch.testing.assert_close(out.loss.detach(), expected)
    assert float(out.components["dec_diversity"]) > 0
    out.loss.backward()
    out_plain.loss.backward()
    assert all(p.grad is None for p in spread.interface.quantizer.parameters())
    moved = [
        not torch.allclose(a.grad, b.grad)
        for a, b in zip(
            spread.interface.extractor.parameters(),
            plain.interface.extractor.parameters(),
            strict=True,
        )
        if a.grad is not None and b.grad is not None
    ]
    assert moved and any(moved), "the extractor's gradient did not change"
    # The decoder itself sees the same memory: its gradient is the plain run's.
    for a, b in zip(spread.decoder.parameters(), plain.decoder.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_xlm_baseline_has_no_decoder_stage() -> None:
    model = model_for("none", tiny())
    assert model.decoder is None
    with pytest.raises(ValueError, match="no decoder stage"):
        model.decoder_loss(random_batch(tiny()), torch.Generator())


def test_mlm_decoder_loss_is_eq_2() -> None:
    """-log p(y_j | s_j, E(C(x))) at masked positions of a bidirectional decoder."""
    config = tiny()
    model = model_for("cl", config, decoder_objective="mlm").eval()
    batch = random_batch(config)
    out = model.decoder_loss(batch, torch.Generator().manual_seed(1))
    generator = torch.Generator().manual_seed(1)  # the same draws, in the same order
    noisy, noisy_lengths = drop_and_shuffle(
        batch.tokens_BT, batch.lengths_B, pad_id=SPECIAL.pad, generator=generator
    )
    inputs, targets = mask_for_mlm(
        batch.tokens_BT,
        batch.lengths_B,
        mask_id=SPECIAL.mask,
        vocab_size=config.vocab_size,
        special_ids=SPECIAL.all,
        generator=generator,
    )
    inputs, lengths = append_token(inputs, batch.lengths_B, SPECIAL.eos, SPECIAL.pad)
    targets, _ = append_token(targets, batch.lengths_B, -100, -100)
    memory = model.interface.table[noisy]
    memory_mask = torch.arange(noisy.shape[1])[None] < noisy_lengths[:, None]
    total, count = 0.0, 0
    for b in range(len(inputs)):
        n = int(lengths[b])
        row = inputs[b : b + 1, :n]
        hidden = model.decoder(
            row,
            torch.ones_like(row, dtype=torch.bool),
            batch.langs_B[b : b + 1],
            memory[b : b + 1],
            memory_mask[b : b + 1],
            causal=False,
        )
        for t in (targets[b, :n] != -100).nonzero().flatten().tolist():
            logits = model.decoder.logits(hidden[0, t])
            total += -torch.log_softmax(logits, -1)[targets[b, t]]
            count += 1
    assert out.num_targets == count > 0
    torch.testing.assert_close(out.loss, total / count)


@pytest.fixture(scope="module")
def real_batches(
    tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path
) -> tuple[list[SequenceBatch], Tokenizer]:
    out = tmp_path_factory.mktemp("stage-shards")
    inputs = [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    build_shards(parse_lang_path(inputs), spm_model, out, ShardBuildConfig())
    tokenizer = Tokenizer.load(spm_model)
    source = ShardSource.from_manifest(Manifest.load(out))
    loader = ShardLoader(
        source, LoaderConfig(max_tokens=1024, max_len=30, seed=3), pad_id=tokenizer.pad_id
    )
    langs = tokenizer.languages
    batches = []
    for _, batch in zip(range(6), loader, strict=False):
        lang = torch.full((len(batch.lengths),), langs.index(batch.lang))
        batches.append(SequenceBatch(batch.tokens, batch.lengths, lang))
    return batches, tokenizer


@pytest.mark.parametrize("kind", ["none", "cl", "vq", "mbart"])
def test_tiny_preset_loss_falls_on_real_text(
    kind: str, real_batches: tuple[list[SequenceBatch], Tokenizer]
) -> None:
    batches, tokenizer = real_batches
    special = SpecialTokens.from_tokenizer(tokenizer)
    config = build_model_config(
        "tiny", [f"vocab_size={tokenizer.vocab_size}", "num_langs=2", f"pad_id={tokenizer.pad_id}"]
    )
    torch.manual_seed(0)
    if kind == "mbart":
        model: torch.nn.Module = DenoisingSeq2Seq(config, special)
        step_loss = model.loss
    else:
        table = torch.randn(config.vocab_size, config.d_model) * 0.3
        interface = build_interface(kind, config, cl_table=table if kind == "cl" else None)
        model = SemFaceModel(config, interface, special)
        step_loss = model.encoder_loss if kind == "none" else model.joint_loss
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=3e-3)
    generator = torch.Generator().manual_seed(0)
    losses = []
    for step in range(40):
        out = step_loss(batches[step % len(batches)], generator)
        assert math.isfinite(out.loss.item())
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
        # The predictive losses; the auxiliary terms (diversity, entropy, L2) fall at their
        # own pace.
        predictive = ("enc_mlm", "dec_clm", "denoise")
        losses.append(sum(float(v) for k, v in out.components.items() if k in predictive))
    first, last = sum(losses[:6]) / 6, sum(losses[-6:]) / 6
    # VQ measured 0.87 here, with the paper's losses or the default ones; a model that does
    # not learn stays near 1.
    assert last < 0.9 * first, (kind, losses)


def test_bf16_model_gives_a_finite_fp32_loss() -> None:
    config = tiny()
    model = model_for("cl", config).to(torch.bfloat16)
    out = model.joint_loss(random_batch(config), torch.Generator().manual_seed(0))
    assert out.loss.dtype == torch.float32 and math.isfinite(out.loss.item())
    out.loss.backward()


# Operations after which a GPU's host waits for the device: a value read back, a size that
# depends on the data (a boolean index counts its true entries), bincount's largest id.
_WAITING = {"_local_scalar_dense", "nonzero", "masked_select", "bincount", "unique", "_unique2"}


def _waits(step: object) -> collections.Counter[str]:
    """Operations of ``step()`` that wait for the device, by the project file they come from
    (``backward`` for those autograd's engine runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    found: collections.Counter[str] = collections.Counter()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            name = func.__name__.split(".")[0]
            indices = args[1] if name.startswith("index") and len(args) > 1 else ()
            boolean = isinstance(indices, (list, tuple)) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices
            )
            if name in _WAITING or boolean:
                frames = [f for f in traceback.extract_stack() if "megasemface" in f.filename]
                found[Path(frames[-1].filename).name if frames else "backward"] += 1
            return func(*args, **(kwargs or {}))

    with Record():
        step()  # type: ignore[operator]
    return found


def test_joint_step_waits_for_the_device_only_where_its_sizes_depend_on_the_data() -> None:
    """A VQ-SemFace joint step (forward and backward) reads nothing back from the device:
    metrics stay tensors, code counts and the copies of chosen code vectors use masks. It
    waits where a size depends on the data: once for each set of real-token positions (the
    encoder's, the extractor's, the decoder's targets), once for the MLM targets in the
    stage and once in the interface (and in the latter's backward), and in the noising, which
    runs before each pass's work is queued."""
    config = tiny(**{"vq.layout": "flat", "vq.num_codes": 64})
    model = model_for("vq", config).train()
    model.stage = "joint"
    batch = random_batch(config, batch=4, length=7)

    def step() -> None:
        model(batch, torch.Generator().manual_seed(0)).loss.backward()

    waits = _waits(step)
    noising = waits.pop("noising.py", 0)
    assert waits == {"layers.py": 3, "semface.py": 1, "vector_quantized.py": 1, "backward": 1}
    assert noising > 0  # still there: a change that removes them updates this test


def test_the_language_mean_term_is_each_language_s_mean_normalised_output() -> None:
    """--language-mean-weight: the encoder stage adds, at its weight, the squared norm of each
    language's mean output before the final norm's gain and bias, over that language's
    tokens of the batch (pads left out), averaged over the languages (a direct computation
    sentence by sentence); it trains the encoder below the final norm, never the norm."""
    config = tiny()
    batch = random_batch(config, batch=4)
    batch.langs_B = torch.tensor([0, 1, 1, 0])
    plain = model_for("cl", config)
    weighted = model_for("cl", config, language_mean_weight=0.5)
    out = weighted.encoder_loss(batch, torch.Generator().manual_seed(0))
    base = plain.encoder_loss(batch, torch.Generator().manual_seed(0))
    assert "enc_lang_mean" not in base.components

    # Directly: the MLM inputs as the stage masks them, each sentence through the encoder
    # alone, its own outputs normalised, then each language's mean over its tokens.
    inputs, lengths, _ = plain._masked_with_eos(batch, torch.Generator().manual_seed(0))
    sums = {0: torch.zeros(config.d_model), 1: torch.zeros(config.d_model)}
    counts = dict.fromkeys(sums, 0)
    with torch.no_grad():
        for row, length in enumerate(lengths.tolist()):
            tokens = inputs[row : row + 1, :length]
            lang = int(batch.langs_B[row])
            encoded = plain.encoder(
                tokens, torch.ones_like(tokens, dtype=torch.bool), batch.langs_B[row : row + 1]
            )
            normed = torch.nn.functional.layer_norm(encoded.pre_norm_BTD[0], (config.d_model,))
            sums[lang] += normed.sum(dim=0)
            counts[lang] += length
    wanted = sum((sums[lang] / counts[lang]).pow(2).sum() for lang in sums) / 2
    torch.testing.assert_close(out.components["enc_lang_mean"], wanted, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(out.loss, base.loss + 0.5 * wanted, rtol=1e-4, atol=1e-5)

    out.loss.backward()
    norm = weighted.encoder.final_norm
    base.loss.backward()
    shift_only = [
        a.grad - b.grad
        for a, b in zip(norm.parameters(), plain.encoder.final_norm.parameters(), strict=True)
    ]
    assert all(torch.allclose(g, torch.zeros_like(g), atol=1e-6) for g in shift_only)
