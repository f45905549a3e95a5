"""Every command in the documentation is one the project accepts.

The shell commands of the ```bash blocks of README.md and docs/*.md are checked without
running them: for ``python tools/X.py``, ``python -m megasemface...``, the ``megasemface-*``
commands of setup.cfg and ``deepspeed ... megasemface/train.py`` the script exists and its
own argument parser (and the option validation behind it) accepts the documented arguments;
``make`` targets and variables exist in the Makefile; ``mlflow`` and ``pip`` commands parse
with their own command lines (and ``pip`` installs megasemface); every ``ds_configs/*.json``
named exists. Programs this test cannot check are listed in UNCHECKED. Inline code that
starts a command (``python tools/...``, ``make ...``) must name an existing script or target,
relative links must resolve, and the parameter counts and memory figures of docs/memory.md
must follow from the model classes.
"""

from __future__ import annotations

import configparser
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

UNCHECKED = {
    "ssh": "a port tunnel to the MLflow UI: nothing of this project to check",
}
"""Programs documented in bash blocks whose arguments this test cannot check, and why."""

_FENCE = re.compile(r"^```bash\n(.*?)^```", re.M | re.S)
_ANY_FENCE = re.compile(r"^```.*?^```", re.M | re.S)
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
_OPERATORS = {"&&", "||", "|", ";"}
_PLACEHOLDER = re.compile(r"<[\w .-]+>|\.\.\.")
_DS_CONFIG = re.compile(r"ds_configs/[\w.-]+\.json")
_PYTHON = ("python", "python3")


@dataclasses.dataclass(frozen=True)
class Command:
    where: str
    """file:line of the command's first line."""
    argv: tuple[str, ...]
    env: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {shlex.join(self.argv)}"


def _relative(path: Path) -> str:
    return str(path.relative_to(ROOT))


def bash_commands(text: str, name: str) -> Iterator[Command]:
    """The commands of the ```bash blocks of Markdown ``text``: continuation lines joined,
    comments dropped, split at ``&&``, ``||``, ``|`` and ``;``, leading ``NAME=value`` set
    aside."""
    for block in _FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        lines = block.group(1).splitlines()
        index = 0
        while index < len(lines):
            start, line = index, lines[index]
            while line.endswith("\\") and index + 1 < len(lines):
                index += 1
                line = line[:-1] + " " + lines[index]
            index += 1
            tokens = shlex.split(line, comments=True)
            parts: list[list[str]] = [[]]
            for token in tokens:
                if token in _OPERATORS:
                    parts.append([])
                else:
                    parts[-1].append(token)
            for part in parts:
                env = []
                while part and _ENV.match(part[0]):
                    env.append(part.pop(0))
                if part:
                    yield Command(f"{name}:{first + start}", tuple(part), tuple(env))


COMMANDS = [
    command
    for path in DOC_FILES
    for command in bash_commands(path.read_text(encoding="utf-8"), _relative(path))
]


# Checks ---------------------------------------------------------------------------------------


def _require(ok: object, command: Command, message: str) -> None:
    if not ok:
        pytest.fail(f"{command}\n{message}")


def _parse(parser, argv: list[str], command: Command):  # type: ignore[no-untyped-def]
    """``parser.parse_args(argv)``; a rejection fails the test with argparse's message."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            return parser.parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0 and ("-h" in argv or "--help" in argv):
            return None
        pytest.fail(f"{command}\nrejected by its parser: {stderr.getvalue().strip()}")


def _check_pipeline(module_name: str, argv: list[str], command: Command) -> None:
    """make demo / tools/reproduce.py: their own main() up to the point where it would run,
    then the pipeline configuration's validation (systems, settings, pair, budgets)."""
    from megasemface.cli.reproduce import config_from_args

    module = importlib.import_module(module_name)
    seen: list[object] = []
    stderr = io.StringIO()
    with (
        mock.patch.object(module, "run", lambda args: seen.append(args) or 0),
        contextlib.redirect_stderr(stderr),
        contextlib.redirect_stdout(io.StringIO()),
    ):
        try:
            assert module.main(argv) == 0
        except SystemExit as exc:
            if exc.code == 0 and ("-h" in argv or "--help" in argv):
                return
            pytest.fail(f"{command}\nrejected by its parser: {stderr.getvalue().strip()}")
    try:
        config_from_args(seen[0])  # type: ignore[arg-type]
    except ValueError as exc:
        pytest.fail(f"{command}\nrejected: {exc}")


def _check_sbatch(argv: list[str], command: Command) -> None:
    """``sbatch [OPTIONS] examples/slurm/SCRIPT TRAIN-OPTIONS``: the script exists and
    train.py accepts the options with the script's DeepSpeed config (or ``DS_CONFIG=``)."""
    scripts = [i for i, arg in enumerate(argv) if arg.endswith(".sbatch")]
    _require(scripts, command, "sbatch runs a script of examples/slurm/")
    script = ROOT / argv[scripts[0]]
    _require(script.is_file(), command, f"{argv[scripts[0]]} does not exist")
    default = re.search(r"DS_CONFIG:-([^}]+)\}", script.read_text(encoding="utf-8"))
    _require(default, command, f"{argv[scripts[0]]} names no default DS_CONFIG")
    given = [e.split("=", 1)[1] for e in command.env if e.startswith("DS_CONFIG=")]
    config = given[0] if given else default[1]  # type: ignore[index]
    _check_train(["--deepspeed_config", config, *argv[scripts[0] + 1 :]], command)


def _check_train(argv: list[str], command: Command) -> None:
    """megasemface/train.py's parser, then the training options' validation."""
    from megasemface.train import build_parser
    from megasemface.training.options import train_config_from_args

    args = _parse(build_parser(), argv, command)
    if args is None:
        return
    try:
        train_config_from_args(args)
    except ValueError as exc:
        pytest.fail(f"{command}\nrejected: {exc}")
    _require(args.deepspeed_config, command, "--deepspeed_config is required")
    json.loads((ROOT / args.deepspeed_config).read_text(encoding="utf-8"))


def _cli_module(script: Path) -> str:
    """The megasemface.cli module a tools/ script runs."""
    match = re.search(r"^from (megasemface\.cli\.\w+) import main$", script.read_text(), re.M)
    assert match, f"{_relative(script)} does not run a megasemface.cli module"
    return match.group(1)


def _check_module(module_name: str, argv: list[str], command: Command) -> None:
    if module_name in ("megasemface.demo", "megasemface.cli.reproduce"):
        _check_pipeline(module_name, argv, command)
    elif module_name == "megasemface.train":
        _check_train(argv, command)
    elif module_name.startswith("megasemface.cli."):
        _parse(importlib.import_module(module_name).build_parser(), argv, command)
    else:
        pytest.fail(f"{command}\nno parser known for module {module_name}")


def _check_python(argv: list[str], command: Command) -> None:
    if argv[:1] == ["-m"]:
        _check_module(argv[1], argv[2:], command)
        return
    script = ROOT / argv[0]
    _require(script.is_file(), command, f"{argv[0]} does not exist")
    if argv[0] == "megasemface/train.py":
        _check_train(argv[1:], command)
    elif argv[0].startswith("tools/"):
        _check_module(_cli_module(script), argv[1:], command)
    else:
        pytest.fail(f"{command}\nno parser known for {argv[0]}")


def _console_scripts() -> dict[str, str]:
    """The ``megasemface-*`` commands setup.cfg installs: name -> module."""
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg", encoding="utf-8")
    entries = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return {
        name.strip(): target.strip().partition(":")[0]
        for name, _, target in (line.partition("=") for line in entries)
    }


def _check_console_script(program: str, argv: list[str], command: Command) -> None:
    scripts = _console_scripts()
    _require(program in scripts, command, f"setup.cfg installs no command {program}")
    _check_module(scripts[program], argv, command)


def _check_deepspeed(argv: list[str], command: Command) -> None:
    from deepspeed.launcher.runner import parse_args

    launcher = _parse(mock.Mock(parse_args=parse_args), argv, command)
    if launcher is None:  # --help
        return
    _require(launcher.user_script == "megasemface/train.py", command, "another script")
    _check_train(list(launcher.user_args), command)


def _makefile() -> tuple[set[str], set[str]]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w.-]+):(?!=)", text, re.M))
    variables = set(re.findall(r"^([A-Z_]+)\s*[?:]?=", text, re.M))
    return targets, variables


def _check_make(argv: list[str], command: Command) -> None:
    targets, variables = _makefile()
    for arg in argv:
        name, sep, value = arg.partition("=")
        if sep:
            _require(name in variables, command, f"the Makefile has no variable {name}")
            if name == "DEMO_ARGS":
                _check_pipeline("megasemface.demo", shlex.split(value), command)
        else:
            _require(arg in targets, command, f"the Makefile has no target {arg}")


def _check_mlflow(argv: list[str], command: Command) -> None:
    import click
    from mlflow.cli import cli

    try:
        name, sub, rest = cli.resolve_command(click.Context(cli), argv)
        assert sub is not None and name is not None
        sub.make_context(name, rest)
    except click.ClickException as exc:
        pytest.fail(f"{command}\nrejected by mlflow: {exc.format_message()}")


_PIP_PARSE = """
import contextlib, io, json, sys
from pip._internal.commands import commands_dict, create_command
argv = json.loads(sys.argv[1])
if not argv or argv[0] not in commands_dict:
    print(json.dumps({"error": f"pip has no command {argv[:1]}"}))
    sys.exit()
stderr = io.StringIO()
try:
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        options, args = create_command(argv[0]).parse_args(argv[1:])
except SystemExit:
    print(json.dumps({"error": "rejected by pip: " + stderr.getvalue().strip()}))
    sys.exit()
print(json.dumps({"args": [*args, *getattr(options, "editables", [])]}))
"""


def _check_pip(argv: list[str], command: Command) -> None:
    """pip's own parser for the subcommand and its options; an install names megasemface (or
    the checkout, ``.``). In a child process: importing pip installs setuptools' distutils
    shim, which breaks torch.compile in any later test of the same process."""
    child = subprocess.run(
        [sys.executable, "-c", _PIP_PARSE, json.dumps(argv)],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(child.stdout.strip().splitlines()[-1])
    if "error" in result:
        pytest.fail(f"{command}\n{result['error']}")
    if argv[0] in ("install", "download", "wheel"):
        names = {re.split(r"[\[<>=!~ ]", arg, maxsplit=1)[0] for arg in result["args"]}
        _require(names & {"megasemface", "."}, command, "a pip command here installs megasemface")


def check(command: Command) -> None:
    program, argv = command.argv[0], list(command.argv[1:])
    for token in command.argv:
        for config in _DS_CONFIG.findall(token):
            _require((ROOT / config).is_file(), command, f"{config} does not exist")
    if program in UNCHECKED:
        return
    placeholders = [t for t in argv if _PLACEHOLDER.search(t) and program != "make"]
    _require(not placeholders, command, f"placeholders {placeholders}: give example values")
    if program in _PYTHON:
        _check_python(argv, command)
    elif program == "deepspeed":
        _check_deepspeed(argv, command)
    elif program == "make":
        _check_make(argv, command)
    elif program == "sbatch":
        _check_sbatch(argv, command)
    elif program == "mlflow":
        _check_mlflow(argv, command)
    elif program == "pip":
        _check_pip(argv, command)
    elif program.startswith("megasemface-"):
        _check_console_script(program, argv, command)
    else:
        pytest.fail(f"{command}\nunknown program: make it checkable here or list it in UNCHECKED")


# Tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", COMMANDS, ids=[c.where for c in COMMANDS])
def test_documented_command_is_accepted(command: Command) -> None:
    check(command)


def test_the_documentation_covers_every_command() -> None:
    used = {c.argv[0] for c in COMMANDS}
    assert set(UNCHECKED) <= used, "UNCHECKED lists programs no bash block uses"
    scripts = {c.argv[1] for c in COMMANDS if c.argv[0] in _PYTHON and len(c.argv) > 1}
    scripts |= {a for c in COMMANDS if c.argv[0] == "deepspeed" for a in c.argv if a[-3:] == ".py"}
    tools = {f"tools/{p.name}" for p in (ROOT / "tools").glob("*.py")}
    assert tools - scripts == set(), "tools without a documented command"
    assert "megasemface/train.py" in scripts
    made = {a for c in COMMANDS if c.argv[0] == "make" for a in c.argv[1:] if "=" not in a}
    assert {"demo", "test", "bench"} <= made
    stages = {c.argv[c.argv.index("--stage") + 1] for c in COMMANDS if "--stage" in c.argv}
    assert stages == {"encoder", "decoder", "joint", "mbart", "mrasp", "veco", "finetune"}


def test_the_checks_refuse_what_they_should() -> None:
    def refused(line: str) -> None:
        (command,) = bash_commands(f"```bash\n{line}\n```\n", "example.md")
        with pytest.raises(pytest.fail.Exception):
            check(command)

    refused("python tools/translate.py --model-dir m --src-lang en --tgt-lang de --beams 5")
    refused("python tools/no_such_tool.py --help")
    refused("python tools/reproduce.py --systems vq,nonsense")
    refused("python tools/reproduce.py --seeds 0,x")
    refused(
        "deepspeed --num_gpus 8 megasemface/train.py --deepspeed_config ds_configs/zero2_bf16.json"
        " --stage decoder --interface vq --data d --spm-model s --output-dir o"
    )
    refused("python tools/evaluate.py --hypotheses <hyp> --references ref")
    refused("make no-such-target")
    refused("megasemface-no-such-command --help")
    refused("megasemface-export huggingface --model-dir m --out o")
    refused("mlflow ui --no-such-option")
    refused("pip install --no-such-option megasemface")
    refused("pip install --no-index --find-links wheelhouse torch")
    refused("rsync -a runs/ elsewhere/")
    refused("make demo NO_SUCH_VARIABLE=1")
    refused('make demo DEMO_ARGS="--pair de-en"')
    refused("python tools/build_shards.py --spm-model m --out o --config ds_configs/none.json")
    refused("sbatch examples/slurm/no_such.sbatch --stage encoder")
    refused(
        "sbatch examples/slurm/pretrain.sbatch --stage encoder --interface vq --data d"
        " --spm-model s --output-dir o --no-such-option"
    )


# Inline commands and links -----------------------------------------------------------------


def _prose(path: Path) -> str:
    """The file without its fenced blocks, code spans joined onto one line."""
    return _ANY_FENCE.sub("", path.read_text(encoding="utf-8"))


def test_inline_commands_name_existing_scripts_and_targets() -> None:
    targets, _ = _makefile()
    for path in DOC_FILES:
        for span in re.findall(r"`([^`]+)`", _prose(path)):
            words = span.split()
            if len(words) > 1 and words[0] in _PYTHON and words[1].endswith(".py"):
                assert (ROOT / words[1]).is_file(), f"{_relative(path)}: `{span}`"
            if len(words) > 2 and words[0] in _PYTHON and words[1] == "-m":
                assert importlib.util.find_spec(words[2]), f"{_relative(path)}: `{span}`"
            if len(words) > 1 and words[0] == "make" and "=" not in words[1]:
                assert words[1] in targets, f"{_relative(path)}: `{span}`"


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = re.findall(r"^#+ (.+)$", _prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_resolve() -> None:
    for path in DOC_FILES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{_relative(path)}: link to {target}"
            if anchor and linked.suffix == ".md":
                assert anchor in _anchors(linked), f"{_relative(path)}: no heading for {target}"


_TABLE_RULE = re.compile(r"^\|(?: *:?-+:? *\|)+ *$")


def _cells(row: str) -> int:
    """The cells of a Markdown table row: pipes in code spans and escaped ones are text."""
    row = re.sub(r"`[^`]*`", "code", row.strip()).replace("\\|", "pipe")
    return len(row.strip("|").split("|"))


def test_every_table_row_has_its_header_s_cells() -> None:
    for path in DOC_FILES:
        lines = _prose(path).splitlines()
        for index, line in enumerate(lines[1:], 1):
            if not _TABLE_RULE.match(line):
                continue
            header = _cells(lines[index - 1])
            row = index
            while row < len(lines) and lines[row].startswith("|"):
                where = f"{_relative(path)}: the table under {lines[index - 1][:60]!r}"
                assert _cells(lines[row]) == header, f"{where}: {lines[row][:80]!r}"
                row += 1


# docs/memory.md's figures --------------------------------------------------------------------

GIB = 1 << 30


def _memory_row(name: str, total: int, trained: int) -> str:
    """A row of the model-state table: bytes per rank by ZeRO stage, as the page derives."""
    frozen = total - trained
    sizes = f"{total / 1e6:.1f}M" + (f" ({trained / 1e6:.1f}M)" if frozen else "")
    cells = [name, sizes, f"{(16 * trained + 2 * frozen) / GIB:.2f}"]
    for ranks in (8, 64):
        zero1 = 2 * total + 2 * trained + 12 * trained / ranks
        zero2 = 2 * total + 14 * trained / ranks
        zero3 = (2 * total + 14 * trained) / ranks
        cells.append(" / ".join(f"{b / GIB:.2f}" for b in (zero1, zero2, zero3)))
    return "| " + " | ".join(cells) + " |"


def test_memory_figures_follow_from_the_model() -> None:
    from megasemface.interfaces.vq.gumbel_quantizer import SPLIT_PARAMETERS

    text = (ROOT / "docs" / "memory.md").read_text(encoding="utf-8")
    (code,) = [c for c in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S) if "meta" in c]
    namespace: dict[str, object] = {}
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "docs/memory.md", "exec"), namespace)
    counts = [line.rsplit(": ", 1)[1] for line in printed.getvalue().splitlines()]
    assert len(counts) == 8
    for value in counts:
        assert f"| {value} |" in text, f"docs/memory.md does not show {value}"

    def size(params) -> int:  # type: ignore[no-untyped-def]
        return sum(p.numel() for p in params)

    vq, product, cl, seq2seq = (namespace[k] for k in ("vq", "vq_product", "cl", "seq2seq"))
    total = size(vq.parameters())  # type: ignore[attr-defined]
    quantizer = vq.interface.quantizer  # type: ignore[attr-defined]
    split = sum(
        size([getattr(quantizer, name)])
        for name in SPLIT_PARAMETERS
        if getattr(quantizer, name) is not None
    )
    cl_trained = size(p for p in cl.parameters() if p.requires_grad)  # type: ignore[attr-defined]
    rows = {
        "VQ joint, flat codebook": (total, total),
        "VQ joint, flat, `--mp-size 2`": (total - split // 2, total - split // 2),
        "VQ joint, product codebook": (size(product.parameters()),) * 2,  # type: ignore[attr-defined]
        "VQ encoder stage, flat": (total, size(vq.encoder_stage_parameters())),  # type: ignore[attr-defined]
        "VQ decoder stage, flat": (total, size(vq.decoder_stage_parameters())),  # type: ignore[attr-defined]
        "CL joint": (size(cl.parameters()), cl_trained),  # type: ignore[attr-defined]
        "fine-tuning": (size(seq2seq.parameters()),) * 2,  # type: ignore[attr-defined]
    }
    for name, (all_params, trained) in rows.items():
        row = _memory_row(name, all_params, trained)
        assert row in text, f"docs/memory.md: expected the row\n{row}"
    assert f"({split:,} parameters, split over" in text
    buffer = quantizer.config.chunk_tokens * quantizer.config.num_codes * 4
    assert buffer == 800 * (1 << 20) and "800 MiB at\nthe defaults" in text
