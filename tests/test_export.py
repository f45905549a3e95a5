"""Exports of a fine-tuned model (trained here through the real launcher) for Hugging Face
transformers and CTranslate2: they translate as megasemface does, and bad input gets one line.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import ROOT, check_finished, launch
from test_finetune_launcher import _finetune

from megasemface.cli.export import main as export_main
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.evaluation.metrics import evaluate
from megasemface.inference.search import SearchConfig, max_lengths
from megasemface.inference.translate import Translator
from megasemface.models.model_dir import save_model_dir
from megasemface.nn.config import ModelConfig, build_model_config
from megasemface.nn.transformer import Seq2SeqModel

pytestmark = pytest.mark.launcher

pytest.importorskip("transformers")
pytest.importorskip("ctranslate2")

SENTENCES = 50
STEPS = 8


@pytest.fixture(scope="module")
def trained(launch_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    data = launch_data
    """A supervised fine-tuning run of a few steps, its best model, the pipeline's test scores
    beside it, and megasemface's own greedy translations of the first test sentences."""
    out = tmp_path_factory.mktemp("export") / "ft"
    args = ["--steps", str(STEPS), "--valid-interval", str(STEPS), "--save-interval", str(STEPS)]
    result = launch(_finetune(data, out, data["parallel"], *args, zero=2))
    check_finished(result, out, STEPS)
    lines = [s for s in Path(f"{data['test']}.en").read_text().splitlines() if s][:SENTENCES]
    references = Path(f"{data['test']}.de").read_text().splitlines()[:SENTENCES]
    translator = Translator.from_model_dir(out / "best")
    ids = translator.tokenizer.encode(lines)
    hypotheses = translator.translate_ids(
        ids, src_lang="en", tgt_lang="de", config=SearchConfig(beam=1)
    )
    texts = [translator.tokenizer.decode(h.tokens) for h in hypotheses]
    scores = evaluate(texts, references)
    (out / "test-scores.json").write_text(
        json.dumps(
            {
                "test_bleu_en-de": scores.bleu.score,
                "test_chrf_en-de": scores.chrf.score,
                "signatures": {"bleu": scores.bleu.signature, "chrf": scores.chrf.signature},
            }
        )
    )
    limits = max_lengths(
        torch.tensor([len(s) + 1 for s in ids]), SearchConfig(), translator.max_positions
    )
    return {
        "model": out / "best",
        "lines": lines,
        "ids": ids,
        "tokens": [h.tokens for h in hypotheses],
        "limits": limits.tolist(),
        "translator": translator,
        "signature": scores.bleu.signature,
    }


def _doc_example(marker: str, placeholder: str, exported: Path) -> str:
    """Runs the Python example of docs/export.md that contains ``marker`` on ``exported``;
    returns what it printed."""
    text = (ROOT / "docs" / "export.md").read_text(encoding="utf-8")
    (code,) = [c for c in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S) if marker in c]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code.replace(placeholder, str(exported)), "docs/export.md", "exec"), {})
    return printed.getvalue()


def _export(*args: str) -> None:
    assert export_main([*args, "--src-lang", "en", "--tgt-lang", "de"]) == 0


def _cut(tokens: list[int], limit: int, eos: int) -> list[int]:
    """A generated continuation as megasemface's hypothesis holds it: up to ``</s>``, at most
    ``limit`` tokens (megasemface forces ``</s>`` there)."""
    if eos in tokens:
        tokens = tokens[: tokens.index(eos)]
    return tokens[:limit]


def test_transformers_generate_reproduces_megasemface(trained: dict, tmp_path: Path) -> None:
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    out = tmp_path / "hf"
    _export("huggingface", "--model-dir", str(trained["model"]), "--out", str(out))
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForSeq2SeqLM.from_pretrained(out).eval()
    ours = trained["translator"].tokenizer
    eos, tag = ours.eos_id, ours.lang_id("de")

    batch = tokenizer(trained["lines"], return_tensors="pt", padding=True)
    for row, ids in zip(batch["input_ids"].tolist(), trained["ids"], strict=True):
        assert row[: len(ids) + 1] == [*ids, eos]  # SentencePiece's pieces, then </s>
    longest = max(trained["limits"])
    with torch.no_grad():
        generated = model.generate(**batch, max_length=longest + 2).tolist()
    assert all(row[0] == tag for row in generated)
    got = [
        _cut(row[1:], limit, eos) for row, limit in zip(generated, trained["limits"], strict=True)
    ]
    same = sum(a == b for a, b in zip(got, trained["tokens"], strict=True))
    assert same == SENTENCES, f"{same} of {SENTENCES} translations match"
    texts = tokenizer.batch_decode(generated, skip_special_tokens=True)
    assert [t.strip() for t in texts] == [ours.decode(t) for t in got]

    # Teacher-forced on megasemface's translations: the logits of every position.
    mega = trained["translator"].model
    worst = 0.0
    for ids, tokens in zip(trained["ids"], trained["tokens"], strict=True):
        src = torch.tensor([[*ids, eos]])
        prefix = torch.tensor([[tag, *tokens]])
        ones = torch.ones_like(src, dtype=torch.bool)
        with torch.no_grad():
            theirs = model(input_ids=src, decoder_input_ids=prefix).logits[0]
            hidden = mega(
                src,
                ones,
                torch.tensor([0]),
                prefix,
                torch.ones_like(prefix, dtype=torch.bool),
                torch.tensor([1]),
            )
            worst = max(worst, float((mega.decoder.logits(hidden)[0] - theirs).abs().max()))
    print(f"transformers: {same}/{SENTENCES} greedy translations equal, max logit diff {worst:.2e}")
    assert worst < 1e-4

    assert _doc_example("AutoTokenizer", "exports/cl-en-de-hf", out).startswith("['")
    card = (out / "README.md").read_text()
    run_id = json.loads((trained["model"] / "config.json").read_text())["meta"]["parent_runs"]
    assert run_id["finetune"] in card and trained["signature"] in card
    assert "AutoModelForSeq2SeqLM" in card and "parallel" in card


def test_ctranslate2_translates_as_megasemface(trained: dict, tmp_path: Path) -> None:
    import ctranslate2

    tokenizer = trained["translator"].tokenizer
    pieces = [tokenizer.processor.encode(line, out_type=str) for line in trained["lines"]]
    suppressed = [[tokenizer.processor.IdToPiece(i)] for i in trained["translator"].banned_ids]
    results = {}
    for quantization in ("float32", "int8"):
        out = tmp_path / quantization
        _export(
            "ctranslate2",
            "--model-dir",
            str(trained["model"]),
            "--out",
            str(out),
            "--quantization",
            quantization,
        )
        translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
        translated = translator.translate_batch(
            pieces,
            beam_size=1,
            max_decoding_length=max(trained["limits"]),
            min_decoding_length=0,
            suppress_sequences=suppressed,
        )
        results[quantization] = [
            [tokenizer.processor.PieceToId(p) for p in r.hypotheses[0]][:limit]
            for r, limit in zip(translated, trained["limits"], strict=True)
        ]
        assert "CTranslate2" in (out / "README.md").read_text()
    assert _doc_example("ctranslate2", "exports/cl-en-de-ct2-int8", out).startswith("['")
    same = sum(a == b for a, b in zip(results["float32"], trained["tokens"], strict=True))
    close = sum(a == b for a, b in zip(results["int8"], trained["tokens"], strict=True))
    print(f"ctranslate2: float32 {same}/{SENTENCES} equal, int8 {close}/{SENTENCES}")
    assert same == SENTENCES
    assert len(results["int8"]) == SENTENCES and close >= SENTENCES // 2


def _export_error(*args: str) -> str:
    langs = () if "--src-lang" in args else ("--src-lang", "en", "--tgt-lang", "de")
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "export.py"), *args, *langs],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("export: error: "), result.stderr
    return lines[0]


def _model_dir(path: Path, state: dict, kind: str, config: ModelConfig, spm: Path) -> Path:
    languages = Tokenizer.load(spm).languages
    return save_model_dir(
        path, state, kind=kind, model_config=config, languages=languages, spm_model=spm
    )


def test_bad_input_is_one_line(trained: dict, launch_data: dict, tmp_path: Path) -> None:
    data = launch_data
    tokenizer = Tokenizer.load(data["spm"])
    config = build_model_config(
        "tiny", [f"vocab_size={tokenizer.vocab_size}", f"num_langs={len(tokenizer.languages)}"]
    )
    pretraining = _model_dir(tmp_path / "pretraining", {}, "pretraining", config, data["spm"])
    message = _export_error("huggingface", "--model-dir", str(pretraining), "--out", "x")
    assert "'pretraining' model, a 'seq2seq' model is needed" in message

    no_spm = tmp_path / "no-spm"
    shutil.copytree(trained["model"], no_spm)
    (no_spm / "spm.model").unlink()
    message = _export_error("ctranslate2", "--model-dir", str(no_spm), "--out", "x")
    assert "spm.model is missing" in message

    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    message = _export_error(
        "huggingface", "--model-dir", str(trained["model"]), "--out", str(blocked / "hf")
    )
    assert "cannot write" in message and "--out" in message

    bridged = build_model_config(
        "tiny", [f"vocab_size={tokenizer.vocab_size}", "num_langs=2", "bridge=codebook"]
    )
    state = Seq2SeqModel(bridged).state_dict()
    codebook = _model_dir(tmp_path / "bridge", state, "seq2seq", bridged, data["spm"])
    message = _export_error("ctranslate2", "--model-dir", str(codebook), "--out", "y")
    assert "bridge" in message

    message = _export_error(
        "huggingface",
        "--model-dir",
        str(trained["model"]),
        "--out",
        str(tmp_path / "z"),
        "--src-lang",
        "fr",
        "--tgt-lang",
        "de",
    )
    assert "'fr' is not one of the languages" in message
