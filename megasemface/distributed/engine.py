"""The one module that drives DeepSpeed: distributed start-up, the engine, checkpoints.

Model code never imports DeepSpeed; the trainer talks to this facade.

DeepSpeed reads checkpoint files with ``torch.load(weights_only=False)``, which runs whatever
code a file's pickle names. Every path into its loaders here (:meth:`DeepSpeedEngine.load`,
:func:`consolidated_state`) first reads each ``*.pt`` file of the checkpoint with torch's
safe loader (:func:`check_safe_to_load`) and stops at a file it refuses.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import dataclasses
import io
import json
import os
import sys
import tempfile
import threading
import warnings
import zipfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from megasemface.distributed import collectives, zero_grad_checks
from megasemface.distributed.groups import DeepSpeedMpu, ParallelGroups, build_parallel_groups

__all__ = [
    "DeepSpeedEngine",
    "UnsafeCheckpointError",
    "accelerator_device",
    "check_safe_to_load",
    "consolidated_state",
    "convert_to_universal",
    "end_process",
    "exit_now",
    "init_distributed",
    "load_ds_config",
    "loading_universal",
    "on_device",
    "unsafe_checkpoint_file",
]

_T = TypeVar("_T")


def init_distributed(mp_size: int) -> ParallelGroups:
    """Starts torch.distributed through DeepSpeed (gloo on CPU) and builds the groups."""
    import deepspeed

    backend = None if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:  # plain `python train.py`: a one-process world
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if backend == "gloo":
        _without_shm_all_reduce()
    deepspeed.init_distributed(dist_backend=backend)
    return build_parallel_groups(mp_size)


SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's shared-memory all-reduce for its CPU accelerator (a C++ extension)."""


def _without_shm_all_reduce() -> None:
    """Tells DeepSpeed that its CPU shared-memory all-reduce is not available here.

    DeepSpeed builds that extension when its communication backend starts on the CPU
    accelerator, but only its inference all-reduce (tensor-parallel inference) calls it:
    training's collectives go through torch.distributed, gloo on CPU. Building it delays
    the first launch in every new environment (the first training run of ``make demo``,
    the first launched test of a fresh clone) by longer than a short run, needs a C++
    compiler on the host, and the extension leaves a buffer per rank in /dev/shm that
    nothing removes. An op that is not available is what DeepSpeed does off Linux.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False


def exit_now(code: int) -> NoReturn:
    """Ends this rank at once with status ``code``: output flushed, and no interpreter
    teardown.

    For an error that stops every rank of a launched run. The launcher reports the first
    non-zero status it sees, and the teardown of a rank whose peers had already exited has
    been seen to abort it (SIGABRT, "terminate called without an active exception" from the
    communication backend's threads): the run would then end with that signal's status
    instead of the error's.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def end_process(code: int) -> NoReturn:
    """Ends a rank whose run is over with status ``code``, without the interpreter's
    teardown.

    Freeing torch's, DeepSpeed's and MLflow's modules object by object takes seconds per rank
    after the run has done everything it had to, about as long as the run's start-up, and a
    pipeline pays it at every launch. What a normal exit does before
    that still happens here, in its order: threading's own exit hooks run and non-daemon
    threads are joined, then the exit handlers run (the tracker's, the logging module's).
    """
    # What the interpreter calls first at exit. Joining the threads without it would wait
    # forever on the idle workers of a ThreadPoolExecutor (inductor's compile pool under
    # --compile): they leave when one of threading's exit hooks tells them to.
    threading._shutdown()  # type: ignore[attr-defined]
    atexit._run_exitfuncs()  # what the interpreter calls next, before the teardown
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def accelerator_device() -> torch.device:
    """The device DeepSpeed's accelerator runs the model on (``DS_ACCELERATOR``; by default
    CUDA where torch sees a GPU), before an engine moves the model there."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().device_name())


def load_ds_config(path: str | Path, *, accumulation: int | None = None) -> dict[str, Any]:
    """Reads a DeepSpeed config and fixes what megasemface owns.

    Batches are token budgets from megasemface's loader, so one "micro batch" is one loader
    batch; ``train_batch_size`` is derived by DeepSpeed from the micro batch, the
    accumulation steps and the data-parallel size.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config not found: {path}")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(
            f"{path} holds a JSON {type(config).__name__}, not the object of a DeepSpeed config "
            "(see ds_configs/)"
        )
    if config.get("train_micro_batch_size_per_gpu", 1) != 1:
        raise ValueError(
            f"{path}: train_micro_batch_size_per_gpu must be 1 (one token-budget batch of the "
            "loader); set the batch size with --max-tokens"
        )
    config["train_micro_batch_size_per_gpu"] = 1
    config.pop("train_batch_size", None)
    if accumulation is not None:
        config["gradient_accumulation_steps"] = accumulation
    if config.get("fp16", {}).get("enabled") and not torch.cuda.is_available():
        raise ValueError(f"{path} enables fp16, which DeepSpeed refuses on CPU; use bf16 or fp32")
    if "gradient_clipping" not in config:
        raise ValueError(
            f"{path}: set gradient_clipping explicitly (defaults changed over releases)"
        )
    scheduler = config.get("scheduler") or {}
    warmup = scheduler.get("params", {}).get("warmup_type", "log")
    if str(scheduler.get("type", "")).startswith("Warmup") and warmup != "linear":
        raise ValueError(f'{path}: set scheduler.params.warmup_type to "linear" (default: log)')
    _torch_fused_adam(config)
    return config


def _torch_fused_adam(config: dict[str, Any]) -> None:
    """Runs the config's Adam as torch's fused Adam, which DeepSpeed takes for ``torch_adam``.

    On CPU, DeepSpeed's own Adam (``FusedAdam``, built from ``cpu_adam``) keeps beta1**t and
    beta2**t as running float32 products in process memory, and a restarted process
    recomputes them as ``pow(beta, t)``: 0.98**3 is 0.9411921 by products and 0.94119203 by
    pow, so every update after a resume would differ from the uninterrupted run's in its last
    bits. torch's Adam derives the bias correction from the step count each step, so a
    resumed run repeats the uninterrupted one bitwise. Its fused kernel makes one pass over
    parameters, gradients and moments, where the per-operation default makes one per
    operation over each tensor (on CPU about 3x the time: docs/results.md); on a GPU it is one
    multi-tensor kernel like DeepSpeed's, without the nvcc build of DeepSpeed's ``fused_adam``
    extension that a run would otherwise start with on a fresh machine. A config that names
    ``torch_adam`` or ``fused`` itself keeps its choice. ZeRO-Offload's CPU Adam has the same
    exact-resume property and is left as configured (docs/pretraining.md, exact resume).
    """
    optimizer = config.get("optimizer") or {}
    offload = (config.get("zero_optimization") or {}).get("offload_optimizer")
    if str(optimizer.get("type", "")).lower() in ("adam", "adamw") and not offload:
        params = optimizer.setdefault("params", {})
        if params.setdefault("torch_adam", True):
            params.setdefault("fused", True)


class DeepSpeedEngine:
    """Wraps ``deepspeed.initialize`` and the calls the trainer needs."""

    def __init__(
        self,
        model: nn.Module,
        config: dict[str, Any],
        groups: ParallelGroups,
        parameters: list[nn.Parameter],
    ) -> None:
        import deepspeed

        self.groups = groups
        self.zero_stage = int(config.get("zero_optimization", {}).get("stage", 0))
        if self.zero_stage == 3:
            external = getattr(model, "external_parameters", lambda: [])()
            for param in external:
                deepspeed.zero.register_external_parameter(model, param)
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model,
            model_parameters=[p for p in parameters if p.requires_grad],
            config=config,
            mpu=DeepSpeedMpu(groups),
        )
        # ZeRO-1/2's per-tensor gradient checks as multi-tensor operations (same values).
        zero_grad_checks.install(self.optimizer)

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    def forward(self, *args: Any) -> Any:
        """The model's forward on ``args``, whose tensors (also inside dataclasses such as a
        batch) are moved to the engine's device: the loader reads batches into host memory."""
        device = self.device
        return self.engine(*(on_device(arg, device) for arg in args))

    def run(self, task: Callable[..., _T], *args: Any) -> _T:
        """``task(*args)``, a method of the wrapped model, run through the engine as the
        model's call (a model with several entry points, such as ``TranslationModel``, has
        a ``forward`` that runs the method it is given): ZeRO-3 gathers the weights around
        it, and the tensors of ``args`` move to the engine's device as :meth:`forward`'s."""
        return self.forward(task, *args)

    @contextlib.contextmanager
    def gathered(self, params: Iterable[nn.Parameter]) -> Iterator[None]:
        """Full values of ZeRO-3 partitioned parameters inside the block (a collective)."""
        if self.zero_stage != 3:
            yield
            return
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(params), modifier_rank=None):
            yield

    @property
    def module(self) -> nn.Module:
        return self.engine.module

    @property
    def global_steps(self) -> int:
        return int(self.engine.global_steps)

    @property
    def skipped_steps(self) -> int:
        """Steps DeepSpeed itself skipped (fp16/bf16 overflow), which it may not log."""
        return int(self.engine.skipped_steps)

    @property
    def skips_non_finite_gradients(self) -> bool:
        """Whether the optimizer's step itself skips a step whose gradients hold an inf or NaN
        on any rank (its overflow check, reduced over the ranks): ZeRO-3 always, ZeRO-1/2
        where it checks the gradient norm (``zero_grad_checks.norm_checked``)."""
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        if isinstance(self.optimizer, DeepSpeedZeroOptimizer_Stage3):
            return True
        if isinstance(self.optimizer, DeepSpeedZeroOptimizer):
            return zero_grad_checks.norm_checked(self.optimizer) or bool(
                self.optimizer.check_grad_overflow
            )
        return False

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def eval(self) -> None:
        self.engine.eval()

    def backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()

    def is_boundary(self) -> bool:
        return bool(self.engine.is_gradient_accumulation_boundary())

    def grad_norm(self) -> float | None:
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else float(norm)

    def train(self) -> None:
        self.engine.train()

    def save(self, directory: Path, tag: str, client_state: dict[str, Any]) -> None:
        """Every rank must call this (ZeRO state is sharded)."""
        self.engine.save_checkpoint(
            str(directory), tag=tag, client_state=client_state, save_latest=False
        )

    def load(self, directory: Path, tag: str) -> dict[str, Any]:
        """Restores checkpoint ``tag`` on every rank (a collective).

        Each rank first reads every file of the checkpoint with the safe loader; if any rank
        finds one it refuses, every rank raises :class:`UnsafeCheckpointError` before
        DeepSpeed's loader opens a file, and only rank 0 reports it.
        """
        problem = unsafe_checkpoint_file(Path(directory) / tag)
        collectives.raise_if_any_rank(problem, UnsafeCheckpointError)
        path, client_state = self.engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise FileNotFoundError(f"no DeepSpeed checkpoint {tag} under {directory}")
        return client_state or {}


def on_device(value: Any, device: torch.device) -> Any:
    """``value`` with its tensors on ``device``: a tensor, or a dataclass of tensors (each
    field in turn); anything else as it is (a generator keeps its own device). A dataclass
    whose tensors are all there already is returned itself, not a copy: a decoding cache is
    updated in place by the step it is passed to."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)  # the tensor itself when already there
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = [f.name for f in dataclasses.fields(value) if f.init]
        moved = {name: on_device(getattr(value, name), device) for name in fields}
        if all(moved[name] is getattr(value, name) for name in fields):
            return value
        return dataclasses.replace(value, **moved)
    return value


def consolidated_state(root: Path, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights of a (ZeRO-sharded) checkpoint, through DeepSpeed's own consolidation.

    Raises :class:`UnsafeCheckpointError` for a file the safe loader refuses.
    """
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    check_safe_to_load(Path(root) / tag)
    return get_fp32_state_dict_from_zero_checkpoint(str(root), tag=tag)


class UnsafeCheckpointError(collectives.RankSharedError):
    """A checkpoint file torch's safe loader refuses: DeepSpeed's loader could run code in it."""


def _deepspeed_checkpoint_types() -> list[type]:
    """The classes DeepSpeed's own checkpoint files hold that torch's safe loader does not
    accept by default, and that it may rebuild when checking them.

    DeepSpeed 0.19's ZeRO optimizer-state files (ZeRO-1/2/3, fp32 and bf16, checked file by
    file) pickle the loss scaler object (``LossScaler``), the ZeRO stage as the enum
    ``ZeroStageEnum`` and, for ZeRO-1/2, each parameter's place in the flat partition as a
    ``fragment_address``; fp16's dynamic loss scaling (GPU only) stores a
    ``DynamicLossScaler`` instead of the ``LossScaler``. Its model-state files need none.
    Each is a plain record whose constructor only stores its arguments: the safe loader
    rebuilds it by setting attributes, calling that constructor or, for the enum, looking up
    a member, so allowing them runs nothing a file chooses. Anything else a file names is
    refused.
    """
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _refusal(exc: Exception) -> str:
    """The safe loader's reason in one short phrase (its message spans many lines)."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:
        text = text.split("WeightsUnpickler error:", 1)[1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return (lines[0].split(". Please", 1)[0] if lines else type(exc).__name__)[:200]


def unsafe_checkpoint_file(folder: Path) -> str | None:
    """Why a ``*.pt`` file under ``folder`` must not reach DeepSpeed's loader, or None.

    Each file is read with ``torch.load(weights_only=True)``, memory-mapped when it is in
    torch's zip format (tensor data is then only mapped, not read): no code named in a file
    runs, and a file that names any type but tensors, containers, numbers, strings and the
    DeepSpeed records above is refused. Symbolic links are named by their target.
    """
    allowed = _deepspeed_checkpoint_types()
    for path in sorted(Path(folder).rglob("*.pt")):
        try:
            with torch.serialization.safe_globals(allowed), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. about a pickle protocol it still reads
                torch.load(
                    path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
                )
        except Exception as exc:  # the safe unpickler's refusals have no single type
            shown = path.resolve() if path.is_symlink() else path
            return (
                f"{shown} is refused by torch's safe loader ({_refusal(exc)}): it is damaged "
                "or holds more than tensors and DeepSpeed's records, and DeepSpeed's loader "
                "could run code stored in it, so it is not loaded; use another checkpoint "
                f"(delete {shown.parent} to resume from the one before it) or restore the "
                "file from a trusted copy"
            )
    return None


def check_safe_to_load(folder: Path) -> None:
    """Raises :class:`UnsafeCheckpointError` for a file :func:`unsafe_checkpoint_file` refuses."""
    problem = unsafe_checkpoint_file(folder)
    if problem is not None:
        raise UnsafeCheckpointError(problem)


def convert_to_universal(
    model_files: list[Path], optim_files: list[Path], mp_rank: int, mp_size: int, target: Path
) -> None:
    """DeepSpeed's universal checkpoint (``ds_to_universal``) of one model-parallel rank's
    files of a checkpoint, in the folder ``target`` (``.../<tag>``): per parameter, the fp32
    master weights and Adam's moments reassembled from every data-parallel rank's ZeRO
    partition, which any number of ranks can load (see :func:`loading_universal`).

    DeepSpeed's converter would take model-parallel ranks for tensor parallelism and merge
    their tensors, so it is shown this rank's files only, as a checkpoint without model
    parallelism: renamed as rank 0, and with ``mp_size > 1`` the model files rewritten to say
    so (read with ``torch.load(weights_only=True)``). DeepSpeed itself reads its files with
    ``weights_only=False``, as its own resume does, so every file is first read with the safe
    loader (:func:`check_safe_to_load`). Serial: no worker processes.
    """
    from deepspeed.checkpoint import ds_to_universal
    from deepspeed.checkpoint.constants import CHECKPOINT_PARALLEL_DIMS, CHECKPOINT_TP_DEGREE

    for folder in {file.parent for file in (*model_files, *optim_files)}:
        check_safe_to_load(folder)

    own = f"mp_rank_{mp_rank:02d}_"
    with tempfile.TemporaryDirectory(prefix="megasemface-universal-") as tmp:
        view = Path(tmp) / target.name
        view.mkdir()
        for file in optim_files:
            (view / file.name.replace(own, "mp_rank_00_")).symlink_to(file.resolve())
        for file in model_files:
            name = view / file.name.replace(own, "mp_rank_00_")
            if mp_size == 1:
                name.symlink_to(file.resolve())
                continue
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            state["mp_world_size"] = 1
            dims = state.get(CHECKPOINT_PARALLEL_DIMS)
            if isinstance(dims, dict):
                state[CHECKPOINT_PARALLEL_DIMS] = {**dims, CHECKPOINT_TP_DEGREE: 1}
            torch.save(state, name)
            del state
        args = argparse.Namespace(
            input_folder=str(view),
            output_folder=str(target),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,  # megasemface's models declare no tensors to merge
        )
        sink = io.StringIO()  # progress lines and bars
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            ds_to_universal.main(args)


def loading_universal(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of a DeepSpeed config whose engine loads universal checkpoints."""
    checkpoint = {**(config.get("checkpoint") or {}), "load_universal": True}
    return {**config, "checkpoint": checkpoint}
