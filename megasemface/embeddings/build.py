"""Builds the cross-lingual subword embedding table that CL-SemFace reads.

Pipeline, from the token shards of a joint SentencePiece vocabulary:

1. **read**: each language's sentences from its shards (flat ids + offsets, as stored);
2. **train**: skip-gram with negative sampling per language, on that language only
   (:mod:`megasemface.embeddings.skipgram`); ids are the joint vocabulary's, so every space
   has V rows of which only the language's seen ids are meaningful;
3. **map**: every language onto the pivot (the first language, or ``config.pivot``) by
   VecMap-style self-learning Procrustes seeded with the shared ids
   (:mod:`megasemface.embeddings.mapping`);
4. **merge**: an id seen in several languages gets the mean of its mapped vectors (renormalised),
   an id seen in one language gets that vector, and an id seen in none (special ids, language
   tags, unused byte pieces, rare pieces) gets a random unit direction from a fixed seed,
   so it is distinct from every other row without carrying meaning;
5. rows are scaled to norm ``sqrt(dim) * row_rms``: the interface regresses the encoder's
   pre-LayerNorm activation onto these rows and ties them as output embeddings, so a
   per-dimension RMS of about 1 matches the activations' scale (unit rows would make the
   tied logits nearly flat).

Writes ``<out>.safetensors`` (``{"embeddings": [V, dim] float32}``) and ``<out>.json``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import resource
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from megasemface.data.shard_format import Manifest, iter_shard_chunks, write_json_atomic
from megasemface.data.tokenizer import Tokenizer
from megasemface.embeddings.mapping import bli_precision, map_onto, normalize
from megasemface.embeddings.skipgram import SkipGramConfig, train_skipgram

__all__ = [
    "CLEmbeddingConfig",
    "CLEmbeddingError",
    "build_cl_embeddings",
    "load_gold_dictionary",
    "read_language",
]

logger = logging.getLogger(__name__)

REPORT_FORMAT = "megasemface-cl-embeddings/1"


class CLEmbeddingError(ValueError):
    """The table cannot be built from these inputs; the message says why."""


@dataclasses.dataclass(frozen=True)
class CLEmbeddingConfig:
    """Options of a table build."""

    skipgram: SkipGramConfig = dataclasses.field(default_factory=SkipGramConfig)
    languages: tuple[str, ...] = ()
    """Languages to use (default: all in the manifest, sorted)."""
    pivot: str | None = None
    """Language the others are mapped onto (default: the first language)."""
    seed_min_count: int = 5
    """A shared id seeds the dictionary when it occurs this often in both languages."""
    dict_min_count: int = 10
    """Only ids this frequent in their language take part in dictionary induction: rare
    pieces have noisy vectors and would add spurious pairs (VecMap's vocabulary cutoff)."""
    max_iterations: int = 20
    direction: str = "mutual"
    retrieval: str = "csls"
    csls_k: int = 10
    block_size: int = 2048
    max_tokens_per_lang: int | None = None
    """Read at most about this many tokens per language (whole samples), to bound memory."""
    row_rms: float = 1.0
    """Per-dimension RMS of every output row (row norm ``sqrt(dim) * row_rms``)."""
    threads: int | None = None

    def __post_init__(self) -> None:
        if self.seed_min_count < 1 or self.max_iterations < 0 or self.csls_k < 1:
            raise CLEmbeddingError("seed_min_count, csls_k >= 1 and max_iterations >= 0 needed")
        if self.block_size < 1 or not self.row_rms > 0:
            raise CLEmbeddingError("block_size must be >= 1 and row_rms > 0")


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
    """All sentences of one language as (flat int64 ids, offsets), read in build order."""
    token_parts: list[np.ndarray] = []
    length_parts: list[np.ndarray] = []
    total = 0
    for url in manifest.shard_paths(lang):
        for chunk in iter_shard_chunks(url, manifest.vocab_size):
            if chunk.lang != lang:
                raise CLEmbeddingError(f"{url}: a sample of language {chunk.lang!r}, not {lang!r}")
            token_parts.append(chunk.tokens.astype(np.int64))
            length_parts.append(chunk.lengths.astype(np.int64))
            total += len(chunk.tokens)
            if max_tokens is not None and total >= max_tokens:
                break
        if max_tokens is not None and total >= max_tokens:
            break
    tokens = np.concatenate(token_parts) if token_parts else np.zeros(0, np.int64)
    lengths = np.concatenate(length_parts) if length_parts else np.zeros(0, np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return tokens, offsets


def load_gold_dictionary(
    path: str | Path, tokenizer: Tokenizer
) -> tuple[list[tuple[int, int]], dict[str, int]]:
    """Word pairs ``src<TAB>tgt`` (or space-separated) as (id, id) pairs of single pieces.

    Words are encoded with the SentencePiece model as whole words (``▁word``); an entry is
    kept only when both sides are one piece, as a multi-piece word has no single row.
    """
    path = Path(path)
    if not path.is_file():
        raise CLEmbeddingError(f"gold dictionary not found: {path}")
    pairs: list[tuple[int, int]] = []
    entries = 0
    for line in path.read_text(encoding="utf-8").splitlines():
        fields = line.split("\t") if "\t" in line else line.split()
        if len(fields) < 2 or not fields[0].strip() or not fields[1].strip():
            continue
        entries += 1
        src = tokenizer.processor.encode(fields[0].strip())
        tgt = tokenizer.processor.encode(fields[1].strip())
        if len(src) == 1 and len(tgt) == 1:
            pairs.append((int(src[0]), int(tgt[0])))
    return pairs, {"entries": entries, "single_piece": len(pairs)}


def _bli(
    src: torch.Tensor,
    tgt: torch.Tensor,
    pairs: Sequence[tuple[int, int]],
    src_seen: np.ndarray,
    tgt_seen: np.ndarray,
    config: CLEmbeddingConfig,
) -> dict[str, float | int]:
    src_rows = torch.from_numpy(np.flatnonzero(src_seen))
    tgt_rows = torch.from_numpy(np.flatnonzero(tgt_seen))
    return bli_precision(
        src,
        tgt,
        pairs,
        (1, 5),
        method=config.retrieval,
        src_candidates=src_rows,
        tgt_candidates=tgt_rows,
        csls_k=config.csls_k,
        block_size=config.block_size,
    )


def _gold_langs(
    path: Path, languages: Sequence[str], pivot: str, others: Sequence[str]
) -> tuple[str, str]:
    """The dictionary's (source, target) languages from a name like ``en-de.tsv``."""
    parts = path.stem.split("-")
    if len(parts) == 2 and all(part in languages for part in parts):
        return parts[0], parts[1]
    return pivot, others[0]


def build_cl_embeddings(
    shard_dir: str | Path,
    spm_model: str | Path,
    out_path: str | Path,
    config: CLEmbeddingConfig | None = None,
    *,
    gold_dict: str | Path | None = None,
    gold_langs: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """Builds and writes the [V, dim] table; returns the report also written as JSON.

    ``out_path`` is a prefix: ``<out>.safetensors`` and ``<out>.json`` are written (a
    ``.safetensors`` suffix on ``out_path`` is accepted and stripped). ``gold_dict`` holds
    ``source word<TAB>target word`` lines for the languages ``gold_langs`` (default: read from
    a file name like ``en-de.tsv``, else the pivot and the first other language); BLI is
    measured before and after mapping.
    """
    config = config or CLEmbeddingConfig()
    previous_threads = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        return _build(shard_dir, spm_model, out_path, config, gold_dict, gold_langs)
    finally:
        # The thread count is process-wide: give the caller back what it had.
        torch.set_num_threads(previous_threads)


def _build(
    shard_dir: str | Path,
    spm_model: str | Path,
    out_path: str | Path,
    config: CLEmbeddingConfig,
    gold_dict: str | Path | None,
    gold_langs: tuple[str, str] | None,
) -> dict[str, Any]:
    """The body of :func:`build_cl_embeddings`, run under its thread setting."""
    from safetensors.torch import save_file

    out_path = Path(out_path)
    if out_path.suffix == ".safetensors":
        out_path = out_path.with_suffix("")
    report: dict[str, Any] = {"format": REPORT_FORMAT, "config": dataclasses.asdict(config)}
    started = time.perf_counter()

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
    languages = list(config.languages) or sorted(manifest.languages)
    missing = [lang for lang in languages if lang not in manifest.languages]
    if missing:
        raise CLEmbeddingError(
            f"languages {missing} have no shards in {shard_dir}; "
            f"it has {sorted(manifest.languages)}"
        )
    if len(languages) < 2:
        raise CLEmbeddingError(f"a cross-lingual table needs >= 2 languages, got {languages}")
    pivot = config.pivot or languages[0]
    if pivot not in languages:
        raise CLEmbeddingError(f"pivot language {pivot!r} is not among {languages}")
    others = [lang for lang in languages if lang != pivot]
    report.update(languages=languages, pivot=pivot, vocab_size=vocab_size)
    report["dim"] = config.skipgram.dim
    report["spm_sha256"] = tokenizer.sha256

    corpora: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    with _phase(report, "read"):
        for lang in languages:
            tokens, offsets = read_language(manifest, lang, config.max_tokens_per_lang)
            if len(tokens) == 0:
                raise CLEmbeddingError(f"language {lang!r} has no tokens in {shard_dir}")
            corpora[lang] = (tokens, offsets)

    spaces: dict[str, torch.Tensor] = {}
    seen: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    sizes: dict[str, Any] = {}
    with _phase(report, "train"):
        for i, lang in enumerate(languages):
            tokens, offsets = corpora.pop(lang)  # free each corpus once trained on
            sg = dataclasses.replace(config.skipgram, seed=config.skipgram.seed + i)
            try:
                result = train_skipgram(tokens, offsets, vocab_size, sg)
            except ValueError as exc:
                raise CLEmbeddingError(f"language {lang!r}: {exc}") from exc
            spaces[lang] = normalize(result.vectors)
            seen[lang] = result.trained
            counts[lang] = result.counts
            sizes[lang] = {
                "sentences": len(offsets) - 1,
                "tokens": len(tokens),
                "ids_seen": int((result.counts > 0).sum()),
                "ids_trained": int(result.trained.sum()),
                "pairs": result.pairs,
                "loss_per_epoch": [round(x, 4) for x in result.losses],
            }
    report["sizes"] = sizes

    gold: list[tuple[int, int]] = []
    if gold_dict is not None:
        gold, gold_stats = load_gold_dictionary(gold_dict, tokenizer)
        gold_src, gold_tgt = gold_langs or _gold_langs(Path(gold_dict), languages, pivot, others)
        for lang in (gold_src, gold_tgt):
            if lang not in languages:
                raise CLEmbeddingError(
                    f"gold dictionary language {lang!r} is not among {languages}"
                )
        usable = [(s, t) for s, t in gold if seen[gold_src][s] and seen[gold_tgt][t]]
        gold_stats.update(usable=len(usable), pair=f"{gold_src}-{gold_tgt}")
        report["gold"] = gold_stats
        gold = usable
        if gold:
            with _phase(report, "bli_before"):
                report["bli_before"] = _bli(
                    spaces[gold_src], spaces[gold_tgt], gold, seen[gold_src], seen[gold_tgt], config
                )

    mapped: dict[str, torch.Tensor] = {pivot: spaces[pivot]}
    report["mapping"] = {}
    with _phase(report, "map"):
        z_rows = np.flatnonzero(seen[pivot] & (counts[pivot] >= config.dict_min_count))
        for lang in others:
            x_rows = np.flatnonzero(seen[lang] & (counts[lang] >= config.dict_min_count))
            floor = max(config.seed_min_count, config.dict_min_count)
            shared = np.flatnonzero(
                (counts[lang] >= floor) & (counts[pivot] >= floor) & seen[lang] & seen[pivot]
            )
            # Seed pairs as positions within the seen-row subsets.
            seed = torch.from_numpy(
                np.stack([np.searchsorted(x_rows, shared), np.searchsorted(z_rows, shared)], 1)
            )
            if seed.numel() == 0:
                raise CLEmbeddingError(
                    f"{lang} and {pivot} share no id seen >= {config.seed_min_count} times in "
                    "both; lower seed_min_count or use more data"
                )
            result = map_onto(
                spaces[lang][x_rows],
                spaces[pivot][z_rows],
                seed,
                max_iterations=config.max_iterations,
                direction=config.direction,
                method=config.retrieval,
                csls_k=config.csls_k,
                block_size=config.block_size,
            )
            mapped[lang] = spaces[lang] @ result.matrix
            report["mapping"][lang] = {
                "onto": pivot,
                "seed_dictionary": result.seed_size,
                "iterations": result.iterations,
                "converged": result.converged,
                "dictionary_sizes": result.dictionary_sizes,
            }

    if gold:
        with _phase(report, "bli_after"):
            report["bli_after"] = _bli(
                mapped[gold_src], mapped[gold_tgt], gold, seen[gold_src], seen[gold_tgt], config
            )
            # Identical pieces (e.g. "Server" in both) are in the seed dictionary, so the
            # pairs whose two sides differ are the honest measure of the mapping.
            nonidentical = [(s, t) for s, t in gold if s != t]
            if nonidentical:
                report["bli_before_nonidentical"] = _bli(
                    spaces[gold_src],
                    spaces[gold_tgt],
                    nonidentical,
                    seen[gold_src],
                    seen[gold_tgt],
                    config,
                )
                report["bli_after_nonidentical"] = _bli(
                    mapped[gold_src],
                    mapped[gold_tgt],
                    nonidentical,
                    seen[gold_src],
                    seen[gold_tgt],
                    config,
                )

    with _phase(report, "merge"):
        dim = config.skipgram.dim
        total = torch.zeros(vocab_size, dim)
        uses = torch.zeros(vocab_size)
        for lang in languages:
            mask = torch.from_numpy(seen[lang])
            total[mask] += torch.nn.functional.normalize(mapped[lang][mask], dim=1)
            uses += mask.float()
        unseen = uses == 0
        generator = torch.Generator().manual_seed(config.skipgram.seed + 7919)
        total[unseen] = torch.randn(int(unseen.sum()), dim, generator=generator)
        table = torch.nn.functional.normalize(total, dim=1) * (math.sqrt(dim) * config.row_rms)
        if not torch.isfinite(table).all():
            raise CLEmbeddingError("the table holds NaN or infinite values; lower the lr")
        report["ids"] = {
            "shared": int((uses > 1).sum()),
            "single_language": int((uses == 1).sum()),
            "unseen": int(unseen.sum()),
        }

    out_path.parent.mkdir(parents=True, exist_ok=True)
    tensor_path = out_path.with_name(out_path.name + ".safetensors")
    save_file(
        {"embeddings": table.contiguous()},
        str(tensor_path),
        metadata={
            "format": REPORT_FORMAT,
            "spm_sha256": tokenizer.sha256,
            "languages": ",".join(languages),
        },
    )
    report["seconds"] = round(time.perf_counter() - started, 3)
    report["peak_rss_mib"] = round(_peak_mib(), 1)
    report["table"] = str(tensor_path)
    report["threads"] = torch.get_num_threads()
    write_json_atomic(out_path.with_name(out_path.name + ".json"), report)
    return report
