"""Bad input deep inside a large corpus, at small size: a damaged gzip member or a line that is
not UTF-8, thousands of lines in, as they would be 30M lines into a 50M-line corpus.

``tools/train_spm.py`` and ``tools/build_shards.py`` run as a user runs them. A damaged member
stops them with exit status 2 and one error line that names the file and the last line read
whole, never a traceback; an invalid line is skipped and named (file and line number) in one
line on standard error the moment it is met, with the count in the summary. And when one
language of several cannot be read, train_spm stops at once rather than after reading every
other language first.
"""

from __future__ import annotations

import gzip
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megasemface.data.demo.synthetic_corpus import SyntheticCorpusConfig, WordSource, write_corpus
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.spm_sampling import map_in_processes
from megasemface.data.text.textio import parse_lang_path

ROOT = Path(__file__).resolve().parents[1]
MEMBER = 2000
"""Lines per gzip member: the corpus has three, and the last is damaged."""
BAD_LINE = 4321
"""The line (1-based) made invalid UTF-8; a second one follows further on."""


@pytest.fixture(scope="module")
def corpus(demo_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """News-length German text in three gzip members, and damaged copies of it."""
    root = tmp_path_factory.mktemp("deep")
    source = WordSource.from_file(demo_corpus / "mono" / "de.txt")
    write_corpus(source, root / "de.txt", SyntheticCorpusConfig(sentences=3 * MEMBER), stream="de")
    lines = (root / "de.txt").read_bytes().splitlines(keepends=True)
    members = [gzip.compress(b"".join(lines[k : k + MEMBER]), mtime=0) for k in (0, MEMBER, 4000)]
    last = bytearray(members[2])
    middle = len(last) // 2
    last[middle : middle + 16] = bytes(b ^ 0x5A for b in last[middle : middle + 16])
    (root / "corrupt.txt.gz").write_bytes(members[0] + members[1] + bytes(last))
    (root / "truncated.txt.gz").write_bytes(members[0] + members[1] + members[2][:middle])
    lines[BAD_LINE - 1] = b"Stra\xdfe " + lines[BAD_LINE - 1]  # Latin-1, not UTF-8
    lines[BAD_LINE + 500] = b"\xff" + lines[BAD_LINE + 500]
    (root / "latin1.txt.gz").write_bytes(gzip.compress(b"".join(lines), mtime=0))
    return {name: root / f"{name}.txt.gz" for name in ("corrupt", "truncated", "latin1")}


def _run(tool: str, *arguments: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / f"{tool}.py"), *arguments],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result


def _train_spm(path: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return _run("train_spm", "--input", f"de:{path}", "--output", str(out / "spm"),
                "--vocab-size", "800", "--threads", "1", "--quiet")  # fmt: skip


def _build_shards(path: Path, spm: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return _run("build_shards", "--input", f"de:{path}", "--spm-model", str(spm),
                "--out", str(out / "shards"), "--jobs", "2", "--dedup", "--quiet")  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["corrupt", "truncated"])
def test_a_damaged_later_member_stops_each_tool_with_one_line(
    corpus: dict[str, Path], spm_model: Path, tmp_path: Path, damage: str
) -> None:
    path = corpus[damage]
    for result in (_train_spm(path, tmp_path), _build_shards(path, spm_model, tmp_path)):
        assert result.returncode == 2, result.stderr
        (line, *others) = sorted(result.stderr.strip().splitlines(), key=lambda x: "error" not in x)
        assert "error" in line and "truncated or damaged" in line
        # Reading stopped in the last member, and the line it stopped after is named.
        match = re.search(rf"{re.escape(str(path))}: cannot read the file past line ([\d,]+)", line)
        assert match, line
        assert int(match.group(1).replace(",", "")) >= 2 * MEMBER - 1000, line
        # Damaged deflate data may decode to garbage until the member's check fails: the
        # first line of it that is not UTF-8 is named too, which points at the damage.
        assert all(re.match(rf"{re.escape(str(path))}:\d+: not valid UTF-8", o) for o in others)
    assert not (tmp_path / "shards" / "manifest.json").exists()


@pytest.mark.slow
def test_an_invalid_line_deep_inside_is_skipped_and_named_at_once(
    corpus: dict[str, Path], spm_model: Path, tmp_path: Path
) -> None:
    path = corpus["latin1"]
    named = f"{path}:{BAD_LINE}: not valid UTF-8"
    trained = _train_spm(path, tmp_path)
    assert trained.returncode == 0, trained.stderr
    (line,) = [line for line in trained.stderr.splitlines() if "UTF-8" in line]
    assert line.startswith(named)
    assert "invalid UTF-8 2" in trained.stdout
    assert f"first invalid UTF-8 line: {path}:{BAD_LINE}" in trained.stdout

    built = _build_shards(path, spm_model, tmp_path)
    assert built.returncode == 0, built.stderr
    (line,) = built.stderr.strip().splitlines()
    assert line.startswith(named)
    assert "invalid_utf8=2" in built.stdout


def test_the_builder_names_the_file_and_its_own_line(
    tmp_path: Path, spm_model: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Line numbers count from the start of the file that holds the line, not of the
    language's first file; each file's first invalid line is named, once."""
    first, second = tmp_path / "a.txt", tmp_path / "b.txt"
    first.write_bytes(b"".join(b"erste Datei, Zeile %d\n" % i for i in range(1, 301)))
    second.write_bytes(
        b"".join(b"\xe4 %d\n" % i if i in (120, 121) else b"Zeile %d\n" % i for i in range(1, 201))
    )
    corpora = parse_lang_path([f"de:{first}", f"de:{second}"])
    build_shards(corpora, spm_model, tmp_path / "out", ShardBuildConfig(bytes_per_task=512))
    warnings = [r.getMessage() for r in caplog.records if "UTF-8" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"{second}:120: not valid UTF-8")


def _release_or_finish(marker: Path) -> str:
    """Waits up to a minute for ``marker`` to appear, then records that it ran to its end."""
    deadline = time.monotonic() + 60
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    marker.with_suffix(".finished").touch()
    return "finished"


def _fail(message: str) -> str:
    raise ValueError(message)


def test_one_language_that_cannot_be_read_ends_the_others_at_once(tmp_path: Path) -> None:
    """The first error ends the other readers: the long one here is ended, not waited for
    (before, train_spm read every other language to its end before reporting it)."""
    marker = tmp_path / "release"
    jobs = [(_release_or_finish, (marker,)), (_fail, ("de: damaged",))]
    with pytest.raises(ValueError, match="de: damaged"):
        for _ in map_in_processes(_dispatch, jobs, processes=2):
            pass
    assert not marker.with_suffix(".finished").exists()


def _dispatch(function: object, args: tuple[object, ...]) -> object:
    return function(*args)  # type: ignore[operator]
