"""VQ-SemFace's codebook started from the cross-lingual table (--vq-codebook-init table): the
codes are the k-means centroids of the frequent pieces' rows at the codebook's norm, on one
process and split over model-parallel ranks; a bad table or a run that cannot use it is one
line."""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from launch import parse_train_argv
from safetensors.torch import save_file

from megasemface.distributed.groups import ParallelGroups, build_parallel_groups
from megasemface.distributed.launch import free_port
from megasemface.interfaces.factory import build_interface
from megasemface.interfaces.vq.table_codes import KMEANS_ROUNDS, table_codes
from megasemface.interfaces.vq.vector_quantized import VectorQuantizedInterface
from megasemface.models.semface import SemFaceModel
from megasemface.nn.config import ModelConfig, VQConfig
from megasemface.nn.transformer import TransformerEncoder
from megasemface.objectives.sequences import SpecialTokens

V, D, K = 40, 8, 4
CONFIG = ModelConfig(
    vocab_size=V,
    d_model=D,
    num_heads=2,
    ffn_dim=16,
    encoder_layers=1,
    decoder_layers=1,
    extractor_layers=1,
    max_len=16,
    num_langs=2,
    vq=VQConfig(num_codes=K, hidden_dim=8),
)
SPECIAL = SpecialTokens(pad=3, bos=0, eos=2, mask=4, lang_tags=(5, 6))
BASE = ["--data", "s", "--spm-model", "m", "--output-dir", "o", "--interface", "vq"]


def _table() -> torch.Tensor:
    return torch.randn(V, D, generator=torch.Generator().manual_seed(5))


def _counts() -> dict[str, np.ndarray]:
    """Two languages; pieces 0-9 are rarer than the table's min_count (3) in both."""
    rng = np.random.default_rng(7)
    en, de = rng.integers(3, 50, V), rng.integers(0, 50, V)
    en[:10], de[:10] = 2, 1
    return {"en": en, "de": de}


def _reference(table: torch.Tensor, counts: dict[str, np.ndarray], k: int) -> torch.Tensor:
    """Lloyd's k-means, written out point by point, from the k most frequent rows."""
    total = counts["en"] + counts["de"]
    ids = sorted(
        (i for i in range(V) if counts["en"][i] >= 3 or counts["de"][i] >= 3),
        key=lambda i: (-total[i], i),
    )
    points = [table[i] for i in ids]
    centroids = [points[j].clone() for j in range(min(k, len(points)))]
    if len(points) > k:
        for _ in range(KMEANS_ROUNDS):
            members: list[list[torch.Tensor]] = [[] for _ in centroids]
            for point in points:
                distances = [float((point - c).pow(2).sum()) for c in centroids]
                members[distances.index(min(distances))].append(point)
            centroids = [
                torch.stack(group).mean(0) if group else c
                for group, c in zip(members, centroids, strict=True)
            ]
    return torch.stack([c * math.sqrt(D) / c.norm() for c in centroids])


@pytest.mark.parametrize("k", [4, 64])  # fewer codes than pieces, and more
def test_codes_are_the_centroids_of_the_frequent_pieces_rows(k: int) -> None:
    table, counts = _table(), _counts()
    codes = table_codes(table, counts, k)
    expected = _reference(table, counts, k)
    assert codes.shape == expected.shape == (min(k, V - 10), D)
    torch.testing.assert_close(codes, expected, rtol=1e-5, atol=1e-5)


def _groups(rank: int, size: int) -> ParallelGroups:
    return ParallelGroups(
        mp_group=None,
        dp_group=None,
        mp_rank=rank,
        mp_size=size,
        dp_rank=0,
        dp_size=1,
        mp_ranks=tuple(range(size)),
    )


@pytest.mark.parametrize("mp_size", [1, 2])
def test_the_codebook_starts_as_the_table_codes_on_every_rank(mp_size: int) -> None:
    """Each model-parallel rank holds its own rows of the codes; with more codes than
    pieces the other codes keep the random start of the default."""
    table, counts = _table(), _counts()
    for k in (K, 64):
        config = dataclasses.replace(CONFIG, vq=dataclasses.replace(CONFIG.vq, num_codes=k))
        codes = table_codes(table, counts, k)
        random = VectorQuantizedInterface(config, ParallelGroups.single(), seed=1)
        expected = random.quantizer.codebook.detach().clone()
        expected[: len(codes)] = codes
        shards = []
        for rank in range(mp_size):
            interface = build_interface(
                "vq",
                config,
                groups=_groups(rank, mp_size),
                seed=1,
                cl_table=table,
                vq_codebook_init="table",
                piece_counts=counts,
            )
            shards.append(interface.quantizer.codebook.detach())
        assert torch.equal(torch.cat(shards), expected)


def _split_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One of two model-parallel ranks (gloo): its shard of the table codes and the codes
    its split layer picks for the same tokens."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        groups = build_parallel_groups(world)
        interface = build_interface(
            "vq",
            CONFIG,
            groups=groups,
            seed=1,
            cl_table=_table(),
            vq_codebook_init="table",
            piece_counts=_counts(),
        ).eval()
        h = torch.randn(9, D, generator=torch.Generator().manual_seed(2))
        result = {
            "shard": interface.quantizer.codebook.detach(),
            "codes": interface.quantizer(h).codes,
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.barrier()
        dist.destroy_process_group()


@pytest.mark.launcher
def test_two_model_parallel_ranks_hold_the_table_codes_as_one_process_does(
    tmp_path: Path,
) -> None:
    """--mp-size 2 in processes: each rank holds its half of the table codes and the split
    layer picks the one-process layer's codes."""
    mp.spawn(_split_worker, args=(2, free_port(), str(tmp_path)), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    whole = build_interface(
        "vq", CONFIG, seed=1, cl_table=_table(), vq_codebook_init="table", piece_counts=_counts()
    ).eval()
    h = torch.randn(9, D, generator=torch.Generator().manual_seed(2))
    codebook = torch.cat([r["shard"] for r in ranks])
    assert torch.equal(codebook, whole.quantizer.codebook.detach())
    assert torch.equal(codebook, table_codes(_table(), _counts(), K))
    for r in ranks:
        assert torch.equal(r["codes"], whole.quantizer(h).codes)


def _build(table: object, config: ModelConfig = CONFIG) -> None:
    build_interface("vq", config, cl_table=table, vq_codebook_init="table", piece_counts=_counts())


def test_a_bad_table_or_layout_is_one_line(tmp_path: Path) -> None:
    wide = tmp_path / "wide.safetensors"
    save_file({"embeddings": torch.zeros(V, D + 1)}, str(wide))
    product = dataclasses.replace(CONFIG, vq=VQConfig(layout="product", groups=2, entries=4))
    cases = [
        (wide, CONFIG, ValueError, "table of shape"),
        (tmp_path / "missing.safetensors", CONFIG, FileNotFoundError, "not found"),
        (torch.zeros(V, D + 1), CONFIG, ValueError, "the model needs"),
        (_table(), product, ValueError, "product"),
    ]
    for table, config, error, words in cases:
        with pytest.raises(error, match=words) as caught:
            _build(table, config)
        assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--stage", "joint", "--vq-codebook-init", "table"], "give --cl-table"),
        (
            [
                "--stage",
                "decoder",
                "--init-from",
                "r",
                "--cl-table",
                "t",
                "--vq-codebook-init",
                "table",
            ],
            "--stage encoder or joint",
        ),
    ],
)
def test_runs_that_cannot_use_the_table_codes_are_one_line(argv: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=words) as caught:
        parse_train_argv([*argv, *BASE])
    assert "\n" not in str(caught.value)


def test_the_table_codes_are_vq_semface_s() -> None:
    argv = ["--stage", "joint", "--data", "s", "--spm-model", "m", "--output-dir", "o"]
    cl = [*argv, "--interface", "cl", "--cl-table", "t", "--vq-codebook-init", "table"]
    with pytest.raises(ValueError, match="use it with --interface vq"):
        parse_train_argv(cl)
    config = parse_train_argv(
        [*BASE, "--stage", "joint", "--cl-table", "t", "--vq-codebook-init", "table"]
    )
    assert config.vq_codebook_init == "table" and config.cl_table == Path("t")


def test_the_table_input_starts_the_vq_encoder_s_embeddings_from_the_table() -> None:
    """With --cl-table-input the encoder's input embeddings (tied to its MLM output layer)
    are the table's rows at unit norm but for the padding row; off (the default) they are
    the model's own start."""
    table = _table()
    torch.manual_seed(0)
    own = TransformerEncoder(CONFIG).embed.tokens.weight.detach()
    for table_input in (False, True):
        torch.manual_seed(0)
        interface = build_interface(
            "vq",
            CONFIG,
            cl_table=table,
            cl_table_input=table_input,
            vq_codebook_init="table",
            piece_counts=_counts(),
        )
        torch.manual_seed(0)
        model = SemFaceModel(CONFIG, interface, SPECIAL)
        weight = model.encoder.embed.tokens.weight.detach()
        if not table_input:
            assert torch.equal(weight, own)
            continue
        expected = table * D**-0.5
        expected[SPECIAL.pad] = own[SPECIAL.pad]  # the padding row keeps its start
        assert torch.equal(weight, expected)
    defaults = parse_train_argv(
        [*BASE, "--stage", "joint", "--cl-table", "t", "--vq-codebook-init", "table"]
    )
    assert defaults.cl_table_input is False


def test_the_trained_rows_threshold_is_the_table_builders() -> None:
    from megasemface.embeddings.skipgram import SkipGramConfig
    from megasemface.interfaces.vq.table_codes import TRAINED_MIN_COUNT

    # The interfaces sit below the table's builder, so the threshold is stated twice.
    assert SkipGramConfig().min_count == TRAINED_MIN_COUNT
