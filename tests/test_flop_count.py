"""Model FLOPs counted for fused steps as for their autograd forms (megasemface/flop_count.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megasemface.distributed.groups import ParallelGroups
from megasemface.flop_count import flop_counter
from megasemface.interfaces.vq.gumbel_quantizer import GumbelVectorQuantizer
from megasemface.nn.config import VQConfig
from megasemface.objectives.output_loss import output_cross_entropy

N, V, D = 37, 50, 16


def _counted(fn) -> int:
    with flop_counter() as counter:
        fn()
    return counter.get_total_flops()


def test_fused_output_loss_counts_the_flops_of_its_autograd_form() -> None:
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(N, D, generator=gen, requires_grad=True)
    w = torch.randn(V, D, generator=gen, requires_grad=True)
    b = torch.randn(V, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (N,), generator=gen)

    def fused() -> None:  # chunks of 5 rows: the weight's gradient accumulates in place
        output_cross_entropy(h, w, b, targets, 0.1, chunk_logits=5 * V).loss.backward()

    def autograd() -> None:
        F.cross_entropy(F.linear(h, w, b), targets, label_smoothing=0.1).backward()

    # The logits, and the gradients of the states and of the weight: three products.
    assert _counted(fused) == _counted(autograd) == 3 * 2 * N * V * D


def test_flat_vq_counts_its_four_products() -> None:
    codes, tokens, width = 64, 13, 8
    config = VQConfig(num_codes=codes, chunk_tokens=5, keep_logits_mib=1)
    vq = GumbelVectorQuantizer(config, width, ParallelGroups.single(), seed=0).train()
    h = torch.randn(tokens, width, generator=torch.Generator().manual_seed(1))
    h.requires_grad_()

    def call() -> None:
        out = vq(h)
        (out.quantized.square().sum() + out.diversity_loss).backward()

    # Logits (kept for backward), the straight-through gradient of the code probabilities,
    # and the logits' gradients of the states and of the table, chunk by chunk.
    assert _counted(call) == 4 * 2 * tokens * width * codes


def test_cpu_attention_counts_as_its_matrix_products() -> None:
    q, k, v = (torch.randn(2, 4, 9, 8, requires_grad=True) for _ in range(3))
    forward = _counted(lambda: F.scaled_dot_product_attention(q, k, v))
    explicit = _counted(lambda: torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, -1) @ v)
    assert forward == explicit == 2 * (2 * 2 * 4 * 9 * 9 * 8)
    both = _counted(lambda: F.scaled_dot_product_attention(q, k, v).sum().backward())
    # Backward: the scores again, then the gradients of the probabilities, values, queries
    # and keys (torch's count for its GPU kernels).
    assert both == forward + 5 * forward // 2
