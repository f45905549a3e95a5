"""Paired significance of BLEU differences: sacreBLEU's own paired bootstrap resampling.

This module only feeds sacreBLEU's implementation (``sacrebleu.significance.PairedTest``,
test type ``bs``: Koehn (2004), as Moses' ``bootstrap-hypothesis-difference-significance.pl``)
with hypotheses and references; it computes nothing itself, so a p-value here equals
``sacrebleu REF -i BASELINE SYSTEM -m bleu --paired-bs`` on the same lines.

Reproducible by construction: 1,000 resamples (sacreBLEU's default) and sacreBLEU's fixed seed,
12345, which sacreBLEU reads from ``SACREBLEU_SEED`` as its command line does; the signature
returned records both (``bs:1000|seed:12345``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sacrebleu.metrics import BLEU
from sacrebleu.significance import PairedTest

__all__ = ["BOOTSTRAP_SAMPLES", "PairedResult", "paired_bootstrap"]

BOOTSTRAP_SAMPLES = 1000
"""sacreBLEU's default number of paired bootstrap resamples (``--paired-bs-n``)."""


@dataclasses.dataclass(frozen=True)
class PairedResult:
    """One system against the baseline, as sacreBLEU's paired bootstrap reports it."""

    bleu: float
    """Corpus BLEU of the system's hypotheses (all of them, as given)."""
    baseline_bleu: float
    p_value: float
    """The probability of a difference at least this large by chance in the choice of test
    sentences (sacreBLEU's p; the smallest possible is 1 / (resamples + 1))."""
    signature: str
    """sacreBLEU's signature of the test, e.g.
    ``nrefs:1|bs:1000|seed:12345|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0``."""


def paired_bootstrap(
    baseline: Sequence[str],
    system: Sequence[str],
    references: Sequence[str],
    *,
    lowercase: bool = False,
) -> PairedResult:
    """sacreBLEU's paired bootstrap test of ``system`` against ``baseline`` on BLEU.

    The three lists are line-aligned: line i of both systems translates the source of
    ``references[i]``. ``lowercase`` as in :func:`megasemface.evaluation.metrics.evaluate`,
    whose BLEU settings (sacreBLEU's defaults otherwise) these are.

    Raises:
        ValueError: the lists differ in length, or are empty.
    """
    if not len(baseline) == len(system) == len(references):
        raise ValueError(
            f"paired test needs line-aligned lists: baseline {len(baseline)}, "
            f"system {len(system)}, references {len(references)} lines"
        )
    if not references:
        raise ValueError("paired test on an empty test set")
    test = PairedTest(
        [("baseline", list(baseline)), ("system", list(system))],
        {"BLEU": BLEU(lowercase=lowercase)},
        [list(references)],
        test_type="bs",
        n_samples=BOOTSTRAP_SAMPLES,
    )
    signatures, scores = test()
    # scores: {"System": names, "BLEU": [baseline Result, system Result]}
    base, result = scores["BLEU"]
    return PairedResult(
        bleu=result.score,  # type: ignore[union-attr]
        baseline_bleu=base.score,  # type: ignore[union-attr]
        p_value=result.p_value,  # type: ignore[union-attr]
        signature=signatures["BLEU"].format(),
    )
