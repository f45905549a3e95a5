"""The diagnostics' results: JSON, MLflow metrics and the table the tool prints."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from megasemface.evaluation.diagnostics.figures import CodeAgreement, CodeUsageFigures
from megasemface.evaluation.diagnostics.reading import READING_MEMORIES, ReadingFigures
from megasemface.interfaces.registry import interface

__all__ = [
    "FORMAT",
    "METRIC_PREFIX",
    "Diagnostics",
    "DictionaryFigures",
    "LanguageFigures",
    "log_to_run",
]

METRIC_PREFIX = "diag_"

FORMAT = "megasemface-diagnostics/2"
"""The JSON's format: a result of another format was measured by other code, and is not
reused as this code's result."""

MEMORIES = ("interface", "codes", "encoder", "bridge", "zeros")
"""The cross-attention memories of the NLL figures, in the order they are reported."""

_MEMORY_LABELS = {
    "interface": "interface memory",
    "codes": "encoder's own codes",
    "encoder": "encoder memory",
    "bridge": "encoder through the codebook",
    "zeros": "zero memory",
}


@dataclasses.dataclass
class LanguageFigures:
    """The figures of one language's text."""

    lang: str
    sentences: int
    tokens: int
    """Tokens of the sentences (after cropping to the model's length), no special tokens."""
    cropped: int
    """Sentences cut to fit the model's position embeddings."""
    encoder_codes: CodeUsageFigures | None = None
    """Argmax code usage of the encoder's VQ layer over the tokens."""
    extractor_codes: CodeUsageFigures | None = None
    """Argmax code usage of the decoder-stage feature extractor through the same layer."""
    code_agreement: float | None = None
    """Share of the tokens for which the encoder and the extractor pick the same code."""
    cosine: float | None = None
    """Mean over tokens of cos(encoder output, its interface vector): VQ, the output after
    the final LayerNorm and its chosen code; CL, the activation before it and the token's
    table row."""
    nll: dict[str, float] = dataclasses.field(default_factory=dict)
    """Teacher-forced NLL (nats per predicted token) per memory in :data:`MEMORIES`."""
    nll_tokens: int = 0
    """Tokens predicted for the NLL: the sentences' tokens and one </s> each."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for name in ("encoder_codes", "extractor_codes"):
            usage = getattr(self, name)
            out[name] = usage.to_dict() if usage is not None else None
        return out

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for short, usage in (("enc", self.encoder_codes), ("ext", self.extractor_codes)):
            if usage is not None:
                out[f"{self.lang}_{short}_codes_used"] = usage.used
                out[f"{self.lang}_{short}_codes_fraction"] = usage.fraction
                out[f"{self.lang}_{short}_code_perplexity"] = usage.perplexity
                out[f"{self.lang}_{short}_dead_codes"] = usage.dead
        if self.code_agreement is not None:
            out[f"{self.lang}_code_agreement"] = self.code_agreement
        if self.cosine is not None:
            out[f"{self.lang}_cosine"] = self.cosine
        for memory, value in self.nll.items():
            out[f"{self.lang}_nll_{memory}"] = value
        return out


@dataclasses.dataclass
class DictionaryFigures:
    """Code sharing of a gold dictionary's translation pairs (the paper's Fig. 5)."""

    source_lang: str
    target_lang: str
    entries: int
    """Word pairs in the file."""
    single_piece: int
    """Entries whose two words are single SentencePiece pieces (the ones measurable)."""
    source_words: int
    """Distinct source words found in the source text."""
    target_words: int
    agreement: CodeAgreement | None
    """None when no translation pair has both words in the texts."""

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["agreement"] = self.agreement.to_dict() if self.agreement is not None else None
        return out

    def metrics(self) -> dict[str, float]:
        a = self.agreement
        if a is None:
            return {}
        out = {
            "dict_pairs": float(a.pairs),
            "dict_same_code": a.same_code,
            "dict_overlap": a.overlap,
        }
        if a.baseline_same_code is not None and a.baseline_overlap is not None:
            out["dict_same_code_random"] = a.baseline_same_code
            out["dict_overlap_random"] = a.baseline_overlap
        return out


@dataclasses.dataclass
class Diagnostics:
    """Everything one diagnostics call measured, and on what."""

    interface: str | None
    stage: str | None
    step: int | None
    mlflow_run_id: str | None
    num_codes: int | None
    measures: list[str]
    sources: dict[str, str]
    languages: list[LanguageFigures]
    dictionary: DictionaryFigures | None = None
    reading: list[ReadingFigures] = dataclasses.field(default_factory=list)
    """Whether the connected model reads a translation, one entry per direction."""
    notes: list[str] = dataclasses.field(default_factory=list)
    """What could not be measured here and why."""

    def to_dict(self) -> dict[str, Any]:
        out = {"format": FORMAT, **dataclasses.asdict(self)}
        out["languages"] = [lang.to_dict() for lang in self.languages]
        out["dictionary"] = self.dictionary.to_dict() if self.dictionary is not None else None
        out["reading"] = [direction.to_dict() for direction in self.reading]
        out["metrics"] = self.metrics()
        return out

    def metrics(self) -> dict[str, float]:
        """The figures as flat MLflow metrics, ``diag_<lang>_<figure>``, ``diag_dict_*``."""
        out: dict[str, float] = {}
        for lang in self.languages:
            out.update(lang.metrics())
        if self.dictionary is not None:
            out.update(self.dictionary.metrics())
        for direction in self.reading:
            out.update(direction.metrics())
        return {f"{METRIC_PREFIX}{k}": float(v) for k, v in out.items()}

    def format_table(self) -> str:
        """A small plain-text table: a row per figure, a column per language."""
        what = f"{self.interface or 'seq2seq'} {self.stage or ''}".strip()
        step = f", step {self.step}" if self.step is not None else ""
        rows: list[tuple[str, list[str]]] = [
            ("sentences", [f"{x.sentences:,}" for x in self.languages]),
            ("tokens", [f"{x.tokens:,}" for x in self.languages]),
        ]
        for label, name in (("encoder", "encoder_codes"), ("extractor", "extractor_codes")):
            usages = [getattr(x, name) for x in self.languages]
            if all(u is None for u in usages):
                continue
            rows += [
                (f"{label} codes used (of {self.num_codes:,})", [_num(u, "used") for u in usages]),
                ("  share of codes", [_pct(u.fraction) if u else "-" for u in usages]),
                ("  perplexity exp(H)", [_num(u, "perplexity", ".2f") for u in usages]),
                ("  dead codes", [_num(u, "dead") for u in usages]),
            ]
        if any(x.code_agreement is not None for x in self.languages):
            shares = [
                _pct(x.code_agreement) if x.code_agreement is not None else "-"
                for x in self.languages
            ]
            rows.append(("encoder and extractor agree", shares))
        if any(x.cosine is not None for x in self.languages):
            target = interface(self.interface).target
            rows.append(
                (f"cosine(encoder, {target})", [_float(x.cosine, ".3f") for x in self.languages])
            )
        for memory in MEMORIES:
            if any(memory in x.nll for x in self.languages):
                label = f"NLL/token, {_MEMORY_LABELS[memory]}"
                rows.append((label, [_float(x.nll.get(memory), ".3f") for x in self.languages]))
        width = max(len(label) for label, _ in rows)
        cells = [max(len(v) for v in values) for _, values in rows]
        col = max([*cells, *(len(x.lang) for x in self.languages)]) + 2
        lines = [f"interface diagnostics: {what}{step}"]
        lines.append(" " * width + "".join(x.lang.rjust(col) for x in self.languages))
        lines += [label.ljust(width) + "".join(v.rjust(col) for v in vs) for label, vs in rows]
        if self.dictionary is not None:
            lines += _dictionary_lines(self.dictionary)
        lines += _reading_lines(self.reading)
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _num(usage: CodeUsageFigures | None, name: str, spec: str = ",") -> str:
    return "-" if usage is None else format(getattr(usage, name), spec)


def _float(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _dictionary_lines(d: DictionaryFigures) -> list[str]:
    a = d.agreement
    found = f"{a.pairs:,} pairs with both words in the texts" if a else "no pair in the texts"
    lines = [
        f"dictionary {d.source_lang}-{d.target_lang}: {d.entries:,} entries, "
        f"{d.single_piece:,} with single-piece words, {found}"
    ]
    if a is not None:
        same = _pct(a.baseline_same_code) if a.baseline_same_code is not None else "-"
        overlap = _float(a.baseline_overlap, ".3f")
        lines.append(f"  same argmax code {_pct(a.same_code)} (random pairs {same})")
        lines.append(f"  top-{a.k} code overlap {a.overlap:.3f} (random pairs {overlap})")
    return lines


def _reading_lines(reading: list[ReadingFigures]) -> list[str]:
    if not reading:
        return []
    lines = [
        "reading a translation: the decoder's NLL/token of each sentence with the encoder's "
        "output for its translation / an unrelated sentence / zeros / its translation with "
        "the languages' mean outputs swapped"
    ]
    for d in reading:
        nll = " / ".join(f"{d.nll[m]:.3f}" for m in READING_MEMORIES)
        bleu = "" if d.bleu is None else f"; zero-shot greedy BLEU {d.bleu:.2f}"
        lines.append(
            f"  {d.direction} ({d.pairs:,} pairs): {nll}; {d.gain_over_zeros:+.3f} over zeros, "
            f"{d.gain_over_unrelated:+.3f} over unrelated, recentred "
            f"{d.recentred_gain_over_zeros:+.3f} over zeros{bleu}"
        )
    return lines


def log_to_run(diagnostics: Diagnostics, *, tracking_uri: str, run_id: str) -> int:
    """Logs :meth:`Diagnostics.metrics` to an existing MLflow run, at the checkpoint's step
    (0 when unknown), in one request, and the whole result as its artifact
    ``diagnostics.json``; returns the number of metrics logged."""
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient  # slow to import; only logging needs it

    client = MlflowClient(tracking_uri)
    now = int(time.time() * 1000)
    step = diagnostics.step or 0
    metrics = [Metric(k, v, now, step) for k, v in diagnostics.metrics().items()]
    client.log_batch(run_id, metrics=metrics)
    client.log_text(run_id, json.dumps(diagnostics.to_dict(), indent=1), "diagnostics.json")
    return len(metrics)
