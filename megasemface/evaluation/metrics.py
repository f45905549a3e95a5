"""Corpus BLEU and chrF with sacreBLEU, and logging them to an MLflow run.

Scores are computed on detokenised text (what ``Tokenizer.decode`` gives) with sacreBLEU's
own tokenisation, so they equal ``sacrebleu REF -i HYP -m bleu chrf`` on the same lines, and
each comes with sacreBLEU's signature string, which records every setting that changes the
number. ``lowercase`` (the paper's setting) lowercases for both metrics: the command-line
equivalent is ``-lc --chrf-lowercase``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sacrebleu.metrics import BLEU, CHRF

from megasemface.tracking.run_scores import log_scores

__all__ = ["EvaluationResult", "MetricScore", "evaluate", "log_to_mlflow"]


@dataclasses.dataclass(frozen=True)
class MetricScore:
    """One corpus-level score."""

    name: str
    """``bleu`` or ``chrf``: the MLflow metric name."""
    score: float
    signature: str
    """sacreBLEU's signature, e.g. ``nrefs:1|case:lc|eff:no|tok:13a|smooth:exp|version:2.6.0``."""
    details: str
    """sacreBLEU's one-line report, e.g. ``BLEU = 53.73 83.3/60.0/50.0/33.3 (BP = 1.000 ...)``."""

    def format(self) -> str:
        return f"{self.details}  [{self.signature}]"


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    bleu: MetricScore
    chrf: MetricScore
    sentences: int
    empty_hypotheses: int
    note: str | None
    """Why a score is 0 or suspect (empty test set, empty hypotheses); None otherwise."""

    @property
    def scores(self) -> list[MetricScore]:
        return [self.bleu, self.chrf]

    def format(self) -> str:
        """A few lines for a terminal or a log."""
        lines = [s.format() for s in self.scores]
        if self.note:
            lines.append(f"note: {self.note}")
        return "\n".join(lines)


def evaluate(
    hypotheses: Sequence[str],
    references: Sequence[str],
    *,
    lowercase: bool = False,
    hypotheses_name: str = "hypotheses",
    references_name: str = "references",
) -> EvaluationResult:
    """Corpus BLEU and chrF of ``hypotheses`` against one reference each.

    ``*_name`` (e.g. the file names) only serve the error message. An empty test set scores 0
    with a note rather than failing, so that an evaluation hook never stops training.

    Raises:
        ValueError: the two lists have different lengths.
    """
    if isinstance(hypotheses, str) or isinstance(references, str):
        raise TypeError("evaluate takes lists of sentences, not a single string")
    if len(hypotheses) != len(references):
        raise ValueError(
            f"{hypotheses_name} has {len(hypotheses)} lines but {references_name} has "
            f"{len(references)}: they must be line-aligned (one hypothesis per reference)"
        )
    bleu, chrf = BLEU(lowercase=lowercase), CHRF(lowercase=lowercase)
    empty = sum(1 for h in hypotheses if not h.strip())
    if not hypotheses:
        # sacreBLEU cannot score nothing; the signature still records the settings.
        for metric in (bleu, chrf):
            metric.corpus_score([""], [[""]])
        return EvaluationResult(
            MetricScore("bleu", 0.0, str(bleu.get_signature()), "BLEU = 0.00 (no sentences)"),
            MetricScore("chrf", 0.0, str(chrf.get_signature()), "chrF2 = 0.00 (no sentences)"),
            0,
            0,
            "empty test set: nothing was scored",
        )
    bleu_score = bleu.corpus_score(list(hypotheses), [list(references)])
    chrf_score = chrf.corpus_score(list(hypotheses), [list(references)])
    note = None
    if empty == len(hypotheses):
        note = "every hypothesis is empty"
    elif empty:
        note = f"{empty} of {len(hypotheses)} hypotheses are empty"
    return EvaluationResult(
        MetricScore("bleu", bleu_score.score, str(bleu.get_signature()), bleu_score.format()),
        MetricScore("chrf", chrf_score.score, str(chrf.get_signature()), chrf_score.format()),
        len(hypotheses),
        empty,
        note,
    )


def log_to_mlflow(
    result: EvaluationResult,
    *,
    tracking_uri: str,
    run_id: str,
    prefix: str = "",
    step: int | None = None,
) -> None:
    """Logs ``<prefix>bleu`` and ``<prefix>chrf`` as metrics of an existing MLflow run, and
    each signature as the tag ``<prefix><name>_signature`` (see :func:`log_scores`)."""
    log_scores(
        tracking_uri,
        run_id,
        {f"{prefix}{score.name}": score.score for score in result.scores},
        {f"{prefix}{score.name}_signature": score.signature for score in result.scores},
        step=step,
    )
