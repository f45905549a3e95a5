"""Shared fixtures: a real corpus from the system's gettext catalogs, a tokenizer on it, and
the shards and models that tests launching training runs train on."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# Keep every test on the CPU and quiet, whatever machine runs the suite.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

LOCALE_DIR = Path(os.environ.get("MEGASEMFACE_LOCALE_DIR", "/usr/share/locale"))


@pytest.fixture(autouse=True)
def _process_kernels() -> Iterator[None]:
    """The process's kernels as they were before each test: a test that applies the CPU
    speed code to a model (nn/cpu_speed.py) installs them for the whole process."""
    from megasemface.nn import kernels

    before = kernels.installed()
    yield
    kernels.install(before)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks ``unit`` every test that is neither ``launcher`` nor ``gpu``, so that each
    test is in one tier: ``-m unit``, ``-m launcher``, ``-m gpu``."""
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in ("launcher", "gpu")):
            item.add_marker(pytest.mark.unit)


@pytest.fixture(scope="session")
def locale_dir() -> Path:
    """The system's gettext catalogs, which the demo corpus is made from."""
    if not any((LOCALE_DIR / "de" / "LC_MESSAGES").glob("*.mo")):
        pytest.skip(f"no German gettext catalogs under {LOCALE_DIR} (set MEGASEMFACE_LOCALE_DIR)")
    return LOCALE_DIR


@pytest.fixture(scope="session")
def demo_corpus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real en-de demo corpus, built once per test session from gettext catalogs, or
    the one ``MEGASEMFACE_DEMO_CORPUS`` names (``tools/make_demo_corpus.py``'s output, for
    a machine without the catalogs: the GPU kit carries one)."""
    from megasemface.data.demo.demo_corpus import build_demo_corpus

    made = os.environ.get("MEGASEMFACE_DEMO_CORPUS")
    if made:
        return Path(made)
    out = tmp_path_factory.mktemp("corpus")
    build_demo_corpus(request.getfixturevalue("locale_dir"), ["de"], out)
    return out


@pytest.fixture(scope="session")
def spm_model(demo_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small joint en-de BPE model trained on the demo corpus."""
    from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
    from megasemface.data.text.textio import parse_lang_path

    prefix = tmp_path_factory.mktemp("spm") / "joint"
    corpora = parse_lang_path(
        [f"en:{demo_corpus / 'mono/en.txt'}", f"de:{demo_corpus / 'mono/de.txt'}"]
    )
    train_spm(corpora, prefix, SpmTrainConfig(vocab_size=1000, num_threads=1, seed=1))
    return prefix.with_suffix(".model")


@pytest.fixture(scope="session")
def mixed_shards(
    tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path
) -> Path:
    """Monolingual en and de text and en-de pairs in one shard directory, as VECO's
    pre-training and deep fusion's fine-tuning read them (small samples, so that two ranks
    get shards of each)."""
    from megasemface.data.shards.shard_build_config import ShardBuildConfig
    from megasemface.data.shards.shard_builder import build_shards
    from megasemface.data.text.textio import parse_lang_path, parse_parallel

    out = tmp_path_factory.mktemp("mixed-shards")
    parallel = demo_corpus / "parallel" / "en-de"
    corpora = parse_lang_path(
        [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    ) + parse_parallel([f"en-de:{parallel / 'train.en'},{parallel / 'train.de'}"])
    config = ShardBuildConfig(tokens_per_sample=4096, samples_per_shard=4, max_tokens=60)
    build_shards(corpora, spm_model, out, config)
    return out


@pytest.fixture(scope="session")
def launch_data(
    tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path
) -> dict:
    """What launched training runs read, from the demo corpus: monolingual and en-de parallel
    shards (``mono``, ``parallel``; small samples, so that two ranks get shards), a random
    CL-SemFace table (``cl``), a random translation model directory (``init``) that names an
    encoder run as its parent, the SentencePiece model (``spm``) and the prefixes of the
    validation and test text (``valid``, ``test``)."""
    import torch
    from safetensors.torch import save_file

    from megasemface.data.shards.shard_build_config import ShardBuildConfig
    from megasemface.data.shards.shard_builder import build_shards
    from megasemface.data.text.textio import parse_lang_path, parse_parallel
    from megasemface.data.text.tokenizer import Tokenizer
    from megasemface.models.model_dir import save_model_dir
    from megasemface.nn.config import build_model_config
    from megasemface.nn.transformer import Seq2SeqModel

    root = tmp_path_factory.mktemp("launch-data")
    config = ShardBuildConfig(tokens_per_sample=4096, samples_per_shard=4, max_tokens=60)
    mono = [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    build_shards(parse_lang_path(mono), spm_model, root / "mono", config)
    parallel = demo_corpus / "parallel" / "en-de"
    build_shards(
        parse_parallel([f"en-de:{parallel / 'train.en'},{parallel / 'train.de'}"]),
        spm_model,
        root / "parallel",
        config,
    )
    tokenizer = Tokenizer.load(spm_model)
    table = torch.randn(tokenizer.vocab_size, 64, generator=torch.Generator().manual_seed(0))
    save_file({"embeddings": table * 0.3}, str(root / "cl.safetensors"))
    model_config = build_model_config(
        "tiny", [f"vocab_size={tokenizer.vocab_size}", f"num_langs={len(tokenizer.languages)}"]
    )
    torch.manual_seed(0)
    save_model_dir(
        root / "init",
        Seq2SeqModel(model_config).state_dict(),
        kind="seq2seq",
        model_config=model_config,
        languages=tokenizer.languages,
        spm_model=spm_model,
        meta={"parent_runs": {"encoder": "0123abcd"}},
    )
    return {
        "root": root,
        "mono": root / "mono",
        "parallel": root / "parallel",
        "cl": root / "cl.safetensors",
        "init": root / "init",
        "spm": spm_model,
        "valid": parallel / "valid",
        "test": parallel / "test",
    }


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mounts a tmpfs of the given size in bytes (a disk that fills up) and returns its path;
    unmounted at teardown. Skips the test where mounting is not permitted (not root, or a
    container without the capability)."""
    mounts: list[Path] = []

    def mount(size: int) -> Path:
        path = tmp_path / f"tmpfs-{len(mounts)}"
        path.mkdir()
        options = f"size={size}"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip() or 'mount failed'}")
        mounts.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounts:
            if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(path)], capture_output=True)


def skip_unless_required(reason: str) -> None:
    """Skips the test, or fails it where ``MEGASEMFACE_REQUIRE_CLUSTER=1``: ``.ci/run`` sets it
    where it installed what the simulated cluster needs (as root on a Debian-like machine),
    so that a cluster test that cannot run there is a failure, not a skip nobody reads."""
    if os.environ.get("MEGASEMFACE_REQUIRE_CLUSTER") == "1":
        pytest.fail(f"{reason} (MEGASEMFACE_REQUIRE_CLUSTER=1: .ci/run installed it)", False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A simulated cluster (tests/cluster.py): 2 nodes with sshd and an MLflow server host,
    torn down after the session; skipped where namespaces cannot be made."""
    from cluster import cluster, unavailable

    reason = unavailable()
    if reason:
        skip_unless_required(f"no simulated cluster: {reason}")
    with cluster(tmp_path_factory.mktemp("cluster")) as made:
        yield made


@pytest.fixture(scope="session")
def slurm(nodes: Any) -> Any:
    """Slurm on the simulated cluster (tests/slurm_cluster.py): slurmctld on its MLflow host,
    a slurmd on each node; skipped where Slurm or munge is missing."""
    from slurm_cluster import Slurm, unavailable

    reason = unavailable()
    if reason:
        skip_unless_required(f"no simulated Slurm: {reason}")
    return Slurm(nodes).up()
