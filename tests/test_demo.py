"""The README's main command on the real demo corpus, at a reduced size."""

from __future__ import annotations

from pathlib import Path

import pytest

from megasemface.data.shard_format import Manifest
from megasemface.demo import main


def test_demo_runs_end_to_end_and_reuses_its_work(
    tmp_path: Path, locale_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--out", str(tmp_path), "--locale-dir", str(locale_dir), "--vocab-size", "2000"]
    args += ["--batches", "40", "--workers", "0", "--jobs", "1"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert "tokens/s" in first and "real tokens" in first
    manifest = Manifest.load(tmp_path / "shards")
    assert set(manifest.languages) == {"en", "de"}
    assert (tmp_path / "corpus" / "parallel" / "en-de" / "test.de").stat().st_size > 0

    assert main(args) == 0
    second = capsys.readouterr().out
    for step in ("reusing " + str(tmp_path / "corpus"), "reusing " + str(tmp_path / "spm")):
        assert step in second
    assert "reusing " + str(tmp_path / "shards") in second


def test_demo_without_catalogs_says_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    empty = tmp_path / "locale"
    empty.mkdir()
    assert main(["--out", str(tmp_path / "out"), "--locale-dir", str(empty)]) == 2
    assert "--locale-dir" in capsys.readouterr().err
