"""Resuming a run on another number of data-parallel ranks (a preempted 8-GPU job goes on
with 4).

A checkpoint holds one ZeRO optimizer partition per data-parallel rank, and DeepSpeed loads
it only into as many ranks. When the number differs, the checkpoint is first converted into
DeepSpeed's *universal* form (``ds_to_universal``: per parameter, the fp32 master weights and
Adam's two moments, reassembled from every partition), which an engine of any data-parallel
size loads (``"checkpoint": {"load_universal": true}``), the step counts and DeepSpeed's
learning-rate scheduler with it. The training state megasemface keeps itself (step, samples
seen, the stage's schedules) travels in DeepSpeed's model file, which the conversion copies,
and the loader continues the run's global batch order
(:mod:`megasemface.data.loading.loader_position`).

Model-parallel ranks write separate ZeRO groups side by side
(:mod:`megasemface.checkpoints.layout`), which DeepSpeed's converter would take for tensor
parallelism and merge. Each model-parallel rank is therefore converted on its own, shown its
files only as a checkpoint without model parallelism
(:func:`~megasemface.distributed.engine.convert_to_universal`), into
``<checkpoint>/universal/mp_rank_RR/`` by its data-parallel rank 0, once: a resume that is
interrupted again reuses it, and pruning removes it with the checkpoint. The model-parallel
size itself cannot change on resume.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path

from megasemface.checkpoints.layout import CheckpointError, find_checkpoint
from megasemface.distributed.engine import convert_to_universal

__all__ = ["ResumePoint", "check_parallel_sizes", "resume_point"]

UNIVERSAL = "universal"
"""The folder inside a checkpoint that holds its universal form, one per model-parallel rank."""


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where DeepSpeed loads a checkpoint from, for this rank."""

    step: int
    tag: str
    load_dir: Path
    """What ``load_checkpoint`` gets: ``<run>/checkpoints`` or ``<tag>/universal/mp_rank_RR``."""
    written_dp_size: int
    universal: bool
    """The number of data-parallel ranks changed: load with ``load_universal``."""


def check_parallel_sizes(checkpoint: Path, mp_size: int) -> int:
    """The number of data-parallel ranks that wrote ``checkpoint``; raises CheckpointError
    when this run's model-parallel size cannot resume it."""
    meta_path = checkpoint / "meta.json"
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        written_mp = int(meta["train_config"].get("mp_size", 1))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(
            f"{meta_path} is unreadable ({exc}); resume from another checkpoint (remove this "
            "one) or start a new run in another --output-dir"
        ) from None
    if written_mp != mp_size:
        raise CheckpointError(
            f"checkpoint {checkpoint} was written with --mp-size {written_mp}, this run has "
            f"--mp-size {mp_size}: only the number of data-parallel ranks can change on "
            f"resume; resume with --mp-size {written_mp}"
        )
    writers = len(list(checkpoint.glob("rank-*.json")))
    if writers == 0 or writers % written_mp:
        raise CheckpointError(
            f"{checkpoint} holds {writers} rank-*.json files, not a multiple of its "
            f"model-parallel size {written_mp}: the checkpoint is damaged; resume from "
            "another one (remove this one)"
        )
    return writers // written_mp


def resume_point(
    checkpoint: Path,
    *,
    mp_size: int,
    mp_rank: int,
    dp_size: int,
    dp_rank: int,
    barrier: Callable[[], None],
) -> ResumePoint:
    """Where this rank resumes ``checkpoint`` from; converts it first if the number of
    data-parallel ranks changed (a collective: every rank calls it)."""
    written = check_parallel_sizes(checkpoint, mp_size)
    step = int(checkpoint.name.removeprefix("step-"))
    if written == dp_size:
        return ResumePoint(step, checkpoint.name, checkpoint.parent, written, universal=False)
    info = find_checkpoint(checkpoint)  # every DeepSpeed file there, or a one-line error
    target = checkpoint / UNIVERSAL / f"mp_rank_{mp_rank:02d}"
    if dp_rank == 0 and not target.is_dir():
        partial = target.with_name(f".{target.name}.partial")
        shutil.rmtree(partial, ignore_errors=True)  # what an interrupted conversion left
        try:
            convert_to_universal(
                info.model_files[mp_rank],
                info.optim_files[mp_rank],
                mp_rank,
                mp_size,
                partial / info.tag,
            )
        except (AssertionError, RuntimeError, ValueError, KeyError, OSError) as exc:
            raise CheckpointError(
                f"DeepSpeed could not convert {checkpoint} (model-parallel rank {mp_rank}) "
                f"for {dp_size} data-parallel ranks: {exc!r}; resume on the {written} "
                "data-parallel ranks that wrote it"
            ) from exc
        partial.rename(target)
    barrier()
    return ResumePoint(step, info.tag, target, written, universal=True)
