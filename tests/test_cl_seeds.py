"""Seed dictionaries of the cross-lingual mapping: the co-occurrence seed of translated
sentences, the initialisations by name, and BLI on a gold dictionary disjoint from the seed.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from megasemface.data.text.tokenizer import Tokenizer
from megasemface.embeddings import CLEmbeddingConfig, bli_precision, normalize
from megasemface.embeddings.inits import INITS, InitInputs, digit_pieces
from megasemface.embeddings.seeds import (
    SeedDictionaryError,
    SeedParallel,
    cooccurrence_counts,
    dice_pairs,
    disjoint_gold,
    parallel_seed,
    word_list_seed,
)
from megasemface.embeddings.table import map_language


def _brute_force_dice(
    src: list[list[int]], tgt: list[list[int]], vocab: int, min_count: int
) -> set[tuple[int, int]]:
    """Mutual-best Dice pairs from a dense count matrix, the definition written out."""
    both = np.zeros((vocab, vocab))
    for a, b in zip(src, tgt, strict=True):
        for s in set(a):
            for t in set(b):
                both[s, t] += 1
    c_s = np.array([sum(s in set(a) for a in src) for s in range(vocab)])
    c_t = np.array([sum(t in set(b) for b in tgt) for t in range(vocab)])
    with np.errstate(invalid="ignore", divide="ignore"):
        dice = np.where(both >= min_count, 2 * both / (c_s[:, None] + c_t[None, :]), -1.0)
    pairs = set()
    for s in range(vocab):
        t = int(np.argmax(dice[s]))
        if dice[s, t] >= 0 and int(np.argmax(dice[:, t])) == s:
            pairs.add((s, t))
    return pairs


def test_dice_seed_keeps_mutual_best_pairs() -> None:
    # Source ids 1..3 translate as 11..13; 9 and 19 are in every sentence (punctuation).
    src = [[1, 2, 9], [1, 3, 9], [2, 3, 9], [1, 2, 9], [3, 9]]
    tgt = [[11, 12, 19], [11, 13, 19], [12, 13, 19], [12, 11, 19], [13, 19, 13]]
    vocab = 20
    arrays = [np.array(a) for a in src], [np.array(b) for b in tgt]
    counts = cooccurrence_counts(*arrays, vocab)
    for min_count in (1, 2, 3, 4):
        got = {tuple(p) for p in dice_pairs(*counts, vocab, min_count).tolist()}
        assert got == _brute_force_dice(src, tgt, vocab, min_count), min_count
    assert {tuple(p) for p in dice_pairs(*counts, vocab, 2).tolist()} == {
        (1, 11),
        (2, 12),
        (3, 13),
        (9, 19),
    }
    # 1 and 2 co-occur with 11 and 12 three times each: only 9-19 (5 times) is left at 4.
    assert dice_pairs(*counts, vocab, 4).tolist() == [[9, 19]]


def test_disjoint_gold_removes_exactly_the_queries_a_seed_covers() -> None:
    gold = [(1, 11), (2, 12), (2, 22), (3, 13), (4, 14), (5, 15)]
    # The seed holds gold pairs 1-11 and 3-13, and 6-22, whose target is a gold target of 2.
    seed = np.array([[1, 11], [3, 13], [6, 22]])
    kept, removed = disjoint_gold(gold, seed)
    assert kept == [(4, 14), (5, 15)] and removed == 3
    kept, removed = disjoint_gold(gold, np.zeros((0, 2), dtype=np.int64))
    assert kept == gold and removed == 0


def test_bli_on_the_disjoint_dictionary_matches_brute_force() -> None:
    gen = torch.Generator().manual_seed(0)
    src = torch.nn.functional.normalize(torch.randn(12, 4, generator=gen), dim=1)
    tgt = torch.nn.functional.normalize(torch.randn(12, 4, generator=gen), dim=1)
    # Half the gold is each source row's true nearest target, half a random target.
    nearest = (src @ tgt.T).argmax(1)
    gold = [(i, int(nearest[i]) if i % 2 == 0 else (i * 5) % 12) for i in range(12)]
    seed = np.array([[0, int(nearest[0])], [1, 3]])
    kept, _ = disjoint_gold(gold, seed)
    assert 0 not in {q for q, _ in kept} and 1 not in {q for q, _ in kept}
    result = bli_precision(src, tgt, kept, (1,), method="cosine")
    sims = src @ tgt.T
    brute = np.mean([int(sims[q].argmax()) == t for q, t in kept])
    assert result["queries"] == len(kept) and result["p@1"] == pytest.approx(brute)
    # CSLS, written out over the full matrix (k = 3 neighbours each way).
    r_t = sims.topk(3, dim=1).values.mean(1)
    r_s = sims.T.topk(3, dim=1).values.mean(1)
    csls = 2 * sims - r_t[:, None] - r_s[None, :]
    brute = np.mean([int(csls[q].argmax()) == t for q, t in kept])
    result = bli_precision(src, tgt, kept, (1,), method="csls", csls_k=3)
    assert result["p@1"] == pytest.approx(brute)


def test_inits_by_name() -> None:
    pieces = ["<unk>", "▁die", "▁2024", "s", "3", "▁x"]
    digits = digit_pieces(pieces)
    assert digits.tolist() == [False, False, True, False, True, False]
    inputs = InitInputs(
        x=torch.zeros(6, 2),
        z=torch.zeros(6, 2),
        x_rows=np.arange(1, 6),
        z_rows=np.arange(1, 6),
        shared=np.array([1, 2, 3, 4]),
        digits=digits,
        init_vocab=4,
        csls_k=2,
        block_size=4,
    )
    assert INITS["identical"](inputs).tolist() == [[1, 1], [2, 2], [3, 3], [4, 4]]
    assert INITS["numerals"](inputs).tolist() == [[2, 2], [4, 4]]


def test_a_given_seed_maps_spaces_that_share_no_id() -> None:
    # z is a rotated copy of x on other ids (x on ids 0..199, z on ids 200..399), so the
    # identical initialisation is empty; 20 given pairs recover the whole map.
    gen = torch.Generator().manual_seed(3)
    n, d = 200, 8
    x = normalize(torch.randn(n, d, generator=gen) * torch.linspace(3.0, 0.3, d))
    rotation, _ = torch.linalg.qr(torch.randn(d, d, generator=gen))
    spaces = {
        "en": torch.cat([x, torch.zeros(n, d)]),
        "de": torch.cat([torch.zeros(n, d), x @ rotation]),
    }
    counts = {
        "en": np.r_[np.full(n, 50), np.zeros(n, dtype=np.int64)],
        "de": np.r_[np.zeros(n, dtype=np.int64), np.full(n, 50)],
    }
    trained = {lang: c > 0 for lang, c in counts.items()}
    config = CLEmbeddingConfig(max_iterations=5)
    digits = np.zeros(2 * n, dtype=bool)
    with pytest.raises(ValueError, match="identical initialisation of en onto de is empty"):
        map_language("en", "de", spaces, counts, trained, config, digits=digits)
    given = np.stack([np.arange(20), np.arange(20) + n], 1)
    matrix, entry = map_language(
        "en", "de", spaces, counts, trained, config, digits=digits, given=given
    )
    assert torch.allclose(matrix, rotation, atol=1e-4)
    assert entry["seed_given"] == 20 and entry["seed_init"] == 0


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_seed_files_are_read_or_refused_in_one_line(spm_model: Path, tmp_path: Path) -> None:
    tokenizer = Tokenizer.load(spm_model)
    en = _write(tmp_path / "s.en", b"open file\nsave file\nopen\n")
    de = _write(tmp_path / "s.de", b"Datei \xc3\xb6ffnen\nDatei speichern\n\xc3\xb6ffnen\n")
    seed = parallel_seed(SeedParallel(("en", "de"), ((en, de),)), tokenizer, 2)
    encode = tokenizer.processor.encode
    assert [encode("file")[-1], encode("Datei")[-1]] in seed.pairs.tolist()
    assert seed.oriented("de", "en").tolist() == seed.pairs[:, ::-1].tolist()
    short = _write(tmp_path / "short.de", b"Datei\n")
    bad = _write(tmp_path / "bad.de", b"Datei\nDatei \xff\nx\n")
    cases = [
        (tmp_path / "none.de", "seed parallel file not found: .*none.de"),
        (short, r"not line-aligned: .*s.en has 3 lines, .*short.de has 1"),
        (bad, r"bad.de:2: not valid UTF-8"),
    ]
    for target, message in cases:
        with pytest.raises(SeedDictionaryError, match=message):
            parallel_seed(SeedParallel(("en", "de"), ((en, target),)), tokenizer, 2)
    words = _write(tmp_path / "en-de.tsv", b"file\tdatei\n")
    pairs = word_list_seed(("en", "de"), words, tokenizer).pairs.tolist()
    assert [encode("file")[-1], encode("Datei")[-1]] in pairs
    with pytest.raises(SeedDictionaryError, match="seed dictionary not found"):
        word_list_seed(("en", "de"), tmp_path / "de-en.tsv", tokenizer)
