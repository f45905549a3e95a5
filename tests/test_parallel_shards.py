"""The shard builder's parallel mode: pairs kept together, through shards, loader and split."""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
import torch
import zstandard

from megasemface.cli.build_shards import main as build_shards_main
from megasemface.data.loading.loader import LoaderConfig, ShardLoader, ShardSource
from megasemface.data.loading.pairs import split_pairs
from megasemface.data.shards.shard_build_config import ShardBuildConfig, ShardBuildError
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.shards.shard_format import Manifest, PairLayout, iter_shard_chunks
from megasemface.data.text.textio import parse_parallel

ROOT = Path(__file__).resolve().parents[1]
PAD, SEP = 3, 2
Pair = tuple[list[int], list[int]]


def encoded_pairs(src: Path, tgt: Path, model: Path, max_tokens: int) -> list[Pair]:
    """What the builder should keep of two aligned files: cleaned, encoded, length-filtered."""
    sp = spm.SentencePieceProcessor(model_file=str(model))
    out = []
    sides = [path.read_bytes().decode("utf-8").split("\n")[:-1] for path in (src, tgt)]
    for a, b in zip(*sides, strict=True):
        ids = [sp.encode(" ".join(text.split())) for text in (a, b)]
        if all(ids) and max(map(len, ids)) <= max_tokens:
            out.append((ids[0], ids[1]))
    return out


def stored_pairs(shard_dir: Path) -> dict[str, list[Pair]]:
    """Every pair of a shard directory, per entry in shard order, split by split_pairs."""
    manifest = Manifest.load(shard_dir)
    out: dict[str, list[Pair]] = {}
    for info in manifest.shards:
        layout = manifest.pair_layouts[info.lang]
        for chunk in iter_shard_chunks(shard_dir / info.name, manifest.vocab_size):
            lengths = chunk.lengths
            padded = np.full((chunk.num_sentences, int(lengths.max())), PAD, dtype=np.int64)
            for row in range(chunk.num_sentences):
                padded[row, : lengths[row]] = chunk.tokens[
                    chunk.offsets[row] : chunk.offsets[row + 1]
                ]
            src, src_len, tgt, tgt_len = split_pairs(
                torch.from_numpy(padded),
                torch.from_numpy(lengths.astype(np.int64)),
                layout.separator_id,
                PAD,
            )
            out.setdefault(info.lang, []).extend(
                (src[i, : src_len[i]].tolist(), tgt[i, : tgt_len[i]].tolist())
                for i in range(chunk.num_sentences)
            )
    return out


def dir_digest(path: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.iterdir())
        if p.is_file()
    }


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


@pytest.fixture(scope="module")
def train_files(demo_corpus: Path) -> tuple[Path, Path]:
    base = demo_corpus / "parallel" / "en-de"
    return base / "train.en", base / "train.de"


@pytest.fixture(scope="module")
def pair_shards(
    tmp_path_factory: pytest.TempPathFactory, train_files: tuple[Path, Path], spm_model: Path
) -> Path:
    """The real en-de training pairs, in small samples and shards, with a tight token limit."""
    out = tmp_path_factory.mktemp("pair-shards")
    src, tgt = train_files
    config = ShardBuildConfig(max_tokens=40, tokens_per_sample=4096, samples_per_shard=4)
    build_shards(parse_parallel([f"en-de:{src},{tgt}"]), spm_model, out, config)
    return out


def test_round_trip_gives_back_the_input_pairs_in_order(
    pair_shards: Path, train_files: tuple[Path, Path], spm_model: Path
) -> None:
    expected = encoded_pairs(*train_files, spm_model, max_tokens=40)
    manifest = Manifest.load(pair_shards)
    assert manifest.pairs == {"en-de": ("en", "de")}
    assert manifest.pair_layouts["en-de"] == PairLayout("en", "de", SEP, 81)
    assert sorted(manifest.languages) == ["en-de"] and len(manifest.shards) > 3
    info = manifest.languages["en-de"]
    lines = train_files[0].read_bytes().count(b"\n")
    assert info["lines"] == lines and info["sentences"] == len(expected)
    # Some pairs are over 40 tokens on one side only; each drop is counted once.
    assert info["filtered"]["too_long_tokens"] > 0
    assert info["lines"] == info["sentences"] + sum(info["filtered"].values())
    assert stored_pairs(pair_shards)["en-de"] == expected


def test_a_bad_line_on_either_side_drops_the_pair(tmp_path: Path, spm_model: Path) -> None:
    src = [
        b"Open the file.",
        b"caf\xe9 au lait",  # invalid UTF-8 on the source side
        b"Close the window.",
        b"Print the page.",
        b"Save the document.",
        b"bell\x07inside",  # control character on the source side
        b"Open   the file.",  # a duplicate pair once cleaned
        b"Open the file.",  # same source, another target: not a duplicate
        b"x" * 81,  # too many characters (limit 80)
        b"Quit the program.",
    ]
    tgt = [
        b"Die Datei \xc3\xb6ffnen.",
        b"Milchkaffee",
        b"\xff\xfe",  # invalid UTF-8 on the target side
        b"   ",  # empty on the target side
        b"Das Dokument speichern.",
        b"Klingel",
        b"Die   Datei \xc3\xb6ffnen.",
        b"Datei \xc3\xb6ffnen!",
        b"zu lang",
        b"Das Programm beenden.",
    ]
    files = write_lines(tmp_path / "t.en", src), tmp_path / "t.de"
    files[1].write_bytes(b"\r\n".join(tgt))  # Windows line ends, no final one: same lines
    config = ShardBuildConfig(max_chars=80, dedup=True)
    corpora = parse_parallel([f"en-de:{files[0]},{files[1]}"])
    manifest = build_shards(corpora, spm_model, tmp_path / "out", config)
    info = manifest["languages"]["en-de"]
    assert info["filtered"] == {
        "invalid_utf8": 2,
        "control_chars": 1,
        "empty": 1,
        "too_long_chars": 1,
        "duplicate": 1,
        "too_long_tokens": 0,
    }
    assert info["lines"] == 10 and info["sentences"] == 4
    sp = spm.SentencePieceProcessor(model_file=str(spm_model))
    decoded = [(sp.decode(a), sp.decode(b)) for a, b in stored_pairs(tmp_path / "out")["en-de"]]
    assert decoded == [
        ("Open the file.", "Die Datei öffnen."),
        ("Save the document.", "Das Dokument speichern."),
        ("Open the file.", "Datei öffnen!"),
        ("Quit the program.", "Das Programm beenden."),
    ]


@pytest.mark.parametrize("longer", ["src", "tgt"])
def test_files_of_different_lengths_are_refused(
    tmp_path: Path, spm_model: Path, longer: str
) -> None:
    lines = [f"Sentence number {i}.".encode() for i in range(500)]
    src = write_lines(tmp_path / "a.en", lines if longer == "src" else lines[:321])
    tgt = write_lines(tmp_path / "a.de", lines if longer == "tgt" else lines[:321])
    config = ShardBuildConfig(bytes_per_task=1000, tokens_per_sample=64, samples_per_shard=2)
    out = tmp_path / "out"
    with pytest.raises(ShardBuildError) as error:
        build_shards(parse_parallel([f"en-de:{src},{tgt}"]), spm_model, out, config)
    message = str(error.value)
    shorter = tgt if longer == "src" else src
    assert str(src) in message and str(tgt) in message
    assert f"{shorter} ends after line 321" in message and "--overwrite" in message
    assert not (out / "manifest.json").exists()


def test_dedup_compares_whole_pairs(tmp_path: Path, spm_model: Path) -> None:
    src = [b"Yes", b"Yes", b"Yes", b"No", b"Yes"]
    tgt = [b"Ja", b"Ja", b"Jawohl", b"Ja", b"Ja"]
    files = write_lines(tmp_path / "d.en", src), write_lines(tmp_path / "d.de", tgt)
    corpora = parse_parallel([f"en-de:{files[0]},{files[1]}"])
    with_dedup = build_shards(corpora, spm_model, tmp_path / "a", ShardBuildConfig(dedup=True))
    assert with_dedup["languages"]["en-de"]["sentences"] == 3
    assert with_dedup["languages"]["en-de"]["filtered"]["duplicate"] == 2
    without = build_shards(corpora, spm_model, tmp_path / "b", ShardBuildConfig())
    assert without["languages"]["en-de"]["sentences"] == 5


def test_parallel_jobs_give_identical_output(
    tmp_path: Path, train_files: tuple[Path, Path], spm_model: Path
) -> None:
    corpora = parse_parallel([f"en-de:{train_files[0]},{train_files[1]}"])
    options = {"tokens_per_sample": 8192, "samples_per_shard": 8, "dedup": True}
    options["bytes_per_task"] = 1 << 15  # many tasks in flight at once
    build_shards(corpora, spm_model, tmp_path / "one", ShardBuildConfig(**options))
    build_shards(corpora, spm_model, tmp_path / "two", ShardBuildConfig(**options, jobs=2))
    assert dir_digest(tmp_path / "one") == dir_digest(tmp_path / "two")


def test_compressed_sides_give_identical_shards(
    tmp_path: Path, demo_corpus: Path, spm_model: Path
) -> None:
    base = demo_corpus / "parallel" / "en-de"
    src, tgt = base / "valid.en", base / "valid.de"
    packed_src = tmp_path / "valid.en.zst"
    packed_src.write_bytes(zstandard.ZstdCompressor().compress(src.read_bytes()))
    packed_tgt = tmp_path / "valid.de.gz"
    packed_tgt.write_bytes(gzip.compress(tgt.read_bytes()))
    config = ShardBuildConfig(tokens_per_sample=4096, samples_per_shard=4, bytes_per_task=4096)
    plain = build_shards(parse_parallel([f"en-de:{src},{tgt}"]), spm_model, tmp_path / "a", config)
    packed = parse_parallel([f"en-de:{packed_src},{packed_tgt}"])
    assert build_shards(packed, spm_model, tmp_path / "b", config)["shards"] == plain["shards"]


def _build_cmd(pair: str, model: Path, out: Path) -> list[str]:
    cmd = [sys.executable, str(ROOT / "tools" / "build_shards.py"), "--spm-model", str(model)]
    cmd += ["--out", str(out), "--tokens-per-sample", "2048", "--samples-per-shard", "4"]
    return [*cmd, "--dedup", "--quiet", "--parallel", pair]


def test_killed_build_resumes_byte_identical(
    tmp_path: Path, train_files: tuple[Path, Path], spm_model: Path
) -> None:
    pair = f"en-de:{train_files[0]},{train_files[1]}"
    reference = tmp_path / "reference"
    config = ShardBuildConfig(tokens_per_sample=2048, samples_per_shard=4, dedup=True)
    build_shards(parse_parallel([pair]), spm_model, reference, config)  # what _build_cmd asks

    interrupted = tmp_path / "interrupted"
    journal = interrupted / ".build-journal.jsonl"
    proc = subprocess.Popen(_build_cmd(pair, spm_model, interrupted))
    deadline = time.monotonic() + 120
    # Kill -9 a few shards into the pairs, so that the resumed run re-hashes a prefix.
    while time.monotonic() < deadline:
        if journal.exists() and journal.read_text().count('"lang": "en-de"') >= 3:
            break
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (interrupted / "manifest.json").exists(), "build finished before it was killed"
    entries = [json.loads(line) for line in journal.read_text().splitlines()[1:]]
    assert not any(e.get("kind") == "language" for e in entries)

    # The same arguments (with more jobs, which do not change the output) complete it.
    result = subprocess.run(
        [*_build_cmd(pair, spm_model, interrupted), "--jobs", "2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert dir_digest(interrupted) == dir_digest(reference), result.stdout
    assert not journal.exists() and not (interrupted / ".partial").exists()


def test_loader_batches_split_into_real_pairs(
    pair_shards: Path, train_files: tuple[Path, Path], spm_model: Path
) -> None:
    manifest = Manifest.load(pair_shards)
    layout = manifest.pair_layouts["en-de"]
    source = ShardSource.from_manifest(manifest)
    expected = {(tuple(a), tuple(b)) for a, b in encoded_pairs(*train_files, spm_model, 40)}
    # max_len below the longest pair would crop targets: refused.
    with pytest.raises(ValueError, match="en-de"):
        ShardLoader(source, LoaderConfig(max_tokens=1024, max_len=80), pad_id=PAD)
    config = LoaderConfig(max_tokens=1024, max_len=layout.max_length, pool_tokens=1 << 14)
    loader = ShardLoader(source, config, pad_id=PAD, rank=1, world_size=2)
    seen = 0
    for batch, _ in zip(loader, range(20), strict=False):
        assert batch.lang == "en-de"
        src, src_len, tgt, tgt_len = split_pairs(
            batch.tokens, batch.lengths, layout.separator_id, PAD
        )
        assert torch.equal(src_len + tgt_len + 1, batch.lengths)
        for i in range(len(batch.lengths)):
            pair = (tuple(src[i, : src_len[i]].tolist()), tuple(tgt[i, : tgt_len[i]].tolist()))
            assert pair in expected
            seen += 1
    assert seen > 100


def test_split_pairs_unit() -> None:
    tokens = torch.tensor(
        [
            [10, 11, SEP, 20, 21, 22],
            [12, SEP, 23, PAD, PAD, PAD],
            [13, 14, 15, SEP, 24, PAD],
        ]
    )
    lengths = torch.tensor([6, 3, 5])
    src, src_len, tgt, tgt_len = split_pairs(tokens, lengths, SEP, PAD)
    assert src.tolist() == [[10, 11, PAD], [12, PAD, PAD], [13, 14, 15]]
    assert tgt.tolist() == [[20, 21, 22], [23, PAD, PAD], [24, PAD, PAD]]
    assert src_len.tolist() == [2, 1, 3] and tgt_len.tolist() == [3, 1, 1]
    # A separator only in the padding (or none at all) is not a pair.
    bad = torch.tensor([[10, 11, 12, SEP], [10, SEP, 20, PAD]])
    with pytest.raises(ValueError, match=r"rows \[0\]"):
        split_pairs(bad, torch.tensor([3, 3]), SEP, PAD)
    with pytest.raises(ValueError, match="lengths"):
        split_pairs(tokens, torch.tensor([6, 3, 7]), SEP, PAD)
    empty = split_pairs(tokens[:0], lengths[:0], SEP, PAD)
    assert [t.shape for t in empty] == [(0, 0), (0,), (0, 0), (0,)]


def test_cli_builds_pairs_and_refuses_bad_pairs(
    tmp_path: Path, demo_corpus: Path, spm_model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = demo_corpus / "parallel" / "en-de"
    pair = f"en-de:{base / 'valid.en'},{base / 'valid.de'}"
    common = ["--spm-model", str(spm_model), "--quiet"]
    mono = f"de:{demo_corpus / 'mono' / 'de.txt'}"
    tool = [sys.executable, str(ROOT / "tools" / "build_shards.py")]
    built = subprocess.run(
        [*tool, *common, "--out", str(tmp_path / "o"), "--parallel", pair, "--input", mono],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert built.returncode == 0, built.stderr
    assert "en-de (pairs)" in built.stdout and "\nde " in built.stdout
    manifest = Manifest.load(tmp_path / "o")
    assert manifest.pairs == {"en-de": ("en", "de")}
    assert sorted(manifest.languages) == ["de", "en-de"]

    out = ["--out", str(tmp_path / "x")]
    unknown = f"en-fr:{base / 'valid.en'},{base / 'valid.de'}"
    assert build_shards_main([*common, *out, "--parallel", unknown]) == 2
    assert "no language tag for fr" in capsys.readouterr().err
    assert build_shards_main([*common, *out, "--parallel", f"en-de:{base / 'valid.en'}"]) == 2
    assert "SRC-TGT:SRC_PATH,TGT_PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # neither --input nor --parallel
        build_shards_main([*common, *out])
    assert "--parallel" in capsys.readouterr().err
    assert not (tmp_path / "x" / "manifest.json").exists()
