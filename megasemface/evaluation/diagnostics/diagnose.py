"""Interface diagnostics over text: what the paper's Fig. 5 analysis and the hand
measurements of ``docs/diagnostics.md`` compute, for one pre-training stage.

Per language, over the first ``max_sentences`` non-blank lines of its text, batched by
token budget in a fixed order, in eval mode without gradients:

1. argmax code usage of the encoder's VQ layer (noise-free) and of the decoder stage's
   feature extractor through the same layer;
2. the mean cosine between the encoder's output and its interface vector;
3. the teacher-forced NLL of the decoder reconstructing each sentence with up to four
   memories: the interface's own, the connected encoder's output, a VQ encoder's output
   through its codebook (what ``connect --bridge codebook`` feeds the decoder), and zeros;
4. with a gold dictionary, how often translated words share codes (:mod:`.figures`);
5. with two of the texts line-aligned translations, whether the connected model reads a
   translation (:mod:`.reading`): the decoder's NLL of each sentence with the encoder's
   output for its translation, for an unrelated sentence and zeros, in both directions,
   and the zero-shot greedy BLEU of a connected model.

Token positions: every figure but the NLL is over the sentences' own tokens, not the </s>
the encoder reads after each sentence; the NLL is over the predicted ``x </s>``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from megasemface.data.text.lines import read_lines
from megasemface.evaluation.diagnostics.dictionary import (
    Position,
    Word,
    continues_word,
    load_gold_pairs,
    whole_word_occurrences,
    words_codes,
)
from megasemface.evaluation.diagnostics.figures import (
    CodeUsageFigures,
    code_agreement,
    cosine_sum,
    teacher_forced_nll,
)
from megasemface.evaluation.diagnostics.reading import (
    ReadingFigures,
    read_translations,
    zero_shot_scores,
)
from megasemface.evaluation.diagnostics.report import (
    Diagnostics,
    DictionaryFigures,
    LanguageFigures,
)
from megasemface.evaluation.diagnostics.sources import (
    DiagnosticModels,
    DiagnosticsError,
    load_models,
)
from megasemface.inference.translate import Translator, token_batches
from megasemface.interfaces.base import SemanticInterface
from megasemface.interfaces.registry import find_interface
from megasemface.models.semface import through_final_norm
from megasemface.nn.transformer import EncoderOutput
from megasemface.objectives.sequences import SequenceBatch, append_token, lengths_to_mask

__all__ = ["MEASURES", "DiagnosticsConfig", "diagnose_interface"]

MEASURES = ("usage", "cosine", "nll", "dictionary", "translation")

_TITLES = {
    "usage": "code usage",
    "cosine": "the encoder-interface cosine",
    "nll": "the NLL",
    "dictionary": "the dictionary analysis",
    "translation": "reading a translation",
}


@dataclasses.dataclass(kw_only=True)
class DiagnosticsConfig:
    """What :func:`diagnose_interface` reads and measures."""

    checkpoint: Path | None = None
    """An encoder, decoder or joint pre-training stage: a run directory (its newest complete
    checkpoint), a checkpoint directory or a ``pretraining`` model directory."""
    model_dir: Path | None = None
    """A connected ``seq2seq`` model directory: its encoder gives the "encoder" memory, and
    its decoder is measured when the stage has none."""
    spm_model: Path | None = None
    """The SentencePiece model; default: the one the stage recorded (or the model
    directory's). It must be the one the weights were trained with."""
    texts: dict[str, Path]
    """One text file per language, one sentence per line."""
    dictionary: Path | None = None
    """A gold dictionary (``source<TAB>target`` words, as ``embeddings/gold.py`` reads)."""
    dictionary_langs: tuple[str, str] | None = None
    """Its (source, target) languages; default: from a name like ``en-de.tsv``, else the
    first two languages of ``texts``."""
    measures: tuple[str, ...] | None = None
    """Which of :data:`MEASURES` to compute; None: every one the sources allow. A measure
    asked for explicitly that the sources cannot give is an error."""
    max_sentences: int = 1000
    """Sentences read per language (the first non-blank lines); 0 reads them all."""
    batch_tokens: int = 4096
    """Tokens per batch, padding included."""
    top_k: int = 100
    """k of the top-k code overlap (the paper's 100)."""
    max_occurrences: int = 20
    """Occurrences per dictionary word averaged (the first ones in the text)."""
    translations: tuple[str, str] | None = None
    """Two languages of ``texts`` whose files are translations of each other, line by line:
    the ``translation`` measure reads them in both directions."""

    def __post_init__(self) -> None:
        if not self.texts:
            raise ValueError("no text to measure on: give one file per language")
        unknown = sorted(set(self.measures or ()) - set(MEASURES))
        if unknown:
            raise ValueError(f"unknown measures {unknown}; choose from {', '.join(MEASURES)}")
        for name in ("batch_tokens", "top_k", "max_occurrences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_sentences < 0:
            raise ValueError(f"max_sentences must be >= 0, got {self.max_sentences}")
        if self.translations is not None:
            missing = [lang for lang in self.translations if lang not in self.texts]
            if missing or self.translations[0] == self.translations[1]:
                raise ValueError(
                    f"translations {'-'.join(self.translations)} need two different languages "
                    f"with a text each; texts are given for {', '.join(self.texts)}"
                )


def _refusal(measure: str, models: DiagnosticModels, config: DiagnosticsConfig) -> str | None:
    """Why the sources cannot give ``measure``, or None when they can."""
    kind, where, title = models.interface_kind, models.sources.get("checkpoint"), _TITLES[measure]
    if measure == "translation":
        if config.translations is None:
            return f"{title} needs --translations SRC-TGT: two texts that translate each other"
        if models.decoder is None or models.connected_encoder is None:
            return (
                f"{where} is an {models.stage} stage: {title} needs a decoder and an encoder "
                "to connect it with (a joint stage, or --model-dir, the connected model)"
            )
        return None
    if measure == "nll":
        if models.decoder is None:
            return (
                f"{where} is an {models.stage} stage, whose decoder was not trained: {title} "
                "needs a decoder or joint stage, or --model-dir (a connected model)"
            )
        return None
    if kind is None:
        return f"{title} needs a pre-training stage: pass --checkpoint"
    needs_vq = measure in ("usage", "dictionary")
    spec, interface = find_interface(kind), models.interface
    compares = interface is not None and interface.compares_encoder
    if spec is None or not (spec.codebook if needs_vq else compares):
        what = "VQ codes" if needs_vq else "an interface vector to compare the encoder with"
        return f"{where} is a run with the {kind!r} interface: {title} needs {what}"
    if measure == "dictionary" and config.dictionary is None:
        return f"{title} needs --dictionary"
    if measure != "usage" and models.encoder is None:
        return (
            f"{where} is a {models.stage} stage, whose encoder was not trained: {title} "
            "needs the encoder or joint stage"
        )
    return None


def _plan(models: DiagnosticModels, config: DiagnosticsConfig) -> tuple[list[str], list[str]]:
    """The measures to compute, and notes on the figures left out."""
    refusals = {m: _refusal(m, models, config) for m in MEASURES}
    if config.measures is not None:
        chosen = [m for m in MEASURES if m in config.measures]
    else:
        chosen = [m for m in MEASURES if refusals[m] is None]
        if config.dictionary is not None and "dictionary" not in chosen:
            chosen.append("dictionary")  # asked for by --dictionary: refused below
        if config.translations is not None and "translation" not in chosen:
            chosen.append("translation")  # asked for by --translations: refused below
        if not chosen:
            # Only a stage without codes gets here: the cosine's and the NLL's reasons say all.
            reasons = [str(refusals[m]) for m in ("cosine", "nll")]
            raise DiagnosticsError("nothing to measure: " + "; ".join(reasons))
    for measure in chosen:
        if refusals[measure] is not None:
            raise DiagnosticsError(str(refusals[measure]))
    notes = []
    if "usage" in chosen and models.encoder is None:
        notes.append("no encoder code usage: the stage did not train the encoder")
    if "usage" in chosen and models.interface_decoder is None:
        notes.append("no extractor code usage: the stage did not train the feature extractor")
    if "nll" in chosen and models.interface_decoder is None:
        notes.append("no NLL with the interface memory: it needs a decoder or joint stage")
    if "nll" in chosen and models.connected_encoder is None:
        notes.append("no NLL with the encoder memory: pass --model-dir, the connected model")
    if "translation" in chosen and models.seq2seq is None:
        notes.append("no zero-shot BLEU: pass --model-dir, the connected model")
    return chosen, notes


def _sentences(path: Path, models: DiagnosticModels, limit: int) -> tuple[list[list[int]], int]:
    """The first ``limit`` non-blank lines as token ids, cropped to fit the model, and how
    many were cropped. Room is left for </s> (encoder) and the language tag (decoder)."""
    lines = [line for line in read_lines(path) if line.strip()]
    if limit:
        lines = lines[:limit]
    if not lines:
        raise DiagnosticsError(f"{path} has no non-blank line to measure on")
    room = models.config.max_len - 1
    ids = [s for s in models.tokenizer.encode(lines) if s]
    cropped = sum(len(s) > room for s in ids)
    return [s[:room] for s in ids], cropped


@dataclasses.dataclass
class _Sums:
    """Running sums of one language's pass."""

    encoder_codes: list[torch.Tensor] = dataclasses.field(default_factory=list)
    extractor_codes: list[torch.Tensor] = dataclasses.field(default_factory=list)
    same_codes: int = 0
    """Tokens for which the encoder and the extractor pick the same code."""
    cosine: float | None = None
    nll: dict[str, float] = dataclasses.field(default_factory=dict)
    nll_tokens: int = 0
    features: dict[Position, torch.Tensor] = dataclasses.field(default_factory=dict)
    """Encoder outputs at the dictionary words' occurrences."""


def _encoder_side(
    models: DiagnosticModels,
    batch: SequenceBatch,
    encoded: EncoderOutput,
    sums: _Sums,
    wanted: dict[Position, int],
) -> None:
    """Codes and cosine of the encoder's outputs; the outputs at the ``wanted`` positions
    (position -> row of the batch)."""
    interface, mask = models.interface, batch.mask_BT
    length = batch.tokens_BT.shape[1]
    hidden_BTD = encoded.hidden_BTD[:, :length]  # the sentences' tokens, not </s>
    spec = find_interface(models.interface_kind)
    if interface is not None and spec is not None and spec.semface:
        pre_norm_ND = encoded.pre_norm_BTD[:, :length][mask]
        targets = interface.diagnostic_targets(hidden_BTD[mask], pre_norm_ND, batch.tokens_BT[mask])
        if targets.codes_N is not None:
            sums.encoder_codes.append(targets.codes_N)
        sums.cosine = (sums.cosine or 0.0) + cosine_sum(targets.outputs_ND, targets.targets_ND)
    for (i, t), row in wanted.items():
        sums.features[(i, t)] = hidden_BTD[row, t].clone()  # not a view: frees the batch


def _nll_side(
    models: DiagnosticModels,
    batch: SequenceBatch,
    src: tuple[torch.Tensor, torch.Tensor],
    encoded: EncoderOutput | None,
    sums: _Sums,
) -> None:
    """The decoder's summed NLL with each memory the sources give."""
    assert models.decoder is not None
    interface, mask = models.interface, batch.mask_BT
    spec = find_interface(models.interface_kind)
    memories = {}
    own = None
    if interface is not None and spec is not None and spec.codebook and models.encoder is not None:
        own = models.encoder(*src, batch.langs_B) if encoded is None else encoded
        codes = interface.features_memory(own.hidden_BTD, src[1], src[0])
        memories["codes"] = (codes.memory_BSD, codes.mask_BS)
    if models.interface_decoder is not None and interface is not None:
        if models.decoder_codes == "extractor":
            memory = interface.decoder_memory(batch.tokens_BT, mask, batch.langs_B)
            memory_BSD = memory.memory_BSD
            if models.memory_norm and models.encoder is not None:
                memory_BSD = through_final_norm(models.encoder, memory_BSD)
            memories["interface"] = (memory_BSD, memory.mask_BS)
        elif "codes" in memories:  # the stage's decoder read the encoder's codes
            memories["interface"] = memories["codes"]
        elif models.encoder is not None:  # CL-SemFace's decoder read the encoder's output
            own = models.encoder(*src, batch.langs_B) if encoded is None else encoded
            memory_BSD = own.hidden_BTD
            # and, at a share in (0, 1), the table's rows of its tokens; a recorded 0, which
            # train.py refuses for CL, is a run whose encoder codes meant the output alone
            if 0 < models.decoder_continuous < 1:
                rows = interface.features_memory(own.hidden_BTD, src[1], src[0]).memory_BSD
                memory_BSD = (
                    through_final_norm(models.encoder, rows) if models.memory_norm else rows
                )
            memories["interface"] = (memory_BSD, src[1])
    if models.connected_encoder is not None:
        connected = encoded
        if models.connected_encoder is not models.encoder or connected is None:
            connected = models.connected_encoder(*src, batch.langs_B)
        memories["encoder"] = (connected.hidden_BTD, src[1])
    if models.bridge is not None:
        assert own is not None  # load_models builds a bridge only with a VQ encoder
        memories["bridge"] = (models.bridge(own.hidden_BTD), src[1])
    # Zero keys and values are the same at every position: the memory's length is moot.
    memories["zeros"] = (torch.zeros(*batch.tokens_BT.shape, models.config.d_model), mask)
    for name, (memory_BSD, mask_BS) in memories.items():
        nll, count = teacher_forced_nll(models.decoder, models.special, batch, memory_BSD, mask_BS)
        sums.nll[name] = sums.nll.get(name, 0.0) + nll
    sums.nll_tokens += count


def _language_pass(
    models: DiagnosticModels,
    lang: str,
    ids: list[list[int]],
    measures: list[str],
    wanted: set[Position],
    batch_tokens: int,
) -> _Sums:
    """One pass over a language's sentences, batch by batch, longest first."""
    sums = _Sums()
    sp, interface = models.special, models.interface
    lang_index = models.tokenizer.languages.index(lang)
    encoder_side = {"usage", "cosine", "dictionary"} & set(measures)
    if not encoder_side and "nll" not in measures:
        return sums  # the translation measure alone reads the texts as pairs
    for rows in token_batches([len(s) + 1 for s in ids], batch_tokens):
        batch = SequenceBatch.from_rows([ids[i] for i in rows], sp.pad, lang_index)
        # The encoder reads x </s>, as in the encoder stage and in translation.
        src_BT, src_lengths = append_token(batch.tokens_BT, batch.lengths_B, sp.eos, sp.pad)
        src = (src_BT, lengths_to_mask(src_lengths, src_BT.shape[1]))
        encoded = None
        if encoder_side and models.encoder is not None:
            encoded = models.encoder(*src, batch.langs_B)
            row_of = {i: r for r, i in enumerate(rows)}
            found = {p: row_of[p[0]] for p in wanted if p[0] in row_of}
            _encoder_side(models, batch, encoded, sums, found)
        reads_extractor = models.decoder_codes == "extractor"
        if "usage" in measures and models.interface_decoder is not None and reads_extractor:
            assert interface is not None
            codes = interface.reading_codes(batch.tokens_BT, batch.mask_BT, batch.langs_B)
            sums.extractor_codes.append(codes)
            if sums.encoder_codes:  # the same tokens, in the same order
                sums.same_codes += int((codes == sums.encoder_codes[-1]).sum())
        if "nll" in measures:
            _nll_side(models, batch, src, encoded, sums)
    return sums


def _figures(
    lang: str, ids: list[list[int]], cropped: int, sums: _Sums, interface: SemanticInterface | None
) -> LanguageFigures:
    tokens = sum(len(s) for s in ids)
    figures = LanguageFigures(lang, len(ids), tokens, cropped)
    if sums.encoder_codes and interface is not None:
        usage = interface.code_figures(torch.cat(sums.encoder_codes))
        figures.encoder_codes = CodeUsageFigures.of(usage)
    if sums.extractor_codes and interface is not None:
        usage = interface.code_figures(torch.cat(sums.extractor_codes))
        figures.extractor_codes = CodeUsageFigures.of(usage)
        if sums.encoder_codes:
            figures.code_agreement = sums.same_codes / tokens
    if sums.cosine is not None:
        figures.cosine = sums.cosine / tokens
    if sums.nll_tokens:
        figures.nll = {m: v / sums.nll_tokens for m, v in sums.nll.items()}
        figures.nll_tokens = sums.nll_tokens
    return figures


def _translation_pairs(
    config: DiagnosticsConfig, models: DiagnosticModels
) -> tuple[list[list[int]], list[list[int]], list[str], list[str]]:
    """The first ``max_sentences`` line pairs of the two translation texts whose sides are
    both non-blank: (source ids, target ids, source lines, target lines), ids cropped to fit
    the model as :func:`_sentences` crops them."""
    assert config.translations is not None
    paths = [config.texts[lang] for lang in config.translations]
    sides = [read_lines(path) for path in paths]
    if len(sides[0]) != len(sides[1]):
        raise DiagnosticsError(
            f"{paths[0]} has {len(sides[0])} lines and {paths[1]} {len(sides[1])}: translations "
            "must be line-aligned (--translations)"
        )
    kept = [(a, b) for a, b in zip(*sides, strict=True) if a.strip() and b.strip()]
    if config.max_sentences:
        kept = kept[: config.max_sentences]
    if len(kept) < 2:
        raise DiagnosticsError(f"{paths[0]} and {paths[1]} have fewer than 2 non-blank pairs")
    room = models.config.max_len - 1
    lines = [[pair[side] for pair in kept] for side in (0, 1)]
    ids = [[s[:room] for s in models.tokenizer.encode(side)] for side in lines]
    return ids[0], ids[1], lines[0], lines[1]


def _reading(config: DiagnosticsConfig, models: DiagnosticModels) -> list[ReadingFigures]:
    """The translation measure in both directions (:mod:`.reading`)."""
    assert config.translations is not None and models.decoder is not None
    assert models.connected_encoder is not None
    ids_a, ids_b, lines_a, lines_b = _translation_pairs(config, models)
    translator = None
    if models.seq2seq is not None:
        translator = Translator(models.seq2seq, models.tokenizer)
    figures = []
    langs = models.tokenizer.languages
    for (src, tgt), (src_ids, tgt_ids, references) in zip(
        (config.translations, config.translations[::-1]),
        ((ids_a, ids_b, lines_b), (ids_b, ids_a, lines_a)),
        strict=True,
    ):
        nll, tokens = read_translations(
            models.decoder,
            models.connected_encoder,
            models.special,
            src_ids,
            tgt_ids,
            (langs.index(src), langs.index(tgt)),
            models.config.d_model,
            config.batch_tokens,
        )
        reading = ReadingFigures(src, tgt, len(src_ids), tokens, nll)
        if translator is not None:
            scores = zero_shot_scores(
                translator, src_ids, references, (src, tgt), config.batch_tokens
            )
            reading.bleu, reading.chrf = scores
        figures.append(reading)
    return figures


def diagnose_interface(
    config: DiagnosticsConfig, models: DiagnosticModels | None = None
) -> Diagnostics:
    """Measures what :data:`MEASURES` the sources allow (see the module docstring).

    ``models``: already loaded sources (default: :func:`load_models` of the config's).

    Raises:
        DiagnosticsError: a measure the sources cannot give, or input that does not fit.
        CheckpointError, ModelDirError, GoldDictionaryError, TextFileError,
            FileNotFoundError: unreadable input.
    """
    if models is None:
        models = load_models(config.checkpoint, config.model_dir, config.spm_model)
    measures, notes = _plan(models, config)
    unknown = [lang for lang in config.texts if lang not in models.tokenizer.languages]
    if unknown:
        raise DiagnosticsError(
            f"language(s) {', '.join(unknown)} not in the SentencePiece model "
            f"({', '.join(models.tokenizer.languages)})"
        )
    dictionary = None
    if "dictionary" in measures:
        assert config.dictionary is not None  # _plan refuses the measure without one
        dictionary = load_gold_pairs(
            config.dictionary, models.tokenizer, list(config.texts), config.dictionary_langs
        )
    continues = continues_word(models.tokenizer) if dictionary is not None else []
    languages, words = [], {}
    with torch.no_grad():
        for lang, path in config.texts.items():
            ids, cropped = _sentences(path, models, config.max_sentences)
            occurrences: dict[Word, list[Position]] = {}
            if dictionary is not None and lang in dictionary.forms:
                forms = dictionary.forms[lang]
                cap = config.max_occurrences
                occurrences = whole_word_occurrences(ids, forms, continues, cap)
            wanted = {p for positions in occurrences.values() for p in positions}
            sums = _language_pass(models, lang, ids, measures, wanted, config.batch_tokens)
            languages.append(_figures(lang, ids, cropped, sums, models.interface))
            if occurrences:
                assert models.interface is not None
                log_probs = models.interface.code_log_probs
                words[lang] = words_codes(log_probs, occurrences, sums.features, config.top_k)
    dictionary_figures = None
    if dictionary is not None:
        source = words.get(dictionary.source_lang, {})
        target = words.get(dictionary.target_lang, {})
        pairs = [(s, t) for s, t in dictionary.pairs if s in source and t in target]
        k = min(config.top_k, models.num_codes or config.top_k)
        dictionary_figures = DictionaryFigures(
            dictionary.source_lang,
            dictionary.target_lang,
            dictionary.entries,
            dictionary.single_piece,
            len(source),
            len(target),
            code_agreement(source, target, pairs, k) if pairs else None,
        )
    reading = []
    if "translation" in measures:
        with torch.no_grad():
            reading = _reading(config, models)
    return Diagnostics(
        interface=models.interface_kind,
        stage=models.stage,
        step=models.step,
        mlflow_run_id=models.mlflow_run_id,
        num_codes=models.num_codes,
        measures=measures,
        sources=models.sources,
        languages=languages,
        dictionary=dictionary_figures,
        reading=reading,
        notes=notes,
    )
