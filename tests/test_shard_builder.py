"""The shard builder: filters and their counts, the format, determinism and resume."""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
import lzma
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import webdataset as wds
import zstandard

from megasemface.cli.build_shards import main as build_shards_main
from megasemface.data.shards.shard_build_config import ShardBuildConfig, ShardBuildError
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.shards.shard_format import Manifest, iter_shard_chunks
from megasemface.data.text.textio import parse_lang_path

GOOD = [
    "The file could not be opened.",
    "Die Datei konnte nicht geöffnet werden.",
    "  Save   the\tdocument before closing?  ",
    "Ünïcödé — “quotes” and emoji 🙂 stay intact.",
]


def read_sentences(shard_dir: Path, model: Path) -> dict[str, list[str]]:
    """Decodes every sentence of a shard directory, per language, in shard order."""
    manifest = Manifest.load(shard_dir)
    sp = spm.SentencePieceProcessor(model_file=str(model))
    out: dict[str, list[str]] = {}
    for info in manifest.shards:
        for chunk in iter_shard_chunks(shard_dir / info.name, manifest.vocab_size):
            for i in range(chunk.num_sentences):
                ids = chunk.tokens[chunk.offsets[i] : chunk.offsets[i + 1]].tolist()
                out.setdefault(chunk.lang, []).append(sp.decode(ids))
    return out


def dir_digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def test_every_kind_of_bad_line_is_dropped_and_counted(tmp_path: Path, spm_model: Path) -> None:
    lines = [
        GOOD[0].encode(),
        b"",  # empty
        b"   \t  ",  # white space only: empty after cleaning
        b"caf\xe9 au lait",  # Latin-1, not UTF-8
        b"\xff\xfe\x00b\x00a\x00d",  # UTF-16 bytes
        b"bell\x07inside",  # C0 control
        "line\u2028separator".encode(),  # Unicode line separator
        "c1\u0085control".encode(),  # C1 control (NEL)
        ("x" * 81).encode(),  # too many characters (limit 80 below)
        GOOD[1].encode(),
        GOOD[0].encode(),  # exact duplicate
        b"  The file could not be opened.  ",  # duplicate once cleaned
        ("漢字" * 10).encode(),  # 20 characters, but about 60 byte-fallback tokens
        GOOD[2].encode(),
        GOOD[3].encode(),
        b"last line without newline\r",
    ]
    corpus = tmp_path / "mixed.txt"
    corpus.write_bytes(b"\n".join(lines))
    config = ShardBuildConfig(max_chars=80, max_tokens=40, dedup=True)
    manifest = build_shards(parse_lang_path([f"de:{corpus}"]), spm_model, tmp_path / "out", config)

    info = manifest["languages"]["de"]
    assert info["lines"] == len(lines)
    assert info["filtered"] == {
        "empty": 2,
        "invalid_utf8": 2,
        "control_chars": 3,
        "too_long_chars": 1,
        "duplicate": 2,
        "too_long_tokens": 1,
    }
    assert info["sentences"] == 5
    assert info["lines"] == info["sentences"] + sum(info["filtered"].values())
    decoded = read_sentences(tmp_path / "out", spm_model)["de"]
    expected = [GOOD[0], GOOD[1], "Save the document before closing?", GOOD[3]]
    expected.append("last line without newline")
    # SentencePiece normalises (NFKC) but byte fallback keeps every character.
    assert decoded == expected


def test_dedup_off_keeps_duplicates(tmp_path: Path, spm_model: Path) -> None:
    corpus = tmp_path / "dups.txt"
    corpus.write_text("\n".join([GOOD[0]] * 3 + [GOOD[1]]) + "\n", encoding="utf-8")
    manifest = build_shards(
        parse_lang_path([f"en:{corpus}"]), spm_model, tmp_path / "out", ShardBuildConfig()
    )
    assert manifest["languages"]["en"]["sentences"] == 4
    assert manifest["languages"]["en"]["filtered"]["duplicate"] == 0


def test_the_sentence_length_limit_keeps_its_former_name_with_a_warning(
    tmp_path: Path, spm_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "en.txt"
    corpus.write_text("\n".join(GOOD) + "\n", encoding="utf-8")
    common = ["--quiet", "--spm-model", str(spm_model), "--input", f"en:{corpus}"]
    assert build_shards_main([*common, "--out", str(tmp_path / "a"), "--max-tokens", "9"]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--max-tokens is now --max-sentence-tokens" in err
    limit = ["--max-sentence-tokens", "9"]
    assert build_shards_main([*common, "--out", str(tmp_path / "b"), *limit]) == 0
    assert capsys.readouterr().err == ""
    old, new = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")
    assert old["languages"] == new["languages"]
    assert 0 < new["languages"]["en"]["filtered"]["too_long_tokens"] < len(GOOD)


def test_a_language_the_model_has_no_tag_for_is_refused(
    tmp_path: Path, spm_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "fr.txt"
    corpus.write_text("\n".join(GOOD) + "\n", encoding="utf-8")
    argv = ["--quiet", "--spm-model", str(spm_model), "--input", f"fr:{corpus}"]
    assert build_shards_main([*argv, "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("build_shards: error: --input fr: the SentencePiece model ")
    assert "no language tag for fr (its languages: " in line
    assert not (tmp_path / "out" / "manifest.json").exists()


def _real_corpus(demo_corpus: Path, tmp_path: Path, copies: int = 1) -> dict[str, Path]:
    files = {}
    for lang in ("en", "de"):
        text = (demo_corpus / "mono" / f"{lang}.txt").read_bytes()
        files[lang] = tmp_path / f"{lang}.txt"
        files[lang].write_bytes(text * copies)
    return files


def test_format_counts_and_readers(tmp_path: Path, spm_model: Path, demo_corpus: Path) -> None:
    files = _real_corpus(demo_corpus, tmp_path)
    config = ShardBuildConfig(tokens_per_sample=8192, samples_per_shard=8)
    inputs = [f"{lang}:{path}" for lang, path in files.items()]
    manifest = build_shards(parse_lang_path(inputs), spm_model, tmp_path / "out", config)
    out = tmp_path / "out"
    assert manifest["id_dtype"] == "uint16"
    assert manifest["spm"]["sha256"] == hashlib.sha256(spm_model.read_bytes()).hexdigest()
    for lang, path in files.items():
        lines = path.read_bytes().count(b"\n")
        assert manifest["languages"][lang]["lines"] == lines
    # Every shard is a plain tar with only npy and json members, and its sha256 is listed.
    for entry in manifest["shards"]:
        shard = out / entry["name"]
        assert hashlib.sha256(shard.read_bytes()).hexdigest() == entry["sha256"]
        with tarfile.open(shard) as tar:
            names = tar.getnames()
        assert names and all(n.endswith((".tokens.npy", ".lengths.npy.gz", ".json")) for n in names)
        assert len(names) == 3 * entry["samples"]
    # Plain webdataset reads the shards with its own decoders.
    dataset = wds.WebDataset(
        str(out / manifest["shards"][0]["name"]), shardshuffle=False, empty_check=False
    ).decode()
    first = next(iter(dataset))
    assert first["tokens.npy"].dtype == np.uint16
    assert first["json"]["sentences"] == len(first["lengths.npy.gz"])
    # What comes back is exactly the cleaned input text (no sentence lost or reordered).
    decoded = read_sentences(out, spm_model)
    for lang, path in files.items():
        original = [" ".join(line.split()) for line in path.read_text("utf-8").splitlines()]
        normalize = spm.SentencePieceProcessor(model_file=str(spm_model))
        expected = [normalize.decode(normalize.encode(t)) for t in original if t]
        assert decoded[lang] == expected


def test_default_layout_stays_under_2_2_bytes_per_token(
    tmp_path: Path, spm_model: Path, demo_corpus: Path
) -> None:
    corpus = demo_corpus / "mono" / "de.txt"
    out = tmp_path / "out"
    manifest = build_shards(parse_lang_path([f"de:{corpus}"]), spm_model, out, ShardBuildConfig())
    on_disk = sum(p.stat().st_size for p in out.glob("*.tar"))
    assert on_disk == manifest["totals"]["bytes"]
    # uint16 ids cost 2 bytes; tar headers, npy headers and lengths must add under 10%.
    assert on_disk / manifest["totals"]["tokens"] <= 2.2


@pytest.mark.parametrize("suffix", [".gz", ".xz", ".zst"])
def test_compressed_input_gives_identical_shards(
    tmp_path: Path, spm_model: Path, demo_corpus: Path, suffix: str
) -> None:
    plain = demo_corpus / "mono" / "de.txt"
    data = plain.read_bytes()
    packed = tmp_path / f"de.txt{suffix}"
    if suffix == ".gz":
        packed.write_bytes(gzip.compress(data))
    elif suffix == ".xz":
        packed.write_bytes(lzma.compress(data))
    else:
        packed.write_bytes(zstandard.ZstdCompressor().compress(data))
    config = ShardBuildConfig(tokens_per_sample=8192, samples_per_shard=8)
    a = build_shards(parse_lang_path([f"de:{plain}"]), spm_model, tmp_path / "a", config)
    b = build_shards(parse_lang_path([f"de:{packed}"]), spm_model, tmp_path / "b", config)
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]


def test_parallel_jobs_give_identical_output(
    tmp_path: Path, spm_model: Path, demo_corpus: Path
) -> None:
    files = _real_corpus(demo_corpus, tmp_path)
    inputs = parse_lang_path([f"{lang}:{path}" for lang, path in files.items()])
    one = ShardBuildConfig(tokens_per_sample=8192, samples_per_shard=8, dedup=True)
    two = ShardBuildConfig(tokens_per_sample=8192, samples_per_shard=8, dedup=True, jobs=2)
    build_shards(inputs, spm_model, tmp_path / "one", one)
    build_shards(inputs, spm_model, tmp_path / "two", two)
    assert dir_digest(tmp_path / "one") == dir_digest(tmp_path / "two")


def _build_cmd(inputs: dict[str, Path], model: Path, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "megasemface.cli.build_shards", "--spm-model", str(model)]
    cmd += ["--out", str(out), "--tokens-per-sample", "2048", "--samples-per-shard", "4"]
    cmd += ["--dedup", "--quiet"]
    for lang, path in inputs.items():
        cmd += ["--input", f"{lang}:{path}"]
    return cmd


def test_killed_build_resumes_byte_identical(
    tmp_path: Path, spm_model: Path, demo_corpus: Path
) -> None:
    files = _real_corpus(demo_corpus, tmp_path, copies=1)
    reference = tmp_path / "reference"
    subprocess.run(_build_cmd(files, spm_model, reference), check=True, capture_output=True)

    interrupted = tmp_path / "interrupted"
    journal = interrupted / ".build-journal.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(_build_cmd(files, spm_model, interrupted), env=env)
    deadline = time.monotonic() + 120
    # Kill -9 once the second language is under way, past a few shards of it.
    while time.monotonic() < deadline:
        if journal.exists() and journal.read_text().count('"lang": "de"') >= 3:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (interrupted / "manifest.json").exists(), "build finished before it was killed"
    entries = [json.loads(line) for line in journal.read_text().splitlines()[1:]]
    assert any(e.get("kind") == "language" for e in entries)  # en finished, de did not

    # Run again with the same arguments: it completes, and the result is byte-identical.
    result = subprocess.run(
        _build_cmd(files, spm_model, interrupted), capture_output=True, text=True, check=True
    )
    assert dir_digest(interrupted) == dir_digest(reference)
    assert not journal.exists() and not (interrupted / ".partial").exists()
    # A third run has nothing to do.
    again = subprocess.run(
        _build_cmd(files, spm_model, interrupted), capture_output=True, text=True, check=True
    )
    assert "nothing to do" in again.stdout, result.stdout


def test_resume_with_changed_input_is_refused(
    tmp_path: Path, spm_model: Path, demo_corpus: Path
) -> None:
    files = _real_corpus(demo_corpus, tmp_path)
    out = tmp_path / "out"
    build_shards(parse_lang_path([f"de:{files['de']}"]), spm_model, out, ShardBuildConfig())
    files["de"].write_bytes(files["de"].read_bytes() + b"Noch ein Satz.\n")
    with pytest.raises(ShardBuildError, match="--overwrite"):
        build_shards(parse_lang_path([f"de:{files['de']}"]), spm_model, out, ShardBuildConfig())
    manifest = build_shards(
        parse_lang_path([f"de:{files['de']}"]), spm_model, out, ShardBuildConfig(), overwrite=True
    )
    assert manifest["languages"]["de"]["lines"] == files["de"].read_bytes().count(b"\n")


def test_cli_reports_bad_input_clearly(
    tmp_path: Path, spm_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.txt"
    assert (
        build_shards_main(
            [
                "--spm-model",
                str(spm_model),
                "--out",
                str(tmp_path / "o"),
                "--input",
                f"de:{missing}",
            ]
        )
        == 2
    )
    assert str(missing) in capsys.readouterr().err
    not_a_model = tmp_path / "model.txt"
    not_a_model.write_text("hello")
    corpus = tmp_path / "c.txt"
    corpus.write_text("Hallo Welt\n")
    assert (
        build_shards_main(
            [
                "--spm-model",
                str(not_a_model),
                "--out",
                str(tmp_path / "o"),
                "--input",
                f"de:{corpus}",
            ]
        )
        == 2
    )
    assert "not a SentencePiece model" in capsys.readouterr().err
    only_bad = tmp_path / "bad.txt"
    only_bad.write_bytes(b"\xff\xfe\n\n\x07\n")
    assert (
        build_shards_main(
            [
                "--spm-model",
                str(spm_model),
                "--out",
                str(tmp_path / "o2"),
                "--input",
                f"de:{only_bad}",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "no sentence kept" in err and "invalid_utf8" in err
    assert (
        build_shards_main(
            ["--spm-model", str(spm_model), "--out", str(tmp_path / "o"), "--input", "no-colon"]
        )
        == 2
    )


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".xz", ".zst"])
def test_a_truncated_compressed_corpus_is_named_in_one_line(
    tmp_path: Path,
    spm_model: Path,
    demo_corpus: Path,
    suffix: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = (demo_corpus / "mono" / "de.txt").read_bytes()[:200_000]
    compress = {
        ".gz": gzip.compress,
        ".bz2": bz2.compress,
        ".xz": lzma.compress,
        ".zst": zstandard.ZstdCompressor().compress,
    }[suffix]
    whole = compress(text)
    cut = tmp_path / f"cut.txt{suffix}"
    cut.write_bytes(whole[: len(whole) // 2])
    out = tmp_path / "o"
    args = ["--spm-model", str(spm_model), "--out", str(out), "--input", f"de:{cut}"]
    assert build_shards_main(args) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(lines) == 1 and str(cut) in lines[0] and "truncated or damaged" in lines[0]
    assert not (out / "manifest.json").exists()  # no manifest claims a corpus it did not read
