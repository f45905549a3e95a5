"""BLEU and chrF against sacreBLEU's own command line, edge cases, the evaluate tool, MLflow."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from megasemface.data.text.lines import TextFileError, read_lines, write_lines
from megasemface.evaluation.metrics import evaluate, log_to_mlflow

ROOT = Path(__file__).resolve().parents[1]
SACREBLEU = Path(sys.executable).with_name("sacrebleu")


def mlflow_uri(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> str:
    """A fresh SQLite MLflow store in ``tmp_path``, copied from one made once per session:
    creating the schema takes seconds, copying the file milliseconds."""
    template = tmp_path_factory.getbasetemp() / "mlflow-template.db"
    if not template.exists():
        MlflowClient(f"sqlite:///{template}").search_experiments()
    shutil.copyfile(template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


@pytest.fixture(scope="module")
def texts(demo_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Real German references and degraded copies of them as hypotheses, as files."""
    references = read_lines(demo_corpus / "parallel/en-de/test.de")[:300]
    hypotheses = []
    for i, line in enumerate(references):
        words = line.split()
        if len(words) > 1 and i % 3:
            del words[i % len(words)]  # a missing word
        if i % 4 == 0:
            words = [w.upper() for w in words]  # a case difference only -lc forgives
        hypotheses.append(" ".join(words))
    out = tmp_path_factory.mktemp("texts")
    write_lines(out / "ref.de", references)
    write_lines(out / "hyp.de", hypotheses)
    return out / "ref.de", out / "hyp.de"


def sacrebleu_cli(ref: Path, hyp: Path, *options: str) -> dict[str, dict[str, object]]:
    result = subprocess.run(
        [str(SACREBLEU), str(ref), "-i", str(hyp), "-m", "bleu", "chrf", "-w", "6", *options],
        capture_output=True,
        text=True,
        check=True,
    )
    return {entry["name"]: entry for entry in json.loads(result.stdout)}


@pytest.mark.parametrize("lowercase", [False, True])
def test_equals_sacrebleu_command_line(texts: tuple[Path, Path], lowercase: bool) -> None:
    ref, hyp = texts
    ours = evaluate(read_lines(hyp), read_lines(ref), lowercase=lowercase)
    theirs = sacrebleu_cli(ref, hyp, *(["-lc", "--chrf-lowercase"] if lowercase else []))
    assert 5 < ours.bleu.score < 95 and 5 < ours.chrf.score < 95  # a real, non-trivial case
    assert ours.bleu.score == pytest.approx(theirs["BLEU"]["score"], abs=1e-5)
    assert ours.chrf.score == pytest.approx(theirs["chrF2"]["score"], abs=1e-5)
    assert ours.bleu.signature == theirs["BLEU"]["signature"]
    assert ours.chrf.signature == theirs["chrF2"]["signature"]
    assert ("case:lc" in ours.bleu.signature) == lowercase
    assert ours.sentences == 300 and ours.note is None


def test_empty_hypotheses_and_empty_test_set() -> None:
    references = ["Die Datei wurde gespeichert.", "Fehler beim Öffnen"]
    blank = evaluate(["", " "], references)
    assert blank.bleu.score == 0 and blank.chrf.score == 0
    assert blank.note == "every hypothesis is empty"
    partly = evaluate(["Die Datei wurde gespeichert.", ""], references)
    assert partly.bleu.score > 0 and partly.note == "1 of 2 hypotheses are empty"
    nothing = evaluate([], [], lowercase=True)
    assert (nothing.bleu.score, nothing.chrf.score, nothing.sentences) == (0.0, 0.0, 0)
    assert nothing.note is not None and "empty test set" in nothing.note
    assert "case:lc" in nothing.bleu.signature and "nrefs:1" in nothing.chrf.signature


def test_count_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"hyp\.txt has 1 lines but ref\.txt has 2"):
        evaluate(["a"], ["a", "b"], hypotheses_name="hyp.txt", references_name="ref.txt")


def test_read_lines(tmp_path: Path) -> None:
    path = tmp_path / "mixed.txt"
    path.write_bytes("eins\r\nzwei\u2028drei\n\nvier".encode())
    assert read_lines(path) == ["eins", "zwei\u2028drei", "", "vier"]
    path.write_bytes(b"ok\nstill ok\nbad \xff byte\n")
    with pytest.raises(TextFileError, match=r"mixed\.txt:3: not valid UTF-8"):
        read_lines(path)
    with pytest.raises(FileNotFoundError):
        read_lines(tmp_path / "missing.txt")
    write_lines(tmp_path / "out.txt", ["a\nb", "c"])
    assert read_lines(tmp_path / "out.txt") == ["a b", "c"]


@pytest.mark.slow  # a subprocess importing torch or MLflow
def test_evaluate_tool_logs_to_mlflow(
    texts: tuple[Path, Path], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    ref, hyp = texts
    uri = mlflow_uri(tmp_path_factory, tmp_path)
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("eval")).info.run_id
    args = ["--hypotheses", str(hyp), "--references", str(ref), "--lowercase"]
    args += ["--tracking-uri", uri, "--run-id", run_id, "--metric-prefix", "test/", "--step", "7"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools/evaluate.py"), *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    expected = evaluate(read_lines(hyp), read_lines(ref), lowercase=True)
    assert result.stdout.strip() == expected.format()
    data = client.get_run(run_id).data
    assert data.metrics["test/bleu"] == pytest.approx(expected.bleu.score)
    assert data.metrics["test/chrf"] == pytest.approx(expected.chrf.score)
    assert data.tags["test/bleu_signature"] == expected.bleu.signature
    assert [m.step for m in client.get_metric_history(run_id, "test/chrf")] == [7]

    # The library helper, as the trainer calls it.
    log_to_mlflow(expected, tracking_uri=uri, run_id=run_id, prefix="valid/", step=100)
    assert client.get_run(run_id).data.metrics["valid/bleu"] == pytest.approx(expected.bleu.score)


def test_evaluate_tool_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from megasemface.cli.evaluate import main

    (tmp_path / "hyp").write_bytes(b"eins\nzwei\n\xe4 drei\n")
    (tmp_path / "ref").write_text("eins\nzwei\ndrei\n", encoding="utf-8")
    (tmp_path / "short").write_text("eins\n", encoding="utf-8")
    assert main(["--hypotheses", str(tmp_path / "hyp"), "--references", str(tmp_path / "ref")]) == 2
    assert f"{tmp_path / 'hyp'}:3: not valid UTF-8" in capsys.readouterr().err
    args = ["--hypotheses", str(tmp_path / "ref"), "--references", str(tmp_path / "short")]
    assert main(args) == 2
    assert "has 3 lines but" in capsys.readouterr().err
    assert main([*args, "--run-id", "abc"]) == 2
    assert "go together" in capsys.readouterr().err
