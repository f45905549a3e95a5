"""Tests for joint SentencePiece training (megasemface.data.text.spm_training), the
tokenizer, the CLI.

Corpora are generated here: seeded random words over Latin, Cyrillic and Gujarati alphabets,
with Zipf-like word frequencies so that BPE has real merges to learn. Models are tiny
(a few hundred learned pieces) so each training takes well under a second.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from megasemface.cli.train_spm import main as cli_main
from megasemface.data.text.languages import lang_tag, temperature_probs
from megasemface.data.text.spm_sampling import (
    LanguageSample,
    balanced_sentences,
    compute_quotas,
    reservoir_sample,
)
from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
from megasemface.data.text.textio import CorpusSpec
from megasemface.data.text.tokenizer import Tokenizer

ALPHABETS = {
    "en": "abcdefghijklmnopqrstuvwxyz",
    "ru": "абвгдежзийклмнопрстуфхцчшщыэюя",
    "gu": "".join(chr(c) for c in range(0x0A95, 0x0AB9) if chr(c).isprintable()) + "ાિીુૂેૈોૌ",
}
VOCAB_SIZE = 700  # 268 reserved ids (4 special, 4 control, 256 bytes) + characters + merges


def make_sentences(lang: str, count: int, seed: int = 0) -> list[str]:
    """``count`` varied sentences in the script of ``lang``."""
    rng = random.Random(f"{lang}:{seed}")
    alphabet = ALPHABETS[lang]
    words = ["".join(rng.choices(alphabet, k=rng.randint(2, 9))) for _ in range(600)]
    weights = [1.0 / (rank + 1) for rank in range(len(words))]
    sentences = []
    for _ in range(count):
        sentence = " ".join(rng.choices(words, weights, k=rng.randint(3, 14)))
        if rng.random() < 0.2:
            sentence += f" {rng.randint(0, 9999)}."
        sentences.append(sentence)
    return sentences


def write_corpus(path: Path, lines: list[str]) -> Path:
    data = ("\n".join(lines) + "\n").encode("utf-8")
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data, mtime=0))
    else:
        path.write_bytes(data)
    return path


def small_config(**overrides: Any) -> SpmTrainConfig:
    options: dict[str, Any] = {"vocab_size": VOCAB_SIZE, "num_threads": 1, "seed": 7}
    options.update(overrides)
    return SpmTrainConfig(**options)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory: pytest.TempPathFactory) -> list[CorpusSpec]:
    root = tmp_path_factory.mktemp("corpora")
    en = make_sentences("en", 3000)
    return [
        # Two files for one language, one of them compressed: both are read, in order.
        CorpusSpec(
            "en",
            [
                write_corpus(root / "en1.txt", en[:1500]),
                write_corpus(root / "en2.txt.gz", en[1500:]),
            ],
        ),
        CorpusSpec("ru", [write_corpus(root / "ru.txt", make_sentences("ru", 2000))]),
        CorpusSpec("gu", [write_corpus(root / "gu.txt", make_sentences("gu", 400))]),
    ]


@pytest.fixture(scope="module")
def trained(
    corpora: list[CorpusSpec], tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, Any]]:
    prefix = tmp_path_factory.mktemp("model") / "joint"
    report = train_spm(corpora, prefix, small_config())
    return prefix, report


@pytest.fixture(scope="module")
def tok(trained: tuple[Path, dict[str, Any]]) -> Tokenizer:
    return Tokenizer.load(trained[0].with_suffix(".model"))


# ---------------------------------------------------------------------------------------------
# Vocabulary layout


def test_special_ids(tok: Tokenizer) -> None:
    assert (tok.unk_id, tok.bos_id, tok.eos_id, tok.pad_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert tok.processor.IdToPiece(4) == "<mask>"
    assert tok.vocab_size == VOCAB_SIZE == len(tok)
    assert tok.id_dtype == np.uint16


def test_languages_are_read_back_from_the_model(tok: Tokenizer) -> None:
    assert tok.languages == ["en", "ru", "gu"]
    assert [tok.lang_id(lang) for lang in tok.languages] == [5, 6, 7]
    # Also without the file: the languages live in the model bytes themselves.
    assert Tokenizer.from_bytes(tok.model_bytes).languages == ["en", "ru", "gu"]


def test_language_tags_are_control_symbols(tok: Tokenizer) -> None:
    for lang in tok.languages:
        tag_id = tok.lang_id(lang)
        assert tok.processor.IsControl(tag_id)
        assert tok.processor.IdToPiece(tag_id) == lang_tag(lang)
        # Text that spells a tag must never produce the tag id: only code inserts tags.
        (ids,) = tok.encode([f"{lang_tag(lang)} abc"])
        assert tag_id not in ids
    (ids,) = tok.encode(["__de__ <mask> <pad> <s>"])
    assert not {tok.mask_id, tok.pad_id, tok.bos_id, tok.eos_id} & set(ids)


def test_unknown_language(tok: Tokenizer) -> None:
    with pytest.raises(KeyError, match=r"'de'.*en, ru, gu"):
        tok.lang_id("de")


def test_byte_fallback_round_trip(tok: Tokenizer) -> None:
    text = "abc 😀 漢字 ok"  # emoji and CJK never occur in the training data
    (ids,) = tok.encode([text])
    assert tok.unk_id not in ids
    assert tok.decode(ids) == text


def test_encode_batch_and_decode_skips_control_ids(tok: Tokenizer) -> None:
    texts = make_sentences("ru", 5, seed=99) + make_sentences("gu", 5, seed=99)
    batch = tok.encode(texts, num_threads=2)
    assert batch == [tok.encode([t])[0] for t in texts]
    for text, ids in zip(texts, batch, strict=True):
        assert tok.unk_id not in ids
        wrapped = [tok.bos_id, tok.lang_id("ru"), *ids, tok.mask_id, tok.eos_id, tok.pad_id]
        assert tok.decode(wrapped) == text
        assert tok.decode(np.array(wrapped, dtype=tok.id_dtype)) == text
    assert tok.encode([]) == []
    with pytest.raises(TypeError, match="list of texts"):
        tok.encode("not a list")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([tok.vocab_size])


def test_identity_and_pickle(tok: Tokenizer, trained: tuple[Path, dict[str, Any]]) -> None:
    model_path = trained[0].with_suffix(".model")
    assert tok.path == model_path
    assert tok.model_bytes == model_path.read_bytes()
    assert tok.sha256 == hashlib.sha256(tok.model_bytes).hexdigest() == trained[1]["model_sha256"]
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.sha256 == tok.sha256 and clone.languages == tok.languages
    assert Tokenizer.from_bytes(tok.model_bytes).path is None


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.model"):
        Tokenizer.load(tmp_path / "nope.model")
    garbage = tmp_path / "garbage.model"
    garbage.write_bytes(b"this is not a protobuf")
    with pytest.raises(ValueError, match="not a SentencePiece model"):
        Tokenizer.load(garbage)
    with pytest.raises(ValueError, match="empty"):
        Tokenizer.from_bytes(b"")


# ---------------------------------------------------------------------------------------------
# Outputs and report


def test_outputs_and_report(trained: tuple[Path, dict[str, Any]]) -> None:
    prefix, report = trained
    on_disk = json.loads(prefix.with_suffix(".json").read_text(encoding="utf-8"))
    assert on_disk == report
    assert report["languages"] == ["en", "ru", "gu"]
    assert report["vocab_size"] == VOCAB_SIZE and report["model_type"] == "bpe"
    assert report["config"]["seed"] == 7
    per_lang = report["per_language"]
    assert per_lang["en"]["lines_usable"] == 3000
    assert sum(v["quota"] for v in per_lang.values()) == report["training_sentences"]
    vocab_lines = prefix.with_suffix(".vocab").read_text(encoding="utf-8").splitlines()
    assert len(vocab_lines) == VOCAB_SIZE
    assert vocab_lines[4].split("\t")[0] == "<mask>"
    # Only the three outputs: no temporary file is left behind.
    assert sorted(p.name for p in prefix.parent.iterdir()) == [
        "joint.json",
        "joint.model",
        "joint.vocab",
    ]


def test_same_seed_gives_byte_identical_model(
    corpora: list[CorpusSpec], trained: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    # Another output path too: the path must not leak into the model bytes.
    report = train_spm(corpora, tmp_path / "again", small_config())
    first = trained[0]
    assert (tmp_path / "again.model").read_bytes() == first.with_suffix(".model").read_bytes()
    assert (tmp_path / "again.vocab").read_bytes() == first.with_suffix(".vocab").read_bytes()
    assert report["model_sha256"] == trained[1]["model_sha256"]


def test_multithreaded_bpe_is_deterministic(corpora: list[CorpusSpec], tmp_path: Path) -> None:
    # Two threads also read the languages in parallel processes.
    reports = [train_spm(corpora, tmp_path / f"m{i}", small_config(num_threads=2)) for i in (1, 2)]
    assert reports[0]["model_sha256"] == reports[1]["model_sha256"]
    # The bytes record num_threads, but BPE learns the same pieces whatever the thread count.
    single = train_spm(corpora, tmp_path / "single", small_config(num_threads=1))
    multi, one = Tokenizer.load(tmp_path / "m1.model"), Tokenizer.load(tmp_path / "single.model")
    pieces = [[t.processor.IdToPiece(i) for i in range(t.vocab_size)] for t in (multi, one)]
    assert pieces[0] == pieces[1]
    assert single["per_language"] == reports[0]["per_language"]


def test_training_respects_the_cap_and_the_seed(corpora: list[CorpusSpec], tmp_path: Path) -> None:
    reports = [
        train_spm(
            corpora, tmp_path / f"s{seed}", small_config(max_sentences_per_lang=500, seed=seed)
        )
        for seed in (1, 2)
    ]
    for report in reports:
        assert [v["sampled"] for v in report["per_language"].values()] == [500, 500, 400]
    # A capped language is sampled differently under another seed, so the model changes too.
    assert reports[0]["model_sha256"] != reports[1]["model_sha256"]
    a = reservoir_sample(corpora[0], capacity=500, seed=1, max_sentence_chars=2000)
    b = reservoir_sample(corpora[0], capacity=500, seed=2, max_sentence_chars=2000)
    assert a.lines != b.lines


# ---------------------------------------------------------------------------------------------
# Sampling


def test_reservoir_is_bounded_deterministic_and_counts_drops(tmp_path: Path) -> None:
    good = [f"line {i}" for i in range(5000)]
    raw = b"\n".join(s.encode() for s in good)
    raw += b"\n\n   \n\xff\xfe broken\n" + b"x" * 60 + b"\n" + "é".encode() * 30 + b"\n"
    path = tmp_path / "mixed.txt"
    path.write_bytes(raw)
    spec = CorpusSpec("xx", [path])

    sample = reservoir_sample(spec, capacity=100, seed=3, max_sentence_chars=50)
    assert len(sample.lines) == 100
    counts = sample.counts()
    assert counts["lines_read"] == 5005
    assert counts["lines_usable"] == 5001  # 30 "é" are 60 bytes but only 30 characters
    assert counts["dropped_empty"] == 2
    assert counts["dropped_invalid_utf8"] == 1
    assert counts["dropped_too_long"] == 1
    allowed = {s.encode() for s in good} | {"é".encode() * 30}
    assert set(sample.lines) <= allowed
    assert len(set(sample.lines)) == 100
    # A uniform sample, not the head of the file: most kept lines come from later on.
    late = sum(int(line.split()[1]) >= 1000 for line in sample.lines if line.startswith(b"line"))
    assert late > 60

    again = reservoir_sample(spec, capacity=100, seed=3, max_sentence_chars=50)
    assert again.lines == sample.lines

    everything = reservoir_sample(spec, capacity=10_000, seed=3, max_sentence_chars=50)
    assert len(everything.lines) == 5001  # below capacity: all kept, in file order
    assert everything.lines[:3] == [b"line 0", b"line 1", b"line 2"]


def test_quotas_follow_temperature_probs() -> None:
    counts = {"big": 90_000, "small": 1_000}
    budget = 20_000
    quotas = compute_quotas(counts, budget, temperature=2.0)
    assert sum(quotas.values()) == budget
    probs = temperature_probs(counts, 2.0)
    for lang in counts:
        assert abs(quotas[lang] - probs[lang] * budget) <= 1
    raw_share = counts["small"] / sum(counts.values())
    assert quotas["small"] / budget > 5 * raw_share  # strongly up-weighted
    assert compute_quotas(counts, budget, temperature=1.0)["small"] == round(raw_share * budget)
    # A language with data never gets 0, even when rounding would give it nothing.
    assert compute_quotas({"a": 10**9, "b": 1}, 10, temperature=1.0)["b"] == 1


def test_balanced_stream_upsamples_by_cycling() -> None:
    big = LanguageSample(lang="big", paths=[], lines=[f"b{i}".encode() for i in range(100)])
    small = LanguageSample(lang="small", paths=[], lines=[f"s{i}".encode() for i in range(7)])
    stream = list(balanced_sentences([big, small], {"big": 40, "small": 30}, seed=1))
    assert len(stream) == 70
    small_part = stream[40:]
    assert all(line.startswith(b"s") for line in small_part)
    # 30 = 4 full passes over the 7 lines + 2: counts differ by at most one.
    counts = {line: small_part.count(line) for line in set(small_part)}
    assert len(counts) == 7 and set(counts.values()) == {4, 5}
    assert len(set(stream[:40])) == 40  # down-sampling never repeats
    assert stream == list(balanced_sentences([big, small], {"big": 40, "small": 30}, seed=1))


def test_temperature_balancing_in_training(corpora: list[CorpusSpec], tmp_path: Path) -> None:
    pair = [corpora[0], corpora[2]]  # en: 3000 lines, gu: 400 lines
    report = train_spm(pair, tmp_path / "pair", small_config(temperature=5.0))
    per_lang = report["per_language"]
    en, gu = per_lang["en"], per_lang["gu"]
    probs = temperature_probs({"en": 3000, "gu": 400}, 5.0)
    assert gu["raw_share"] == pytest.approx(400 / 3400)
    assert gu["probability"] == pytest.approx(probs["gu"])
    assert gu["share"] > gu["raw_share"]
    assert gu["quota"] == pytest.approx(probs["gu"] * 3400, abs=1)
    assert gu["quota"] > gu["sampled"] == 400  # really up-sampled, not just re-weighted
    assert en["quota"] < en["sampled"]


# ---------------------------------------------------------------------------------------------
# Errors


def test_empty_language_is_an_error(corpora: list[CorpusSpec], tmp_path: Path) -> None:
    empty = tmp_path / "empty.de.txt"
    empty.write_bytes(b"\n  \n\xff\xff\n")
    with pytest.raises(ValueError, match=r"'de'.*empty\.de\.txt.*2 blank, 1 invalid UTF-8"):
        train_spm([corpora[0], CorpusSpec("de", [empty])], tmp_path / "m", small_config())
    assert not list(tmp_path.glob("m.*"))


def test_vocab_too_large_is_a_clear_error(corpora: list[CorpusSpec], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"lower --vocab-size.*Vocabulary size too high"):
        train_spm(corpora[2:], tmp_path / "m", small_config(vocab_size=20_000))
    assert not list(tmp_path.glob("m.*"))


def test_vocab_too_small_is_a_clear_error(corpora: list[CorpusSpec], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"raise --vocab-size$"):
        train_spm(corpora, tmp_path / "m", small_config(vocab_size=200))  # < 256 bytes
    # Room for the reserved ids, not for the ~110 characters of three scripts on top.
    with pytest.raises(ValueError, match=r"raise --vocab-size or lower --character-coverage"):
        train_spm(corpora, tmp_path / "m", small_config(vocab_size=300))


def test_missing_file_is_reported_before_reading(corpora: list[CorpusSpec], tmp_path: Path) -> None:
    missing = CorpusSpec("de", [tmp_path / "missing.txt"])
    with pytest.raises(FileNotFoundError, match=r"'de'.*missing\.txt"):
        train_spm([*corpora, missing], tmp_path / "m", small_config())


@pytest.mark.parametrize(
    "overrides",
    [
        {"vocab_size": 0},
        {"vocab_size": True},
        {"model_type": "wordpiece"},
        {"character_coverage": 0.5},
        {"max_sentences_per_lang": 0},
        {"temperature": 0.0},
        {"temperature": float("nan")},
        {"seed": -1},
        {"num_threads": 0},
        {"max_sentence_chars": 0},
        {"extra_control_symbols": ("__xx__",)},
        {"extra_control_symbols": ("<mask>",)},
        {"extra_control_symbols": ("a b",)},
    ],
)
def test_config_validation(overrides: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        small_config(**overrides)


def test_corrupt_archive_is_reported(
    corpora: list[CorpusSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truncated = tmp_path / "cut.txt.gz"
    whole = gzip.compress("".join(f"line {i}\n" for i in range(5000)).encode())
    truncated.write_bytes(whole[: len(whole) // 2])
    inputs = ["--input", f"en:{corpora[0].paths[0]}", "--input", f"de:{truncated}"]
    code = cli_main([*inputs, "--output", str(tmp_path / "m"), "--threads", "1", "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "cut.txt.gz" in err and "'de'" in err and "Traceback" not in err


def test_unigram_has_the_same_layout(corpora: list[CorpusSpec], tmp_path: Path) -> None:
    report = train_spm(corpora, tmp_path / "uni", small_config(model_type="unigram"))
    tok = Tokenizer.load(tmp_path / "uni.model")
    assert report["model_type"] == "unigram"
    assert (tok.mask_id, tok.languages, tok.lang_id("gu")) == (4, ["en", "ru", "gu"], 7)
    (ids,) = tok.encode(["ok 😀"])
    assert tok.unk_id not in ids and tok.decode(ids) == "ok 😀"


def test_extra_control_symbols_follow_language_tags(
    corpora: list[CorpusSpec], tmp_path: Path
) -> None:
    train_spm(corpora[1:], tmp_path / "x", small_config(extra_control_symbols=("<sep>",)))
    tok = Tokenizer.load(tmp_path / "x.model")
    assert tok.languages == ["ru", "gu"]
    assert tok.processor.PieceToId("<sep>") == 7 and tok.processor.IsControl(7)


# ---------------------------------------------------------------------------------------------
# CLI


def test_cli_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nothere.txt"
    code = cli_main(["--input", f"fr:{missing}", "--output", str(tmp_path / "m"), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err
    assert "nothere.txt" in err and "'fr'" in err and "Traceback" not in err


def test_cli_bad_input_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["--input", "no-colon", "--output", str(tmp_path / "m"), "--quiet"]) == 2
    assert "LANG:PATH" in capsys.readouterr().err


def test_cli_trains_and_prints_table(
    corpora: list[CorpusSpec], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inputs = [f"{spec.lang}:{path}" for spec in corpora for path in spec.paths]
    argv = [arg for item in inputs for arg in ("--input", item)]
    argv += ["--output", str(tmp_path / "cli"), "--vocab-size", str(VOCAB_SIZE), "--threads", "1"]
    assert cli_main([*argv, "--seed", "7", "--quiet"]) == 0
    out = capsys.readouterr().out
    for lang in ("en", "ru", "gu"):
        assert f"\n{lang} " in out
    assert str(tmp_path / "cli.model") in out
    assert Tokenizer.load(tmp_path / "cli.model").languages == ["en", "ru", "gu"]
