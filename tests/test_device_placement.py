"""Tensors are made on the device of the tensors they meet: the model's, or the collective's
(NCCL reduces device tensors only), never the host by default. Each test runs on the CPU and,
in the GPU tier (``-m gpu``), on CUDA, where a tensor left on the host fails it."""

from __future__ import annotations

import pytest
import torch
from launch import on_cuda

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces import code_usage
from megasemface.interfaces.code_usage import CodeUsage
from megasemface.models.config import build_model_config
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.objectives.stages import ObjectiveConfig
from megasemface.objectives.veco import VecoSeq2Seq

DEVICES = ["cpu", on_cuda("cuda")]


@pytest.mark.parametrize("device", DEVICES)
def test_code_usage_reduces_on_the_collectives_device_before_any_batch(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window with no batch on this rank (the encoder stage's decoder-side usage, a rank
    that has not stepped yet) still enters the data-parallel sum with a tensor where the
    collective takes them, and the first batch later counts on its own device."""
    reduced: list[torch.device] = []

    def nccl_like(tensor: torch.Tensor, groups: ParallelGroups) -> torch.Tensor:
        # NCCL refuses host tensors ("No backend type associated with device type cpu").
        assert tensor.device.type == device, f"a {tensor.device} tensor reached the collective"
        reduced.append(tensor.device)
        return tensor

    monkeypatch.setattr(code_usage, "collective_device", lambda: torch.device(device))
    monkeypatch.setattr(code_usage, "all_reduce_data_parallel", nccl_like)
    usage = CodeUsage(8, ParallelGroups.single())
    assert usage.summary() == {}
    usage.update(torch.tensor([1, 1, 5], device=device))
    figures = usage.summary()
    assert figures["tokens"] == 3 and figures["codes_used"] == 2 and figures["dead_codes"] == 6
    assert usage.counts is not None and usage.counts.device.type == device
    assert len(reduced) == 2


@pytest.mark.parametrize("device", DEVICES)
def test_veco_step_figures_stay_on_the_models_device(device: str) -> None:
    """VECO's accuracies are tensors on the model's device until a logging step reads them,
    as every stage's figures are: reading them in the step would wait for the device."""
    config = build_model_config("tiny", ["vocab_size=60", "num_langs=2", "dropout=0.0"])
    special = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))
    model = VecoSeq2Seq(config, special, ObjectiveConfig()).to(device)
    g = torch.Generator().manual_seed(0)
    sides = [
        SequenceBatch(
            torch.randint(7, 60, (4, 9), generator=g).to(device),
            torch.full((4,), 9, device=device),
            torch.full((4,), lang, dtype=torch.long, device=device),
        )
        for lang in (0, 1)
    ]
    out = model(*sides, torch.Generator().manual_seed(1))  # a host generator, as the loop's
    out.loss.backward()
    for name in ("is_mlm_accuracy", "cs_mlm_accuracy"):
        value = out.metrics[name]
        assert isinstance(value, torch.Tensor) and value.device.type == device, name
        assert 0 <= float(value) <= 1
