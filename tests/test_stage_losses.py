"""Every stage's per-step losses with a fixed seed, against recorded values.

Each stage (the SemFace encoder, decoder and joint stages over both interfaces, the XLM and
mBART baselines, supervised and unsupervised fine-tuning) runs three steps through the real
``deepspeed`` launcher, one CPU process, fp32. The losses must equal the ones recorded in
``tests/data/stage_losses.json``: a change to the trainer, a stage, an objective or the data
path that alters what a run computes shows up here. The tolerance only absorbs the last
bits that differ between CPU instruction sets.

After an intended change of the numbers, record them again with
``MEGASEMFACE_RECORD_STAGE_LOSSES=1 pytest tests/test_stage_losses.py`` and say why in the
commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from launch import ROOT, check_finished, ds_config, launch, losses, train_command
from safetensors.torch import save_file

from megasemface.data.shard_builder import ShardBuildConfig, build_shards
from megasemface.data.textio import parse_lang_path, parse_parallel
from megasemface.data.tokenizer import Tokenizer
from megasemface.models.config import build_model_config
from megasemface.models.model_dir import save_model_dir
from megasemface.models.transformer import Seq2SeqModel

RECORDED = ROOT / "tests" / "data" / "stage_losses.json"
RECORD = os.environ.get("MEGASEMFACE_RECORD_STAGE_LOSSES") == "1"
STEPS = 3

pytestmark = pytest.mark.usefixtures("no_leftover_shared_memory")

# name: (shards, arguments, the run whose checkpoint --init-from names, if any)
RUNS: dict[str, tuple[str, tuple[str, ...], str | None]] = {
    "xlm-encoder": ("mono", ("--stage", "encoder", "--interface", "none"), None),
    "vq-encoder": ("mono", ("--stage", "encoder", "--interface", "vq"), None),
    "vq-decoder": ("mono", ("--stage", "decoder", "--interface", "vq"), "vq-encoder"),
    "cl-decoder": ("mono", ("--stage", "decoder", "--interface", "cl"), None),
    "cl-joint": ("mono", ("--stage", "joint", "--interface", "cl"), None),
    "vq-joint": ("mono", ("--stage", "joint", "--interface", "vq"), None),
    "mbart": ("mono", ("--stage", "mbart", "--interface", "none"), None),
    "finetune-supervised": ("parallel", ("--stage", "finetune"), "init"),
    "finetune-unsupervised": (
        "mono",
        (
            "--stage",
            "finetune",
            "--finetune-mode",
            "unsupervised",
            "--max-len-a",
            "1.0",
            "--max-len-b",
            "5",
        ),
        "init",
    ),
}


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path) -> dict:
    root = tmp_path_factory.mktemp("stage-losses")
    config = ShardBuildConfig(tokens_per_sample=4096, samples_per_shard=4, max_tokens=60)
    mono = [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    build_shards(parse_lang_path(mono), spm_model, root / "mono", config)
    parallel = demo_corpus / "parallel" / "en-de"
    build_shards(
        parse_parallel([f"en-de:{parallel / 'train.en'},{parallel / 'train.de'}"]),
        spm_model,
        root / "parallel",
        config,
    )
    tokenizer = Tokenizer.load(spm_model)
    table = torch.randn(tokenizer.vocab_size, 64, generator=torch.Generator().manual_seed(0))
    save_file({"embeddings": table * 0.3}, str(root / "cl.safetensors"))
    model_config = build_model_config(
        "tiny", [f"vocab_size={tokenizer.vocab_size}", f"num_langs={len(tokenizer.languages)}"]
    )
    torch.manual_seed(0)
    save_model_dir(
        root / "init",
        Seq2SeqModel(model_config).state_dict(),
        kind="seq2seq",
        model_config=model_config,
        languages=tokenizer.languages,
        spm_model=spm_model,
    )
    return {"root": root, "spm": spm_model, "cl": root / "cl.safetensors"}


@pytest.fixture(scope="module")
def measured(data: dict) -> dict[str, list[float]]:
    """Runs every stage once (in dependency order); the losses of steps 1..STEPS per run."""
    root: Path = data["root"]
    found: dict[str, list[float]] = {}
    for name, (shards, args, init) in RUNS.items():
        out = root / "runs" / name
        extra = []
        if init is not None:
            extra = ["--init-from", str(root / init if init == "init" else root / "runs" / init)]
        cmd = train_command(
            {"shards": root / shards, "spm": data["spm"]},
            out,
            *args,
            *extra,
            "--cl-table",
            str(data["cl"]),
            "--steps",
            str(STEPS),
            "--seed",
            "3",
            "--lr",
            "1e-3",
            config=ds_config(2, root),
            procs=1,
        )
        result = launch(cmd)
        check_finished(result, out, STEPS)
        by_step = losses(out)
        found[name] = [by_step[step] for step in range(1, STEPS + 1)]
    if RECORD:
        RECORDED.parent.mkdir(exist_ok=True)
        RECORDED.write_text(json.dumps(found, indent=1) + "\n", encoding="utf-8")
    return found


@pytest.mark.parametrize("name", list(RUNS))
def test_stage_losses_equal_the_recorded_ones(measured: dict[str, list[float]], name: str) -> None:
    recorded = json.loads(RECORDED.read_text(encoding="utf-8"))
    assert measured[name] == pytest.approx(recorded[name], rel=2e-5), name
    # The steps differ from each other: the run trained, and the record is not a constant.
    assert len(set(recorded[name])) == STEPS
