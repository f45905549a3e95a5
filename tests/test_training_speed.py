"""Tokens/s per GPU, model FLOPs utilisation and the memory peak, in the progress line and in
MLflow (megasemface/training/throughput.py), on a CPU run against the measured matmul peak."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch
from launch import ROOT, launch, mlflow_run, train_command

from megasemface.checkpoints.consolidate import param_dtype
from megasemface.nn.config import build_model_config
from megasemface.training.throughput import Throughput, datasheet_peak, measured_matmul_peak


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H200", torch.bfloat16, 989e12),
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H20", torch.bfloat16, 148e12),
        ("NVIDIA A100-SXM4-80GB", torch.float16, 312e12),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 19.5e12),
        ("NVIDIA GeForce RTX 3050", torch.bfloat16, None),
    ],
)
def test_datasheet_peaks_by_name_and_dtype(name: str, dtype: torch.dtype, peak: float) -> None:
    assert datasheet_peak(name, dtype) == peak


def test_measured_peak_is_measured_once() -> None:
    first = measured_matmul_peak(torch.device("cpu"), torch.float32)
    assert 1e8 < first < 1e14  # between a slow core and far more than any CPU's fp32
    assert measured_matmul_peak(torch.device("cpu"), torch.float32) == first  # cached


def test_figures_are_their_definitions() -> None:
    speed = Throughput(torch.device("cpu"), world=2, dtype=torch.float32)
    assert speed.peak_source == "measured"
    figures = speed.figures(tokens=6_000, flops=3e12, seconds=1.5)
    assert figures["tokens_per_s_per_gpu"] == 6_000 / 1.5 / 2
    assert figures["model_tflops_per_gpu"] == pytest.approx(1.0)
    assert figures["mfu"] == pytest.approx(1e12 / speed.peak)
    assert figures["peak_tflops_per_gpu"] == speed.peak / 1e12
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    assert figures["rss_peak_gib"] == pytest.approx(rss, rel=0.05)
    assert "gpu_memory_peak_gib" not in figures


def test_a_peak_measured_low_is_raised_by_the_next_figures() -> None:
    """A peak measured while the machine was busy does not stay below what the products reach
    later: every logging window times one more product and keeps the fastest."""
    speed = Throughput(torch.device("cpu"), world=1, dtype=torch.float32)
    speed.peak = 1.0  # as if every product of the first quarter second had waited
    figures = speed.figures(tokens=1_000, flops=1e9, seconds=1.0)
    assert speed.peak > 1e8 and figures["peak_tflops_per_gpu"] == speed.peak / 1e12
    assert figures["mfu"] == pytest.approx(1e9 / speed.peak)


def test_the_peak_is_taken_in_the_configs_training_dtype() -> None:
    import json

    def dtype(name: str) -> torch.dtype:
        config = json.loads((ROOT / "ds_configs" / name).read_text())
        return param_dtype(config)

    assert dtype("zero2_bf16.json") == torch.bfloat16
    assert dtype("zero2_fp16.json") == torch.float16
    assert dtype("cpu_fp32_zero2.json") == torch.float32


@pytest.mark.launcher
def test_a_cpu_run_shows_and_tracks_mfu(launch_data: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = train_command(
        {"shards": launch_data["mono"], "spm": launch_data["spm"]},
        out,
        "--stage", "encoder", "--interface", "none", "--steps", "4", "--log-interval", "2",
        config=ROOT / "ds_configs" / "cpu_fp32_zero2.json",
    )  # fmt: skip
    result = launch(cmd)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [x for x in result.stdout.splitlines() if "tok/s/GPU MFU" in x]
    assert len(lines) == 2 and all("% RSS " in x and " GiB | loss " in x for x in lines), lines
    client, run = mlflow_run(out)

    def history(name: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}

    tiny = build_model_config("tiny")
    d, f = tiny.d_model, tiny.ffn_dim
    per_token = 6 * tiny.encoder_layers * (4 * d * d + 2 * d * f)
    steps = [2, 4]
    per_gpu, total = history("tokens_per_s_per_gpu"), history("tokens_per_s")
    mfu, achieved = history("mfu"), history("model_tflops_per_gpu")
    peak, rss = history("peak_tflops_per_gpu"), history("rss_peak_gib")
    assert sorted(per_gpu) == sorted(mfu) == sorted(rss) == steps
    for step in steps:
        assert per_gpu[step] == pytest.approx(total[step] / 2)  # two ranks
        assert mfu[step] == pytest.approx(achieved[step] / peak[step])
        assert 0 < mfu[step] < 1 and 0 < rss[step] < 64  # no product beats the peak
        # An XLM encoder step's model FLOPs per real token: at least its encoder layers'
        # products, 6 FLOPs per weight (forward and backward), at most a few times that
        # with padding, attention and the output layer (a sixth of the tokens predicted).
        flops_per_token = achieved[step] * 1e12 / per_gpu[step]
        assert per_token <= flops_per_token < 4 * per_token, (flops_per_token, per_token)
