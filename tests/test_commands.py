"""The command family: every tool is an installed ``megasemface-*`` command with examples."""

from __future__ import annotations

import configparser
import contextlib
import importlib
import io
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _entry_points() -> dict[str, str]:
    """console_scripts of setup.cfg: command -> module."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    found = {}
    for line in lines:
        name, _, target = line.partition("=")
        module, _, function = target.strip().partition(":")
        assert function == "main", line
        found[name.strip()] = module
    return found


ENTRY_POINTS = _entry_points()


def test_every_tool_and_training_is_a_command() -> None:
    modules = set(ENTRY_POINTS.values())
    for tool in sorted((ROOT / "tools").glob("*.py")):
        match = re.search(r"^from (megasemface\.cli\.\w+) import main$", tool.read_text(), re.M)
        assert match, f"{tool.name} does not run a megasemface.cli module"
        assert match.group(1) in modules, f"tools/{tool.name} has no megasemface-* command"
    assert "megasemface.train" in modules
    assert all(name.startswith("megasemface-") for name in ENTRY_POINTS)


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_help_shows_examples(name: str) -> None:
    main = importlib.import_module(ENTRY_POINTS[name]).main
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
        status = main(["--help"])
        assert status in (0, None)
    assert re.search(r"^examples?:", out.getvalue(), re.M | re.I), out.getvalue()[-500:]


def test_installed_command_runs() -> None:
    """The console script itself (installed by ``pip install -e``), as a user types it."""
    command = shutil.which("megasemface-translate", path=str(Path(sys.executable).parent))
    if command is None:
        pytest.skip("megasemface is not installed in this environment (make setup)")
    result = subprocess.run([command, "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "--model-dir" in result.stdout
