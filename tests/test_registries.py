"""The interface and stage registries: no module outside them compares a name, and a new
interface is one registration."""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from toy_interface import SPEC

from megasemface.interfaces.factory import build_interface
from megasemface.interfaces.registry import INTERFACES, Interface, interface_names
from megasemface.models.semface import SemFaceModel
from megasemface.nn.config import build_model_config
from megasemface.objectives.objective import ObjectiveConfig
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.pipeline.settings import setting_names
from megasemface.stages import FINETUNE_MODES, STAGES, finetune_mode_names, stage_names
from megasemface.training import model_flops
from megasemface.training.options import TrainConfig, add_train_arguments, train_config_from_args
from megasemface.training.units import TrainUnit, unit_class

PACKAGE = Path(__file__).resolve().parents[1] / "megasemface"
REGISTRIES = {PACKAGE / "stages.py", PACKAGE / "interfaces", PACKAGE / "pipeline" / "settings.py"}
"""Where the names are defined, and only there compared."""
NAMED = ("stage", "interface", "kind", "finetune_mode", "setting")
"""What the compared expression is called when it holds a stage's, interface's,
fine-tuning mode's or comparison setting's name."""


def _literals(node: ast.expr) -> set[str]:
    """The string constants of a constant or of a tuple, list or set of them."""
    items = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
    return {i.value for i in items if isinstance(i, ast.Constant) and isinstance(i.value, str)}


def name_comparisons(source: str) -> list[str]:
    """Comparisons of a stage's, interface's or fine-tuning mode's name with a string
    literal, and literal tuples of stage or interface names, in ``source``."""
    names = set(stage_names()) | set(interface_names()) | set(finetune_mode_names())
    names |= set(setting_names())
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            literal = [s for s in sides if _literals(s) & names]
            named = [s for s in sides if any(n in ast.unparse(s).lower() for n in NAMED)]
            if literal and any(s not in literal for s in named):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Tuple, ast.List, ast.Set)) and len(node.elts) > 1:
            values = _literals(node)
            stages, interfaces = set(stage_names()), set(interface_names())
            if len(values) == len(node.elts) and (values <= stages or values <= interfaces):
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _outside_registries() -> list[Path]:
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(path == r or r in path.parents for r in REGISTRIES)
    ]


def test_no_module_outside_the_registries_compares_a_stage_or_interface_name() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)} {hit}"
        for path in _outside_registries()
        for hit in name_comparisons(path.read_text(encoding="utf-8"))
    ]
    assert not found, "ask megasemface/stages.py or interfaces/registry.py:\n" + "\n".join(found)


def test_the_name_check_sees_a_comparison() -> None:
    assert name_comparisons('if config.interface == "vq":\n    pass\n')
    assert name_comparisons('ok = meta.get("stage") in ("encoder", "joint")\n')
    assert name_comparisons('INTERFACES = ("cl", "vq")\n')
    assert not name_comparisons('if stack == "encoder":\n    pass\n')
    assert not name_comparisons('if config.bridge != "none":\n    pass\n')
    assert name_comparisons('if self.finetune_mode == "unsupervised":\n    pass\n')


def test_every_stage_and_fine_tuning_mode_names_a_train_unit() -> None:
    paths = [spec.unit for spec in STAGES.values() if spec.unit is not None]
    paths += [mode.unit for mode in FINETUNE_MODES.values()]
    units = {unit_class(path) for path in paths}
    assert all(issubclass(unit, TrainUnit) for unit in units)
    assert len(units) == 7  # the SemFace stages share one
    assert all(spec.finetunes for spec in STAGES.values() if spec.unit is None)
    with pytest.raises(ValueError, match="names no train unit"):
        unit_class("megasemface.training.units.base:model_config_from")


SPECIAL = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))
PATHS: dict[str, Any] = {"data": Path(), "spm_model": Path(), "output_dir": Path()}


@pytest.fixture
def tokens_interface(monkeypatch: pytest.MonkeyPatch) -> Interface:
    monkeypatch.setitem(INTERFACES, SPEC.name, SPEC)
    return SPEC


def test_a_registered_interface_is_an_option_with_the_stages_rules(
    tokens_interface: Interface,
) -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    argv = ["--stage", "joint", "--interface", "tokens", "--data", "d", "--spm-model", "s"]
    config = train_config_from_args(parser.parse_args([*argv, "--output-dir", "o"]))
    assert (config.interface, config.decoder_codes, config.cl_trainable) == (
        "tokens",
        "extractor",
        False,
    )
    TrainConfig(stage="joint", interface="tokens", decoder_codes="encoder", **PATHS)
    with pytest.raises(ValueError, match="--extractor-diversity trains the VQ decoder"):
        TrainConfig(stage="joint", interface="tokens", extractor_diversity=True, **PATHS)
    with pytest.raises(ValueError, match="--cl-unit-logits"):
        TrainConfig(stage="encoder", interface="tokens", cl_unit_logits=True, **PATHS)
    assert TrainConfig(stage="mbart", interface="tokens", **PATHS).interface == "none"
    assert (
        model_flops.semface_step(
            build_model_config("tiny"),
            interface="tokens",
            stage="joint",
            decoder_codes="extractor",
            batch=2,
            length=5,
            tokens=8,
        )
        > 0
    )


def test_a_registered_interface_trains_in_the_joint_stage(tokens_interface: Interface) -> None:
    config = build_model_config("tiny", ["vocab_size=60", "dropout=0.0"])
    torch.manual_seed(0)
    model = SemFaceModel(config, build_interface("tokens", config), SPECIAL, ObjectiveConfig())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(7, config.vocab_size, (4, 8), generator=g)
    batch = SequenceBatch(tokens, torch.full((4,), 8), torch.tensor([0, 1, 0, 1]))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for step in range(8):
        output = model(batch, torch.Generator().manual_seed(step % 2))
        optimizer.zero_grad()
        output.loss.backward()
        optimizer.step()
        losses.append(float(output.loss.detach()))
    assert model.interface.table.weight.grad is not None  # the decoder's loss reaches it
    assert losses[-1] < losses[0]


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (None, "cannot import 'missing_plugin' (No module named 'missing_plugin')"),
        ("x = (\n", "importing 'missing_plugin' failed: SyntaxError"),
    ],
)
def test_a_plugin_that_cannot_be_imported_is_one_line(
    tmp_path: Path, source: str | None, message: str
) -> None:
    if source is not None:
        (tmp_path / "missing_plugin.py").write_text(source)
    env = {**os.environ, "MEGASEMFACE_PLUGINS": "missing_plugin", "PYTHONPATH": str(tmp_path)}
    code = "import megasemface.interfaces.registry"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert message in result.stderr and "Traceback" not in result.stderr
