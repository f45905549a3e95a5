"""Checkpoint averaging: the mean of the consolidated fp32 weights of one stage's checkpoints.

The mean is computed in fp32 as ``(((w_1 + w_2) + w_3) + ...) / n`` in the order given,
checkpoint by checkpoint, so only the running sum and one consolidated checkpoint are held:
about three times the model's fp32 size at the peak (the sum, and the consolidation's own
twice; measured in docs/checkpoints.md). A tensor that is bitwise the
same in every checkpoint (a parameter the stage keeps frozen, e.g. the decoder stage's
codebook) is kept as it is rather than recomputed, so that the averaged stage keeps the
interface fingerprint later stages check; sameness is decided by sha256 of the values, so
nothing beyond the sum is kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from megasemface.checkpoints.consolidate import DTYPES, load_checkpoint
from megasemface.checkpoints.layout import (
    CheckpointError,
    CheckpointInfo,
    complete_checkpoints,
    find_checkpoint,
)
from megasemface.interfaces.base import tensor_sha256
from megasemface.interfaces.factory import fingerprint_of_state
from megasemface.interfaces.registry import recorded_weights
from megasemface.nn.config import config_from_dict

__all__ = ["average_checkpoints", "last_checkpoints"]


def last_checkpoints(run_dir: str | Path, count: int) -> list[Path]:
    """The run's ``count`` newest complete checkpoints, oldest first."""
    if count < 1:
        raise CheckpointError(f"--last must be >= 1, got {count}")
    done = complete_checkpoints(Path(run_dir))
    if len(done) < count:
        raise CheckpointError(
            f"{run_dir} has {len(done)} complete checkpoint(s), {count} were asked for; a run "
            "keeps its last --keep-last checkpoints"
        )
    return done[-count:]


def _check_compatible(infos: Sequence[CheckpointInfo]) -> None:
    first = infos[0]
    for info in infos[1:]:
        for key in ("stage", "model", "languages", "vocab_sha256"):
            if first.meta.get(key) != info.meta.get(key):
                raise CheckpointError(
                    f"cannot average {first.path} and {info.path}: different {key} "
                    f"({first.meta.get(key)!r} and {info.meta.get(key)!r}); average "
                    "checkpoints of one stage and model shape"
                )
        mine, theirs = first.meta.get("interface", {}), info.meta.get("interface", {})
        # Interface weights that train (a codebook, a table the joint stage updates) change
        # their hash between the checkpoints of one run; runs apart must share theirs.
        trains = recorded_weights(first.meta) is not None
        one_run = info.path.parent == first.path.parent
        if mine.get("kind") != theirs.get("kind") or (not (trains or one_run) and mine != theirs):
            raise CheckpointError(
                f"cannot average {first.path} and {info.path}: they were trained against "
                f"different semantic interfaces ({mine} and {theirs})"
            )


def _check_same_tensors(total: dict[str, Tensor], state: dict[str, Tensor], where: Path) -> None:
    if total.keys() != state.keys():
        extra = sorted(state.keys() - total.keys())[:3]
        missing = sorted(total.keys() - state.keys())[:3]
        raise CheckpointError(
            f"cannot average {where}: its parameters differ from the first checkpoint's "
            f"(extra {extra}, missing {missing})"
        )
    for key, value in state.items():
        if value.shape != total[key].shape:
            raise CheckpointError(
                f"cannot average {where}: {key} has shape {tuple(value.shape)}, the first "
                f"checkpoint {tuple(total[key].shape)}"
            )


def average_checkpoints(
    sources: Sequence[str | Path],
) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(mean fp32 state, meta) of checkpoints of one stage; see the module docstring.

    Every source is a checkpoint or run directory (its newest checkpoint). The checkpoints
    must share stage, model config, languages, tokenizer and interface kind; checkpoints of
    different runs, an interface without trained weights of its own kind (a codebook) too.
    ``meta`` is the last checkpoint's, with the fingerprint of the averaged interface,
    ``averaged`` (count, steps) and ``source`` listing them all.
    """
    infos = [find_checkpoint(p) for p in sources]  # every file checked before any loading
    if not infos:
        raise CheckpointError("no checkpoints to average")
    paths = [info.path.resolve() for info in infos]
    if len(set(paths)) != len(paths):
        raise CheckpointError(f"a checkpoint is listed twice: {[str(p) for p in paths]}")
    _check_compatible(infos)
    total: dict[str, Tensor] = {}
    first_hash: dict[str, str] = {}
    constant: set[str] = set()
    metas = []
    for index, info in enumerate(infos):
        state, meta = load_checkpoint(info)
        metas.append(meta)
        if index == 0:
            total = state  # fp32 and ours alone: the running sum, without a copy
            first_hash = {k: tensor_sha256(v) for k, v in state.items()}
            constant = set(state)
            continue
        _check_same_tensors(total, state, info.path)
        last = index == len(infos) - 1
        for key, value in state.items():
            if key in constant and tensor_sha256(value) != first_hash[key]:
                constant.discard(key)
            if last and key in constant:
                total[key] = value.to(torch.float32, copy=True)
            else:
                total[key].add_(value.to(torch.float32))
        del state  # else it stays alive through the next consolidation
    for key, value in total.items():
        if key not in constant:
            value.div_(len(infos))
    meta = dict(metas[-1])
    weights = recorded_weights(meta)
    config, dtype = config_from_dict(meta["model"]), DTYPES[meta["param_dtype"]]
    if weights is not None:
        meta["interface"] = weights.fingerprint(total, config, dtype=dtype)
        meta.pop("interface_recorded", None)
    elif any(m.get("interface") != meta.get("interface") for m in metas):
        # An interface that trained without weights of its own kind: its fingerprint of the
        # averaged weights, as the interface computes it.
        meta["interface"] = fingerprint_of_state(meta["interface"]["kind"], config, total, dtype)
    meta["averaged"] = {
        "count": len(infos),
        "steps": [info.step for info in infos],
        "unchanged_tensors": len(constant),
    }
    meta["source"] = {"kind": "average", "checkpoints": [m["source"] for m in metas]}
    return total, meta
