"""Random aligned substitution (mRASP) and its dictionary, against direct computations on
small inputs: the real demo tokenizer, written sentences and dictionary files."""

from __future__ import annotations

import itertools
import math
import string
from pathlib import Path

import numpy as np
import pytest
import torch

from megasemface.data.loading.pairs import split_pairs
from megasemface.data.text.ras import (
    WORD_START,
    RandomAlignedSubstitution,
    RasDictionary,
    RasDictionaryError,
)
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.embeddings.dictionary import (
    induce_dictionary_pairs,
    whole_word_counts,
    word_candidates,
    write_dictionary,
)
from megasemface.training.options import TrainConfig

WORDS = {"file": "Datei", "error": "Fehler", "delete": "löschen", "password": "Passwort"}
SENTENCES = [
    "the file is open",
    "Delete the file: error while reading",
    "password error.",
    "no word of the dictionary here",
    "File error file Error",
    "cannot delete password file.",
]


@pytest.fixture(scope="module")
def tokenizer(spm_model: Path) -> Tokenizer:
    return Tokenizer.load(spm_model)


@pytest.fixture()
def small_dict(tmp_path: Path) -> Path:
    path = tmp_path / "en-de.tsv"
    path.write_text("".join(f"{s}\t{t}\t0.5\n" for s, t in WORDS.items()), encoding="utf-8")
    return path


def _batch(tokenizer: Tokenizer, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = tokenizer.encode(texts)
    tokens = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_id, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    return tokens, torch.tensor([len(r) for r in rows])


def _texts(tokenizer: Tokenizer, tokens: torch.Tensor, lengths: torch.Tensor) -> list[str]:
    return [tokenizer.decode(row[:n].tolist()) for row, n in zip(tokens, lengths, strict=True)]


def _substituted_text(text: str, table: dict[str, str]) -> str:
    """RAS at probability 1 on the text: every whitespace word whose letters (trailing
    punctuation apart) are a dictionary word as written, lower-cased or with a capital
    initial, translated (with a capital initial when the word has one)."""
    forms = {}
    for source, target in table.items():
        for form in (source, source.lower(), source[:1].upper() + source[1:]):
            forms[form] = target[:1].upper() + target[1:] if form[:1].isupper() else target
    out = []
    for word in text.split():
        core = word.rstrip(string.punctuation)
        out.append(forms[core] + word[len(core) :] if core in forms else word)
    return " ".join(out)


def test_at_probability_one_every_dictionary_word_and_nothing_else_is_replaced(
    tokenizer: Tokenizer, small_dict: Path
) -> None:
    ras = RandomAlignedSubstitution(RasDictionary.load([small_dict], tokenizer), tokenizer, 1.0)
    tokens, lengths = _batch(tokenizer, SENTENCES)
    result = ras(tokens, lengths, "en", torch.Generator().manual_seed(0))
    assert _texts(tokenizer, result.tokens_BT, result.lengths_B) == [
        _substituted_text(text, WORDS) for text in SENTENCES
    ]
    expected = sum(_substituted_text(t, WORDS).split() != t.split() for t in SENTENCES)
    assert expected and result.replaced == result.candidates
    assert result.words == sum(len(t.split()) for t in SENTENCES)
    # The pair serves both directions: German sentences get the English words.
    de = ["Datei löschen", "Fehler: Passwort"]
    back = {t: s for s, t in WORDS.items()}
    tokens, lengths = _batch(tokenizer, de)
    result = ras(tokens, lengths, "de", torch.Generator().manual_seed(0))
    assert _texts(tokenizer, result.tokens_BT, result.lengths_B) == [
        _substituted_text(t, back) for t in de
    ]
    assert _substituted_text(de[1], back) == "Error: Password"


def test_the_words_of_a_sentence_are_its_pieces_from_one_word_start_to_the_next(
    tokenizer: Tokenizer, small_dict: Path
) -> None:
    ras = RandomAlignedSubstitution(RasDictionary.load([small_dict], tokenizer), tokenizer, 0.3)
    eos = tokenizer.eos_id
    for text in SENTENCES:
        (ids,) = tokenizer.encode([text])
        ids = [*ids, eos, *ids]  # a pair row: the separator ends a word and is no word
        pieces = [tokenizer.processor.IdToPiece(i) for i in ids]
        spans = ras.words(ids)
        words = ["".join(pieces[a:b]).removeprefix(WORD_START) for a, _, b in spans]
        assert words == text.split() * 2
        for start, core, end in spans:  # only trailing punctuation is left out of a lookup
            assert start < core <= end and eos not in ids[start:end]
            assert all(not any(c.isalnum() for c in pieces[i]) for i in range(core, end))
            assert any(c.isalnum() for c in pieces[core - 1])


def _parallel(corpus: Path, limit: int) -> tuple[list[str], list[str]]:
    base = corpus / "parallel" / "en-de" / "train"
    en = Path(f"{base}.en").read_text(encoding="utf-8").splitlines()[:limit]
    de = Path(f"{base}.de").read_text(encoding="utf-8").splitlines()[:limit]
    return en, de


def test_the_rate_is_the_probability_and_only_dictionary_words_change(
    tokenizer: Tokenizer, demo_corpus: Path
) -> None:
    dictionary = RasDictionary.load([demo_corpus / "dict" / "en-de.tsv"], tokenizer)
    ras = RandomAlignedSubstitution(dictionary, tokenizer, 0.3)
    en, _ = _parallel(demo_corpus, 3000)
    tokens, lengths = _batch(tokenizer, en)
    result = ras(tokens, lengths, "en", torch.Generator().manual_seed(1))
    n, p = result.candidates, 0.3
    assert n > 1000
    # A binomial count: within 4 standard deviations of n p (fails with p < 1e-4).
    assert abs(result.replaced - n * p) < 4 * math.sqrt(n * p * (1 - p))
    table = dictionary.words["en"]
    changed = 0
    for i in range(len(en)):
        before = tokens[i, : lengths[i]].tolist()
        after = result.tokens_BT[i, : result.lengths_B[i]].tolist()
        old, new = ras.words(before), ras.words(after)
        assert len(old) == len(new)  # one word for one word
        for (s0, c0, e0), (s1, c1, e1) in zip(old, new, strict=True):
            word, replaced = tuple(before[s0:c0]), tuple(after[s1:c1])
            assert before[c0:e0] == after[c1:e1]  # trailing punctuation stays
            if replaced != word:
                assert replaced in table[word]
                changed += 1
    assert changed == result.replaced


def test_the_target_side_of_a_pair_is_untouched(tokenizer: Tokenizer, demo_corpus: Path) -> None:
    """Pair rows as the shards store them (source, separator, target), split as the units
    split them, then the source substituted: the target and the separator's place are the
    pair's own."""
    ras = RandomAlignedSubstitution(
        RasDictionary.load([demo_corpus / "dict" / "en-de.tsv"], tokenizer), tokenizer, 1.0
    )
    en, de = _parallel(demo_corpus, 200)
    sep, pad = tokenizer.eos_id, tokenizer.pad_id
    rows = [[*s, sep, *t] for s, t in zip(tokenizer.encode(en), tokenizer.encode(de), strict=True)]
    tokens = torch.full((len(rows), max(map(len, rows))), pad, dtype=torch.long)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    src, src_len, tgt, tgt_len = split_pairs(tokens, torch.tensor(list(map(len, rows))), sep, pad)
    sides = [t.clone() for t in (src, src_len, tgt, tgt_len)]
    result = ras(src, src_len, "en", torch.Generator().manual_seed(0))
    assert result.replaced > 0 and not torch.equal(result.tokens_BT, src)
    # Nothing changed in place: the target the loss reads is the pair's.
    assert all(torch.equal(a, b) for a, b in zip(sides, (src, src_len, tgt, tgt_len), strict=True))
    # Substituting whole pair rows at probability 1: no word spans the separator, which
    # stays where the source words put it and is never replaced.
    whole = ras(tokens, torch.tensor(list(map(len, rows))), "en", torch.Generator())
    for i in range(len(rows)):
        out = whole.tokens_BT[i, : whole.lengths_B[i]].tolist()
        assert out.count(sep) == rows[i].count(sep) == 1
        assert ras.words(out) and all(sep not in out[a:b] for a, _, b in ras.words(out))


def test_substitution_is_deterministic_with_the_generator(
    tokenizer: Tokenizer, demo_corpus: Path
) -> None:
    ras = RandomAlignedSubstitution(
        RasDictionary.load([demo_corpus / "dict" / "en-de.tsv"], tokenizer), tokenizer, 0.3
    )
    tokens, lengths = _batch(tokenizer, _parallel(demo_corpus, 300)[0])
    runs = []
    for seed in (5, 5, 6):
        generator = torch.Generator().manual_seed(seed)
        result = ras(tokens, lengths, "en", generator)
        runs.append((result.tokens_BT, result.lengths_B, torch.rand(1, generator=generator)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1], strict=True))
    assert not torch.equal(runs[0][0], runs[2][0])
    # Two draws of one number per dictionary word, whatever was replaced.
    generator = torch.Generator().manual_seed(5)
    n = ras(tokens, lengths, "en", torch.Generator()).candidates
    torch.rand(n, generator=generator), torch.rand(n, generator=generator)
    assert torch.equal(runs[0][2], torch.rand(1, generator=generator))
    # Rows cut to max_length, and probability 0 changes nothing.
    cut = ras(tokens, lengths, "en", torch.Generator(), max_length=5)
    assert int(cut.lengths_B.max()) <= 5
    none = RandomAlignedSubstitution(ras.dictionary, tokenizer, 0.0)
    kept = none(tokens, lengths, "en", torch.Generator())
    assert torch.equal(kept.tokens_BT, tokens[:, : kept.tokens_BT.shape[1]])


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("words.tsv", "file\tDatei\n", "name the dictionary <src>-<tgt>.tsv"),
        ("en-fr.tsv", "file\tfichier\n", "name the dictionary <src>-<tgt>.tsv"),
        ("en-de.tsv", "file Datei\n", r"en-de.tsv:1: expected 'source<TAB>target"),
        ("en-de.tsv", "\n\n", "no 'source<TAB>target' word pairs"),
        ("en-de.tsv", b"file\tDatei\nstreet\tStra\xdfe\n", r"en-de.tsv:2: not valid UTF-8"),
    ],
)
def test_bad_dictionary_files_are_named(
    tokenizer: Tokenizer, tmp_path: Path, name: str, text: str | bytes, message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))
    with pytest.raises(RasDictionaryError, match=message) as error:
        RasDictionary.load([path], tokenizer)
    assert str(path) in str(error.value)
    with pytest.raises(RasDictionaryError, match="not found"):
        RasDictionary.load([tmp_path / "de-en.tsv"], tokenizer)


def test_phrases_are_skipped_and_counted(tokenizer: Tokenizer, tmp_path: Path) -> None:
    path = tmp_path / "en-de.tsv"
    path.write_text("file\tDatei\nlog in\tanmelden\n", encoding="utf-8")
    dictionary = RasDictionary.load([path], tokenizer)
    assert dictionary.files[str(path)] == {"entries": 2, "skipped": 1}
    assert dictionary.size("en") == 2 and dictionary.size("de") == 2  # file and File


# The induced dictionary -------------------------------------------------------------------

PIECES = ["<unk>", "▁file", "s", "▁Datei", "▁the", "▁die", ".", "▁12", "▁error", "▁Fehler"]


def test_whole_word_counts_leave_out_words_that_continue() -> None:
    # Sentences: "▁file s ." | "▁file ." | "▁the ▁file" | "▁file"
    tokens = np.array([1, 2, 6, 1, 6, 4, 1, 1])
    offsets = np.array([0, 3, 5, 7, 8])
    counts = whole_word_counts(tokens, offsets, PIECES)
    direct = np.zeros(len(PIECES), dtype=np.int64)
    for a, b in itertools.pairwise(offsets):
        for i in range(a, b):
            follows = PIECES[tokens[i + 1]] if i + 1 < b else "▁"
            direct[tokens[i]] += follows.startswith("▁") or not any(c.isalnum() for c in follows)
    assert counts.tolist() == direct.tolist()
    assert counts[1] == 3  # "▁file s" is the word "files"
    candidates = word_candidates(PIECES, np.array([0, 3, 9, 0, 5, 0, 9, 9, 3, 0]), 3)
    assert candidates.tolist() == [4, 1, 8]  # "▁12" and "." are no words


def test_induced_pairs_are_csls_nearest_words_above_the_threshold(tmp_path: Path) -> None:
    """Two spaces where the translation of each word is its neighbour: the pairs found are
    the translations, scored as CSLS scores them, minus those below the threshold and the
    word that is its own translation."""
    generator = torch.Generator().manual_seed(0)
    base = torch.nn.functional.normalize(torch.randn(len(PIECES), 16, generator=generator), dim=1)
    en, de = base.clone(), base.clone()
    de[3], de[9] = base[1], base[8]  # Datei is where file is, Fehler where error is
    # "▁the" (row 4 in both) is its own nearest neighbour: no pair.
    counts = {
        "en": np.array([0, 5, 0, 0, 5, 0, 0, 0, 5, 0]),
        "de": np.array([0, 0, 0, 5, 5, 0, 0, 0, 0, 5]),
    }
    pairs = induce_dictionary_pairs(
        {"en": en, "de": de}, counts, PIECES, ("en", "de"), words=10, min_count=1, min_score=-9
    )
    assert {(s, t) for s, t, _ in pairs} == {(1, 3), (8, 9)}
    assert [score for *_, score in pairs] == sorted((score for *_, score in pairs), reverse=True)
    threshold = (pairs[0][2] + pairs[1][2]) / 2
    kept = induce_dictionary_pairs(
        {"en": en, "de": de},
        counts,
        PIECES,
        ("en", "de"),
        words=10,
        min_count=1,
        min_score=threshold,
    )
    assert kept == pairs[:1] and pairs[0][2] > threshold
    path = tmp_path / "en-de.tsv"
    write_dictionary(path, pairs, PIECES)
    lines = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
    assert {(s, t) for s, t, _ in lines} == {("file", "Datei"), ("error", "Fehler")}
    assert [float(x) for *_, x in lines] == pytest.approx([x for *_, x in pairs], abs=1e-4)


# Options ----------------------------------------------------------------------------------


def _config(**values: object) -> TrainConfig:
    paths = {"data": Path(), "spm_model": Path(), "output_dir": Path()}
    return TrainConfig(**{"interface": "none", **paths, **values})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"stage": "mrasp"}, "needs --ras-dictionary"),
        ({"stage": "mrasp", "ras_prob": 1.5, "ras_dictionary": [Path("en-de.tsv")]}, "ras-prob"),
        ({"stage": "finetune", "ras_dictionary": [Path("en-de.tsv")]}, "is read by --stage mrasp"),
        ({"stage": "finetune", "finetune_ras": True}, "needs --ras-dictionary"),
        (
            {"stage": "finetune", "finetune_mode": "unsupervised", "finetune_ras": True},
            "--finetune-mode supervised",
        ),
        ({"stage": "encoder", "interface": "vq", "decoder_noise_ras": True}, "--stage decoder"),
        ({"stage": "mbart", "decoder_noise_ras": True}, "--stage decoder or joint"),
        (
            {"stage": "mrasp", "ras_dictionary": [Path("en-de.tsv")], "valid_prefix": Path("v")},
            "validation belongs to its fine-tuning",
        ),
        ({"stage": "mrasp", "ras_dictionary": [Path("en-de.tsv")], "mp_size": 2}, "mp-size 1"),
    ],
)
def test_ras_options_are_refused_where_nothing_reads_them(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(**values)


def test_ras_options_where_they_apply() -> None:
    dictionary = [Path("en-de.tsv")]
    assert _config(stage="mrasp", interface="vq", ras_dictionary=dictionary).interface == "none"
    assert _config(stage="mrasp", ras_prob=0.0).ras_dictionary == []  # mRASP without RAS
    _config(stage="finetune", finetune_ras=True, ras_dictionary=dictionary)
    _config(stage="joint", interface="cl", decoder_noise_ras=True, ras_dictionary=dictionary)
