"""The README's data-preparation commands, run as a user runs them: tools/*.py scripts."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from megasemface.data.loading.loader import LoaderConfig, ShardLoader, ShardSource
from megasemface.data.shards.shard_format import Manifest
from megasemface.data.text.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def tool(name: str, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / name), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_documented_data_commands(tmp_path: Path, locale_dir: Path) -> None:
    corpus, model, shards = tmp_path / "corpus", tmp_path / "spm" / "joint", tmp_path / "shards"
    tool(
        "make_demo_corpus.py",
        "--langs",
        "de",
        "--out",
        str(corpus),
        "--locale-dir",
        str(locale_dir),
    )
    mono = [f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    inputs = [arg for spec in mono for arg in ("--input", spec)]
    tool(
        "train_spm.py",
        *inputs,
        "--output",
        str(model),
        "--vocab-size",
        "2000",
        "--threads",
        "1",
        "--quiet",
    )
    tokenizer = Tokenizer.load(model.with_suffix(".model"))
    assert tokenizer.languages == ["en", "de"]
    args = [*inputs, "--spm-model", str(model.with_suffix(".model")), "--out", str(shards)]
    out = tool("build_shards.py", *args, "--jobs", "2", "--dedup", "--quiet")
    assert "bytes/token" in out
    again = tool("build_shards.py", *args, "--jobs", "2", "--dedup", "--quiet")
    assert "nothing to do" in again

    manifest = Manifest.load(shards)
    assert manifest.spm_sha256 == tokenizer.sha256
    listing = subprocess.run(
        ["tar", "tf", str(shards / manifest.shards[0].name)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert ".tokens.npy" in listing
    loader = ShardLoader(
        ShardSource.from_manifest(manifest), LoaderConfig(max_tokens=8192), pad_id=3
    )
    batch = next(iter(loader))
    assert tokenizer.decode(batch.tokens[0, : int(batch.lengths[0])].tolist())


@pytest.mark.parametrize(
    ("command", "option", "default"),
    [
        ("translate", "--beam", "5"),
        ("build_shards", "--jobs", "1"),
        ("train_spm", "--vocab-size", "60000"),
        ("build_cl_embeddings", "--dim", "300"),
    ],
)
def test_help_shows_the_defaults(command: str, option: str, default: str) -> None:
    parser = importlib.import_module(f"megasemface.cli.{command}").build_parser()
    metavar = option[2:].upper().replace("-", "_")
    lines = " ".join(parser.format_help().split()).split(f" {option} {metavar} ")
    assert len(lines) == 2 and f"(default: {default})" in lines[1].split(" --")[0], lines
