"""Every tool, run as a user runs it, on bad input: exit status 2 and one error line on
standard error that names the file or option at fault, never a traceback.

One table drives them all; each case starts the tool's script in a fresh process (the real
entry point, imports and exit status), so the table is kept to a case or a few per tool.
The inputs are real files made bad the ways files go bad: truncated, empty, a directory
where a file belongs, invalid UTF-8, the wrong kind of model directory, a text file where a
database belongs. Tests beside each tool call its ``main`` in-process for more cases.
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


@pytest.mark.slow
@pytest.mark.parametrize(("tool", "arguments", "names"), CASES)
def test_bad_input_is_one_line_and_status_2(
    bad: dict[str, str], tmp_path: Path, tool: str, arguments: str, names: str
) -> None:
    paths = {**bad, "out": str(tmp_path / "out")}
    result = subprocess.run(
        [*_command(tool), *f"{COMMON.get(tool, '')} {arguments}".format(**paths).split()],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu"},
        timeout=300,
    )
    err = result.stderr
    assert "Traceback" not in err, err
    assert result.returncode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], err
    assert names.format(**paths) in lines[0], err
