"""Language tags and temperature-based language sampling.

With raw corpus sizes ``n_l`` and exponent ``alpha`` (XLM's q_i = p_i^alpha / sum_j p_j^alpha;
alpha = 1 / temperature), small languages get a larger share than their raw proportion, so
they are not drowned out by large ones. alpha = 1 keeps raw proportions; alpha = 0 is uniform.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

__all__ = [
    "LANG_TAG_FORMAT",
    "lang_from_tag",
    "lang_tag",
    "sampling_probs",
    "temperature_probs",
]

LANG_TAG_FORMAT = "__{}__"


def lang_tag(lang: str) -> str:
    """The control symbol that stands for a language, e.g. ``__de__``."""
    return LANG_TAG_FORMAT.format(lang)


def lang_from_tag(piece: str) -> str | None:
    """The language of a tag piece, or None when the piece is not a language tag."""
    if len(piece) > 4 and piece.startswith("__") and piece.endswith("__"):
        return piece[2:-2]
    return None


def temperature_probs(sizes: Mapping[str, int], temperature: float) -> dict[str, float]:
    """Sampling probabilities per language: proportional to size ** (1 / temperature)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not sizes:
        raise ValueError("no languages to sample from")
    langs = list(sizes)
    counts = np.array([sizes[lang] for lang in langs], dtype=np.float64)
    if (counts < 0).any():
        raise ValueError(f"negative corpus size in {dict(sizes)}")
    if counts.sum() == 0:
        raise ValueError(f"every language is empty: {dict(sizes)}")
    weights = np.where(counts > 0, (counts / counts.sum()) ** (1.0 / temperature), 0.0)
    weights /= weights.sum()
    return {lang: float(w) for lang, w in zip(langs, weights, strict=True)}


def sampling_probs(
    sizes: Mapping[str, int],
    temperature: float,
    pairs: Collection[str] = (),
    pair_share: float | None = None,
) -> dict[str, float]:
    """Sampling probabilities of the languages and language ``pairs`` of ``sizes``.

    Without ``pair_share``, one temperature over all of them (a pair counts its pairs). With
    it, the pairs together get that share and the single languages the rest, each kind
    divided among its own by temperature: a corpus whose pairs are few (VECO's, which
    alternates monolingual and parallel batches one to one) still trains on them as often
    as asked. A source with only one kind is sampled as it is.
    """
    if pair_share is None:
        return temperature_probs(sizes, temperature)
    if not 0 < pair_share < 1:
        raise ValueError(f"pair_share must be in (0, 1), got {pair_share}")
    paired = {k: n for k, n in sizes.items() if k in pairs}
    single = {k: n for k, n in sizes.items() if k not in pairs}
    if not paired or not single:
        return temperature_probs(sizes, temperature)
    probs = {k: pair_share * p for k, p in temperature_probs(paired, temperature).items()}
    probs |= {k: (1 - pair_share) * p for k, p in temperature_probs(single, temperature).items()}
    return {k: probs[k] for k in sizes}
