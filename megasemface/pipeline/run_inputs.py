"""The contents of the files a pipeline run read, recorded beside it.

The pipeline rebuilds its inputs in place: a CL-SemFace table built with other skip-gram
epochs, an induced RAS dictionary with other thresholds, shards of another corpus land at
the paths the runs trained on them name. :func:`~megasemface.pipeline.launcher.changed_settings`
compares paths, so a finished run would be reused on inputs it never read. Each run started
by the pipeline records the SHA-256 of the files it reads in ``<run>/inputs.json``, keyed by
option rather than path (a moved work directory is still reused); a run reused or resumed
is checked against it.
"""

from __future__ import annotations

import json
from pathlib import Path

from megasemface.files import atomic_write_text, file_sha256
from megasemface.training.options import TrainConfig

__all__ = ["INPUTS_FILE", "changed_inputs", "input_files", "record_inputs"]

INPUTS_FILE = "inputs.json"


def input_files(config: TrainConfig) -> dict[str, Path]:
    """The files ``config`` reads whose content may change at the same path, by option: the
    tokenizer, the shards' manifest, the CL table and the RAS dictionaries, where given and
    present. A run started from a model directory is checked by its lineage instead."""
    files = {"spm_model": config.spm_model, "data": config.data / "manifest.json"}
    if config.cl_table is not None:
        files["cl_table"] = config.cl_table
    if config.model_config_file is not None:
        files["model_config_file"] = config.model_config_file
    for index, path in enumerate(config.ras_dictionary):
        files[f"ras_dictionary[{index}]"] = path
    return {name: Path(path) for name, path in files.items() if Path(path).is_file()}


def _digests(config: TrainConfig) -> dict[str, str]:
    return {name: file_sha256(path) for name, path in input_files(config).items()}


def record_inputs(run_dir: Path, config: TrainConfig) -> None:
    """Writes the digests of the files ``config`` reads to ``run_dir/inputs.json``."""
    run_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(_digests(config), indent=1, sort_keys=True) + "\n"
    atomic_write_text(run_dir / INPUTS_FILE, text)


def changed_inputs(run_dir: Path, config: TrainConfig) -> list[str]:
    """The files ``config`` reads whose content differs from what the run in ``run_dir``
    recorded, one ``option (path)`` each; empty without a record (a run not started by the
    pipeline, or started before it kept one) or for the same contents. An unreadable record
    counts every recorded input as changed: the run cannot show what it read."""
    path = run_dir / INPUTS_FILE
    if not path.is_file():
        return []
    files = input_files(config)
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(recorded, dict):
            raise ValueError("not an object")
    except (OSError, UnicodeDecodeError, ValueError):
        return [f"{name} ({file})" for name, file in files.items()]
    now = _digests(config)
    names = sorted(set(recorded) | set(now))
    return [
        f"{name} ({files.get(name, 'no longer read')})"
        for name in names
        if recorded.get(name) != now.get(name)
    ]
