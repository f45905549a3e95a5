"""Shared fixtures: a real corpus from the system's gettext catalogs and a tokenizer on it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Keep every test on the CPU and quiet, whatever machine runs the suite.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

LOCALE_DIR = Path(os.environ.get("MEGASEMFACE_LOCALE_DIR", "/usr/share/locale"))


@pytest.fixture(scope="session")
def locale_dir() -> Path:
    """The system's gettext catalogs, which the demo corpus is made from."""
    if not any((LOCALE_DIR / "de" / "LC_MESSAGES").glob("*.mo")):
        pytest.skip(f"no German gettext catalogs under {LOCALE_DIR} (set MEGASEMFACE_LOCALE_DIR)")
    return LOCALE_DIR


@pytest.fixture(scope="session")
def demo_corpus(locale_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real en-de demo corpus, built once per test session from gettext catalogs."""
    from megasemface.data.demo_corpus import build_demo_corpus

    out = tmp_path_factory.mktemp("corpus")
    build_demo_corpus(locale_dir, ["de"], out)
    return out


@pytest.fixture(scope="session")
def spm_model(demo_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small joint en-de BPE model trained on the demo corpus."""
    from megasemface.data.spm_training import SpmTrainConfig, train_spm
    from megasemface.data.textio import parse_lang_path

    prefix = tmp_path_factory.mktemp("spm") / "joint"
    corpora = parse_lang_path(
        [f"en:{demo_corpus / 'mono/en.txt'}", f"de:{demo_corpus / 'mono/de.txt'}"]
    )
    train_spm(corpora, prefix, SpmTrainConfig(vocab_size=1000, num_threads=1, seed=1))
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def no_leftover_shared_memory() -> Iterator[None]:
    """Training runs remove their DeepSpeed shm all-reduce buffers at exit; a killed run
    cannot, so a launching test module removes what its runs left (it would hold RAM until
    reboot)."""
    before = set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*"))
    yield
    for path in set(Path("/dev/shm").glob("deepspeed_allreduce_buffer_*")) - before:
        path.unlink(missing_ok=True)
