"""Finding and checking checkpoints: run directories, checkpoint directories, model directories.

A source given to the checkpoint tools is one of:

- a run directory (``<run>/checkpoints/step-NNNNNNNN/``): its newest complete checkpoint;
- a checkpoint directory ``step-NNNNNNNN/``, which must be complete (``COMPLETE`` marker);
- a megasemface model directory (``config.json`` with ``"format": "megasemface-model"``).

What a checkpoint directory holds (DeepSpeed 0.19, model-parallel size m, data-parallel
size d; ZeRO-1/2 name the model file ``mp_rank_RR_model_states.pt``, ZeRO-3 writes one per
data-parallel rank, ``zero_pp_rank_D_mp_rank_RR_model_states.pt``)::

    mp_rank_RR_model_states.pt                  per mp rank RR: module state, shapes, config
    [bf16_]zero_pp_rank_D_mp_rank_RR_optim_states.pt   per (dp rank D, mp rank RR): the
                                                fp32 master partition and optimizer state
    meta.json  rank-XXXXX.json  COMPLETE        megasemface's own files

Model-parallel ranks thus write separate ZeRO groups side by side, and DeepSpeed's
consolidation (``zero_to_fp32``) refuses such a directory: it expects one optimizer file per
data-parallel rank and finds d x m. :mod:`megasemface.checkpoints.consolidate` therefore
consolidates each model-parallel rank on its own.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import torch

from megasemface.models.model_dir import FORMAT

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "complete_checkpoints",
    "find_checkpoint",
    "is_model_dir",
    "read_ds_header",
]

TAG_PATTERN = re.compile(r"^step-(\d{8})$")
"""A checkpoint directory's name; the group is the step."""
_DS_FILE = re.compile(r"(?:^|_)mp_rank_(\d+)_(model|optim)_states\.pt$")
MARKER = "COMPLETE"
"""Written by rank 0 once every rank has finished writing a checkpoint."""


def checkpoint_tag(step: int) -> str:
    """The directory name of the checkpoint of ``step``."""
    return f"step-{step:08d}"


class CheckpointError(ValueError):
    """A checkpoint or model directory is missing, incomplete or does not fit the request."""


@dataclasses.dataclass
class CheckpointInfo:
    """A complete megasemface checkpoint directory, checked file by file."""

    path: Path
    """``.../checkpoints/step-NNNNNNNN``."""
    step: int
    meta: dict[str, Any]
    """meta.json: stage, interface fingerprint, model config, languages, vocab_sha256, ..."""
    mp_size: int
    dp_size: int
    model_files: dict[int, list[Path]]
    """DeepSpeed model-state files per model-parallel rank."""
    optim_files: dict[int, list[Path]]
    """DeepSpeed optimizer-state files (ZeRO partitions) per model-parallel rank."""

    @property
    def tag(self) -> str:
        return self.path.name

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent

    def describe(self) -> dict[str, Any]:
        """JSON-ready identity, for provenance."""
        return {
            "checkpoint": str(self.path.resolve()),
            "run": str(self.run_dir.resolve()),
            "step": self.step,
            "stage": self.meta.get("stage"),
            "mlflow_run_id": self.meta.get("mlflow_run_id"),
            "mp_size": self.mp_size,
            "dp_size": self.dp_size,
        }


def is_model_dir(path: Path) -> bool:
    """Whether ``path`` is a megasemface model directory (not a run's config.json)."""
    config = path / "config.json"
    if not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("format") == FORMAT
    except (ValueError, AttributeError):  # not JSON, not UTF-8, not an object
        return False


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """The run's complete checkpoint directories, oldest first."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        raise CheckpointError(
            f"{run_dir} is not a training run directory (no checkpoints/ folder); pass the "
            "--output-dir of a train.py run, a checkpoint directory or a model directory"
        )
    return [path for _, path in _complete_by_step(root)]


def newest_complete_step(run_dir: Path) -> int:
    """The step of the run's newest complete checkpoint; 0 when it has none yet."""
    root = run_dir / "checkpoints"
    done = _complete_by_step(root) if root.is_dir() else []
    return done[-1][0] if done else 0


def _complete_by_step(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoint directories under ``root`` with their steps, oldest first."""
    found = []
    for path in root.iterdir():
        match = TAG_PATTERN.match(path.name)
        if match and path.is_dir() and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def find_checkpoint(path: str | Path) -> CheckpointInfo:
    """The checkpoint a run or checkpoint directory names, with every file checked."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if (path / "checkpoints").is_dir():
        done = complete_checkpoints(path)
        if not done:
            raise CheckpointError(
                f"{path} has no complete checkpoint (none with a {MARKER} marker); let the run "
                "save one (--save-interval) or resume it"
            )
        path = done[-1]
    match = TAG_PATTERN.match(path.name)
    if not match or not path.is_dir():
        raise CheckpointError(
            f"{path} is neither a run directory (with checkpoints/), a checkpoint directory "
            "(checkpoints/step-NNNNNNNN) nor a megasemface model directory"
        )
    if not (path / MARKER).is_file():
        raise CheckpointError(
            f"checkpoint {path} is incomplete (no {MARKER} marker: the run stopped while "
            "writing it); use an earlier checkpoint, or the run directory for the newest "
            "complete one"
        )
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise CheckpointError(f"{meta_path} is missing: {path} was not written by megasemface")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{meta_path} is not valid JSON: {exc}") from None
    model_files, optim_files = _deepspeed_files(path)
    mp_size = int(meta.get("train_config", {}).get("mp_size", 1))
    world = len(list(path.glob("rank-*.json")))
    if world % mp_size:
        raise CheckpointError(
            f"{path} holds {world} rank-*.json files, not a multiple of the model-parallel "
            f"size {mp_size} in meta.json; the checkpoint is damaged"
        )
    dp_size = world // mp_size
    info = CheckpointInfo(
        path, int(match.group(1)), meta, mp_size, dp_size, model_files, optim_files
    )
    _check_deepspeed_files(info)
    return info


def _deepspeed_files(path: Path) -> tuple[dict[int, list[Path]], dict[int, list[Path]]]:
    model: dict[int, list[Path]] = {}
    optim: dict[int, list[Path]] = {}
    for file in sorted(path.iterdir()):
        match = _DS_FILE.search(file.name)
        if match:
            target = model if match.group(2) == "model" else optim
            target.setdefault(int(match.group(1)), []).append(file)
    return model, optim


def _check_deepspeed_files(info: CheckpointInfo) -> None:
    """Every model-parallel rank has its model file and one ZeRO partition per dp rank."""
    extra = sorted((set(info.model_files) | set(info.optim_files)) - set(range(info.mp_size)))
    if extra:
        raise CheckpointError(
            f"{info.path} holds DeepSpeed files of model-parallel rank(s) {extra}, but meta.json "
            f"says the run had --mp-size {info.mp_size}"
        )
    for rank in range(info.mp_size):
        if not info.model_files.get(rank):
            raise CheckpointError(
                f"{info.path} lacks mp_rank_{rank:02d}_model_states.pt (model-parallel rank "
                f"{rank}): the checkpoint is damaged; use another checkpoint"
            )
        optim = info.optim_files.get(rank, [])
        if not optim:
            raise CheckpointError(
                f"{info.path} has no *_mp_rank_{rank:02d}_optim_states.pt: the run did not use "
                "ZeRO (stage 1-3), whose fp32 partitions the tools consolidate, or the files "
                "were deleted"
            )
        if len(optim) != info.dp_size:
            names = {f.name for f in optim}
            prefix = "bf16_" if optim[0].name.startswith("bf16_") else ""
            missing = [
                f"{prefix}zero_pp_rank_{d}_mp_rank_{rank:02d}_optim_states.pt"
                for d in range(info.dp_size)
                if f"{prefix}zero_pp_rank_{d}_mp_rank_{rank:02d}_optim_states.pt" not in names
            ]
            raise CheckpointError(
                f"{info.path} holds {len(optim)} ZeRO optimizer partition(s) of model-parallel "
                f"rank {rank}, the run had {info.dp_size} data-parallel ranks (missing: "
                f"{', '.join(missing) or 'unknown'}); the checkpoint is damaged, use another one"
            )


def read_ds_header(info: CheckpointInfo, mp_rank: int) -> dict[str, Any] | None:
    """The DeepSpeed model-state file of ``mp_rank`` (data-parallel rank 0), or None.

    Read with ``torch.load(weights_only=True)`` and memory-mapped: no pickled code runs and
    tensors are only paged in when used. Holds ``ds_config``, ``mp_world_size`` and, for
    ZeRO-1/2, the full ``module`` state in the training dtype. None when the file holds a
    type the safe loader refuses (then callers do without it).
    """
    path = info.model_files[mp_rank][0]
    try:
        header = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # the safe unpickler's refusals have no single type
        return None
    return header if isinstance(header, dict) else None
