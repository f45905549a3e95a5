"""The pipeline's data steps: corpus, tokenizer, shards, cross-lingual table.

Each returns its output and is reused when the output is already complete (and says so).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from megasemface.data.demo.demo_corpus import SOURCE_LANG, build_demo_corpus
from megasemface.data.demo.documentation import PACKAGES
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.lines import read_lines, write_lines
from megasemface.data.text.spm_training import SpmTrainConfig, train_spm
from megasemface.data.text.textio import parse_lang_path, parse_parallel
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.embeddings.config import CLEmbeddingConfig
from megasemface.nn.config import build_model_config
from megasemface.pipeline.config import PipelineConfig
from megasemface.pipeline.launcher import ROOT, run_logged
from megasemface.pipeline.settings import setting

__all__ = [
    "build_cl_table",
    "build_corpus",
    "build_mixed_shards",
    "build_mono_shards",
    "build_parallel_shards",
    "build_ras_dictionary",
    "build_tokenizer",
    "cl_seed_pairs",
    "slice_parallel",
]


def build_corpus(config: PipelineConfig, corpus: Path | None = None) -> Path:
    """The demo corpus from gettext catalogs and Debian's documentation, or a corpus of the
    same layout given by the user (``mono/<lang>.txt``,
    ``parallel/<pair>/{train,valid,test}.<lang>``)."""
    if corpus is not None:
        for path in (
            *[corpus / "mono" / f"{lang}.txt" for lang in config.all_langs],
            *[
                corpus / "parallel" / pair / f"{s}.{lang}"
                for pair in config.pairs
                for s in ("train", "valid", "test")
                for lang in pair.split("-")
            ],
        ):
            if not path.is_file():
                raise FileNotFoundError(f"--corpus {corpus}: {path} is missing")
        print(f"using the corpus in {corpus}")
        return corpus
    out = config.workdir / "corpus"
    files = [out / "mono" / f"{lang}.txt" for lang in config.all_langs]
    if (out / "report.json").exists():
        # The split and the held-out text depend on every language read together, and the
        # tokenizer, shards and runs beside the corpus were built from it: a corpus of other
        # languages is not this one's, and building this one over it would orphan them.
        built = sorted(json.loads((out / "report.json").read_text())["pairs"])
        if built != sorted(config.pairs):
            asked = (
                f"--languages {','.join(config.languages)}"
                if config.multilingual
                else f"--pair {config.pair}"
            )
            raise ValueError(
                f"{out} holds the corpus of {', '.join(built)}, not of {asked}: give another "
                "--workdir"
            )
        if all(f.exists() for f in files):
            print(f"reusing {out} (delete it to rebuild)")
            return out
    report = build_demo_corpus(
        config.locale_dir, list(config.all_langs[1:]), out, doc_root=config.doc_root
    )
    if not (report["documentation"] or {}).get("installed"):
        print(
            f"no Debian documentation under {config.doc_root}: the corpus is the gettext "
            f"catalogs alone (apt-get install {PACKAGES} adds text and a prose test set)"
        )
    for pair, info in report["pairs"].items():
        sizes = ", ".join(f"{split} {n:,}" for split, n in info["split_sizes"].items())
        held = "the handbook's held-out chapters" if info["held_out_from"] != "catalogs" else ""
        where = f"valid and test from {held}, " if held else "split by program, "
        print(f"{pair} parallel pairs: {sizes} ({where}no test text in training)")
    for lang, info in report["mono"].items():
        print(f"{lang} monolingual: {info['lines']:,} lines, {info['tokens']:,} words")
    return out


def build_tokenizer(config: PipelineConfig, corpus: Path) -> Path:
    prefix = config.workdir / "spm" / "joint"
    model = prefix.with_suffix(".model")
    if model.exists() and set(Tokenizer.load(model).languages) == set(config.all_langs):
        print(f"reusing {model}")
        return model
    prefix.parent.mkdir(parents=True, exist_ok=True)
    corpora = parse_lang_path(
        [f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in config.all_langs]
    )
    started = time.perf_counter()
    train_spm(corpora, prefix, SpmTrainConfig(vocab_size=config.vocab_size, seed=config.seed))
    print(f"trained {model} ({config.vocab_size} pieces) in {time.perf_counter() - started:.1f}s")
    return model


def _shard_config(config: PipelineConfig) -> ShardBuildConfig:
    # Sentences the model cannot take whole (max_len less two special tokens) are dropped.
    max_len = build_model_config(config.model_preset, list(config.model_options)).max_len
    sizes = {"tokens_per_sample": 8192, "samples_per_shard": 8} if config.small_shards else {}
    return ShardBuildConfig(max_tokens=max_len - 2, jobs=config.shard_jobs, **sizes)


def _report(manifest: dict, out: Path) -> None:
    if manifest.get("already_built"):
        print(f"reusing {out}")
        return
    for lang, info in manifest["languages"].items():
        dropped = {k: v for k, v in info["filtered"].items() if v}
        print(f"  {lang}: {info['sentences']:,} kept, dropped {dropped or 'none'}")


def build_mono_shards(config: PipelineConfig, corpus: Path, spm: Path) -> Path:
    out = config.workdir / "shards" / "mono"
    inputs = [f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in config.all_langs]
    manifest = build_shards(
        parse_lang_path(inputs), spm, out, _shard_config(config), overwrite=True
    )
    _report(manifest, out)
    return out


def slice_parallel(
    config: PipelineConfig, corpus: Path, split: str, limit: int, pair: str | None = None
) -> Path:
    """``PREFIX`` with PREFIX.<lang> holding the first ``limit`` pairs of a split (0: all),
    of ``pair`` (default: ``config.pair``, under ``data/``; another: under ``data/<pair>/``)."""
    source = corpus / "parallel" / (pair or config.pair) / split
    if limit <= 0:
        return source
    folder = config.workdir / "data" if pair is None else config.workdir / "data" / pair
    prefix = folder / f"{split}-{limit}"
    for lang in pair.split("-") if pair else config.langs:
        target = prefix.with_name(f"{prefix.name}.{lang}")
        lines = read_lines(f"{source}.{lang}")[:limit]
        if not target.exists() or read_lines(target) != lines:
            target.parent.mkdir(parents=True, exist_ok=True)
            write_lines(target, lines)
    return prefix


def build_parallel_shards(
    config: PipelineConfig, corpus: Path, spm: Path, pair: str | None = None
) -> Path:
    """Parallel shards of the low-resource slice of the training pairs of ``pair`` (default:
    ``config.pair``, in ``shards/parallel-<n>``; another: ``shards/parallel-<pair>-<n>``)."""
    prefix = slice_parallel(config, corpus, "train", config.train_pairs, pair)
    src, tgt = pair.split("-") if pair else config.langs
    name = "parallel" if pair is None else f"parallel-{pair}"
    out = config.workdir / "shards" / f"{name}-{config.train_pairs}"
    item = f"{src}-{tgt}:{prefix}.{src},{prefix}.{tgt}"
    manifest = build_shards(parse_parallel([item]), spm, out, _shard_config(config), overwrite=True)
    _report(manifest, out)
    return out


def cl_seed_pairs(config: PipelineConfig, corpus: Path) -> list[tuple[str, Path, Path]]:
    """The (pair, source file, target file) translated sentences that seed the cross-lingual
    mapping: each pair's low-resource slice of training pairs when every setting of the run
    fine-tunes on it (supervised), else none. The table is built once for all the run's
    settings, and an unsupervised run may not see a translated sentence, through the table
    neither; validation and test pairs never seed it."""
    if not all(setting(name).parallel for name in config.settings):
        return []
    seeds = []
    for pair in config.pairs:
        own = pair if config.multilingual else None
        prefix = slice_parallel(config, corpus, "train", config.train_pairs, own)
        src, tgt = pair.split("-")
        seeds.append(
            (
                pair,
                prefix.with_name(f"{prefix.name}.{src}"),
                prefix.with_name(f"{prefix.name}.{tgt}"),
            )
        )
    return seeds


def _seed_files(report: dict) -> list[list[str]]:
    """The seed parallel files a build's report names (none: an unseeded build)."""
    return [files for seed in report.get("seeds", []) for files in seed.get("files", [])]


def _cl_embeddings_command(
    config: PipelineConfig,
    shards: Path,
    spm: Path,
    dim: int,
    corpus: Path,
    out: Path,
    seeds: Sequence[tuple[str, Path, Path]] = (),
) -> list[str]:
    """tools/build_cl_embeddings.py on the monolingual shards, writing ``out``.{safetensors,
    json}; with the corpus' gold dictionary, when it has one, for the report's precision,
    and the mapping seeded by ``seeds`` (:func:`cl_seed_pairs`)."""
    cmd = [sys.executable, str(ROOT / "tools" / "build_cl_embeddings.py")]
    cmd += ["--shards", str(shards), "--spm-model", str(spm), "--out", str(out)]
    cmd += ["--dim", str(dim), "--epochs", str(config.cl_epochs)]
    for pair, src, tgt in seeds:
        cmd += ["--seed-parallel", f"{pair}:{src},{tgt}"]
    if seeds:
        # VecMap's supervised mode: one Procrustes fit on the seed (the pairs of the training
        # sentences and the shared pieces), no self-learning, which on the demo's small
        # spaces drifts away from the seed's translations (BLI p@1 on the queries the seed
        # leaves out halved: docs/results.md#cross-lingual-embeddings).
        cmd += ["--max-iterations", "0"]
    if seeds and config.multilingual:
        # Every pair is en-xx: each language is mapped onto English with its own pairs.
        cmd += ["--pivot", SOURCE_LANG]
    # Several pairs: BLI is reported on the first one's dictionary (the table maps all).
    gold = corpus / "dict" / f"{config.pairs[0]}.tsv"
    if gold.is_file():
        cmd += ["--gold-dict", str(gold)]
    return cmd


def build_mixed_shards(
    config: PipelineConfig, corpus: Path, spm: Path, pair: str | None = None
) -> Path:
    """The monolingual text of ``pair``'s languages (default: ``config.pair``) and the
    low-resource slice of its training pairs in one shard directory (VECO's pre-training
    and deep fusion's fine-tuning read both; the loader draws each batch's language or pair
    by temperature sampling)."""
    prefix = slice_parallel(config, corpus, "train", config.train_pairs, pair)
    src, tgt = pair.split("-") if pair else config.langs
    name = "mono-parallel" if pair is None else f"mono-parallel-{pair}"
    out = config.workdir / "shards" / f"{name}-{config.train_pairs}"
    mono = [f"{lang}:{corpus / 'mono' / f'{lang}.txt'}" for lang in (src, tgt)]
    pairs = [f"{src}-{tgt}:{prefix}.{src},{prefix}.{tgt}"]
    corpora = parse_lang_path(mono) + parse_parallel(pairs)
    manifest = build_shards(corpora, spm, out, _shard_config(config), overwrite=True)
    _report(manifest, out)
    return out


def table_matches(
    built: dict[str, Any], config: PipelineConfig, dim: int, seed_files: list[list[str]]
) -> bool:
    """Whether a table's build report (``<workdir>/cl/table.json``) is the table this run
    asks for: its width, skip-gram epochs, seed files and centring."""
    recorded = built.get("config", {})
    epochs = recorded.get("skipgram", {}).get("epochs")
    # A table of a version before the centring records no such option: built without it.
    centred = recorded.get("centre_languages", False) == CLEmbeddingConfig.centre_languages
    same = built.get("dim") == dim and epochs == config.cl_epochs and centred
    return same and _seed_files(built) == seed_files


def build_cl_table(
    config: PipelineConfig,
    shards: Path,
    spm: Path,
    dim: int,
    corpus: Path,
    seeds: Sequence[tuple[str, Path, Path]] = (),
) -> Path:
    """The CL-SemFace table through tools/build_cl_embeddings.py (the documented command),
    its mapping seeded by ``seeds`` (:func:`cl_seed_pairs`)."""
    out = config.workdir / "cl" / "table"
    table, report = out.with_suffix(".safetensors"), out.with_suffix(".json")
    wanted = [[str(src), str(tgt)] for _, src, tgt in seeds]
    built = json.loads(report.read_text()) if report.is_file() else {}
    if table.is_file() and built and table_matches(built, config, dim, wanted):
        print(f"reusing {table}")
        return table
    cmd = _cl_embeddings_command(config, shards, spm, dim, corpus, out, seeds)
    seconds = run_logged(cmd, config.workdir / "cl" / "build.log", show=("p@", "BLI", "error"))
    print(f"built {table} in {seconds:.0f}s")
    return table


def build_ras_dictionary(
    config: PipelineConfig,
    shards: Path,
    spm: Path,
    dim: int,
    corpus: Path,
    seeds: Sequence[tuple[str, Path, Path]] = (),
) -> Path:
    """The word dictionary of random aligned substitution: the user's file, or one induced
    from the cross-lingual embeddings through tools/build_cl_embeddings.py --dictionary-out.

    The embeddings are built as the CL table's (same options, seed dictionary and seed, so
    the same vectors), in their own directory, ``<workdir>/ras/``, so that a work directory
    whose table was built before keeps it. The corpus' gold dictionary is passed for the
    report only (the induced dictionary's precision on it), never as the dictionary.
    """
    gold = corpus / "dict" / f"{config.pair}.tsv"
    if config.ras_dictionary is not None:
        path = config.ras_dictionary
        if not path.is_file():
            raise FileNotFoundError(f"--ras-dictionary {path}: no such file")
        if gold.is_file() and path.resolve() == gold.resolve():
            print(
                f"warning: {path} is the corpus' gold dictionary; the demo's holds one-word "
                "messages of the test split, so substituting from it trains on test pairs",
                flush=True,
            )
        print(f"using the RAS dictionary {path}")
        return path
    out = config.workdir / "ras"
    dictionary = out / f"{config.pair}.tsv"
    report = out / "embeddings.json"
    wanted = {"min_score": config.ras_min_score, "words": config.ras_words}
    seed_files = [[str(src), str(tgt)] for _, src, tgt in seeds]
    if dictionary.is_file() and report.is_file():
        built = json.loads(report.read_text()).get("dictionary", {})
        seeded = _seed_files(json.loads(report.read_text()))
        if {key: built.get(key) for key in wanted} == wanted and seeded == seed_files:
            print(f"reusing {dictionary} ({built.get('pairs')} pairs)")
            return dictionary
    cmd = _cl_embeddings_command(config, shards, spm, dim, corpus, out / "embeddings", seeds)
    cmd += ["--dictionary-out", str(dictionary), "--dictionary-words", str(config.ras_words)]
    cmd += ["--dictionary-min-score", str(config.ras_min_score)]
    seconds = run_logged(cmd, out / "build.log", show=("error",))
    built = json.loads(report.read_text())["dictionary"]
    checked = built.get("gold")
    judged = ""
    if checked and checked.get("precision") is not None:
        confirmed = round(checked["precision"] * checked["checked"])
        judged = f"; the gold dictionary judges {checked['checked']}, confirms {confirmed}"
    print(f"induced {dictionary}: {built['pairs']} pairs in {seconds:.0f}s{judged}")
    return dictionary
