"""Every command on a CUDA device, with the tiny models: the pre-training stages (VQ and CL
SemFace, mBART, VECO, mRASP) under ZeRO-2 and ZeRO-3 in bf16 and under fp16, with random
aligned substitution (mRASP's, in CL-SemFace's decoder noise, on fine-tuning's sources);
consolidating, averaging, connecting and exporting the checkpoints they write; supervised
fine-tuning with validation and best-model selection; unsupervised fine-tuning (denoising
and online back-translation, in lockstep under ZeRO-3); the translate, evaluate and
diagnose_interface tools; and the pipeline at its smallest budget, its test sets decoded on
the device and its runs and scores in its MLflow store.

The GPU tier: skipped without CUDA, selected with ``pytest -m gpu`` (the GPU kit runs it).
``MEGASEMFACE_GPU_TIER_DEVICE=cpu`` runs the same tests on DeepSpeed's CPU accelerator
with the CPU configs (fp16 left out: DeepSpeed refuses it on a CPU), to check the tests
themselves on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import ROOT, chain, check_finished, environment, launch, mlflow_run, train_command
from safetensors.torch import load_file

from megasemface.checkpoints import load_stage
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.textio import parse_lang_path, parse_parallel

DEVICE = os.environ.get("MEGASEMFACE_GPU_TIER_DEVICE", "cuda")
ON_GPU = DEVICE == "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(ON_GPU and not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CONFIGS = {
    "bf16": ROOT / "ds_configs" / ("zero2_bf16.json" if ON_GPU else "zero1_bf16.json"),
    "fp16": ROOT / "ds_configs" / "zero2_fp16.json",
    "zero3": ROOT / "ds_configs" / ("zero3_bf16.json" if ON_GPU else "cpu_fp32_zero3.json"),
}
HALF = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""The dtype each run's module holds its weights in (the optimizer keeps fp32 masters)."""


def _env() -> dict[str, str]:
    return {"DS_ACCELERATOR": DEVICE}


def _tool(name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / f"{name}.py"), *args],
        capture_output=True,
        text=True,
        env={**environment(), **_env()},
        cwd=ROOT,
        timeout=timeout,
    )


def _chain(runs: dict[Path, tuple[Path, str, tuple[str, ...]]], spm: Path) -> str:
    """Launches the runs ``{output: (shards, config, arguments)}`` one after another in one
    launch of one rank (tests/launch.py's ``chain``), each keeping its live weights beside
    every checkpoint; returns what the launch printed."""
    commands = [
        train_command(
            {"shards": shards, "spm": spm}, out, *args, config=CONFIGS[config], procs=1, live=True
        )
        for out, (shards, config, args) in runs.items()
    ]
    result = launch(chain(commands), timeout=900, env=_env())
    for out, (_, _, args) in runs.items():
        check_finished(result, out, int(args[args.index("--steps") + 1]))
    return result.stdout


def _ok(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


@pytest.fixture(scope="module")
def veco_shards(tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path):
    """Monolingual and parallel text in one set of shards, as VECO reads them."""
    out = tmp_path_factory.mktemp("gpu-veco-shards")
    parallel = demo_corpus / "parallel" / "en-de"
    corpora = parse_lang_path(
        [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    ) + parse_parallel([f"en-de:{parallel / 'train.en'},{parallel / 'train.de'}"])
    build_shards(corpora, spm_model, out, ShardBuildConfig(tokens_per_sample=4096, max_tokens=60))
    return out


# name: (config, shards, steps, arguments)
PRETRAINING: dict[str, tuple[str, str, int, tuple[str, ...]]] = {
    "vq-bf16": ("bf16", "mono", 3, ("--stage", "joint", "--interface", "vq")),
    "vq-fp16": ("fp16", "mono", 3, ("--stage", "joint", "--interface", "vq")),
    "cl-zero3": ("zero3", "mono", 2, ("--stage", "joint", "--interface", "cl")),
    "mbart": ("bf16", "mono", 2, ("--stage", "mbart", "--interface", "none")),
    "veco": ("bf16", "veco", 2, ("--stage", "veco")),
    "mrasp": ("zero3", "parallel", 2, ("--stage", "mrasp")),
}


@pytest.fixture(scope="module")
def pretrained(
    launch_data: dict,
    demo_corpus: Path,
    veco_shards: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    """The pre-training runs, in one launch (:func:`_chain`)."""
    root = tmp_path_factory.mktemp("gpu-runs")
    shards = {**launch_data, "veco": veco_shards}
    ras = ("--ras-dictionary", str(demo_corpus / "dict" / "en-de.tsv"))
    extra = {
        "cl-zero3": ("--cl-table", str(launch_data["cl"]), "--decoder-noise-ras", *ras),
        "mrasp": ras,
        "vq-bf16": (
            *(
                "--save-interval",
                "1",
                "--keep-last",
                "3",
                "--valid-prefix",
                str(launch_data["valid"]),
            ),
            *("--valid-interval", "3", "--valid-max-sentences", "16"),
        ),
    }
    names = [n for n in PRETRAINING if ON_GPU or PRETRAINING[n][0] != "fp16"]
    runs = {}
    for name in names:
        config, data, steps, args = PRETRAINING[name]
        arguments = (*args, *extra.get(name, ()), "--steps", str(steps))
        runs[root / name] = (shards[data], config, arguments)
    _chain(runs, launch_data["spm"])
    return {name: root / name for name in names}


@pytest.mark.launcher
def test_pretraining_stages_train_and_report_their_speed(pretrained: dict[str, Path]) -> None:
    for name, out in pretrained.items():
        records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in records if "loss" in r]
        assert [r["step"] for r in steps] == list(range(1, PRETRAINING[name][2] + 1)), name
        assert all(r["loss"] == r["loss"] and not r["skipped"] for r in steps), (name, steps)
        metrics = mlflow_run(out)[1].data.metrics
        memory = "gpu_memory_peak_gib" if ON_GPU else "rss_peak_gib"
        assert metrics[memory] > 0 and 0 < metrics["mfu"] < 1, (name, metrics)
        assert metrics["tokens_per_s_per_gpu"] == pytest.approx(metrics["tokens_per_s"])
        if name in ("cl-zero3", "mrasp"):  # random aligned substitution replaced words
            assert metrics["ras_replaced"] > 0, (name, metrics)
        if name == "vq-bf16":  # validation in eval mode on the device
            assert 0 < metrics["valid_enc_mlm"] < 20 and 0 < metrics["valid_dec_clm"] < 20
            assert metrics["valid_enc_code_perplexity"] >= 1, metrics


@pytest.mark.launcher
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_checkpoints_written_on_the_device_consolidate_to_their_weights(
    pretrained: dict[str, Path], precision: str, tmp_path: Path
) -> None:
    """fp32 master weights come back from the device's checkpoint (read on the host); cast
    to the run's half precision they are the weights the live model held."""
    if f"vq-{precision}" not in pretrained:
        pytest.skip("DeepSpeed runs fp16 on CUDA only")
    run = pretrained[f"vq-{precision}"]
    state, meta = load_stage(run)
    assert meta["param_dtype"] == str(HALF[precision]).removeprefix("torch.")
    live = load_file(str(run / "live" / "step-00000003-mp0.safetensors"))
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in state.values())
    for key, value in state.items():
        assert torch.equal(value.to(HALF[precision]).float(), live[key]), key
    out = tmp_path / "consolidated"
    _ok(_tool("merge_checkpoints", "consolidate", str(run), "--out", str(out)))
    assert (out / "model.safetensors").is_file()
    connected = tmp_path / "connected"
    _ok(_tool("merge_checkpoints", "connect", "--encoder", str(run), "--decoder", str(run),
              "--out", str(connected)))  # fmt: skip
    weights = load_file(str(connected / "model.safetensors"))
    assert all(v.dtype == torch.float32 and bool(v.isfinite().all()) for v in weights.values())


@pytest.mark.launcher
def test_average_connect_and_export_of_device_checkpoints(
    pretrained: dict[str, Path], tmp_path: Path
) -> None:
    run = pretrained["vq-bf16"]
    averaged = tmp_path / "averaged"
    _ok(_tool("merge_checkpoints", "average", str(run), "--last", "3", "--out", str(averaged)))
    steps = [load_stage(run / "checkpoints" / f"step-{s:08d}")[0] for s in (1, 2, 3)]
    mean = load_file(str(averaged / "model.safetensors"))
    key = "encoder.layers.0.ffn.fc1.weight"
    assert torch.equal(mean[key], (steps[0][key] + steps[1][key] + steps[2][key]) / 3)
    for name, args in {
        "vq": ("--encoder", str(run), "--decoder", str(run)),
        "mbart": ("--mbart", str(pretrained["mbart"])),
        "veco": ("--mbart", str(pretrained["veco"])),
        "mrasp": ("--mbart", str(pretrained["mrasp"])),
    }.items():
        _ok(_tool("merge_checkpoints", "connect", *args, "--out", str(tmp_path / name)))
    pytest.importorskip("transformers")
    exported = tmp_path / "hf"
    out = _tool(
        "export", "huggingface", "--model-dir", str(tmp_path / "vq"),
        "--src-lang", "en", "--tgt-lang", "de", "--out", str(exported),
    )  # fmt: skip
    _ok(out)
    assert (exported / "config.json").is_file()


@pytest.fixture(scope="module")
def finetuned(
    launch_data: dict,
    demo_corpus: Path,
    pretrained: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, Path]:
    """Supervised fine-tuning of the connected VQ-SemFace model (random aligned substitution
    on its sources) with validation at steps 2 and 4 (the best model kept), then unsupervised
    fine-tuning under ZeRO-3, in one launch."""
    root = tmp_path_factory.mktemp("gpu-finetune")
    connected = root / "vq-model"
    run = pretrained["vq-bf16"]
    _ok(_tool("merge_checkpoints", "connect", "--encoder", str(run), "--decoder", str(run),
              "--out", str(connected)))  # fmt: skip
    common = (
        "--stage", "finetune", "--valid-prefix", str(launch_data["valid"]),
        "--valid-max-sentences", "24", "--lr", "1e-3", "--warmup-steps", "2",
    )  # fmt: skip
    runs = {
        "supervised": (
            launch_data["parallel"], "bf16", connected,
            ("--steps", "4", "--valid-interval", "2", "--finetune-ras", "--ras-dictionary",
             str(demo_corpus / "dict" / "en-de.tsv")),
        ),
        "unsupervised": (
            launch_data["mono"], "zero3", launch_data["init"],
            ("--finetune-mode", "unsupervised", "--steps", "3", "--valid-interval", "3",
             "--max-len-a", "1.0", "--max-len-b", "5", "--denoise-schedule", "0:1,3:0"),
        ),
    }  # fmt: skip
    shown = _chain(
        {
            root / name: (shards, config, (*common, "--init-from", str(init), *args))
            for name, (shards, config, init, args) in runs.items()
        },
        launch_data["spm"],
    )
    assert "validation" in shown
    return {name: root / name for name in runs}


@pytest.mark.launcher
def test_finetuning_validates_and_keeps_the_best_model(finetuned: dict[str, Path]) -> None:
    client, run = mlflow_run(finetuned["supervised"])
    bleu = client.get_metric_history(run.info.run_id, "valid_bleu")
    assert sorted(m.step for m in bleu) == [2, 4]
    best = json.loads((finetuned["supervised"] / "best" / "config.json").read_text())
    assert best["meta"]["valid_bleu"] == pytest.approx(run.data.metrics["best_valid_bleu"])
    assert run.data.metrics["ras_replaced"] > 0
    client, run = mlflow_run(finetuned["unsupervised"])
    assert client.get_metric_history(run.info.run_id, "bt")  # back-translation trained
    assert client.get_metric_history(run.info.run_id, "valid_bleu")
    assert (finetuned["unsupervised"] / "best" / "model.safetensors").is_file()


@pytest.mark.launcher
def test_translate_evaluate_and_diagnose_tools(
    launch_data: dict, pretrained: dict[str, Path], finetuned: dict[str, Path], tmp_path: Path
) -> None:
    lines = {}
    for lang in ("en", "de"):
        text = Path(f"{launch_data['test']}.{lang}").read_text(encoding="utf-8").splitlines()
        lines[lang] = tmp_path / f"test.{lang}"
        lines[lang].write_text("\n".join(text[:40]) + "\n", encoding="utf-8")
    hyp = tmp_path / "hyp.de"
    shown = _ok(
        _tool(
            "translate", "--model-dir", str(finetuned["supervised"] / "best"),
            "--src-lang", "en", "--tgt-lang", "de", "--input", str(lines["en"]),
            "--output", str(hyp), "--reference", str(lines["de"]), "--device", DEVICE,
        )
    )  # fmt: skip
    assert f"beam 5, {DEVICE})" in shown and "BLEU" in shown
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == 40
    scored = _ok(_tool("evaluate", "--hypotheses", str(hyp), "--references", str(lines["de"])))
    assert "BLEU" in scored and "chrF" in scored
    figures = tmp_path / "diagnostics.json"
    _ok(
        _tool(
            "diagnose_interface", "--checkpoint", str(pretrained["vq-bf16"]),
            "--text", f"en:{lines['en']}", "--text", f"de:{lines['de']}",
            "--output", str(figures),
        )
    )  # fmt: skip
    assert json.loads(figures.read_text())


def test_pipeline_at_its_smallest_budget(demo_corpus: Path, tmp_path: Path) -> None:
    """tools/reproduce.py end to end at the smoke budget on the device (bf16 under ZeRO-2
    there), with MLflow tracking to its SQLite store."""
    workdir = tmp_path / "smoke"
    shown = _ok(
        _tool(
            "reproduce", "--budget", "smoke", "--workdir", str(workdir),
            "--corpus", str(demo_corpus), "--pair", "en-de", "--vocab-size", "1000",
            "--systems", "transformer,vq", "--settings", "supervised", "--procs", "1",
            timeout=1200,
        )
    )  # fmt: skip
    assert "| system | en-de | de-en | avg | gain |" in shown
    assert (workdir / "results.md").stat().st_size > 0
    assert (workdir / "runs" / "supervised-vq" / "best" / "model.safetensors").is_file()
    # The test sets are decoded where the runs trained (the GPU where there is one).
    decoded = "cuda" if torch.cuda.is_available() else "cpu"
    assert shown.count(f"s on {decoded})") == 4, shown[-3000:]  # 2 systems x 2 directions
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    scored = [r for r in runs if "test_bleu" in r.data.metrics]
    assert len(scored) == 2 and all("valid_bleu" in r.data.metrics for r in scored), runs
