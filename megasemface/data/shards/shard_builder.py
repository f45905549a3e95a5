"""Builds webdataset token shards from monolingual or parallel text, resumably and reproducibly.

The builder streams each language's text once, never holding a corpus in memory: the main
process reads lines in blocks, worker processes clean, hash and encode them with
SentencePiece (``jobs``), and the main process de-duplicates, packs sentences into samples
(see ``shard_format``) and writes shards with ``webdataset.ShardWriter``.

A parallel corpus (``textio.parse_parallel``) goes the same way as one more "language" named
after its pair (``en-de``): its two files are read in lockstep, and each kept pair is one
sentence ``source ids + [eos] + target ids`` (see ``pairs``), so packing, resume, the loader
and batching treat it like any sentence and never split a pair.

Resume: each shard is written under ``.partial/`` and renamed into place when complete,
then recorded in ``.build-journal.jsonl`` with the input line it ends at and the filter
counts so far. Run again with the same arguments after a crash or ``kill -9``, the builder
skips the recorded lines (re-hashing them when de-duplicating, without encoding) and writes
the remaining shards. The output is a deterministic function of the inputs and options, so
a resumed build is byte-identical to an uninterrupted one. ``manifest.json`` is written last
and marks the build complete.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from megasemface.data.shards.encoding import EncodingPool
from megasemface.data.shards.language_shards import PARTIAL, LanguageShardBuild
from megasemface.data.shards.shard_build_config import (
    ShardBuildConfig,
    ShardBuildError,
    id_dtype_for,
)
from megasemface.data.shards.shard_format import FORMAT_VERSION, write_json_atomic
from megasemface.data.shards.shard_journal import JOURNAL, BuildJournal
from megasemface.data.text.textio import CorpusSpec
from megasemface.data.text.tokenizer import Tokenizer

__all__ = ["build_shards"]


def _input_fingerprint(corpus: CorpusSpec) -> list[dict[str, Any]]:
    """Identifies each input by its size and the sha256 of its first and last MiB.

    Cheap for any corpus size, independent of timestamps (a regenerated identical file is
    the same input), and still catches appended, truncated or replaced files.
    """
    out = []
    for path in corpus.all_paths:
        if not path.is_file():
            raise ShardBuildError(f"{corpus.lang}: corpus file not found: {path}")
        size = path.stat().st_size
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            digest.update(handle.read(1 << 20))
            if size > 2 << 20:
                handle.seek(size - (1 << 20))
            digest.update(handle.read(1 << 20))
        out.append({"path": str(path), "size": size, "ends_sha256": digest.hexdigest()})
    return out


def _check_languages(corpora: list[CorpusSpec], tokenizer: Tokenizer, spm_model: Path) -> None:
    """Every language of ``corpora`` must have a tag in the model: training puts it before
    each sentence, and a mistyped code would otherwise cost a whole build before the first
    run refuses the shards."""
    for corpus in corpora:
        langs = corpus.pair or (corpus.lang,)
        missing = [lang for lang in langs if lang not in tokenizer.languages]
        if missing:
            what = f"pair {corpus.lang}" if corpus.pair else f"--input {corpus.lang}"
            raise ShardBuildError(
                f"{what}: the SentencePiece model {spm_model} has no language tag for "
                f"{', '.join(missing)} (its languages: {', '.join(tokenizer.languages)}); fix "
                "the language code or train a model with these languages"
            )


def _pair_layouts(
    corpora: list[CorpusSpec], tokenizer: Tokenizer, spm_model: Path, config: ShardBuildConfig
) -> dict[str, dict[str, Any]]:
    """How each parallel corpus is stored, as the manifest records it under ``pair``.

    Pairs are joined with the tokenizer's eos id, which SentencePiece encoding never
    produces, so the split is unambiguous.
    """
    layouts = {}
    for corpus in corpora:
        if corpus.pair is None:
            continue
        try:
            separator = tokenizer.eos_id
        except ValueError as exc:
            raise ShardBuildError(f"{spm_model}: {exc}, which separates pairs") from exc
        layouts[corpus.lang] = {
            "src": corpus.pair[0],
            "tgt": corpus.pair[1],
            "separator_id": separator,
            "max_length": 2 * config.max_tokens + 1,
        }
    return layouts


def _build_fingerprint(
    corpora: list[CorpusSpec],
    spm_sha256: str,
    config: ShardBuildConfig,
    pairs: dict[str, dict[str, Any]],
) -> tuple[str, dict[str, Any]]:
    described = {
        "format_version": FORMAT_VERSION,
        "spm_sha256": spm_sha256,
        "config": config.output_fields(),
        "inputs": {c.lang: _input_fingerprint(c) for c in corpora},
    }
    if pairs:  # absent otherwise, so that builds without pairs keep their fingerprint
        described["pairs"] = pairs
    digest = hashlib.sha256(json.dumps(described, sort_keys=True).encode()).hexdigest()
    return digest, described


def _read_manifest(path: Path) -> dict[str, Any]:
    """The manifest of an earlier build in the output directory."""
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        manifest = exc
    if not isinstance(manifest, dict):
        raise ShardBuildError(
            f"{path} is not a shard manifest ({manifest}); choose another output directory "
            "or pass --overwrite to build again"
        )
    return manifest


def build_shards(
    corpora: list[CorpusSpec],
    spm_model: Path,
    out_dir: Path,
    config: ShardBuildConfig,
    *,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
    """Builds (or completes, or confirms) the shards of every corpus; returns the manifest."""
    if not corpora:
        raise ShardBuildError("no input corpora given")
    spm_model = Path(spm_model)
    if not spm_model.is_file():
        raise ShardBuildError(f"SentencePiece model not found: {spm_model}")
    names = [corpus.lang for corpus in corpora]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ShardBuildError(
            f"{', '.join(repeated)} given more than once; give all files of a language (or "
            "pair) in one CorpusSpec"
        )
    model_proto = spm_model.read_bytes()
    try:
        tokenizer = Tokenizer.from_bytes(model_proto)
    except ValueError as exc:
        raise ShardBuildError(f"{spm_model}: {exc}") from exc
    vocab_size = tokenizer.vocab_size
    _check_languages(corpora, tokenizer, spm_model)
    pairs = _pair_layouts(corpora, tokenizer, spm_model, config)
    # Languages never join sides, so any id would do for them.
    separator = tokenizer.eos_id if pairs else -1
    spm_sha256 = tokenizer.sha256
    fingerprint, described = _build_fingerprint(corpora, spm_sha256, config, pairs)

    if out_dir.exists() and not out_dir.is_dir():
        raise ShardBuildError(f"{out_dir} is a file; the output (--out) is a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists():
        existing = _read_manifest(manifest_path)
        if existing.get("build_fingerprint") == fingerprint:
            existing["already_built"] = True
            return existing
        if not overwrite:
            raise ShardBuildError(
                f"{out_dir} already holds shards built from other inputs or options; "
                "choose another output directory or pass --overwrite"
            )
    if overwrite:
        _remove_build(out_dir)
    (out_dir / PARTIAL).mkdir(exist_ok=True)
    for stale in (out_dir / PARTIAL).iterdir():
        stale.unlink()
    journal = BuildJournal(out_dir / JOURNAL, fingerprint)
    dtype = id_dtype_for(vocab_size)
    executor = EncodingPool(config.jobs, model_proto)
    try:
        for corpus in corpora:
            if journal.language_done(corpus.lang) is None:
                build = LanguageShardBuild(
                    corpus, out_dir, config, journal, executor, dtype, separator, progress
                )
                journal.add(build.run())
    finally:
        executor.close()
    manifest = _manifest(journal, corpora, described, fingerprint, vocab_size, spm_model, dtype)
    write_json_atomic(manifest_path, manifest)
    (out_dir / JOURNAL).unlink()
    shutil.rmtree(out_dir / PARTIAL, ignore_errors=True)
    return manifest


def _remove_build(out_dir: Path) -> None:
    """Removes what an earlier build wrote (its shards, journal, manifest), nothing else."""
    for path in [*out_dir.glob("*-[0-9][0-9][0-9][0-9][0-9][0-9].tar"), out_dir / JOURNAL]:
        path.unlink(missing_ok=True)
    (out_dir / "manifest.json").unlink(missing_ok=True)
    shutil.rmtree(out_dir / PARTIAL, ignore_errors=True)


def _manifest(
    journal: BuildJournal,
    corpora: list[CorpusSpec],
    described: dict[str, Any],
    fingerprint: str,
    vocab_size: int,
    spm_model: Path,
    dtype: type[np.unsignedinteger],
) -> dict[str, Any]:
    shards = [e["shard"] for e in journal.entries if e.get("kind") == "shard"]
    languages = {}
    for corpus in corpora:
        done = journal.language_done(corpus.lang)
        assert done is not None
        mine = [s for s in shards if s["lang"] == corpus.lang]
        languages[corpus.lang] = {
            "inputs": [str(p) for p in corpus.paths],
            "lines": done["lines"],
            "sentences": sum(s["sentences"] for s in mine),
            "tokens": sum(s["tokens"] for s in mine),
            "shards": len(mine),
            "filtered": {k: v for k, v in done["counts"].items() if k != "kept"},
        }
        if corpus.pair is not None:
            # For a pair, lines and sentences count pairs, and tokens include separators.
            languages[corpus.lang]["inputs"] = [[str(p) for p in g] for g in corpus.file_groups]
            languages[corpus.lang]["pair"] = described["pairs"][corpus.lang]
    total_tokens = sum(s["tokens"] for s in shards)
    total_bytes = sum(s["bytes"] for s in shards)
    return {
        "format_version": FORMAT_VERSION,
        "build_fingerprint": fingerprint,
        "spm": {
            "sha256": described["spm_sha256"],
            "vocab_size": vocab_size,
            "file": spm_model.name,
        },
        "id_dtype": np.dtype(dtype).name,
        "config": described["config"],
        "languages": languages,
        "shards": shards,
        "totals": {
            "shards": len(shards),
            "sentences": sum(s["sentences"] for s in shards),
            "tokens": total_tokens,
            "bytes": total_bytes,
            "bytes_per_token": round(total_bytes / max(total_tokens, 1), 4),
        },
    }
