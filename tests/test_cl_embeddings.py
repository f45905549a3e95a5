"""Cross-lingual subword embeddings: skip-gram, Procrustes/CSLS mapping, the table build."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from megasemface.cli.build_cl_embeddings import main as cli_main
from megasemface.data.shard_builder import ShardBuildConfig, build_shards
from megasemface.data.textio import parse_lang_path
from megasemface.data.tokenizer import SpmTrainConfig, train_spm
from megasemface.embeddings import (
    CLEmbeddingConfig,
    CLEmbeddingError,
    SkipGramConfig,
    bli_precision,
    build_cl_embeddings,
    csls_topk,
    map_onto,
    procrustes,
    train_skipgram,
)
from megasemface.embeddings.mapping import normalize
from megasemface.interfaces.cross_lingual import CrossLingualInterface, load_embedding_table
from megasemface.interfaces.factory import build_interface
from megasemface.models.config import build_model_config

DIM = 64


@pytest.fixture(scope="module")
def big_vocab_shards(demo_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shards of the demo corpus under an 8000-piece joint model.

    The session's 1000-piece model splits all but 6 of the gold dictionary's words into
    several pieces; with 8000 pieces about 90 entries are single pieces on both sides.
    """
    root = tmp_path_factory.mktemp("cl-emb")
    corpora = parse_lang_path(
        [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    )
    train_spm(corpora, root / "joint8k", SpmTrainConfig(vocab_size=8000, num_threads=1, seed=1))
    build_shards(corpora, root / "joint8k.model", root / "shards", ShardBuildConfig(jobs=1))
    return root


@pytest.fixture(scope="module")
def built(big_vocab_shards: Path, demo_corpus: Path) -> tuple[Path, dict[str, Any]]:
    config = CLEmbeddingConfig(
        skipgram=SkipGramConfig(dim=DIM, epochs=3, seed=0), max_iterations=8, threads=2
    )
    out = big_vocab_shards / "out" / "table"
    report = build_cl_embeddings(
        big_vocab_shards / "shards",
        big_vocab_shards / "joint8k.model",
        out,
        config,
        gold_dict=demo_corpus / "dict" / "en-de.tsv",
    )
    return out, report


def test_table_has_one_finite_row_per_id_and_loads(built: tuple[Path, dict[str, Any]]) -> None:
    out, report = built
    path = out.with_name("table.safetensors")
    table = load_embedding_table(path, 8000, DIM)
    assert table.shape == (8000, DIM) and torch.isfinite(table).all()
    # Every row, unseen ids included, has the documented norm sqrt(dim).
    assert torch.allclose(table.norm(dim=1), torch.full((8000,), DIM**0.5), atol=1e-3)
    on_disk = json.loads(out.with_name("table.json").read_text())
    assert on_disk["ids"] == report["ids"] and sum(report["ids"].values()) == 8000
    assert report["ids"]["unseen"] > 0  # special ids and byte pieces at least
    assert set(report["phases"]) >= {"read", "train", "map", "merge", "bli_before", "bli_after"}
    assert report["mapping"]["en"]["onto"] == "de" and report["mapping"]["en"]["seed_dictionary"]


def test_mapping_retrieves_translations_better_than_unmapped(
    built: tuple[Path, dict[str, Any]],
) -> None:
    _, report = built
    assert report["gold"]["usable"] >= 50, report["gold"]
    before, after = report["bli_before"], report["bli_after"]
    # Independently trained spaces are unrelated: retrieval is at chance (~0 of 88 queries).
    # After mapping 4-6 of 88 are found at p@5 on this tiny corpus (0.3M tokens a language),
    # so the margin is set at 3 queries.
    assert before["p@1"] == 0.0 and before["p@5"] <= 0.012, report
    assert after["p@5"] >= before["p@5"] + 3 / 88, report
    assert after["p@1"] > before["p@1"], report


def test_table_plugs_into_the_cl_interface(built: tuple[Path, dict[str, Any]]) -> None:
    out, _ = built
    config = build_model_config("tiny", ["vocab_size=8000", f"d_model={DIM}", "num_heads=4"])
    interface = build_interface("cl", config, cl_table=out.with_name("table.safetensors"))
    assert isinstance(interface, CrossLingualInterface)
    assert interface.table.shape == (8000, DIM)


def test_procrustes_recovers_a_known_rotation() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 16, generator=gen)
    rotation, _ = torch.linalg.qr(torch.randn(16, 16, generator=gen))
    z = x @ rotation
    assert torch.allclose(procrustes(x, z), rotation, atol=1e-5)
    # Self-learning from a 20-pair seed recovers the rotation and the whole dictionary.
    xn = normalize(x)
    zn = normalize(x) @ rotation
    perm = torch.randperm(300, generator=gen)
    seed = torch.stack([torch.arange(20), torch.argsort(perm)[:20]], 1)
    result = map_onto(xn, zn[perm], seed, max_iterations=10)
    assert result.converged
    assert torch.allclose(result.matrix, rotation, atol=1e-4)
    assert result.dictionary.shape[0] == 300


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


def test_bli_precision_counts_hits_at_k() -> None:
    vecs = torch.eye(6)
    shifted = vecs[[1, 0, 2, 3, 4, 5]]  # ids 0 and 1 swapped in the target space
    out = bli_precision(vecs, shifted, [(0, 0), (2, 2), (3, 3), (3, 4)], k=(1, 5))
    assert out["queries"] == 3 and out["p@1"] == pytest.approx(2 / 3) and out["p@5"] == 1.0


def test_skipgram_is_deterministic_and_learns() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50, size=4000)
    offsets = np.arange(0, 4001, 20)
    config = SkipGramConfig(dim=8, epochs=2, batch_size=512, seed=3)
    first = train_skipgram(tokens, offsets, 60, config)
    second = train_skipgram(tokens, offsets, 60, config)
    assert torch.equal(first.vectors, second.vectors)
    assert first.trained[:50].all() and not first.trained[50:].any()
    assert first.pairs > 0 and first.losses[-1] < first.losses[0]
    with pytest.raises(ValueError, match="dimension must be >= 1"):
        SkipGramConfig(dim=0)


def test_shards_from_another_model_are_refused(
    big_vocab_shards: Path, spm_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(CLEmbeddingError, match="shards from another SentencePiece model"):
        build_cl_embeddings(big_vocab_shards / "shards", spm_model, tmp_path / "t")


def test_missing_language_is_refused(big_vocab_shards: Path, tmp_path: Path) -> None:
    config = CLEmbeddingConfig(languages=("en", "fr"))
    with pytest.raises(CLEmbeddingError, match=r"\['fr'\] have no shards"):
        build_cl_embeddings(
            big_vocab_shards / "shards", big_vocab_shards / "joint8k.model", tmp_path / "t", config
        )


def test_cli_reports_errors_without_traceback(
    big_vocab_shards: Path, spm_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = str(big_vocab_shards / "shards")
    code = cli_main(["--shards", shards, "--spm-model", str(spm_model), "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "another SentencePiece model" in err and "Traceback" not in err
    code = cli_main(
        ["--shards", shards, "--spm-model", str(spm_model), "--out", str(tmp_path), "--dim", "0"]
    )
    assert code == 2 and "dimension must be >= 1" in capsys.readouterr().err
