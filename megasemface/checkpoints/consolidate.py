"""fp32 weights of a training checkpoint, with the model-parallel codebook gathered.

Consolidation goes through DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint``
(:func:`megasemface.distributed.engine.consolidated_state`), which reassembles the fp32 master
weights from the ZeRO partitions of every data-parallel rank. It reads DeepSpeed's files
with DeepSpeed's loader, ``torch.load(weights_only=False)``, which can run code stored in
a file; so every file is first read with ``torch.load(weights_only=True)``, and a file that
loader refuses stops the consolidation (:class:`CheckpointError` naming the file) before
DeepSpeed opens any. megasemface itself reads DeepSpeed's model file only through
``torch.load(weights_only=True)`` (:func:`~.layout.read_ds_header`).

Model parallelism. A run with ``--mp-size m`` writes m ZeRO groups side by side
(``*_mp_rank_RR_*`` files, see :mod:`megasemface.checkpoints.layout`), which DeepSpeed's
function refuses (it expects one optimizer file per data-parallel rank). Each
model-parallel rank is consolidated on its own, from a temporary directory of links to that
rank's files; the flat codebook's shards are concatenated in rank order, and every other
tensor, replicated on the model-parallel ranks, must be bitwise equal on all of them (else
the files are not from one step).

Frozen parameters. ZeRO-2 and ZeRO-3 store parameters a stage does not train beside the
trained ones; ZeRO-1 does not (DeepSpeed saves frozen fragments only when gradients are
partitioned), so DeepSpeed's consolidation of a ZeRO-1 checkpoint lacks them. They are then
taken from the module state of DeepSpeed's model file, in the training dtype, and listed in
the source's ``from_module_state``.

Interface fingerprint. meta.json holds the fingerprint model-parallel rank 0 recorded: for a
split codebook, a hash of rank 0's shard only. Loading recomputes it from the consolidated
weights (rank 0's view, in the training dtype), refuses a checkpoint whose weights do not
reproduce it, and replaces it with the fingerprint of the gathered layer, which is what a
model-parallel-size-1 run holding these weights records. Stages of runs with different
model-parallel sizes are then compared like with like.

Memory. DeepSpeed parses each model file whole (for ZeRO-1/2 it holds the module state) and
drops it, then memory-maps the optimizer files and concatenates the fp32 partitions into
new tensors: the peak is the consolidated weights plus the mapped pages of the partitions
read to build them, about twice the model's fp32 size. Its tensors come with the autograd
graph of that concatenation (the partitions were saved with ``requires_grad``), which
would keep the mapped partitions resident as long as the weights; they are detached, so
afterwards only the weights remain. With model parallelism, ranks 1..m-1 are consolidated
first and only copies of their codebook shards are kept (replicated tensors are compared
through hashes), so a rank's peak adds (m-1)/m of the split tensors. The merge tool prints
its peak RSS; what it measured is in docs/checkpoints.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor

from megasemface.checkpoints.layout import (
    CheckpointError,
    CheckpointInfo,
    find_checkpoint,
    is_model_dir,
    read_ds_header,
)
from megasemface.distributed.engine import UnsafeCheckpointError, consolidated_state
from megasemface.interfaces.base import tensor_sha256
from megasemface.interfaces.registry import recorded_weights
from megasemface.interfaces.weights import TrainedWeights
from megasemface.models.model_dir import load_model_dir, read_model_dir_info
from megasemface.nn.config import config_from_dict
from megasemface.stages import find_stage

__all__ = [
    "Codebook",
    "Consolidated",
    "codebook_state_for_rank",
    "consolidate_checkpoint",
    "load_checkpoint",
    "load_codebook",
    "load_stage",
    "param_dtype",
]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclasses.dataclass
class Consolidated:
    """A checkpoint's full fp32 state and how it was obtained."""

    state: dict[str, Tensor]
    param_dtype: torch.dtype | None
    """The dtype the run held parameters in (DeepSpeed config), None if unreadable."""
    zero_stage: int | None
    gathered: list[str]
    """Keys concatenated from the model-parallel ranks' shards."""
    from_module_state: list[str]
    """Frozen parameters ZeRO-1 does not consolidate, taken from DeepSpeed's module state."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def param_dtype(ds_config: dict[str, Any] | None) -> torch.dtype | None:
    """The dtype a DeepSpeed config holds the model's parameters in (bf16, fp16 or fp32),
    None for a config that cannot be read."""
    if not isinstance(ds_config, dict):
        return None
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)):
        if (ds_config.get(key) or {}).get("enabled"):
            return dtype
    if (ds_config.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def _deepspeed_state(info: CheckpointInfo, mp_rank: int) -> dict[str, Tensor]:
    """One model-parallel rank's fp32 state through DeepSpeed's consolidation."""
    if info.mp_size == 1:
        return _run_deepspeed(info.path.parent, info, mp_rank)
    # DeepSpeed globs every *_model_states.pt / *_optim_states.pt of a tag folder: show it
    # only this rank's files.
    with tempfile.TemporaryDirectory(prefix="megasemface-mp-rank-") as tmp:
        view = Path(tmp) / info.tag
        view.mkdir()
        for file in [*info.model_files[mp_rank], *info.optim_files[mp_rank]]:
            (view / file.name).symlink_to(file.resolve())
        return _run_deepspeed(Path(tmp), info, mp_rank)


def _run_deepspeed(root: Path, info: CheckpointInfo, mp_rank: int) -> dict[str, Tensor]:
    sink = io.StringIO()  # DeepSpeed prints progress; the tools print their own summary
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            state = consolidated_state(root, info.tag)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except (ValueError, KeyError, RuntimeError, OSError, EOFError, pickle.UnpicklingError) as exc:
        where = str(info.path) + (f" (model-parallel rank {mp_rank})" if info.mp_size > 1 else "")
        raise CheckpointError(
            f"DeepSpeed could not consolidate {where}: {exc}; the checkpoint is damaged or was "
            "not written by DeepSpeed 0.19"
        ) from exc
    # DeepSpeed's tensors come out of torch.cat over the loaded fp32 partitions, which are
    # saved with requires_grad=True: their autograd graph would keep every partition (and
    # the pages of the memory-mapped optimizer files) alive as long as the weights.
    return {key: value.detach() for key, value in state.items()}


def _rank_state(
    info: CheckpointInfo, mp_rank: int, header: dict[str, Any] | None, zero_stage: int | None
) -> tuple[dict[str, Tensor], list[str]]:
    state = _deepspeed_state(info, mp_rank)
    filled: list[str] = []
    if zero_stage is not None and zero_stage < 3 and header is not None:
        # ZeRO-1/2 model files hold the full module state (ZeRO-3 only placeholders).
        for key, value in (header.get("module") or {}).items():
            if key not in state and isinstance(value, Tensor) and value.is_floating_point():
                state[key] = value.to(torch.float32, copy=True)
                filled.append(key)
    return state, filled


def consolidate_checkpoint(info: CheckpointInfo) -> Consolidated:
    """The full fp32 state of a checked checkpoint (see the module docstring)."""
    header = read_ds_header(info, 0)
    ds_config = header.get("ds_config") if header else None
    zero_stage = None
    if isinstance(ds_config, dict):
        zero_stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    weights = recorded_weights(info.meta)
    config = config_from_dict(info.meta["model"]) if weights is not None else None
    split_keys: tuple[str, ...] = ()
    if weights is not None and config is not None and info.mp_size > 1:
        split_keys = weights.split_keys(config)
    shards: list[dict[str, Tensor]] = []
    replicated: list[dict[str, str]] = []
    filled: set[str] = set()
    for rank in range(1, info.mp_size):
        state, from_module = _rank_state(info, rank, read_ds_header(info, rank), zero_stage)
        filled.update(from_module)
        # Copies: a view would keep this rank's whole consolidated vector alive.
        shards.append({k: state.pop(k).clone() for k in split_keys if k in state})
        replicated.append({k: tensor_sha256(v) for k, v in state.items()})
        del state
    state, from_module = _rank_state(info, 0, header, zero_stage)
    filled.update(from_module)
    gathered: list[str] = []
    if info.mp_size > 1:
        mine = {k: tensor_sha256(v) for k, v in state.items() if k not in split_keys}
        for rank, theirs in enumerate(replicated, start=1):
            differ = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
            if differ:
                raise CheckpointError(
                    f"{info.path}: model-parallel ranks 0 and {rank} disagree on replicated "
                    f"parameters ({', '.join(differ[:3])}); their files are not from the same "
                    "training step"
                )
        gathered = [k for k in split_keys if k in state]
        for rank, shard in enumerate(shards, start=1):
            if sorted(shard) != sorted(gathered):
                raise CheckpointError(
                    f"{info.path}: model-parallel rank {rank} holds the split tensors "
                    f"{sorted(shard)}, rank 0 {sorted(gathered)}"
                )
        if weights is not None and config is not None:
            try:
                state.update(weights.gather([{k: state[k] for k in gathered}, *shards], config))
            except ValueError as exc:
                raise CheckpointError(f"{info.path}: {exc}") from None
    return Consolidated(state, param_dtype(ds_config), zero_stage, gathered, sorted(filled))


def _checked_fingerprint(
    state: dict[str, Tensor], info: CheckpointInfo, configured: torch.dtype | None
) -> tuple[dict[str, Any], torch.dtype]:
    """(fingerprint of the gathered interface, the training dtype that reproduces meta.json)."""
    recorded = dict(info.meta.get("interface") or {})
    fallback = configured or torch.float32
    weights = recorded_weights(info.meta)
    if weights is None:
        return recorded, fallback  # no interface, or a fixed one (a CL table, never split)
    config = config_from_dict(info.meta["model"])
    mp_size = info.mp_size if weights.split_keys(config) else 1
    if not weights.own_state(state):
        if mp_size == 1:
            return recorded, fallback
        raise CheckpointError(
            f"{info.path}: the interface's weights are not in the checkpoint, so its "
            f"{weights.noun} split over model-parallel ranks cannot be gathered"
        )
    local = weights.split(state, config, 0, mp_size)  # what model-parallel rank 0 hashed
    candidates = dict.fromkeys([fallback, torch.float32, torch.bfloat16, torch.float16])
    for dtype in candidates:
        if weights.fingerprint(local, config, dtype=dtype, mp_size=mp_size) == recorded:
            break
    else:
        raise CheckpointError(
            f"the interface weights of {info.path} do not reproduce the interface fingerprint "
            "in its meta.json: the checkpoint's files do not belong together (copied from "
            "another run or step?)"
        )
    if mp_size == 1:
        return recorded, dtype
    return weights.fingerprint(state, config, dtype=dtype), dtype


def load_checkpoint(info: CheckpointInfo) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(full fp32 state, meta) of a checked checkpoint; see :func:`load_stage`."""
    consolidated = consolidate_checkpoint(info)
    fingerprint, dtype = _checked_fingerprint(consolidated.state, info, consolidated.param_dtype)
    meta = dict(info.meta)
    if fingerprint != meta.get("interface"):
        meta["interface_recorded"] = meta.get("interface")
    meta["interface"] = fingerprint
    meta["param_dtype"] = _dtype_name(dtype)
    meta["source"] = {
        "kind": "checkpoint",
        **info.describe(),
        "zero_stage": consolidated.zero_stage,
        "gathered": consolidated.gathered,
        "from_module_state": consolidated.from_module_state,
    }
    return consolidated.state, meta


def _model_dir_meta(path: Path) -> dict[str, Any]:
    info = read_model_dir_info(path, "pretraining")
    return {
        **info.meta,
        "model": info.model.to_dict(),
        "languages": info.languages,
        "vocab_sha256": info.vocab_sha256,
        "interface": info.interface,
        "source": {
            "kind": "model_dir",
            "path": str(path.resolve()),
            "spm_model": str(info.spm_model.resolve()),
            "from": info.meta.get("source"),
        },
    }


def load_stage(path: str | Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """A pre-training stage's full fp32 state and metadata.

    ``path``: a run directory (its newest complete checkpoint), a complete checkpoint
    directory, or a ``pretraining`` model directory. ``meta`` is meta.json's (stage, model,
    languages, vocab_sha256, mlflow_run_id, parent_runs, train_config) with ``interface``
    the fingerprint of the gathered interface, ``param_dtype`` the training dtype, and
    ``source`` where the weights came from.
    """
    path = Path(path)
    if is_model_dir(path):
        meta = _model_dir_meta(path)
        state, _ = load_model_dir(path, "pretraining")
        return state, meta
    return load_checkpoint(find_checkpoint(path))


@dataclasses.dataclass
class Codebook:
    """An encoder stage's full interface weights (VQ-SemFace's layer), keyed as in the
    model's state dict."""

    state: dict[str, Tensor]
    weights: TrainedWeights
    meta: dict[str, Any]

    def for_rank(self, mp_rank: int, mp_size: int) -> dict[str, Tensor]:
        """The state model-parallel rank ``mp_rank`` of ``mp_size`` loads, keyed as the
        interface's own module loads it (``quantizer.load_state_dict`` keys)."""
        if mp_size < 1 or not 0 <= mp_rank < mp_size:
            raise ValueError(f"invalid model-parallel rank {mp_rank} of size {mp_size}")
        config = config_from_dict(self.meta["model"])
        try:
            part = self.weights.split(self.state, config, mp_rank, mp_size)
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        return self.weights.own_state(part)


def load_codebook(source: str | Path) -> Codebook:
    """The VQ layer of an encoder-stage (or joint) run, checkpoint or model directory.

    From a model directory only the layer's tensors are read. Refuses other stages and
    interfaces with a message naming what was found.
    """
    source = Path(source)
    if is_model_dir(source):
        meta = _model_dir_meta(source)
        weights = recorded_weights(meta)
        state = {}
        with safe_open(str(source / "model.safetensors"), framework="pt") as stored:
            for key in stored.keys():  # noqa: SIM118 - safe_open has no __iter__
                if weights is not None and key.startswith(weights.prefix):
                    state[key] = stored.get_tensor(key)
    else:
        state, meta = load_checkpoint(find_checkpoint(source))
        weights = recorded_weights(meta)
    kind, stage = meta.get("interface", {}).get("kind"), meta.get("stage")
    trained = find_stage(stage)
    if weights is None or trained is None or not trained.encoder:
        raise CheckpointError(
            f"{source} is not a VQ encoder-stage run (stage {stage!r}, interface {kind!r}); "
            "the VQ decoder stage needs the run whose codebook it uses"
        )
    own = {key: value for key, value in state.items() if key.startswith(weights.prefix)}
    return Codebook(own, weights, meta)


def codebook_state_for_rank(source: str | Path, mp_rank: int, mp_size: int) -> dict[str, Tensor]:
    """The quantizer state model-parallel rank ``mp_rank`` of ``mp_size`` loads from an
    encoder stage saved at any model-parallel size (``quantizer.load_state_dict`` keys)."""
    return load_codebook(source).for_rank(mp_rank, mp_size)
