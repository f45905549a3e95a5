"""Builds the cross-lingual subword embedding table that CL-SemFace reads.

Pipeline, from the token shards of a joint SentencePiece vocabulary:

1. **read**: each language's sentences from its shards (flat ids + offsets, as stored);
2. **train**: skip-gram with negative sampling per language, on that language only, by a
   compiled library (gensim's Word2Vec by default) reading the sentences from a temporary
   text file (:mod:`megasemface.embeddings.skipgram`); ids are the joint vocabulary's, so
   every space has V rows of which only the language's trained ids are meaningful;
3. **map**: every language onto the pivot (the first language, or ``config.pivot``) by
   VecMap-style self-learning Procrustes (:mod:`megasemface.embeddings.mapping`), seeded
   with the ids both languages use often (``init="identical"``), those of them holding a
   digit (``init="numerals"``) or VecMap's fully unsupervised initialisation from
   similarity distributions (``init="unsupervised"``; :mod:`megasemface.embeddings.inits`),
   plus the pairs of a seed dictionary given from outside, translated sentences or a word
   list (:mod:`megasemface.embeddings.seeds`);
   only the ``induction_vocab`` most frequent ids of each language take part in dictionary
   induction (VecMap's vocabulary cutoff), the map is then applied to every row;
4. **merge**: an id trained in several languages gets the mean of its mapped vectors
   (renormalised), an id trained in one language gets that vector, and an id trained in none
   gets a random unit direction from a fixed seed, so it is distinct from every other row
   without carrying meaning; the report counts them as ``unseen`` (never in the shards:
   special ids, language tags, unused byte pieces) and ``rare`` (fewer than ``min_count``
   occurrences in every language);
5. rows are scaled to norm ``sqrt(dim) * row_rms``: the interface regresses the encoder's
   pre-LayerNorm activation onto these rows and ties them as output embeddings, so a
   per-dimension RMS of about 1 matches the activations' scale (unit rows would make the
   tied logits nearly flat).

Writes ``<out>.safetensors`` (``{"embeddings": [V, dim] float32}``) and ``<out>.json``.

Memory of each phase (V ids, d dimensions, L languages, n = ``induction_vocab``; the
report's ``phases`` holds the measured time and peak RSS of each):

- read: 4 bytes per token plus 8 per sentence, per language (bounded by
  ``max_tokens_per_lang``);
- train: ``8 V d`` bytes for one language at a time (the library's input and output
  vectors; 60,000 x 1,024: 0.5 GB) and ``4 V d`` for the result, plus about 50 bytes per
  token of a 4M-token block while the sentence file is written (on disk: about 5 bytes per
  token);
- map: ``4 L V d`` bytes for the normalised spaces (kept for the merge), ``8 n d`` for the
  induction rows and ``4 block_size n`` for one block of similarities: never ``V x V``
  (60,000^2 float32 would be 14.4 GB); the unsupervised initialisation adds
  ``8 init_vocab^2`` bytes (4,000: 128 MB);
- merge: ``8 V d`` bytes.
"""

from __future__ import annotations

import dataclasses
import logging
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megasemface.data.shards.shard_format import Manifest, iter_shard_chunks, write_json_atomic
from megasemface.data.text.ras import RasDictionaryError, dictionary_languages
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.embeddings.config import INITS, CLEmbeddingConfig, CLEmbeddingError
from megasemface.embeddings.dictionary import (
    gold_precision,
    induce_dictionary_pairs,
    whole_word_counts,
    write_dictionary,
)
from megasemface.embeddings.gold import (
    GoldDictionaryError,
    GoldEntry,
    gold_languages,
    gold_queries,
    load_gold_dictionary,
)
from megasemface.embeddings.inits import digit_pieces
from megasemface.embeddings.mapping import bli_precision, normalize
from megasemface.embeddings.seeds import (
    SeedDictionary,
    SeedDictionaryError,
    SeedParallel,
    disjoint_gold,
    parallel_seed,
    word_list_seed,
)
from megasemface.embeddings.skipgram import train_skipgram
from megasemface.embeddings.table import map_language, merge_table
from megasemface.files import write_atomically

__all__ = [
    "INITS",
    "CLEmbeddingConfig",
    "CLEmbeddingError",
    "SeedParallel",
    "build_cl_embeddings",
    "read_language",
]

logger = logging.getLogger(__name__)

REPORT_FORMAT = "megasemface-cl-embeddings/1"


def _peak_mib() -> float:
    # ru_maxrss is the process's peak resident size so far, in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@contextmanager
def _phase(report: dict[str, Any], name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    report.setdefault("phases", {})[name] = {
        "seconds": round(time.perf_counter() - start, 3),
        "peak_rss_mib": round(_peak_mib(), 1),
    }


def read_language(
    manifest: Manifest, lang: str, max_tokens: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """All sentences of one language as (flat int32 ids, int64 offsets), in build order."""
    token_parts: list[np.ndarray] = []
    length_parts: list[np.ndarray] = []
    total = 0
    for url in manifest.shard_paths(lang):
        for chunk in iter_shard_chunks(url, manifest.vocab_size):
            if chunk.lang != lang:
                raise CLEmbeddingError(f"{url}: a sample of language {chunk.lang!r}, not {lang!r}")
            token_parts.append(chunk.tokens.astype(np.int32))
            length_parts.append(chunk.lengths.astype(np.int64))
            total += len(chunk.tokens)
            if max_tokens is not None and total >= max_tokens:
                break
        if max_tokens is not None and total >= max_tokens:
            break
    tokens = np.concatenate(token_parts) if token_parts else np.zeros(0, np.int32)
    lengths = np.concatenate(length_parts) if length_parts else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return tokens, offsets


def _languages(manifest: Manifest, config: CLEmbeddingConfig, shard_dir: Path) -> list[str]:
    monolingual = sorted(set(manifest.languages) - set(manifest.pair_layouts))
    languages = list(config.languages) or monolingual
    missing = [lang for lang in languages if lang not in monolingual]
    if missing:
        raise CLEmbeddingError(
            f"languages {missing} have no monolingual shards in {shard_dir}; it has {monolingual}"
        )
    if len(languages) < 2:
        raise CLEmbeddingError(
            f"a cross-lingual table needs >= 2 languages, got {languages} from {shard_dir}; "
            "build shards of at least two languages"
        )
    return languages


def _bli(
    src: torch.Tensor,
    tgt: torch.Tensor,
    pairs: Sequence[tuple[int, int]],
    src_trained: np.ndarray,
    tgt_trained: np.ndarray,
    config: CLEmbeddingConfig,
) -> dict[str, float | int]:
    """BLI precision@1/@5, retrieving among every trained id of the target language."""
    return bli_precision(
        src,
        tgt,
        pairs,
        (1, 5),
        method=config.retrieval,
        src_candidates=torch.from_numpy(np.flatnonzero(src_trained)),
        tgt_candidates=torch.from_numpy(np.flatnonzero(tgt_trained)),
        csls_k=config.csls_k,
        block_size=config.block_size,
    )


def build_cl_embeddings(
    shard_dir: str | Path,
    spm_model: str | Path,
    out_path: str | Path,
    config: CLEmbeddingConfig | None = None,
    *,
    gold_dict: str | Path | None = None,
    gold_langs: tuple[str, str] | None = None,
    dictionary_out: str | Path | None = None,
    seed_parallel: Sequence[SeedParallel] = (),
    seed_dictionary: str | Path | None = None,
) -> dict[str, Any]:
    """Builds and writes the [V, dim] table; returns the report also written as JSON.

    ``out_path`` is a prefix: ``<out>.safetensors`` and ``<out>.json`` are written (a
    ``.safetensors`` suffix on ``out_path`` is accepted and stripped). ``gold_dict`` holds
    ``source word<TAB>target word`` lines for the languages ``gold_langs`` (default: read from
    a file name like ``en-de.tsv``, else the pivot and the first other language); BLI is
    measured before and after mapping. ``dictionary_out`` (named ``<src>-<tgt>.tsv``, the
    languages it holds) receives a word
    dictionary induced from the mapped spaces (:mod:`megasemface.embeddings.dictionary`), with
    its precision on the gold dictionary in the report when there is one.

    ``seed_parallel`` (translated sentences) and ``seed_dictionary`` (a word list named
    ``<src>-<tgt>.tsv``) add seed pairs to the mapping of their non-pivot language onto the
    pivot (:mod:`megasemface.embeddings.seeds`); BLI then leaves out the gold queries a seed
    covers, and the report's ``gold`` says how many.
    """
    config = config or CLEmbeddingConfig()
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _build(
            Path(shard_dir),
            Path(spm_model),
            Path(out_path),
            config,
            gold_dict,
            gold_langs,
            None if dictionary_out is None else Path(dictionary_out),
            seed_parallel,
            None if seed_dictionary is None else Path(seed_dictionary),
        )
    finally:
        # The thread count is process-wide: give the caller back what it had.
        torch.set_num_threads(previous_threads)


def _build(
    shard_dir: Path,
    spm_model: Path,
    out_path: Path,
    config: CLEmbeddingConfig,
    gold_dict: str | Path | None,
    gold_langs: tuple[str, str] | None,
    dictionary_out: Path | None,
    seed_parallel: Sequence[SeedParallel],
    seed_dictionary: Path | None,
) -> dict[str, Any]:
    """The body of :func:`build_cl_embeddings`, run under its thread setting."""
    from safetensors.torch import save_file

    if out_path.suffix == ".safetensors":
        out_path = out_path.with_suffix("")
    report: dict[str, Any] = {"format": REPORT_FORMAT, "config": dataclasses.asdict(config)}
    started = time.perf_counter()

    if not spm_model.is_file():
        raise CLEmbeddingError(f"SentencePiece model not found: {spm_model}")
    tokenizer = Tokenizer.load(spm_model)
    try:
        manifest = Manifest.load(shard_dir)
    except FileNotFoundError as exc:
        raise CLEmbeddingError(str(exc)) from exc
    if manifest.spm_sha256 != tokenizer.sha256:
        raise CLEmbeddingError(
            f"{shard_dir}: shards from another SentencePiece model (manifest sha256 "
            f"{manifest.spm_sha256[:12]}..., {spm_model} has {tokenizer.sha256[:12]}...); "
            "rebuild the shards with this model or pass the model they were built with"
        )
    vocab_size = tokenizer.vocab_size
    languages = _languages(manifest, config, shard_dir)
    pivot = config.pivot or languages[0]
    if pivot not in languages:
        raise CLEmbeddingError(f"pivot language {pivot!r} is not among {languages}")
    others = [lang for lang in languages if lang != pivot]
    report.update(languages=languages, pivot=pivot, vocab_size=vocab_size)
    report["dim"] = config.skipgram.dim
    report["spm_sha256"] = tokenizer.sha256

    entries: list[GoldEntry] = []
    if gold_dict is not None:
        # Read before hours of training, so that a bad path fails at once.
        try:
            entries, report["gold"] = load_gold_dictionary(gold_dict, tokenizer)
        except GoldDictionaryError as exc:
            raise CLEmbeddingError(str(exc)) from exc
        gold_src, gold_tgt = gold_langs or gold_languages(Path(gold_dict), languages, pivot, others)
        for lang in (gold_src, gold_tgt):
            if lang not in languages:
                raise CLEmbeddingError(
                    f"gold dictionary language {lang!r} is not among {languages}"
                )

    dictionary_langs = None
    if dictionary_out is not None:
        try:  # the name RAS reads the languages from, checked before the training
            dictionary_langs = dictionary_languages(dictionary_out, languages)
        except RasDictionaryError as exc:
            raise CLEmbeddingError(str(exc)) from None

    # Read before the training too: a bad file fails at once.
    seeds = _read_seeds(seed_parallel, seed_dictionary, tokenizer, languages, pivot, config)
    if seeds:
        report["seeds"] = [
            {
                "languages": "-".join(seed.langs),
                "pairs": len(seed.pairs),
                "origin": seed.origin,
                "files": [[str(a), str(b)] for a, b in seed.files],
            }
            for seed in seeds
        ]

    spaces: dict[str, torch.Tensor] = {}
    trained: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    word_counts: dict[str, np.ndarray] = {}
    sizes: dict[str, Any] = {}
    pieces = [tokenizer.processor.IdToPiece(i) for i in range(vocab_size)]
    for i, lang in enumerate(languages):
        with _phase(report, f"read_{lang}"):
            tokens, offsets = read_language(manifest, lang, config.max_tokens_per_lang)
        if len(tokens) == 0:
            raise CLEmbeddingError(
                f"language {lang!r} has no tokens in {shard_dir}; add text for it to the shards "
                "or leave it out with --lang"
            )
        with _phase(report, f"train_{lang}"):
            sg = dataclasses.replace(config.skipgram, seed=config.skipgram.seed + i)
            try:
                result = train_skipgram(tokens, offsets, vocab_size, sg)
            except ValueError as exc:
                raise CLEmbeddingError(f"language {lang!r} in {shard_dir}: {exc}") from exc
        spaces[lang] = normalize(result.vectors)
        trained[lang] = result.trained
        counts[lang] = result.counts
        if dictionary_out is not None:
            word_counts[lang] = whole_word_counts(tokens, offsets, pieces)
        sizes[lang] = {
            "sentences": len(offsets) - 1,
            "tokens": len(tokens),
            "ids_seen": int((result.counts > 0).sum()),
            "ids_trained": int(result.trained.sum()),
            "tokens_trained": result.tokens,
            "tokens_per_second": round(result.tokens / max(result.seconds, 1e-9)),
            "sentence_file_seconds": round(result.file_seconds, 3),
            "cpu_seconds": round(result.cpu_seconds, 3),
        }
        del tokens, offsets, result
    report["sizes"] = sizes

    gold: list[tuple[int, int]] = []
    if entries:
        gold = gold_queries(entries, counts[gold_src], counts[gold_tgt], config.bli_min_count)
        report["gold"].update(
            pair=f"{gold_src}-{gold_tgt}",
            queries=len({s for s, _ in gold}),
            min_count=config.bli_min_count,
        )
        covering = [
            s.oriented(gold_src, gold_tgt) for s in seeds if {*s.langs} == {gold_src, gold_tgt}
        ]
        if covering:
            # The evaluation dictionary must be disjoint from the seed the mapping was given.
            gold, removed = disjoint_gold(gold, np.concatenate(covering))
            report["gold"].update(queries=len({s for s, _ in gold}), seed_queries_removed=removed)
    if gold:
        with _phase(report, "bli_before"):
            report["bli_before"] = _bli(
                spaces[gold_src],
                spaces[gold_tgt],
                gold,
                trained[gold_src],
                trained[gold_tgt],
                config,
            )

    report["mapping"] = {}
    digits = digit_pieces(pieces)
    for lang in others:
        given = [s.oriented(lang, pivot) for s in seeds if {*s.langs} == {lang, pivot}]
        with _phase(report, f"map_{lang}"):
            matrix, report["mapping"][lang] = map_language(
                lang,
                pivot,
                spaces,
                counts,
                trained,
                config,
                digits=digits,
                given=np.concatenate(given) if given else None,
            )
            # Mapped in place of the unmapped space, which is not needed again: a second
            # [V, d] copy per language would set the peak at scale.
            spaces[lang] = spaces[lang] @ matrix

    if gold:
        with _phase(report, "bli_after"):
            report["bli_after"] = _bli(
                spaces[gold_src],
                spaces[gold_tgt],
                gold,
                trained[gold_src],
                trained[gold_tgt],
                config,
            )
            # With the identical seed, pairs written alike in both languages ("Server") are
            # in the seed dictionary: the pairs whose sides differ measure the mapping alone.
            different = [(s, t) for s, t in gold if s != t]
            if different:
                report["bli_after_different"] = _bli(
                    spaces[gold_src],
                    spaces[gold_tgt],
                    different,
                    trained[gold_src],
                    trained[gold_tgt],
                    config,
                )

    if dictionary_out is not None and dictionary_langs is not None:
        with _phase(report, "dictionary"):
            langs = dictionary_langs
            pairs = _write_dictionary(dictionary_out, langs, spaces, word_counts, pieces, config)
            report["dictionary"] = {
                "file": str(dictionary_out),
                "languages": list(langs),
                "pairs": len(pairs),
                "words": config.dictionary_words,
                "min_score": config.dictionary_min_score,
            }
            if entries and langs == (gold_src, gold_tgt):
                # How many pairs the gold dictionary can judge, and how many it confirms.
                report["dictionary"]["gold"] = gold_precision(pairs, entries)

    with _phase(report, "merge"):
        table, report["ids"] = merge_table(languages, spaces, counts, trained, config)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tensor_path = out_path.with_name(out_path.name + ".safetensors")
    metadata = {
        "format": REPORT_FORMAT,
        "spm_sha256": tokenizer.sha256,
        "languages": ",".join(languages),
    }
    write_atomically(
        tensor_path,
        lambda target: save_file(
            {"embeddings": table.contiguous()}, str(target), metadata=metadata
        ),
    )
    report["seconds"] = round(time.perf_counter() - started, 3)
    report["peak_rss_mib"] = round(_peak_mib(), 1)
    report["table"] = str(tensor_path)
    report["threads"] = torch.get_num_threads()
    write_json_atomic(out_path.with_name(out_path.name + ".json"), report)
    return report


def _read_seeds(
    seed_parallel: Sequence[SeedParallel],
    seed_dictionary: Path | None,
    tokenizer: Tokenizer,
    languages: Sequence[str],
    pivot: str,
    config: CLEmbeddingConfig,
) -> list[SeedDictionary]:
    """The seed dictionaries given to the build; each must pair the pivot with another of
    the build's languages, the only mappings there are."""
    seeds: list[SeedDictionary] = []
    try:
        for source in seed_parallel:
            _check_seed_languages(source.langs, languages, pivot, "seed parallel data")
            seeds.append(parallel_seed(source, tokenizer, config.seed_pair_min_count))
        if seed_dictionary is not None:
            langs = dictionary_languages(seed_dictionary, languages)
            _check_seed_languages(langs, languages, pivot, str(seed_dictionary))
            seeds.append(word_list_seed(langs, seed_dictionary, tokenizer))
    except (SeedDictionaryError, RasDictionaryError) as exc:
        raise CLEmbeddingError(str(exc)) from None
    return seeds


def _check_seed_languages(
    langs: tuple[str, str], languages: Sequence[str], pivot: str, what: str
) -> None:
    if not set(langs) <= set(languages) or pivot not in langs:
        raise CLEmbeddingError(
            f"{what} is {'-'.join(langs)}: a seed must pair the pivot {pivot!r} with another "
            f"of the languages {list(languages)}; choose the pivot with --pivot"
        )


def _write_dictionary(
    path: Path,
    langs: tuple[str, str],
    spaces: dict[str, torch.Tensor],
    word_counts: dict[str, np.ndarray],
    pieces: list[str],
    config: CLEmbeddingConfig,
) -> list[tuple[int, int, float]]:
    """Induces and writes the RAS dictionary; returns its (source, target, score) pairs."""
    pairs = induce_dictionary_pairs(
        spaces,
        word_counts,
        pieces,
        langs,
        words=config.dictionary_words,
        min_count=config.dict_min_count,
        min_score=config.dictionary_min_score,
        csls_k=config.csls_k,
        block_size=config.block_size,
    )
    if not pairs:
        raise CLEmbeddingError(
            f"no word pair of {'-'.join(langs)} reaches the CSLS threshold "
            f"{config.dictionary_min_score}; lower it or use more data"
        )
    write_dictionary(path, pairs, pieces)
    return pairs
