"""One export, start to end: read the model directory, write the model and its card.

``export_huggingface`` and ``export_ctranslate2`` are what ``megasemface-export`` (and
``tools/export.py``) run; each returns a summary of what it wrote.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from megasemface.export.card import model_card, read_test_scores
from megasemface.export.ct2 import write_ct2_model
from megasemface.export.huggingface import write_hf_model
from megasemface.export.output import write_export
from megasemface.export.source import ExportSource, load_export_source

__all__ = ["export_ctranslate2", "export_huggingface"]

PathLike = str | os.PathLike[str]


def export_huggingface(
    model_dir: PathLike,
    src_lang: str,
    tgt_lang: str,
    out: PathLike,
    *,
    scores: PathLike | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """A transformers model directory (mBART) of one direction of ``model_dir``."""
    source = load_export_source(model_dir, src_lang, tgt_lang)
    recorded = _scores(source, scores)
    usage = _HF_USAGE.format(out=Path(out).name, text=_EXAMPLE.get(src_lang, "Hello."))

    def build(tmp: Path) -> None:
        write_hf_model(source, tmp)
        _card(tmp, source, "Hugging Face transformers", usage, recorded)

    return _summary(source, write_export(out, build, overwrite), "transformers")


def export_ctranslate2(
    model_dir: PathLike,
    src_lang: str,
    tgt_lang: str,
    out: PathLike,
    *,
    quantization: str = "float32",
    scores: PathLike | None = None,
    overwrite: bool = False,
) -> dict[str, Any]:
    """A CTranslate2 model directory of one direction of ``model_dir``, its weights in
    ``quantization`` (float32 or int8)."""
    source = load_export_source(model_dir, src_lang, tgt_lang)
    recorded = _scores(source, scores)
    suppressed = [source.tokenizer.processor.IdToPiece(i) for i in source.suppressed_ids]
    usage = _CT2_USAGE.format(
        out=Path(out).name,
        text=_EXAMPLE.get(src_lang, "Hello."),
        suppressed=", ".join(repr(p) for p in suppressed),
        limit=source.config.max_len - 1,
    )

    def build(tmp: Path) -> None:
        write_ct2_model(source, tmp, quantization)
        (tmp / "spm.model").write_bytes(source.tokenizer.model_bytes)
        _card(tmp, source, f"CTranslate2, {quantization}", usage, recorded)

    summary = _summary(source, write_export(out, build, overwrite), "ctranslate2")
    return {**summary, "quantization": quantization}


def _scores(source: ExportSource, scores: PathLike | None) -> dict[str, Any]:
    """The test scores of the card, read before the export's work so that a bad file fails
    at once."""
    return read_test_scores(source, Path(scores) if scores is not None else None)


def _card(out: Path, source: ExportSource, kind: str, usage: str, recorded: dict[str, Any]) -> None:
    (out / "README.md").write_text(model_card(source, kind, usage, recorded), encoding="utf-8")


def _summary(source: ExportSource, out: Path, kind: str) -> dict[str, Any]:
    files = sorted(p for p in out.iterdir() if p.is_file())
    return {
        "format": kind,
        "model_dir": str(source.info.path),
        "direction": source.direction,
        "out": str(out),
        "files": [p.name for p in files],
        "bytes": sum(p.stat().st_size for p in files),
    }


_EXAMPLE = {"en": "Open the file.", "de": "Datei öffnen.", "fr": "Ouvrir le fichier."}

_HF_USAGE = """With Hugging Face transformers, from this directory (no network access needed):

```python
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("{out}")
model = AutoModelForSeq2SeqLM.from_pretrained("{out}").eval()
batch = tokenizer(["{text}"], return_tensors="pt", padding=True)
output = model.generate(**batch)  # greedy, as generation_config.json sets; num_beams=5 for beam
print(tokenizer.batch_decode(output, skip_special_tokens=True))
```

The tokenizer appends `</s>` to each source; `generate()` starts the decoder with the target
language's tag and never generates the ids megasemface's own search bans.
"""

_CT2_USAGE = """With CTranslate2 and SentencePiece, from this directory:

```python
import ctranslate2
import sentencepiece

sp = sentencepiece.SentencePieceProcessor(model_file="{out}/spm.model")
translator = ctranslate2.Translator("{out}", device="cpu")
pieces = sp.encode(["{text}"], out_type=str)
results = translator.translate_batch(
    pieces,
    beam_size=5,
    max_decoding_length={limit},
    min_decoding_length=0,
    suppress_sequences=[[p] for p in [{suppressed}]],
)
print([sp.decode(r.hypotheses[0]) for r in results])
```

CTranslate2 appends `</s>` to each source and starts the decoder with the target language's
tag (the model's config.json); `suppress_sequences` bans what megasemface's search bans, and
`min_decoding_length=0` lets a translation be empty as megasemface's can.
"""
