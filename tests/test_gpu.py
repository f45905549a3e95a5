"""What differs on a GPU: the fused Gumbel noise, the VQ layer's half-precision products and
the output loss's chunks. Skipped without CUDA (CI has none); a GPU machine runs them with
the rest of the GPU tier (``pytest -m gpu``; tests/test_gpu_paths.py runs every command)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.vq import noise_kernel
from megasemface.interfaces.vq.gumbel_quantizer import GumbelVectorQuantizer
from megasemface.interfaces.vq.randomness import gumbel_noise
from megasemface.nn.config import VQConfig
from megasemface.objectives.output_loss import output_cross_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_noise_kernel_matches_the_cpu_and_tiles() -> None:
    """The Triton kernel hashes the same integers as the CPU's eager blocks (logarithms may
    round differently in the last bit), and any tiling gives the same values."""
    pytest.importorskip("triton")
    whole = gumbel_noise(11, 100, 300, 7, 5000, device="cuda")
    assert not noise_kernel._failed, noise_kernel._failed  # the kernel ran, not the fallback
    cpu = gumbel_noise(11, 100, 300, 7, 5000)
    torch.testing.assert_close(whole.cpu(), cpu, rtol=0, atol=2e-6)
    top = gumbel_noise(11, 100, 120, 7, 5000, device="cuda")
    right = gumbel_noise(11, 220, 180, 2007, 3000, device="cuda")
    assert torch.equal(whole[:120], top)
    assert torch.equal(whole[120:, 2000:], right)


def _flat(dtype: torch.dtype) -> GumbelVectorQuantizer:
    config = VQConfig(layout="flat", num_codes=4096, chunk_tokens=256)
    layer = GumbelVectorQuantizer(config, 256, ParallelGroups.single(), seed=3)
    return layer.cuda().to(dtype).train()


def test_flat_layer_half_products_agree_with_fp32() -> None:
    """bf16 weights multiply on tensor cores into fp32 logits: the same codes as the fp32
    products of the same (upcast) weights, to a few near-ties, and close gradients."""
    half, full = _flat(torch.bfloat16), _flat(torch.float32)
    full.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    h = torch.randn(1000, 256, device="cuda")
    outs, grads = [], []
    for layer, x in ((half, h.bfloat16()), (full, h.bfloat16().float())):
        x = x.clone().requires_grad_()
        out = layer(x, noise_key=5)
        (out.quantized.float().square().sum() + out.diversity_loss).backward()
        outs.append(out)
        grads.append(x.grad.float())
    agree = (outs[0].codes == outs[1].codes).float().mean().item()
    assert agree >= 0.99, agree
    error = (grads[0] - grads[1]).norm() / grads[1].norm()
    assert error < 0.05, error.item()


def test_output_loss_under_bf16_autocast_matches_fp32() -> None:
    torch.manual_seed(0)
    hidden = torch.randn(3000, 128, device="cuda", requires_grad=True)
    weight = torch.randn(6000, 128, device="cuda", requires_grad=True)
    targets = torch.randint(0, 6000, (3000,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = output_cross_entropy(hidden, weight, None, targets, 0.1)
    out.loss.backward()
    reference = F.cross_entropy(hidden @ weight.t(), targets, label_smoothing=0.1)
    torch.testing.assert_close(out.loss, reference, rtol=2e-2, atol=0)
    grad_w = weight.grad.clone()
    weight.grad = None
    reference.backward()
    assert (grad_w - weight.grad).norm() / weight.grad.norm() < 0.05


@pytest.mark.parametrize("logits", ["distance", "mlp"])
@pytest.mark.parametrize("from_gumbel", [False, True])
def test_fused_flat_passes_match_the_eager_ones(logits: str, from_gumbel: bool) -> None:
    """The fused kernels pick the eager passes' codes (the same products and noise) with
    the same losses and gradients to float rounding, and repeat themselves bit for bit."""
    pytest.importorskip("triton")
    runs = []
    for fused in (False, True, True):
        config = VQConfig(
            layout="flat", num_codes=4096, chunk_tokens=256, hidden_dim=128, logits=logits,
            diversity_from_gumbel=from_gumbel, fused_kernels=fused, keep_logits_mib=0,
        )  # fmt: skip
        torch.manual_seed(0)
        layer = GumbelVectorQuantizer(config, 256, ParallelGroups.single(), seed=3)
        layer = layer.cuda().to(torch.bfloat16).train()
        h = torch.randn(1000, 256, device="cuda").bfloat16().requires_grad_()
        out = layer(h, noise_key=5)
        loss = out.quantized.float().square().sum() + out.diversity_loss + out.token_entropy
        loss.backward()
        grads = [h.grad.float()] + [
            p.grad.float() for p in layer.parameters() if p.grad is not None
        ]
        runs.append((out, grads))
    (eager, eager_grads), (fused, fused_grads), (again, again_grads) = runs
    assert torch.equal(fused.codes, eager.codes)
    for name in ("diversity_loss", "token_entropy"):
        torch.testing.assert_close(getattr(fused, name), getattr(eager, name), rtol=1e-4, atol=1e-6)
    for got, want in zip(fused_grads, eager_grads, strict=True):
        assert (got - want).norm() / want.norm() < 5e-3
    assert torch.equal(again.codes, fused.codes)
    assert all(torch.equal(a, b) for a, b in zip(again_grads, fused_grads, strict=True))
