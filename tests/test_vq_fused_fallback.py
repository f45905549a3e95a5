"""The VQ layer's fused kernels where they cannot build: one warning, then the eager passes,
with the eager results. (The kernels themselves are compared with the eager passes on a GPU,
``tests/test_gpu.py``.)"""

from __future__ import annotations

import warnings

import pytest
import torch

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.vq import flat_fused as vq_flat_fused
from megasemface.interfaces.vq.gumbel_quantizer import GumbelVectorQuantizer
from megasemface.nn.config import VQConfig


def _step(fused: bool) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    config = VQConfig(num_codes=96, chunk_tokens=16, fused_kernels=fused)
    layer = GumbelVectorQuantizer(config, 24, ParallelGroups.single(), seed=5).train()
    h = torch.randn(40, 24, generator=torch.Generator().manual_seed(2)).requires_grad_()
    out = layer(h, noise_key=7)
    (out.quantized.square().sum() + out.diversity_loss + out.token_entropy).backward()
    assert h.grad is not None
    grads = [h.grad] + [p.grad for p in layer.parameters() if p.grad is not None]
    return out.codes, out.quantized, grads


def test_kernels_that_do_not_build_fall_back_to_the_eager_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_kernel(*_args: object) -> None:
        raise RuntimeError("no kernel for this device\nsecond line")

    monkeypatch.setattr(vq_flat_fused, "_failed", [])
    monkeypatch.setattr(vq_flat_fused, "_built", set())
    monkeypatch.setattr(vq_flat_fused, "row_stats", no_kernel)
    # As on a GPU: the kernels are tried until they fail once.
    monkeypatch.setattr(vq_flat_fused, "available", lambda _device: not vq_flat_fused._failed)
    with pytest.warns(UserWarning, match=r"fused kernels did not build \(RuntimeError: no kernel"):
        codes, quantized, grads = _step(fused=True)
    assert vq_flat_fused._failed == ["RuntimeError: no kernel for this device"]
    eager_codes, eager_quantized, eager_grads = _step(fused=False)
    assert torch.equal(codes, eager_codes)
    assert torch.equal(quantized, eager_quantized)
    assert all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        _step(fused=True)  # the eager passes serve from then on, without a second word
    assert not [w for w in later if "fused kernels" in str(w.message)]


def test_an_error_after_the_kernels_ran_is_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vq_flat_fused, "_failed", [])
    monkeypatch.setattr(vq_flat_fused, "_built", {"forward"})

    def broken() -> None:
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        vq_flat_fused.first_build("forward", broken)
    assert not vq_flat_fused._failed
