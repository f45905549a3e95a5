"""Search runs where the model is, whatever device the batch was built on: validation and
back-translation build their batches on the host, and the search must not take its device
from them (fine-tuning's first validation on CUDA once failed that way)."""

from __future__ import annotations

import pytest
import torch
from launch import on_cuda
from torch import nn

from megasemface.inference.search import SearchConfig, scorer_device, search
from megasemface.nn.config import build_model_config
from megasemface.nn.transformer import Seq2SeqModel

DEVICES = ["cpu", on_cuda("cuda")]


class _Adapter:
    """A scorer that says where it runs, as the trainer's adapter around its engine does."""

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)


def test_the_device_is_the_scorers_not_the_batchs() -> None:
    host = torch.device("cpu")
    assert scorer_device(_Adapter("meta"), host) == torch.device("meta")
    with torch.device("meta"):
        on_meta = nn.Linear(2, 2)
    assert scorer_device(on_meta, host) == torch.device("meta")  # its parameters'
    assert scorer_device(object(), host) == host  # says nothing: the batch's


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("beam", [1, 3])
def test_host_batches_are_searched_on_the_models_device(device: str, beam: int) -> None:
    """The hypotheses of a batch left on the host equal those of the same batch on the
    model's device, greedy and beam."""
    config = build_model_config("tiny", ["vocab_size=60", "num_langs=2"])
    torch.manual_seed(0)
    model = Seq2SeqModel(config).to(device).eval()
    g = torch.Generator().manual_seed(1)
    src = torch.randint(7, 60, (5, 9), generator=g)
    src[:, -1] = 2  # </s>
    mask, langs = torch.ones_like(src, dtype=torch.bool), torch.zeros(5, dtype=torch.long)
    options = {
        "tgt_tags": 6, "tgt_langs": 1, "max_positions": config.max_len,
        "config": SearchConfig(beam=beam, max_len_b=6),
    }  # fmt: skip
    on_host = search(model, src, mask, langs, **options)
    moved = search(model, src.to(device), mask.to(device), langs.to(device), **options)
    assert [h.tokens for h in on_host] == [h.tokens for h in moved]
    assert all(len(h.tokens) > 0 for h in on_host)
