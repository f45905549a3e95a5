"""The semantic interfaces, by name: what each needs, checks, builds and keeps.

An interface is defined once, here: its :class:`Interface` says what it needs (a
cross-lingual table), what it checks in a run's options, how it is built, and what its
checkpoints and diagnostics hold (a codebook that trains, or a fixed table). Every other
module asks :func:`interface` instead of comparing a name; a new interface is its module
and one :func:`register_interface`. Nothing here imports torch at import time: parsing the
command line reads the registry, and the builders import their modules when called.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from megasemface.interfaces.cross_lingual_options import CrossLingualOptions
from megasemface.interfaces.vq.options import (
    CODEBOOK_INITS,
    RANDOM_CODES,
    TABLE_CODES,
    VQOptions,
)
from megasemface.stages import Stage, add_record

if TYPE_CHECKING:
    import numpy as np
    import torch

    from megasemface.distributed.groups import ParallelGroups
    from megasemface.interfaces.base import SemanticInterface
    from megasemface.interfaces.weights import TrainedWeights
    from megasemface.nn.config import ModelConfig
    from megasemface.nn.flop_terms import Backward

__all__ = [
    "CODEBOOK_INITS",
    "DECODER_CODES",
    "DEFAULT",
    "INTERFACES",
    "NONE",
    "RANDOM_CODES",
    "TABLE_CODES",
    "BuildOptions",
    "CrossLingualOptions",
    "Interface",
    "OptionSection",
    "VQOptions",
    "find_interface",
    "interface",
    "interface_names",
    "interface_option_sections",
    "recorded_interface",
    "recorded_weights",
    "records_codebook",
    "register_interface",
    "shard_piece_counts",
]

NONE = "none"
"""The interface of a model without one: the XLM baseline and the sequence-to-sequence
stages."""
DEFAULT = "vq"
"""The interface of a SemFace stage when ``--interface`` is not given."""
DECODER_CODES = ("extractor", "encoder", "encoder-trained")
"""What the decoder stage reads (``--decoder-codes``): the interface's own reading of the
noised copy, the encoder's output through the interface without gradient, or with it."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildOptions:
    """What building an interface may read besides the model's shape."""

    groups: ParallelGroups | None = None
    """The model-parallel group a codebook is split over (None: one process)."""
    seed: int = 0
    cl_table: torch.Tensor | str | Path | None = None
    """A [vocab_size, d_model] tensor or a safetensors file of one."""
    # CL-SemFace's table options, as the run resolved them (train.py's --cl-* options).
    cl_trainable: bool
    cl_unit_logits: bool
    cl_unit_mse: bool
    cl_table_input: bool
    vq_codebook_init: str = VQOptions.vq_codebook_init
    """How VQ-SemFace's codebook starts (``VQOptions.vq_codebook_init``); ``table`` reads
    ``cl_table`` and ``piece_counts``."""
    piece_counts: Mapping[str, np.ndarray] | None = None
    """Each language's [vocab_size] occurrences of every piece in the run's shards."""


Builder = Callable[["ModelConfig", BuildOptions], "SemanticInterface"]


def _no_check(options: Any, spec: Stage) -> None:
    del options, spec


LayerFlops = Callable[["ModelConfig", int, "Backward"], float]
"""An interface layer's model FLOPs over a number of tokens, with its kind of backward."""


class OptionSection(Protocol):
    """A component's section of train.py's options: a dataclass of fields, each with its
    default and its docstring (the flag's help), and the flags that set them."""

    @staticmethod
    def add_arguments(add: Callable[..., None]) -> None:
        """Adds the section's flags with ``add``, ``argparse``'s ``add_argument`` that
        takes each flag's help from its field's docstring."""

    def loss_weights(self) -> dict[str, float]:
        """The weights of the loss terms the interface's encoder head gives, by their names
        (``EncoderHeadOutput``'s losses)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Interface:
    """One semantic interface: an ``--interface`` value and its checkpoints'
    ``interface.kind``."""

    name: str
    build: Builder
    """Builds the interface for a model of the given shape."""
    semface: bool = True
    """A semantic interface between the stages (False: the XLM baseline's encoder alone)."""
    table: bool = False
    """Reads a cross-lingual embedding table (``--cl-table``), which stays fixed in the
    checkpoint's fingerprint; diagnostics compare an encoder output with its table row."""
    codebook: bool = False
    """A vector-quantised codebook: it trains (its fingerprint changes, averaging
    recomputes it), splits over model-parallel ranks, is read by the decoder stage from
    ``--init-from`` and by a codebook bridge; its feature extractor trains in the decoder
    stage; diagnostics compare an encoder output with its code."""
    check: Callable[[Any, Stage], None] = _no_check
    """The interface's own checks of a run's options (a ``TrainConfig``) in ``stage``."""
    weights: Callable[[], TrainedWeights] | None = None
    """How the checkpoint tools handle its own weights that train and split over
    model-parallel ranks (None: it has none; a fixed table is the model's like any other)."""
    flops: Callable[[], LayerFlops] | None = None
    """How a step's model FLOPs count its layer over the tokens (MFU; None: a lookup, not
    counted)."""
    options: type[OptionSection] | None = None
    """Its section of train.py's options: a torch-free dataclass whose fields ``TrainConfig``
    holds and whose ``add_arguments`` adds their flags (None: it has no options of its own)."""

    @property
    def target(self) -> str:
        """What the diagnostics compare an encoder output with."""
        return "its code" if self.codebook else "its table row"


INTERFACES: dict[str, Interface] = {}
"""Every interface by name, in the order ``--interface`` lists them."""


def interface_option_sections() -> tuple[type[OptionSection], ...]:
    """The interfaces' sections of train.py's options, in registration order."""
    return tuple(spec.options for spec in INTERFACES.values() if spec.options is not None)


def register_interface(spec: Interface) -> Interface:
    """Adds ``spec`` to :data:`INTERFACES`."""
    return add_record(INTERFACES, spec.name, spec, "interface")


def interface_names(where: Callable[[Interface], bool] = lambda spec: True) -> tuple[str, ...]:
    """The names of the interfaces ``where`` holds for, in registration order."""
    return tuple(name for name, spec in INTERFACES.items() if where(spec))


def find_interface(name: object) -> Interface | None:
    """The interface ``name``, None when it is none (metadata and tags may hold anything)."""
    return INTERFACES.get(name) if isinstance(name, str) else None


def recorded_interface(meta: Mapping[str, Any]) -> Interface | None:
    """The interface a checkpoint's or a model directory's metadata records
    (``interface.kind``), None when it records none that is registered."""
    return find_interface((meta.get("interface") or {}).get("kind"))


def records_codebook(meta: Mapping[str, Any]) -> bool:
    """Whether the metadata records an interface with a codebook (its checkpoints hold a
    trained, possibly split codebook and fingerprint it by its weights)."""
    spec = recorded_interface(meta)
    return spec is not None and spec.codebook


def recorded_weights(meta: Mapping[str, Any]) -> TrainedWeights | None:
    """How the interface the metadata records keeps its own trained weights, None when it
    keeps none (see :attr:`Interface.weights`)."""
    spec = recorded_interface(meta)
    return spec.weights() if spec is not None and spec.weights is not None else None


def interface(name: str) -> Interface:
    """The interface ``name``.

    Raises:
        ValueError: an unknown name, as ``--interface`` reports it.
    """
    spec = find_interface(name)
    if spec is None:
        names = interface_names()
        raise ValueError(
            f"--interface must be {', '.join(names[:-1])} or {names[-1]}, got {name!r}"
        )
    return spec


def _build_none(config: ModelConfig, options: BuildOptions) -> SemanticInterface:
    from megasemface.interfaces.base import NoInterface

    return NoInterface()


def _cl_table(config: ModelConfig, table: torch.Tensor | str | Path) -> torch.Tensor:
    """The [vocab_size, d_model] cross-lingual table given as a tensor or a file of one.

    Raises:
        ValueError, FileNotFoundError: one line, a table of another shape or no such file.
    """
    import torch

    from megasemface.interfaces.cross_lingual import load_embedding_table

    if not isinstance(table, torch.Tensor):
        return load_embedding_table(table, config.vocab_size, config.d_model)
    if tuple(table.shape) != (config.vocab_size, config.d_model):
        raise ValueError(
            f"cross-lingual table of shape {tuple(table.shape)}, the model needs "
            f"[{config.vocab_size}, {config.d_model}]"
        )
    return table


def _build_cl(config: ModelConfig, options: BuildOptions) -> SemanticInterface:
    from megasemface.interfaces.cross_lingual import CrossLingualInterface

    if options.cl_table is None:
        raise ValueError("the cl interface needs a cross-lingual embedding table (--cl-table)")
    return CrossLingualInterface(
        _cl_table(config, options.cl_table),
        trainable=options.cl_trainable,
        unit_logits=options.cl_unit_logits,
        unit_mse=options.cl_unit_mse,
        table_input=options.cl_table_input,
    )


def _build_vq(config: ModelConfig, options: BuildOptions) -> SemanticInterface:
    from megasemface.distributed.groups import ParallelGroups
    from megasemface.interfaces.vq.vector_quantized import VectorQuantizedInterface

    groups = options.groups or ParallelGroups.single()
    if options.vq_codebook_init != TABLE_CODES:
        return VectorQuantizedInterface(config, groups, options.seed)
    from megasemface.interfaces.vq.table_codes import start_codes, table_codes

    if options.cl_table is None or options.piece_counts is None:
        raise ValueError(
            "--vq-codebook-init table needs the cross-lingual table (--cl-table) and the "
            "pieces' counts in the shards"
        )
    table = _cl_table(config, options.cl_table)
    input_table = table if options.cl_table_input else None
    built = VectorQuantizedInterface(config, groups, options.seed, input_table)
    start_codes(built.quantizer, table_codes(table, options.piece_counts, config.vq.num_codes))
    return built


def shard_piece_counts(manifest: Any) -> dict[str, np.ndarray]:
    """Each monolingual language's occurrences of every piece in a shard ``Manifest``: what
    ``--vq-codebook-init table`` reads to choose the table rows it starts the codes from."""
    from megasemface.interfaces.vq.table_codes import piece_counts

    return piece_counts(manifest)


def _vq_weights() -> TrainedWeights:
    from megasemface.interfaces.vq.weights import CodebookWeights

    return CodebookWeights()


def _vq_flops() -> LayerFlops:
    from megasemface.interfaces.vq.flops import quantizer_flops

    return quantizer_flops


def _check_none(options: Any, spec: Stage) -> None:
    if spec.decoder:
        raise ValueError("--interface none (XLM) has only an encoder stage")


def _check_vq(options: Any, spec: Stage) -> None:
    if options.vq_codebook_init == TABLE_CODES:
        if options.cl_table is None:
            raise ValueError(
                "--vq-codebook-init table starts the codebook from the cross-lingual table: "
                "give --cl-table"
            )
        if not spec.encoder:
            raise ValueError(
                "--vq-codebook-init table starts the codebook the encoder trains: use it with "
                "--stage encoder or joint (the decoder stage reads --init-from's codebook)"
            )
    if spec.decoder and not spec.encoder and options.init_from is None:
        raise ValueError(
            "the VQ decoder stage needs --init-from: the encoder-stage run whose codebook "
            "it uses (frozen)"
        )


register_interface(Interface(name="cl", build=_build_cl, table=True, options=CrossLingualOptions))
register_interface(
    Interface(
        name="vq",
        build=_build_vq,
        codebook=True,
        check=_check_vq,
        weights=_vq_weights,
        flops=_vq_flops,
        options=VQOptions,
    )
)

register_interface(Interface(name=NONE, build=_build_none, semface=False, check=_check_none))


PLUGINS_ENV = "MEGASEMFACE_PLUGINS"
"""Modules (comma-separated) imported once the built-in interfaces are registered, so that an
interface defined outside the package registers itself in train.py's ranks and in every
tool that reads its checkpoints."""


def _load_plugins() -> None:
    for name in filter(None, (n.strip() for n in os.environ.get(PLUGINS_ENV, "").split(","))):
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise SystemExit(
                f"{PLUGINS_ENV}: cannot import {name!r} ({exc}); put its folder on PYTHONPATH "
                f"or leave it out of {PLUGINS_ENV}"
            ) from None
        except Exception as exc:  # a plugin's own error: one line that names it
            raise SystemExit(
                f"{PLUGINS_ENV}: importing {name!r} failed: {type(exc).__name__}: {exc}"
            ) from None


_load_plugins()
