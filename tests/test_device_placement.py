"""Tensors are made on the device of the tensors they meet: the model's, or the collective's
(NCCL reduces device tensors only), never the host by default. Each test runs on the CPU and,
in the GPU tier (``-m gpu``), on CUDA, where a tensor left on the host fails it."""

from __future__ import annotations

import pytest
import torch
from launch import on_cuda

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.vq import code_usage
from megasemface.interfaces.vq.code_usage import CodeUsage
from megasemface.models.veco import VecoSeq2Seq
from megasemface.nn.config import build_model_config
from megasemface.objectives import noising
from megasemface.objectives.objective import ObjectiveConfig
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens

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


NOISES = {
    "mask_for_mlm": lambda t, n, g: noising.mask_for_mlm(
        t, n, mask_id=4, vocab_size=60, special_ids=(0, 1, 2, 3), generator=g, prob=0.3
    ),
    "drop_and_shuffle": lambda t, n, g: noising.drop_and_shuffle(t, n, pad_id=3, generator=g),
    "infill_spans": lambda t, n, g: noising.infill_spans(t, n, mask_id=4, pad_id=3, generator=g),
    "permute_sentences": lambda t, n, g: noising.permute_sentences(
        t, n, boundary_ids=(9, 10), pad_id=3, generator=g
    ),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("noise", sorted(NOISES))
def test_a_host_generator_noises_a_device_batch_as_it_noises_a_host_one(
    device: str, noise: str
) -> None:
    """The training loop's generator is on the host and its batches on the model's device:
    each noise draws on the generator's device and returns the batch's, with the values the
    same batch gets on the host (a draw made on the batch's device with a host generator
    fails on CUDA)."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([12, 7, 1, 10])
    tokens = torch.randint(11, 60, (4, 12), generator=g)
    tokens[:, 4] = 9  # a sentence's end, for permute_sentences
    tokens[torch.arange(12)[None] >= lengths[:, None]] = 3  # pad
    on_host = NOISES[noise](tokens, lengths, torch.Generator().manual_seed(1))
    assert not torch.equal(on_host[0], tokens)  # noised
    on_device = NOISES[noise](
        tokens.to(device), lengths.to(device), torch.Generator().manual_seed(1)
    )
    for host, moved in zip(on_host, on_device, strict=True):
        assert moved.device.type == device
        assert torch.equal(moved.cpu(), host), noise
