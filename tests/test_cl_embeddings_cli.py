"""The documented cross-lingual embedding command, run as a user runs it, on the real demo corpus.

The command is read from the section of docs/corpus.md itself, so the documented options
are the ones tested; only the paths are replaced by this session's corpus, model and shards. One run
gives the table, the report and the quality figures every test here checks.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
from megasemface.data.text.textio import parse_lang_path
from megasemface.interfaces.cross_lingual import CrossLingualInterface, load_embedding_table
from megasemface.interfaces.factory import build_interface
from megasemface.nn.config import build_model_config

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 8000


def documented_command() -> list[str]:
    """The command of docs/corpus.md's "Cross-lingual embeddings" section, as argv."""
    guide = (ROOT / "docs" / "corpus.md").read_text(encoding="utf-8")
    heading = "## 4. Cross-lingual embeddings"
    assert heading in guide, f"docs/corpus.md has no section {heading!r}"
    section = guide.split(heading, 1)[1].split("\n## ", 1)[0]
    assert "```bash\n" in section, "docs/corpus.md's embeddings section has no bash block"
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


@pytest.fixture(scope="module")
def demo_shards(demo_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo corpus under an 8000-piece joint model, as `make demo` builds it.

    (The session's 1000-piece model splits all but a few dictionary words into several
    pieces, leaving too few single-piece entries for lexicon induction.)
    """
    root = tmp_path_factory.mktemp("cl-demo")
    corpora = parse_lang_path(
        [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    )
    train_spm(corpora, root / "joint", SpmTrainConfig(vocab_size=VOCAB, num_threads=1, seed=1))
    build_shards(corpora, root / "joint.model", root / "shards", ShardBuildConfig(jobs=1))
    return root


@pytest.fixture(scope="module")
def cli_run(demo_shards: Path, demo_corpus: Path) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    """Runs the documented command; returns (output prefix, report, printed summary)."""
    argv = documented_command()
    assert argv[:2] == ["python", "tools/build_cl_embeddings.py"], argv
    paths = {
        "--shards": demo_shards / "shards",
        "--spm-model": demo_shards / "joint.model",
        "--out": demo_shards / "cl" / "en-de",
        "--gold-dict": demo_corpus / "dict" / "en-de.tsv",
    }
    args = argv[2:]
    for i, arg in enumerate(args):
        if arg in paths:
            args[i + 1] = str(paths[arg])
    assert set(paths) <= set(args), f"the documented command lacks one of {sorted(paths)}"
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "build_cl_embeddings.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    out = paths["--out"]
    report = json.loads(out.with_name("en-de.json").read_text(encoding="utf-8"))
    return out, report, json.loads(result.stdout)


def test_documented_command_writes_the_table_and_its_report(
    cli_run: tuple[Path, dict[str, Any], dict[str, Any]],
) -> None:
    out, report, summary = cli_run
    dim = report["dim"]
    table = load_embedding_table(out.with_name("en-de.safetensors"), VOCAB, dim)
    assert torch.isfinite(table).all()
    # Every row, unseen ids included, has the documented norm sqrt(dim).
    assert torch.allclose(table.norm(dim=1), torch.full((VOCAB,), dim**0.5), atol=1e-3)
    assert report["languages"] == ["de", "en"] and report["pivot"] == "de"
    assert report["vocab_size"] == VOCAB and summary["table"] == report["table"]
    for lang in ("de", "en"):
        sizes = report["sizes"][lang]
        assert sizes["tokens"] > 200_000 and 0 < sizes["ids_trained"] <= sizes["ids_seen"]
        epochs = report["config"]["skipgram"]["epochs"]
        assert sizes["tokens_trained"] == sizes["tokens"] * epochs
    ids = report["ids"]
    assert sum(ids.values()) == VOCAB and ids["shared"] > 1000 and ids["unseen"] > 0
    mapping = report["mapping"]["en"]
    assert mapping["onto"] == "de" and mapping["init"] == "identical"
    assert mapping["seed_dictionary"] > 500 and mapping["iterations"] >= 1
    assert len(mapping["dictionary_sizes"]) == mapping["iterations"]
    phases = {"read_de", "read_en", "train_de", "train_en", "map_en", "merge"}
    assert phases | {"bli_before", "bli_after"} <= set(report["phases"])
    assert all(p["seconds"] >= 0 and p["peak_rss_mib"] > 0 for p in report["phases"].values())


def test_table_plugs_into_the_cl_interface(
    cli_run: tuple[Path, dict[str, Any], dict[str, Any]],
) -> None:
    out, report, _ = cli_run
    # The documented --dim is the tiny preset's d_model.
    config = build_model_config("tiny", [f"vocab_size={VOCAB}"])
    assert config.d_model == report["dim"]
    interface = build_interface("cl", config, cl_table=out.with_name("en-de.safetensors"))
    assert isinstance(interface, CrossLingualInterface)
    assert interface.table.shape == (VOCAB, config.d_model)


def test_mapping_retrieves_translations_far_better_than_unmapped(
    cli_run: tuple[Path, dict[str, Any], dict[str, Any]],
) -> None:
    _, report, _ = cli_run
    before, after = report["bli_before"], report["bli_after"]
    assert report["gold"]["queries"] == before["queries"] >= 200, report["gold"]
    # Independently trained spaces are unrelated: retrieval is at chance (a handful of
    # candidates among ~5,800 German ids for each of ~250 English words).
    assert before["p@1"] <= 0.01 and before["p@5"] <= 0.02, report
    # Measured with gensim's skip-gram, --seed 0 and 1: p@1 0.101 and 0.105, p@5 0.191 and
    # 0.206 (unmapped: 0 and 0; docs/results.md); the torch trainer before it gave 0.066 and
    # 0.156 with seed 0. The bars leave a safety margin below the worst seed; p@5 >= 0.12 is
    # still 6x the unmapped bound above.
    assert after["p@1"] >= 0.04, report
    assert after["p@5"] >= 0.12, report


def test_the_build_induces_the_ras_dictionary(
    demo_shards: Path, demo_corpus: Path, tmp_path: Path
) -> None:
    """--dictionary-out: CSLS pairs of single-piece words above the threshold, best first,
    each side a word of its language, read back as mRASP's dictionary; a name that does not
    say the languages is refused before any training."""
    from megasemface.data.text.ras import RasDictionary
    from megasemface.data.text.tokenizer import Tokenizer

    base = [
        sys.executable,
        str(ROOT / "tools" / "build_cl_embeddings.py"),
        "--shards",
        str(demo_shards / "shards"),
        "--spm-model",
        str(demo_shards / "joint.model"),
        "--out",
        str(tmp_path / "emb"),
        "--dim",
        "32",
        "--epochs",
        "1",
        "--gold-dict",
        str(demo_corpus / "dict" / "en-de.tsv"),
    ]
    bad = subprocess.run(
        [*base, "--dictionary-out", str(tmp_path / "words.tsv")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "<src>-<tgt>.tsv" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "phases" not in bad.stdout
    assert not (tmp_path / "emb.json").exists()

    path = tmp_path / "ras" / "en-de.tsv"
    args = ["--dictionary-out", str(path), "--dictionary-min-score", "0.1"]
    result = subprocess.run([*base, *args], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "emb.json").read_text(encoding="utf-8"))["dictionary"]
    assert report["languages"] == ["en", "de"] and report["min_score"] == 0.1
    lines = [line.split("\t") for line in path.read_text(encoding="utf-8").splitlines()]
    assert len(lines) == report["pairs"] > 0
    scores = [float(score) for *_, score in lines]
    assert scores == sorted(scores, reverse=True) and min(scores) >= 0.1
    assert all(s.lower() != t.lower() and " " not in s + t for s, t, _ in lines)
    assert 0 < report["gold"]["checked"] <= len(lines)
    tokenizer = Tokenizer.load(demo_shards / "joint.model")
    dictionary = RasDictionary.load([path], tokenizer)
    assert dictionary.size("en") > 0 and dictionary.size("de") > 0
