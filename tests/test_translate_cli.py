"""The Translator and tools/translate.py on a random tiny model directory with a real tokenizer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient

from megasemface.cli.translate import main
from megasemface.data.text.lines import read_lines, write_lines
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.evaluation.metrics import evaluate
from megasemface.inference.search import SearchConfig
from megasemface.inference.translate import Translator, token_batches
from megasemface.models.model_dir import save_model_dir
from megasemface.nn.config import build_model_config
from megasemface.nn.transformer import Seq2SeqModel

ROOT = Path(__file__).resolve().parents[1]
MAX_LEN = 24  # small position table: a long line must be cropped
SEARCH = ["--max-len-a", "0", "--max-len-b", "6"]


def mlflow_uri(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> str:
    """A fresh SQLite MLflow store in ``tmp_path``, copied from one made once per session:
    creating the schema takes seconds, copying the file milliseconds."""
    template = tmp_path_factory.getbasetemp() / "mlflow-template.db"
    if not template.exists():
        MlflowClient(f"sqlite:///{template}").search_experiments()
    shutil.copyfile(template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny matrices: a second intra-op thread only spin-waits on the suite's busy cores.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model_dir(spm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizer = Tokenizer.load(spm_model)
    config = build_model_config(
        "tiny", [f"vocab_size={tokenizer.vocab_size}", f"max_len={MAX_LEN}"]
    )
    torch.manual_seed(0)
    model = Seq2SeqModel(config)
    with torch.no_grad():  # a likelier </s>, so that some outputs end before the limit
        model.decoder.output_bias[tokenizer.eos_id] = 2.0
    path = tmp_path_factory.mktemp("models") / "tiny"
    return save_model_dir(
        path,
        model.state_dict(),
        kind="seq2seq",
        model_config=config,
        languages=tokenizer.languages,
        spm_model=spm_model,
    )


@pytest.fixture(scope="module")
def data(demo_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Real English sources and German references, an empty line and a line too long."""
    sources = read_lines(demo_corpus / "parallel/en-de/test.en")[:20]
    references = read_lines(demo_corpus / "parallel/en-de/test.de")[:20]
    sources[5:5] = [""]
    references[5:5] = [""]
    sources.append(" ".join(["translation"] * 60))
    references.append("Übersetzung")
    out = tmp_path_factory.mktemp("data")
    write_lines(out / "test.en", sources)
    write_lines(out / "test.de", references)
    return out / "test.en", out / "test.de"


def tool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools/translate.py"), *args],
        input=stdin,
        capture_output=True,
        cwd=ROOT,
    )


def test_model_dir_files_are_readable_by_everyone_the_umask_allows(model_dir: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    modes = {path.name: path.stat().st_mode & 0o777 for path in model_dir.iterdir()}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o666 & ~umask}


def test_token_batches() -> None:
    lengths = [3, 10, 1, 7, 7, 2, 30]
    batches = token_batches(lengths, batch_tokens=20)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert batches[0] == [6]  # longer than the budget: alone, not an error
    for batch in batches[1:]:
        assert len(batch) * max(lengths[i] for i in batch) <= 20
    assert batches[1:] == [[1, 3], [4, 0], [5, 2]]  # 3 x 7 > 20 tokens
    with pytest.raises(ValueError, match="batch_tokens"):
        token_batches(lengths, 0)


def test_translator_order_and_batching(model_dir: Path, data: tuple[Path, Path]) -> None:
    translator = Translator.from_model_dir(model_dir)
    sources = read_lines(data[0])[:12]
    config = SearchConfig(max_len_a=0, max_len_b=6)

    def run(items: list[str], batch_tokens: int = 4096) -> list[str]:
        return translator.translate(
            items, src_lang="en", tgt_lang="de", config=config, batch_tokens=batch_tokens
        )

    one_batch = run(sources)
    assert one_batch[5] == "" and all(one_batch[:5]) and all(one_batch[6:])
    assert run(sources, batch_tokens=16) == one_batch
    assert [run([s])[0] for s in sources[:3]] == one_batch[:3]

    # A random model's outputs hardly depend on the source, but their scores do: equal scores
    # per sentence under another batching show that every result went back to its sentence.
    ids = translator.tokenizer.encode(sources[:5])
    scores = {
        budget: [
            h.score
            for h in translator.translate_ids(
                ids, src_lang="en", tgt_lang="de", config=config, batch_tokens=budget
            )
        ]
        for budget in (4096, 16)
    }
    assert len(set(scores[4096])) == 5
    assert scores[16] == pytest.approx(scores[4096], abs=1e-5)
    with pytest.raises(ValueError, match="not one of this model's languages: en, de"):
        translator.translate(sources, src_lang="en", tgt_lang="fr")


@pytest.mark.slow  # a subprocess importing torch or MLflow
def test_translate_file_with_reference_and_mlflow(
    model_dir: Path,
    data: tuple[Path, Path],
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    source, reference = data
    uri = mlflow_uri(tmp_path_factory, tmp_path)
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("translate")).info.run_id
    output = tmp_path / "hyp.de"
    result = tool(
        *("--model-dir", str(model_dir), "--src-lang", "en", "--tgt-lang", "de"),
        *("--input", str(source), "--output", str(output), "--beam", "3", *SEARCH),
        *("--reference", str(reference), "--lowercase", "--tracking-uri", uri, "--run-id", run_id),
    )
    assert result.returncode == 0, result.stderr.decode()
    translator = Translator.from_model_dir(model_dir)
    sources = read_lines(source)
    too_long = sum(len(ids) > MAX_LEN - 1 for ids in translator.tokenizer.encode(sources))
    assert too_long >= 1  # at least the line of 60 words
    message = f"{too_long} of 21 sources are longer than {MAX_LEN - 1} tokens and were cropped"
    assert message in result.stderr.decode()
    translations = read_lines(output)
    assert len(translations) == 22 and translations[5] == ""

    config = SearchConfig(beam=3, max_len_a=0, max_len_b=6)
    assert translations == translator.translate(
        sources, src_lang="en", tgt_lang="de", config=config
    )
    expected = evaluate(translations, read_lines(reference), lowercase=True)
    assert result.stdout.decode().strip() == expected.format()
    metrics = client.get_run(run_id).data.metrics
    assert metrics == pytest.approx({"bleu": expected.bleu.score, "chrf": expected.chrf.score})


def test_translate_stdin_to_stdout(model_dir: Path, data: tuple[Path, Path]) -> None:
    source, reference = data
    result = tool(
        *("--model-dir", str(model_dir), "--src-lang", "en", "--tgt-lang", "de", "--beam", "1"),
        *SEARCH,
        *("--reference", str(reference)),
        stdin=source.read_bytes(),
    )
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stdout.decode("utf-8").split("\n")
    assert lines[-1] == "" and len(lines) == 23  # the translations only, line-aligned
    config = SearchConfig(max_len_a=0, max_len_b=6)
    expected = Translator.from_model_dir(model_dir).translate(
        read_lines(source), src_lang="en", tgt_lang="de", config=config
    )
    assert lines[:-1] == expected
    assert "BLEU = " in result.stderr.decode() and "chrF2 = " in result.stderr.decode()


def test_translate_minimum_length_relative_to_the_source(
    spm_model: Path, data: tuple[Path, Path], tmp_path: Path
) -> None:
    tokenizer = Tokenizer.load(spm_model)
    config = build_model_config("tiny", [f"vocab_size={tokenizer.vocab_size}", "max_len=64"])
    torch.manual_seed(0)
    model = Seq2SeqModel(config)
    with torch.no_grad():  # </s> first, unless it is forbidden
        model.decoder.output_bias[tokenizer.eos_id] = 100.0
    model_dir = save_model_dir(
        tmp_path / "ends-at-once",
        model.state_dict(),
        kind="seq2seq",
        model_config=config,
        languages=tokenizer.languages,
        spm_model=spm_model,
    )
    sources = read_lines(data[0])[:5]
    write_lines(tmp_path / "src.en", sources)
    common = ["--model-dir", str(model_dir), "--src-lang", "en", "--tgt-lang", "de", "--beam", "1"]
    common += ["--input", str(tmp_path / "src.en")]
    assert main([*common, "--output", str(tmp_path / "free")]) == 0
    assert read_lines(tmp_path / "free") == [""] * 5
    assert main([*common, "--output", str(tmp_path / "held"), "--min-len-a", "0.5"]) == 0
    search = SearchConfig(beam=1, min_len_a=0.5)
    held = Translator.from_model_dir(model_dir).translate(
        sources, src_lang="en", tgt_lang="de", config=search
    )
    assert read_lines(tmp_path / "held") == held and all(held)


def test_translate_errors(
    model_dir: Path, data: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = ["--model-dir", str(model_dir), "--src-lang", "en", "--tgt-lang", "de"]
    bad = tmp_path / "bad.en"
    bad.write_bytes(b"Open file\nSave \xe9 as\n")
    assert main([*base, "--input", str(bad)]) == 2
    assert f"{bad}:2: not valid UTF-8" in capsys.readouterr().err
    short = tmp_path / "short.de"
    short.write_text("Datei öffnen\nSpeichern unter\n", encoding="utf-8")
    assert main([*base, "--input", str(data[0]), "--reference", str(short)]) == 2
    assert f"{short} has 2 lines but {data[0]} has 22" in capsys.readouterr().err
    assert main([*base[:-1], "fr", "--input", str(data[0])]) == 2
    assert "'fr' is not one of this model's languages: en, de" in capsys.readouterr().err
    assert main([*base, "--input", str(data[0]), "--beam", "0"]) == 2
    assert "beam must be >= 1" in capsys.readouterr().err
    assert main([*base, "--model-dir", str(tmp_path)]) == 2
    assert "not a megasemface model directory" in capsys.readouterr().err
    assert main([*base, "--model-dir", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such directory" in capsys.readouterr().err
    # A truncated or empty weights file: one line naming it, not safetensors' traceback.
    damaged = tmp_path / "damaged"
    shutil.copytree(model_dir, damaged)
    weights = damaged / "model.safetensors"
    for content in (weights.read_bytes()[:1000], b""):
        weights.write_bytes(content)
        assert main([*base, "--model-dir", str(damaged), "--input", str(data[0])]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and f"{weights} cannot be read" in error
    # An empty input translates nothing, and says so.
    empty = tmp_path / "empty.en"
    empty.write_text("")
    output = tmp_path / "empty.de"
    assert main([*base, "--input", str(empty), "--output", str(output)]) == 0
    assert f"{empty} has no line to translate" in capsys.readouterr().err
    assert output.read_text() == ""
