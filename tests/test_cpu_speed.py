"""nn/cpu_speed.py: the CPU speed code applied from outside the model path.

The model path names nothing CPU-specific; the seam turns a built model's modules into the
CPU ones in place (names, parameters and hooks kept), only for a CPU; and what it swaps in
computes what torch's modules do: without dropout and with torch's products, bit for bit.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from test_stages import model_for, random_batch, tiny
from torch import nn

from megasemface.nn import cpu_gemm, cpu_speed, dropout, kernels
from megasemface.nn.layers import MultiHeadAttention, TransformerLayer

PACKAGE = Path(__file__).resolve().parents[1] / "megasemface"
MODEL_PATH = [
    PACKAGE / "nn" / "layers.py",
    PACKAGE / "objectives" / "output_loss.py",
    *sorted((PACKAGE / "interfaces" / "vq").glob("*.py")),
]
CPU_SPECIFIC = ("cpu_gemm", "cpu_passes", "cpu_speed", "host_memory", "onednn", "mkldnn")
"""Names the model path must not import or use (``megasemface.nn.dropout`` is one too)."""


@pytest.fixture(autouse=True)
def _torch_kernels() -> object:
    """Each test starts and ends with torch's own kernels installed."""
    before = kernels.install(kernels.Kernels())
    yield
    kernels.install(before)


@pytest.mark.parametrize("path", MODEL_PATH, ids=lambda p: p.name)
def test_model_path_imports_nothing_cpu_specific(path: Path) -> None:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Name):
            names = [node.id]
        elif isinstance(node, ast.Attribute):
            names = [node.attr]
        else:
            continue
        found += [
            n
            for n in names
            if any(word in n.lower() for word in CPU_SPECIFIC) or n == "megasemface.nn.dropout"
        ]
    assert not found, f"{path.name} names CPU-specific code: {found}"


def _model(**overrides: object) -> nn.Module:
    return model_for("vq", tiny(**{"attention_dropout": 0.1, **overrides})).train()


def test_applies_in_place_for_a_cpu_only() -> None:
    model = _model(dropout=0.1)
    names, params = list(model.state_dict()), list(model.parameters())
    others = [
        m
        for m in model.modules()
        if type(m) is nn.Linear
        and not any(
            m in layer.modules() for layer in model.modules() if isinstance(layer, TransformerLayer)
        )
    ]
    assert not cpu_speed.apply_cpu_speed(model, "meta")
    assert kernels.installed() == kernels.Kernels()
    assert not any(isinstance(m, dropout.Dropout | cpu_gemm.Linear) for m in model.modules())

    assert cpu_speed.apply_cpu_speed(model, "cpu")
    assert kernels.installed() is cpu_speed.CPU_KERNELS
    assert list(model.state_dict()) == names
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    assert not any(type(m) is nn.Dropout for m in model.modules())
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            assert type(module) is cpu_speed.CpuAttention
        if isinstance(module, TransformerLayer):
            linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
            assert linears and all(type(m) is cpu_gemm.Linear for m in linears)
    assert all(type(m) is nn.Linear for m in others)  # the VQ layer's and bridges' stay


def _step(model: nn.Module, steps: int = 2) -> list[torch.Tensor]:
    torch.manual_seed(1)  # dropout
    config = model.config  # type: ignore[attr-defined]
    losses = []
    for step in range(steps):
        batch = random_batch(config, seed=step, length=12)
        out = model.joint_loss(batch, torch.Generator().manual_seed(step))  # type: ignore[operator]
        out.loss.backward()
        losses.append(out.loss.detach())
    return losses + [p.grad for p in model.parameters() if p.grad is not None]


def test_without_dropout_the_seam_computes_torchs_numbers(monkeypatch: pytest.MonkeyPatch) -> None:
    """With torch's products chosen (as on a CPU that oneDNN does not speed up), the applied
    model's losses and gradients are the plain model's, bit for bit."""
    monkeypatch.setattr(cpu_gemm, "_machine_default", lambda: False)
    plain = _step(_model(attention_dropout=0.0))
    applied = _model(attention_dropout=0.0)
    cpu_speed.apply_cpu_speed(applied, "cpu")
    got = _step(applied)
    assert len(got) == len(plain)
    assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


@pytest.mark.skipif(not cpu_gemm._have_onednn(), reason="torch built without oneDNN")
def test_with_onednn_the_seam_computes_torchs_numbers_to_rounding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where oneDNN runs the products (AMD with AVX-512; forced here), the same values up to
    the products' rounding."""
    monkeypatch.setattr(cpu_gemm, "_machine_default", lambda: True)
    monkeypatch.setattr(cpu_gemm, "_MIN_MULTIPLY_ADDS", 0)  # these products are small
    plain = _step(_model(attention_dropout=0.0))
    applied = _model(attention_dropout=0.0)
    cpu_speed.apply_cpu_speed(applied, "cpu")
    for got, want in zip(_step(applied), plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
