"""Every tool, run as a user runs it, on bad input: exit status 2 and one error line on
standard error that names the file or option at fault, never a traceback.

One table drives them all; each case starts the tool's script in a fresh process (the real
entry point, imports and exit status), so the table is kept to a case or a few per tool.
The inputs are real files made bad the ways files go bad: truncated, empty, a directory
where a file belongs, invalid UTF-8, the wrong kind of model directory, a text file where a
database belongs. Tests beside each tool call its ``main`` in-process for more cases.

A misspelt option of each command stops it before it starts, with the option and the
closest valid one; DeepSpeed's launcher arguments are accepted by name.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _model_dir(root: Path, name: str, source: Path, damage: dict[str, bytes]) -> None:
    shutil.copytree(source, root / name)
    for file, content in damage.items():
        (root / name / file).write_bytes(content)


@pytest.fixture(scope="module")
def bad(launch_data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Bad inputs next to good ones; the names the table's arguments use."""
    root = tmp_path_factory.mktemp("bad-input")
    whole = gzip.compress("".join(f"Zeile {i}\n" for i in range(5000)).encode(), mtime=0)
    (root / "cut.txt.gz").write_bytes(whole[: len(whole) // 2])
    (root / "dir").mkdir()
    (root / "empty.txt").write_bytes(b"")
    (root / "latin1.txt").write_bytes(b"Open file\nSave \xe9 as\n")
    (root / "two.txt").write_text("Open file\nSave as\n", encoding="utf-8")
    (root / "three.txt").write_text("Datei\nSpeichern\nunter\n", encoding="utf-8")
    (root / "gold.tsv").write_bytes(b"Datei\tfile\ncaf\xe9\tcoffee\n")
    (root / "list.json").write_text("[]\n")
    (root / "scores.json").write_bytes(b'{"test_bleu_en-de": \xff}')
    (root / "not-a-db.db").write_text("not a database\n")
    (root / "locale").mkdir()

    init = launch_data["init"]
    weights = (init / "model.safetensors").read_bytes()
    config = json.loads((init / "config.json").read_text(encoding="utf-8"))
    _model_dir(root, "truncated", init, {"model.safetensors": weights[: len(weights) // 2]})
    _model_dir(root, "empty-weights", init, {"model.safetensors": b""})
    _model_dir(root, "bad-config", init, {"config.json": b'{"format": "megasemface-model",'})
    _model_dir(root, "latin1-config", init, {"config.json": b'{"format": "caf\xe9"}'})
    pretraining = json.dumps({**config, "kind": "pretraining"}).encode()
    _model_dir(root, "pretraining", init, {"config.json": pretraining})

    shards = root / "shards"  # the first shard read (of de, the first language) is cut short
    shutil.copytree(launch_data["mono"], shards)
    first = shards / "de-000000.tar"
    first.write_bytes(first.read_bytes()[: first.stat().st_size // 2 + 100])
    return {
        "bad": str(root),
        "first_shard": str(first),
        "spm": str(launch_data["spm"]),
        "init": str(init),
        "mono": str(launch_data["mono"]),
        "parallel": str(launch_data["parallel"]),
        "ds": str(ROOT / "ds_configs" / "cpu_fp32_zero2.json"),
    }


TRANSLATE = "--src-lang en --tgt-lang de --input {bad}/two.txt"
TRAIN = "--deepspeed_config {ds} --spm-model {spm} --output-dir {out}/run"
EXPORT = "--src-lang en --tgt-lang de --out {out}/export"


def case(name: str, tool: str, arguments: str, names: str) -> object:
    """A row: the tool's arguments and what its error line must name. ``{out}`` is an empty
    directory of the case's own; other ``{...}`` are the paths of the ``bad`` fixture."""
    return pytest.param(tool, arguments, names, id=f"{tool}-{name}")


CASES = [
    case("language-not-in-the-model", "build_shards", "--out {out}/s --input fr:{bad}/three.txt",
         "--input fr: the SentencePiece model {spm} has no language tag for fr"),
    case("truncated-gzip", "build_shards", "--out {out}/s --input de:{bad}/cut.txt.gz",
         "{bad}/cut.txt.gz"),
    case("directory-as-corpus", "build_shards", "--out {out}/s --input de:{bad}/dir", "{bad}/dir"),
    case("out-is-a-file", "build_shards", "--input de:{bad}/three.txt --out {bad}/two.txt",
         "{bad}/two.txt"),
    case("empty-corpus", "train_spm", "--quiet --input en:{bad}/empty.txt --output {out}/spm",
         "{bad}/empty.txt"),
    case("truncated-shard", "build_cl_embeddings", "--shards {bad}/shards --out {out}/cl",
         "{first_shard}"),
    case("latin1-dictionary", "build_cl_embeddings",
         "--shards {mono} --out {out}/cl --gold-dict {bad}/gold.tsv", "{bad}/gold.tsv:2"),
    case("not-a-run", "merge_checkpoints", "consolidate {bad}/dir --out {out}/m", "{bad}/dir"),
    case("latin1-model-config", "merge_checkpoints",
         "consolidate {bad}/latin1-config --out {out}/m", "{bad}/latin1-config"),
    case("seq2seq-as-mbart", "merge_checkpoints", "connect --mbart {init} --out {out}/m", "{init}"),
    case("missing-model-dir", "translate", "--model-dir {bad}/missing " + TRANSLATE,
         "{bad}/missing: no such directory"),
    case("truncated-weights", "translate", "--model-dir {bad}/truncated " + TRANSLATE,
         "{bad}/truncated/model.safetensors"),
    case("empty-weights", "translate", "--model-dir {bad}/empty-weights " + TRANSLATE,
         "{bad}/empty-weights/model.safetensors"),
    case("damaged-config", "translate", "--model-dir {bad}/bad-config " + TRANSLATE,
         "{bad}/bad-config/config.json"),
    case("pretraining-model", "translate", "--model-dir {bad}/pretraining " + TRANSLATE,
         "{bad}/pretraining"),
    case("latin1-input", "translate",
         "--model-dir {init} --src-lang en --tgt-lang de --input {bad}/latin1.txt",
         "{bad}/latin1.txt:2"),
    case("output-is-a-directory", "translate",
         "--model-dir {init} " + TRANSLATE + " --output {bad}/dir", "{bad}/dir"),
    case("missing-references", "evaluate",
         "--hypotheses {bad}/two.txt --references {bad}/missing.txt", "{bad}/missing.txt"),
    case("latin1-hypotheses", "evaluate",
         "--hypotheses {bad}/latin1.txt --references {bad}/two.txt", "{bad}/latin1.txt:2"),
    case("text-file-as-store", "evaluate",
         "--hypotheses {bad}/two.txt --references {bad}/two.txt "
         "--tracking-uri {bad}/not-a-db.db --run-id 0", "{bad}/not-a-db.db"),
    case("text-file-as-store", "compare_runs", "--tracking-uri {bad}/not-a-db.db",
         "{bad}/not-a-db.db"),
    case("pretraining-model", "export", "huggingface --model-dir {bad}/pretraining " + EXPORT,
         "{bad}/pretraining"),
    case("truncated-weights", "export", "ctranslate2 --model-dir {bad}/truncated " + EXPORT,
         "{bad}/truncated/model.safetensors"),
    case("damaged-scores", "export",
         "huggingface --model-dir {init} --scores {bad}/scores.json " + EXPORT,
         "{bad}/scores.json"),
    case("corpus-without-files", "reproduce", "--corpus {bad}/dir --workdir {out}/w",
         "{bad}/dir"),
    case("seq2seq-as-stage", "diagnose_interface",
         "--checkpoint {bad}/empty-weights --text en:{bad}/two.txt", "{bad}/empty-weights"),
    case("seq2seq-as-stage", "valid_mlm",
         "--checkpoint {bad}/empty-weights --text en:{bad}/two.txt", "{bad}/empty-weights"),
    case("no-catalogs", "make_demo_corpus", "--locale-dir {bad}/locale --out {out}/c",
         "{bad}/locale"),
    case("mp-size-3", "train", TRAIN + " --stage encoder --data {mono} --mp-size 3",
         "--mp-size 3"),
    case("vq-finetune-without-init", "train",
         TRAIN + " --stage finetune --interface vq --data {parallel}", "--init-from"),
    case("ds-config-not-an-object", "train",
         TRAIN.replace("{ds}", "{bad}/list.json") + " --stage encoder --data {mono}",
         "{bad}/list.json"),
    case("output-dir-is-a-file", "train",
         TRAIN.replace("{out}/run", "{bad}/two.txt") + " --stage encoder --data {mono}",
         "{bad}/two.txt"),
    # The launchers' own arguments, as DeepSpeed's (--local_rank=R first) and torch's pass
    # them, are accepted: the error is the next one the command line holds.
    case("mp-size-3-from-a-launcher", "train",
         "--local_rank=0 " + TRAIN + " --stage encoder --data {mono} --mp-size 3 --local-rank=0",
         "--mp-size 3"),
    case("misspelt-model-option", "train",
         TRAIN + " --stage encoder --data {mono} --model vq.layot=product",
         "unknown model option 'vq.layot' (did you mean vq.layout?)"),
]  # fmt: skip

# What a tool needs besides the arguments of a case.
COMMON = {
    "build_shards": "--quiet --spm-model {spm}",
    "build_cl_embeddings": "--spm-model {spm}",
}


def _command(tool: str) -> list[str]:
    if tool == "train":  # run without the launcher: one process, as megasemface-train runs
        return [sys.executable, str(ROOT / "megasemface" / "train.py")]
    return [sys.executable, str(ROOT / "tools" / f"{tool}.py")]


def _run(tool: str, arguments: str, paths: dict[str, str], cwd: Path) -> tuple[int, str]:
    """The exit status and standard error of ``tool`` run on ``arguments``."""
    result = subprocess.run(
        [*_command(tool), *f"{COMMON.get(tool, '')} {arguments}".format(**paths).split()],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"},
        timeout=300,
    )
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stderr


@pytest.mark.slow
@pytest.mark.parametrize(("tool", "arguments", "names"), CASES)
def test_bad_input_is_one_line_and_status_2(
    bad: dict[str, str], tmp_path: Path, tool: str, arguments: str, names: str
) -> None:
    paths = {**bad, "out": str(tmp_path / "out")}
    status, err = _run(tool, arguments, paths, tmp_path)
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], err
    assert names.format(**paths) in lines[0], err


def misspelt(tool: str, arguments: str, wrong: str, right: str, command: str = "") -> object:
    """A row: a command line that would run but for the option ``wrong``, which is
    ``right`` misspelt; ``command`` is how the error line names the command (default the
    tool's name)."""
    return pytest.param(tool, arguments, wrong, right, command or tool, id=f"{tool}{wrong}")


MISSPELT = [
    misspelt("train", TRAIN + " --stage encoder --data {mono} --stpes 5", "--stpes", "--steps"),
    # An abbreviation is no option either: --max-token must not run with the default batch.
    misspelt("train", TRAIN + " --stage encoder --data {mono} --max-token=512",
             "--max-token", "--max-tokens"),
    misspelt("train", TRAIN + " --stage encoder --data {mono} --deepspeed-config {ds}",
             "--deepspeed-config", "--deepspeed_config"),
    misspelt("build_shards", "--out {out}/s --input de:{bad}/three.txt --samples-per-shrad 4",
             "--samples-per-shrad", "--samples-per-shard"),
    misspelt("train_spm", "--quiet --input en:{bad}/two.txt --output {out}/spm --vocab-sise 50",
             "--vocab-sise", "--vocab-size"),
    misspelt("build_cl_embeddings", "--shards {mono} --out {out}/cl --epoch 1",
             "--epoch", "--epochs"),
    misspelt("merge_checkpoints", "consolidate {init} --out {out}/m --mp-sise 2",
             "--mp-sise", "--mp-size", "merge_checkpoints consolidate"),
    misspelt("translate", "--model-dir {init} " + TRANSLATE + " --output {out}/hyp --beam-size 4",
             "--beam-size", "--beam"),
    misspelt("evaluate", "--hypotheses {bad}/two.txt --references {bad}/two.txt --lower-case",
             "--lower-case", "--lowercase"),
    misspelt("compare_runs", "--tracking-uri {out}/mlflow.db --experimnt demo",
             "--experimnt", "--experiment"),
    misspelt("export", "huggingface --model-dir {init} " + EXPORT + " --over-write",
             "--over-write", "--overwrite", "export huggingface"),
    misspelt("reproduce", "--corpus {bad}/dir --workdir {out}/w --pretrain-step 10",
             "--pretrain-step", "--pretrain-steps"),
    misspelt("diagnose_interface",
             "--model-dir {init} --text en:{bad}/two.txt --output {out}/d.json --max-sentence 2",
             "--max-sentence", "--max-sentences"),
    misspelt("valid_mlm",
             "--checkpoint {init} --text en:{bad}/two.txt --output {out}/m.json --max-sentence 2",
             "--max-sentence", "--max-sentences"),
    misspelt("make_demo_corpus", "--locale-dir {bad}/locale --out {out}/c --lang de",
             "--lang", "--langs"),
    misspelt("learning_curves",
             "--shards {mono} --spm-model {spm} --workdir {out}/curves --no-tracking --stpes 5",
             "--stpes", "--steps"),
]  # fmt: skip


def test_every_command_has_a_misspelt_option_case() -> None:
    commands = {path.stem for path in (ROOT / "tools").glob("*.py")} | {"train"}
    assert {row.values[0] for row in MISSPELT} == commands  # type: ignore[attr-defined]


@pytest.mark.slow
@pytest.mark.parametrize(("tool", "arguments", "wrong", "right", "command"), MISSPELT)
def test_misspelt_option_stops_before_anything_starts(
    bad: dict[str, str], tmp_path: Path, tool: str, arguments: str, wrong: str, right: str,
    command: str,
) -> None:  # fmt: skip
    paths = {**bad, "out": str(tmp_path / "out")}
    status, err = _run(tool, arguments, paths, tmp_path)
    assert status == 2, err
    assert err == f"{command}: error: unknown option {wrong} (did you mean {right}?)\n", err
    assert not (tmp_path / "out").exists()  # every output of the command lies under it


@pytest.mark.slow
def test_unexpected_argument_is_named(bad: dict[str, str], tmp_path: Path) -> None:
    """A stray word is no option to suggest for: the line names it."""
    paths = {**bad, "out": str(tmp_path / "out")}
    status, err = _run("train", TRAIN + " --stage encoder --data {mono} 5", paths, tmp_path)
    assert status == 2, err
    assert err == "train: error: unexpected argument '5' (--help lists the arguments)\n", err


def test_help_still_shows_required_options_as_required(tmp_path: Path) -> None:
    """The pass that looks for unknown options treats none as required; --help is not it."""
    result = subprocess.run(
        [*_command("export"), "huggingface", "--help"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    usage = " ".join(result.stdout.split("\n\n")[0].split())
    assert " --model-dir MODEL_DIR " in usage and "[--model-dir" not in usage, usage
