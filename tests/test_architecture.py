"""The package's layering and file sizes, as docs/architecture.md draws them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megasemface"

# Lowest first: a module may import from its own layer's other parts and from lower layers.
LAYERS: list[set[str]] = [
    {"files", "host_memory", "flop_count", "command_line", "stages"},
    {"data", "distributed"},
    {"nn"},
    {"interfaces"},
    {"objectives"},
    {"models"},
    {"checkpoints", "embeddings", "export", "inference", "tracking"},
    {"evaluation"},
    {"training"},
    {"pipeline"},
    {"cli", "train", "demo"},
]
MAX_LINES = 600


def _part(module: str) -> str:
    """``megasemface.data.loading.loader`` -> ``data``; ``megasemface.train`` -> ``train``."""
    return module.split(".")[1]


def _layer(part: str) -> int:
    for index, parts in enumerate(LAYERS):
        if part in parts:
            return index
    raise AssertionError(f"megasemface/{part} belongs to no layer of docs/architecture.md")


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found.update(n for n in names if n.startswith("megasemface."))
    return found


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_imports_from_a_higher_layer() -> None:
    upward = []
    for path in _modules():
        relative = path.relative_to(PACKAGE)
        if relative.name == "__init__.py" and relative.parent == Path("."):
            continue
        own = relative.parts[0].removesuffix(".py")
        for module in _imports(path):
            if _layer(_part(module)) > _layer(own):
                upward.append(f"{relative} imports {module}")
    assert not upward, "\n".join(upward)


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in _modules()}
    parts.discard("__init__")
    assert parts == set().union(*LAYERS)


def test_no_module_is_over_the_size_limit() -> None:
    long = {
        str(p.relative_to(ROOT)): n
        for p in _modules()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, long


def test_the_layer_check_sees_an_upward_import(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text("from megasemface.training.trainer import Trainer\nimport megasemface.files\n")
    assert _imports(path) == {"megasemface.training.trainer", "megasemface.files"}
    assert _layer("training") > _layer("models")


def test_objectives_hold_losses_not_models() -> None:
    """Trainable models live in models/; objectives/ holds what their losses are made of."""
    modules = []
    for path in sorted((PACKAGE / "objectives").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                ast.unparse(base) in ("nn.Module", "torch.nn.Module", "Module")
                for base in node.bases
            ):
                modules.append(f"{path.relative_to(ROOT)}: {node.name}")
    assert not modules, modules
    assert (PACKAGE / "models" / "semface.py").exists()


# What the rest of the package may import of interfaces/: the abstraction, the registry and
# the builder. An interface's own modules (interfaces/vq/, interfaces/cross_lingual.py) stay
# behind them, so that a new interface is its folder and one registration.
INTERFACE_SURFACE = frozenset(
    f"megasemface.interfaces.{name}" for name in ("base", "factory", "registry", "weights")
)


def _interface_imports(path: Path) -> set[str]:
    """The interfaces/ modules ``path`` imports (``from megasemface.interfaces import vq``
    names the module ``megasemface.interfaces.vq``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module == "megasemface.interfaces":
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("megasemface.interfaces.")}


def test_only_interfaces_import_an_interfaces_own_modules() -> None:
    internal = {}
    for path in _modules():
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] == "interfaces":
            continue
        if names := sorted(_interface_imports(path) - INTERFACE_SURFACE):
            internal[relative.as_posix()] = names
    assert not internal, internal


def test_the_interface_check_sees_an_internal_import(tmp_path: Path) -> None:
    path = tmp_path / "bad.py"
    path.write_text(
        "from megasemface.interfaces import registry, vq\n"
        "import megasemface.interfaces.cross_lingual\n"
    )
    assert _interface_imports(path) - INTERFACE_SURFACE == {
        "megasemface.interfaces.vq",
        "megasemface.interfaces.cross_lingual",
    }
