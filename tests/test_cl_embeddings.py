"""Cross-lingual embeddings, the parts: skip-gram, Procrustes/CSLS mapping, the unsupervised
initialisation, gold dictionaries, and the build's refusals of bad input.

The whole build on the real demo corpus, through the documented command, and its quality are
in test_cl_embeddings_cli.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megasemface.cli.build_cl_embeddings import main as cli_main
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
from megasemface.data.text.textio import parse_lang_path
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.embeddings import (
    CLEmbeddingConfig,
    CLEmbeddingError,
    GoldEntry,
    SkipGramConfig,
    bli_precision,
    build_cl_embeddings,
    csls_topk,
    gold_queries,
    induce_dictionary,
    load_gold_dictionary,
    map_onto,
    normalize,
    procrustes,
    train_skipgram,
    unsupervised_seed,
)
from megasemface.embeddings.sentence_file import id_words, write_sentence_file
from megasemface.embeddings.skipgram import SKIPGRAM_BACKENDS
from megasemface.embeddings.table import merge_table
from megasemface.interfaces.cross_lingual import load_embedding_table


def _isomorphic_pair(
    n: int, d: int, noise: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, and z = a rotated, row-permuted, noisy copy; returns (x, z, rotation, perm) with
    z[i] the image of x[perm[i]]. The spectrum decays so that rows are distinguishable by
    their similarity distributions (an isotropic cloud has nothing to match)."""
    gen = torch.Generator().manual_seed(seed)
    x = normalize(torch.randn(n, d, generator=gen) * torch.linspace(3.0, 0.3, d))
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    perm = torch.randperm(n, generator=gen)
    z = normalize(x[perm] @ rotation + noise * torch.randn(n, d, generator=gen) / d**0.5)
    return x, z, rotation, perm


def test_procrustes_recovers_a_known_rotation() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 16, generator=gen)
    rotation, _ = torch.linalg.qr(torch.randn(16, 16, generator=gen))
    assert torch.allclose(procrustes(x, x @ rotation), rotation, atol=1e-5)
    # Self-learning from a 20-pair seed recovers the rotation and the whole dictionary.
    x, z, rotation, perm = _isomorphic_pair(300, 16, 0.0, 1)
    inverse = torch.argsort(perm)  # x row i is z row inverse[i]
    seed = torch.stack([torch.arange(20), inverse[:20]], 1)
    result = map_onto(x, z, seed, max_iterations=10)
    assert result.converged
    assert torch.allclose(result.matrix, rotation, atol=1e-4)
    assert torch.equal(result.dictionary[:, 1], inverse)


def test_csls_in_blocks_equals_the_full_matrix() -> None:
    gen = torch.Generator().manual_seed(1)
    src = torch.nn.functional.normalize(torch.randn(37, 8, generator=gen), dim=1)
    tgt = torch.nn.functional.normalize(torch.randn(23, 8, generator=gen), dim=1)
    sims = src @ tgt.T
    k = 4
    r_tgt = sims.topk(k, dim=1).values.mean(1)  # per source row
    r_src = sims.T.topk(k, dim=1).values.mean(1)  # per target row
    full = 2 * sims - r_tgt[:, None] - r_src[None, :]
    expected = full.topk(3, dim=1)
    indices, scores = csls_topk(src, tgt, 3, csls_k=k, block_size=5)
    assert torch.equal(indices, expected.indices)
    assert torch.allclose(scores, expected.values, atol=1e-6)
    cos_idx, _ = csls_topk(src, tgt, 3, method="cosine", block_size=4)
    assert torch.equal(cos_idx, sims.topk(3, dim=1).indices)


def test_dictionary_induction_in_blocks_equals_the_full_matrix() -> None:
    gen = torch.Generator().manual_seed(2)
    x = normalize(torch.randn(53, 8, generator=gen))
    z = normalize(torch.randn(41, 8, generator=gen))
    sims = x @ z.T
    k = 4
    full = 2 * sims - sims.topk(k, 1).values.mean(1)[:, None] - sims.topk(k, 0).values.mean(0)
    fwd, bwd = full.argmax(1), full.argmax(0)
    forward = torch.stack([torch.arange(53), fwd], 1)
    expected = {
        "forward": forward,
        "mutual": forward[bwd[fwd] == torch.arange(53)],
        "union": torch.unique(torch.cat([forward, torch.stack([bwd, torch.arange(41)], 1)]), dim=0),
    }
    objective = float((full.max(1).values.mean() + full.max(0).values.mean()) / 2)
    for direction, pairs in expected.items():
        got, got_objective = induce_dictionary(x, z, direction=direction, csls_k=k, block_size=7)
        assert torch.equal(got, pairs), direction
        assert got_objective == pytest.approx(objective, abs=1e-6)
    # Stochastic induction is reproducible from its generator and differs from the greedy one.
    runs = [
        induce_dictionary(
            x, z, direction="forward", keep_prob=0.3, generator=torch.Generator().manual_seed(5)
        )[0]
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], forward)


def test_unsupervised_initialisation_recovers_a_permuted_rotation() -> None:
    x, z, rotation, perm = _isomorphic_pair(400, 24, 0.0, 3)
    seed = unsupervised_seed(x, z, block_size=64)
    # Without noise the similarity distributions alone give the whole dictionary.
    assert torch.equal(perm[seed[:, 1]], seed[:, 0])
    x, z, rotation, perm = _isomorphic_pair(400, 24, 0.2, 3)
    seed = unsupervised_seed(x, z, block_size=64)
    right = (perm[seed[:, 1]] == seed[:, 0]).float().mean()
    assert 0.2 < right < 0.5, float(right)  # a poor but better than chance (1/400) start
    for stochastic in (None, (0.25, 3)):
        result = map_onto(x, z, seed, max_iterations=20, stochastic=stochastic)
        assert result.converged, stochastic
        final = result.dictionary
        assert torch.equal(perm[final[:, 1]], final[:, 0]) and final.shape[0] == 400
        assert torch.allclose(result.matrix, rotation, atol=0.05)
    # Stochastic induction only converges once the keep probability has reached 1.
    assert result.iterations > 6


def test_mapping_refuses_spaces_of_different_dimensions() -> None:
    x, z = torch.eye(4), torch.eye(5)
    with pytest.raises(ValueError, match="embedding dimensions differ: source 4, target 5"):
        map_onto(x, z, torch.tensor([[0, 0]]))


def test_bli_precision_counts_hits_at_k() -> None:
    vecs = torch.eye(6)
    shifted = vecs[[1, 0, 2, 3, 4, 5]]  # ids 0 and 1 swapped in the target space
    out = bli_precision(vecs, shifted, [(0, 0), (2, 2), (3, 3), (3, 4)], k=(1, 5))
    assert out["queries"] == 3 and out["p@1"] == pytest.approx(2 / 3) and out["p@5"] == 1.0


def test_merged_table_loses_each_language_s_mean_in_the_shares_it_uses_each_id() -> None:
    """Two languages whose rows share a direction of their own: the merged table takes each
    language's count-weighted mean out of every row in the shares its uses fall to each
    language, before the rows are scaled to norm sqrt(d)."""
    rng = np.random.default_rng(0)
    vocab, dim = 12, 6
    offsets = {"de": torch.tensor([3.0, 0, 0, 0, 0, 0]), "en": torch.tensor([0, 3.0, 0, 0, 0, 0])}
    mapped = {lang: torch.randn(vocab, dim) + offsets[lang] for lang in offsets}
    counts = {lang: rng.integers(1, 50, size=vocab).astype(np.int64) for lang in offsets}
    counts["de"][7:], counts["en"][:6] = 0, 0  # ids 1-5 German, 7-11 English, 6 both
    counts["de"][0], counts["en"][0] = 0, 0  # an id no language uses: a random row
    trained = {lang: counts[lang] > 0 for lang in offsets}
    config = CLEmbeddingConfig(skipgram=SkipGramConfig(dim=dim))
    table, _ = merge_table(("de", "en"), mapped, counts, trained, config)
    plain, _ = merge_table(
        ("de", "en"), mapped, counts, trained, dataclasses.replace(config, centre_languages=False)
    )

    # Directly: the merged unit rows, each language's weighted mean, each row's shift.
    unit = torch.zeros(vocab, dim)
    for lang in offsets:
        unit[trained[lang]] += F.normalize(mapped[lang][trained[lang]], dim=1)
    unit = F.normalize(unit, dim=1)
    used = torch.from_numpy(counts["de"] + counts["en"] > 0)
    weights = {lang: torch.from_numpy(counts[lang]).float() * used for lang in offsets}
    means = {lang: weights[lang] @ unit / weights[lang].sum() for lang in offsets}
    uses = sum(torch.from_numpy(counts[lang]).float() for lang in offsets).clamp_min(1)
    shift = sum(
        (torch.from_numpy(counts[lang]).float() / uses)[:, None] * means[lang] for lang in offsets
    )
    wanted = F.normalize(unit - shift, dim=1) * dim**0.5
    assert torch.allclose(table[used], wanted[used], atol=1e-5)
    assert torch.allclose(table[~used], plain[~used])  # the random rows are the same
    assert torch.allclose(table.norm(dim=1), torch.full((vocab,), dim**0.5), atol=1e-4)

    def language_mean(rows: torch.Tensor, lang: str) -> torch.Tensor:
        return weights[lang] @ F.normalize(rows, dim=1) / weights[lang].sum()

    # The direction that tells the languages apart shrinks.
    gap = (language_mean(table, "de") - language_mean(table, "en")).norm()
    plain_gap = (language_mean(plain, "de") - language_mean(plain, "en")).norm()
    assert gap < 0.5 * plain_gap


def _grouped_corpus(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Sentences of 12 ids, each drawn from one of 4 groups of 10 ids (ids 0-39): ids of a
    group co-occur, ids of different groups never do."""
    rng = np.random.default_rng(seed)
    groups = rng.integers(0, 4, size=600)
    tokens = (groups[:, None] * 10 + rng.integers(0, 10, size=(600, 12))).astype(np.int32)
    return tokens.reshape(-1), np.arange(0, tokens.size + 1, 12)


@pytest.mark.parametrize("backend", list(SKIPGRAM_BACKENDS))
def test_skipgram_puts_co_occurring_ids_closer(backend: str) -> None:
    """Every backend: ids of a group nearer each other than ids of other groups, the rows of
    untrained ids at their seeded init, and one thread with a seed gives the same vectors."""
    tokens, offsets = _grouped_corpus(0)
    tokens[:5] = 45  # 5 occurrences: trained; id 46 twice, below min_count
    tokens[5:7] = 46
    config = SkipGramConfig(dim=16, epochs=5, subsample=0, seed=3, backend=backend)
    first = train_skipgram(tokens, offsets, 60, config)
    second = train_skipgram(tokens, offsets, 60, config)
    assert torch.equal(first.vectors, second.vectors)
    trained = np.zeros(60, dtype=bool)
    trained[:40] = trained[45] = True
    assert np.array_equal(first.trained, trained) and first.counts[46] == 2
    assert first.tokens == tokens.size * 5 and first.seconds >= first.file_seconds > 0
    unit = normalize(first.vectors[:40])
    similarity = unit @ unit.T
    group = torch.arange(40) // 10
    same = (group[:, None] == group[None, :]) & ~torch.eye(40, dtype=torch.bool)
    assert similarity[same].mean() > similarity[group[:, None] != group[None, :]].mean() + 0.3
    # Each id's nearest other id is of its own group.
    assert (group[(similarity - 2 * torch.eye(40)).argmax(1)] == group).all()
    # Untrained rows keep word2vec's small init, seeded.
    assert first.vectors[46].abs().max() <= 0.5 / 16
    reseeded = train_skipgram(tokens, offsets, 60, dataclasses.replace(config, seed=4))
    assert not torch.equal(reseeded.vectors[46], first.vectors[46])


def test_skipgram_refuses_bad_input() -> None:
    tokens, offsets = _grouped_corpus(1)
    with pytest.raises(ValueError, match="dimension must be >= 1"):
        SkipGramConfig(dim=0)
    with pytest.raises(ValueError, match="backend must be one of"):
        SkipGramConfig(backend="word2vec.c")
    config = SkipGramConfig(dim=8, epochs=1)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        train_skipgram(tokens, offsets, 30, config)
    with pytest.raises(ValueError, match="offsets must start at 0"):
        train_skipgram(tokens, offsets[:-1], 60, config)
    with pytest.raises(ValueError, match="min_count=1000"):
        train_skipgram(tokens, offsets, 60, dataclasses.replace(config, min_count=1000))


def test_sentence_file_holds_one_sentence_a_line(tmp_path: Path) -> None:
    """Lines of the sentences' words in order, empty sentences left out, whatever the block
    size; a word with white space is refused (it would split into two)."""
    tokens = np.array([5, 12, 3, 0, 7, 100, 2], dtype=np.int32)
    offsets = np.array([0, 3, 3, 5, 7])
    for block in (1, 2, 1 << 20):
        path = tmp_path / f"s{block}.txt"
        size = write_sentence_file(path, tokens, offsets, id_words(101), block_tokens=block)
        assert path.read_bytes() == b"5 12 3\n0 7\n100 2\n" and size == 17
    words = [f"\u2581w{i}" for i in range(101)]
    write_sentence_file(tmp_path / "p.txt", tokens, offsets, words)
    assert (tmp_path / "p.txt").read_text(encoding="utf-8").split("\n")[1] == "\u2581w0 \u2581w7"
    with pytest.raises(ValueError, match="white space"):
        write_sentence_file(tmp_path / "x.txt", tokens, offsets, ["a b"] * 101)


def test_gold_dictionary_matches_case_forms(spm_model: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.load(spm_model)
    piece = tokenizer.processor.piece_to_id
    path = tmp_path / "en-de.tsv"
    # The demo dictionary is lower-cased; "Datei" is how German writes it.
    path.write_text("file\tdatei\nzzqx\tqqzx\n\nlonely\n", encoding="utf-8")
    entries, stats = load_gold_dictionary(path, tokenizer)
    assert stats == {"entries": 2, "single_piece": 1}
    assert piece("▁Datei") in entries[0].target and piece("▁file") in entries[0].source
    # One query per source word: its most frequent form; gold: its frequent target forms.
    counts = np.zeros(tokenizer.vocab_size, dtype=np.int64)
    entry = GoldEntry(source=(5, 6), target=(7, 8))
    counts[[5, 6, 7, 8]] = [3, 40, 50, 2]
    assert gold_queries([entry], counts, counts, min_count=3) == [(6, 7)]
    empty = tmp_path / "empty.tsv"
    empty.write_text("oneword\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"empty.tsv: no 'source<TAB>target' word pairs"):
        load_gold_dictionary(empty, tokenizer)
    with pytest.raises(ValueError, match="gold dictionary not found"):
        load_gold_dictionary(tmp_path / "missing.tsv", tokenizer)


@pytest.fixture(scope="module")
def small_shards(
    demo_corpus: Path, spm_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """Shards of the first 2,000 English and 3 German lines of the demo corpus."""
    root = tmp_path_factory.mktemp("cl-small")
    inputs = []
    for lang, lines in (("en", 2000), ("de", 3)):
        text = (demo_corpus / "mono" / f"{lang}.txt").read_text(encoding="utf-8")
        (root / f"{lang}.txt").write_text("\n".join(text.splitlines()[:lines]) + "\n")
        inputs.append(f"{lang}:{root / f'{lang}.txt'}")
    build_shards(parse_lang_path(inputs), spm_model, root / "shards", ShardBuildConfig())
    return root / "shards"


def test_shards_from_another_model_are_refused(
    small_shards: Path, demo_corpus: Path, tmp_path: Path
) -> None:
    other = tmp_path / "other"
    corpora = parse_lang_path([f"en:{demo_corpus / 'mono' / 'en.txt'}"])
    train_spm(corpora, other, SpmTrainConfig(vocab_size=500, num_threads=1, seed=2))
    with pytest.raises(CLEmbeddingError, match="shards from another SentencePiece model"):
        build_cl_embeddings(small_shards, other.with_suffix(".model"), tmp_path / "t")


def test_languages_without_data_are_refused(
    small_shards: Path, spm_model: Path, tmp_path: Path
) -> None:
    config = CLEmbeddingConfig(languages=("en", "fr"))
    with pytest.raises(CLEmbeddingError, match=r"\['fr'\] have no monolingual shards in .*shards"):
        build_cl_embeddings(small_shards, spm_model, tmp_path / "t", config)
    # German has 3 lines: no piece reaches min_count, which the message names.
    config = CLEmbeddingConfig(skipgram=SkipGramConfig(dim=8, epochs=1, min_count=5))
    with pytest.raises(CLEmbeddingError, match=r"language 'de' in .*min_count=5"):
        build_cl_embeddings(small_shards, spm_model, tmp_path / "t", config)
    assert not (tmp_path / "t.safetensors").exists()


def test_table_of_another_dimension_is_refused(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    path = tmp_path / "table.safetensors"
    save_file({"embeddings": torch.zeros(10, 8)}, str(path))
    with pytest.raises(ValueError, match=r"table.safetensors: table of shape \(10, 8\).*d_model"):
        load_embedding_table(path, 10, 16)


def test_cli_reports_errors_without_traceback(
    small_shards: Path, spm_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--shards", str(small_shards), "--spm-model", str(spm_model), "--out", str(tmp_path)]
    cases = [
        (["--dim", "0"], "dimension must be >= 1"),
        (["--gold-dict", str(tmp_path / "none.tsv")], "gold dictionary not found"),
        (["--lang", "en"], "needs >= 2 languages"),
        (["--stochastic", "0", "3"], "stochastic needs"),
        (["--shards", str(tmp_path / "nowhere")], "no shard manifest"),
    ]
    for extra, message in cases:
        code = cli_main(base + extra)
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (extra, err)


def test_cli_refuses_bad_seeds_in_one_line(
    small_shards: Path, spm_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--shards", str(small_shards), "--spm-model", str(spm_model), "--out", str(tmp_path)]
    en, de = tmp_path / "t.en", tmp_path / "t.de"
    en.write_text("a\nb\n", encoding="utf-8")
    de.write_text("a\n", encoding="utf-8")
    cases = [
        (["--seed-parallel", f"en-de:{en},{de}"], "not line-aligned"),
        (["--seed-parallel", f"en-fr:{en},{de}"], "a seed must pair the pivot"),
        (["--seed-parallel", f"en:{en}"], "expected SRC-TGT:SRC_PATH,TGT_PATH"),
        (["--seed-dictionary", str(tmp_path / "words.tsv")], "name the dictionary <src>-<tgt>"),
        (["--seed-dictionary", str(tmp_path / "en-de.tsv")], "seed dictionary not found"),
        (["--seed-pair-min-count", "0"], "seed_pair_min_count"),
    ]
    for extra, message in cases:
        code = cli_main(base + extra)
        err = capsys.readouterr().err
        assert code == 2 and message in err and "Traceback" not in err, (extra, err)
        assert len(err.strip().splitlines()) == 1, err
