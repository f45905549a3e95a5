"""Typed model configuration, named presets and command-line or file overrides.

A preset is a function returning a fresh ModelConfig; ``build_model_config("tiny",
["d_model=128", "vq.layout=product"])`` applies dotted ``key=value`` overrides on top of it,
and ``--model-config file.json`` style files are dicts of the same keys.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "PRESETS",
    "ModelConfig",
    "VQConfig",
    "apply_overrides",
    "build_model_config",
    "config_from_dict",
    "model_option",
]


@dataclasses.dataclass(kw_only=True)
class VQConfig:
    """The vector-quantised interface (VQ-SemFace)."""

    layout: Literal["flat", "product"] = "flat"
    """flat: one table of ``num_codes`` codes of size d_model, splittable across model-parallel
    ranks; product: ``groups`` tables of ``entries`` codes of size d_model / groups, whose
    concatenations give entries ** groups combinations (wav2vec 2.0: 320 ** 2 = 102,400)."""
    num_codes: int = 102_400
    """Codes in the flat table."""
    groups: int = 2
    """Product layout: number of tables."""
    entries: int = 320
    """Product layout: codes per table."""
    logits: Literal["mlp", "distance"] = "distance"
    """How a hidden state h becomes code logits. distance (the default): ``-||h - z_k||^2 /
    sqrt(width)`` for each code z_k (wider codes: ``distance_width``), so the noise-free code
    is Eq. 4's nearest neighbour and the straight-through gradient pulls h towards the codes
    it picks (no logit weights);
    mlp: the Linear-ReLU-Linear of the paper's section 2.3 (as wav2vec 2.0), which leaves
    the encoder's output far from its codes, which the connected decoder then reads instead
    of the codes (validation chose ``distance``: docs/pretraining.md). See
    interfaces/vq/gumbel_quantizer.py."""
    distance_width: int = 128
    """distance: codes of width w up to this one divide the squared distance by sqrt(w),
    wider codes by w / sqrt(distance_width). Over sqrt(w) the logits spread alike at any width
    at initialisation, but the gap that a state's partial alignment with one code opens grows
    with sqrt(w): at d 1,024 a cosine of about 0.3 leaves the softmax one-hot and the
    diversity loss without gradient, and the codebook collapsed (2 of 4,096 codes within 15
    steps, fp32; d 64 kept 1,524; d 1,024 with this default kept 1,512; docs/pretraining.md).
    Checkpoints of codes wider than this from before the option: set it to their width to
    keep their logits."""
    hidden_dim: int = 1024
    """Width of the Linear-ReLU-Linear that turns a hidden state into code logits (mlp)."""
    temperature_start: float = 2.0
    """Gumbel-softmax temperature at step 0 (wav2vec 2.0's schedule)..."""
    temperature_end: float = 0.5
    """...decayed geometrically per step down to this floor..."""
    temperature_decay: float = 0.999995
    """...by this factor per step."""
    chunk_tokens: int = 2048
    """Logits are computed for this many tokens at a time and recomputed in backward, so the
    layer's activation memory is bounded by chunk_tokens x codes per rank."""
    keep_logits_mib: int = 256
    """Where a call's three fp32 [tokens, codes per rank] buffers (the Gumbel softmax, the
    centred logits and their exponentials) take at most this many MiB, forward keeps them for
    backward instead of backward recomputing the logits and the noise: the same results,
    faster for small batches and codebooks (the tiny and small presets' 512 codes up to
    43,690 tokens a rank; the paper's 102,400 up to 218). 0 always recomputes."""
    fused_kernels: bool = True
    """On a GPU with Triton, the flat layer's passes over each chunk's [tokens, codes] logits
    run as fused kernels (interfaces/vq/flat_fused.py); on a CPU, from 4M logits a chunk
    (the paper's codebook), compiled by torch.compile (nn/cpu_passes.py). The
    same values up to float rounding; False runs them as eager PyTorch operations."""
    diversity_loss: Literal["perplexity", "eq6", "entropy"] = "perplexity"
    """perplexity: wav2vec 2.0's ``(K - exp(H(pbar))) / K``, whose pull does not fade with K
    but fades as the codebook collapses (-exp(H)/K a nat);
    eq6: the paper's Eq. 6 as printed, ``(1/K) sum pbar log pbar``, which moves by at most
    ln(K)/K and lets the codebook collapse (kept for the ablation);
    entropy (not in the paper; the paper preset's): ``max(0, ln min(K, N) - H(pbar))`` for
    a batch of N tokens (per group for the product layout), a pull of one nat a nat
    whatever the codebook's state, towards what the batch's tokens can reach. See
    interfaces/vq/gumbel_quantizer.py."""
    copy_gradient: float = 0.0
    """Not in the paper: the gradient of the chosen code also reaches the layer's input h
    unchanged, times this gain, as in VQ-VAE's straight-through estimator, beside the
    Gumbel-softmax's. The Gumbel path alone passes it through the logits: with distance
    logits its Jacobian is about ``(2 s / tau) I`` while every token spreads over many
    codes (s the distance scale), 0.011 at d 1,024 and 102,400 codes, so the encoder
    trains on the L2 penalty and the diversity terms, whose gradients are not scaled down,
    and hardly on the MLM (docs/reproduce.md, the encoder at the paper's scale). The
    forward output is exactly the chosen code either way. 0: the Gumbel path alone."""
    diversity_from_gumbel: bool = False
    """Average Eq. 5's Gumbel probabilities for the diversity loss (the paper's text) instead
    of the noise-free softmax (wav2vec 2.0's code); see interfaces/vq/gumbel_quantizer.py."""

    def __post_init__(self) -> None:
        if self.layout not in ("flat", "product"):
            raise ValueError(f"vq.layout must be 'flat' or 'product', got {self.layout!r}")
        if self.logits not in ("mlp", "distance"):
            raise ValueError(f"vq.logits must be 'mlp' or 'distance', got {self.logits!r}")
        if self.diversity_loss not in ("perplexity", "eq6", "entropy"):
            raise ValueError(
                "vq.diversity_loss must be 'perplexity', 'eq6' or 'entropy', "
                f"got {self.diversity_loss!r}"
            )
        counts = ("num_codes", "groups", "entries", "distance_width", "hidden_dim", "chunk_tokens")
        for name in counts:
            if getattr(self, name) < 1:
                raise ValueError(f"vq.{name} must be >= 1, got {getattr(self, name)}")
        if not self.copy_gradient >= 0:
            raise ValueError(f"vq.copy_gradient must be >= 0, got {self.copy_gradient}")
        if self.keep_logits_mib < 0:
            raise ValueError(f"vq.keep_logits_mib must be >= 0, got {self.keep_logits_mib}")
        if not 0 < self.temperature_end <= self.temperature_start:
            raise ValueError("need 0 < vq.temperature_end <= vq.temperature_start")

    def code_products(self, d_model: int) -> tuple[int, int, int]:
        """(logit input width, logit rows, code width) of the layer's matrix products, for
        counting their FLOPs."""
        flat = self.layout == "flat"
        rows = self.num_codes if flat else self.groups * self.entries
        width = d_model if flat else d_model // self.groups
        return (d_model if self.logits == "distance" else self.hidden_dim), rows, width

    @property
    def combinations(self) -> int:
        """Distinct code vectors the layout can express."""
        return self.num_codes if self.layout == "flat" else self.entries**self.groups


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """Shapes of the encoder, decoder and semantic interfaces."""

    vocab_size: int = 60_000
    """SentencePiece vocabulary size (the paper: 60,000 joint BPE codes)."""
    num_langs: int = 2
    """Language embeddings; language i is the i-th language of the tokenizer."""
    d_model: int = 1024
    """Embedding and hidden size."""
    num_heads: int = 8
    ffn_dim: int = 4096
    encoder_layers: int = 6
    decoder_layers: int = 6
    extractor_layers: int = 2
    """VQ-SemFace decoder stage: the Transformer that turns token embeddings into features."""
    dropout: float = 0.1
    attention_dropout: float = 0.1
    max_len: int = 256
    """Longest sequence, special tokens included (position embeddings)."""
    pad_id: int = 3
    mask_id: int = 4
    vq: VQConfig = dataclasses.field(default_factory=VQConfig)
    bridge: Literal["none", "codebook"] = "none"
    """The translation model's path from encoder to cross-attention. none: the encoder's
    output, as the paper connects the stages; codebook: through the VQ-SemFace encoder
    stage's code distribution, ``softmax(l(h) / bridge_temperature) @ codebook``, the kind of
    memory its decoder was pre-trained on (not in the paper; see nn/bridge.py)."""
    bridge_temperature: float = 1.0
    """Softmax temperature of the codebook bridge."""
    fusion: Literal["none", "deep"] = "none"
    """deep: the decoder reads the encoder through the layer-wise coordinator of deep fusion
    (nn/fusion_coordinator.py): the encoder's layers in ``decoder_layers`` parts of
    ``fusion_part_layers`` layers, each decoder layer cross-attending to its own memory."""
    fusion_part_layers: int = 1
    """M, the encoder layers a deep-fusion part aggregates (encoder_layers = N x M)."""

    def __post_init__(self) -> None:
        if self.bridge not in ("none", "codebook"):
            raise ValueError(f"bridge must be 'none' or 'codebook', got {self.bridge!r}")
        if self.bridge_temperature <= 0:
            raise ValueError(f"bridge_temperature must be > 0, got {self.bridge_temperature}")
        if self.fusion not in ("none", "deep"):
            raise ValueError(f"fusion must be 'none' or 'deep', got {self.fusion!r}")
        if self.fusion == "deep" and (
            self.bridge != "none"
            or self.fusion_part_layers < 1
            or self.encoder_layers != self.decoder_layers * self.fusion_part_layers
        ):
            raise ValueError(
                f"deep fusion splits the encoder's {self.encoder_layers} layers into one part of "
                f"fusion_part_layers={self.fusion_part_layers} layers per decoder layer "
                f"({self.decoder_layers}), without a bridge"
            )
        for name in ("vocab_size", "num_langs", "d_model", "num_heads", "ffn_dim", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by {self.num_heads} heads")
        if not 0 <= self.dropout < 1 or not 0 <= self.attention_dropout < 1:
            raise ValueError("dropout rates must be in [0, 1)")
        if self.vq.layout == "product" and self.d_model % self.vq.groups:
            raise ValueError(
                f"d_model {self.d_model} is not divisible by vq.groups {self.vq.groups}"
            )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _paper() -> ModelConfig:
    """The paper's shapes: 6+6 layers, hidden 1024, 8 heads, 102,400 codes of size 1024.

    The 102,400 codes are wav2vec 2.0's, which the paper follows: 2 groups of 320 entries
    (``product``), not one flat table. At d 1,024 the flat table's encoder never commits to
    a code: with 102,400 codes a token's distance logits must open a gap of about ln K =
    11.5 nats before its Gumbel sample stops being noise, and the MLM stays above the
    uniform guess. The product layout needs ln 320 = 5.8 nats a group, and its MLM learns.
    Three choices beyond the paper keep it from collapsing, feed its encoder the MLM's
    gradient and let its tokens commit: the ``entropy`` diversity loss, whose pull does not
    fade as the codebook collapses (the ``perplexity`` form left 15-24 codewords);
    ``copy_gradient``, which passes the code's gradient to the encoder at full strength
    beside the Gumbel path's (about 0.02 of it); and distance logits over sqrt(512) for the
    groups' 512-wide codes (``distance_width`` 512): twice the default's scale, so a token's
    code entropy falls from about 10 nats to 5 within 100 steps and the training MLM, which
    reads Gumbel-sampled codes, learns too. docs/reproduce.md, "The encoders at the paper's
    scale", has the measurements.
    """
    return ModelConfig(
        vq=VQConfig(
            layout="product", diversity_loss="entropy", copy_gradient=1.0, distance_width=512
        )
    )


def _tiny() -> ModelConfig:
    """Trains in minutes on a 2-core CPU; for tests, CI and the demo."""
    return ModelConfig(
        vocab_size=8000,
        d_model=64,
        num_heads=4,
        ffn_dim=256,
        encoder_layers=2,
        decoder_layers=2,
        extractor_layers=1,
        dropout=0.1,
        attention_dropout=0.0,
        max_len=128,
        vq=VQConfig(
            num_codes=512,
            entries=32,
            hidden_dim=64,
            temperature_start=2.0,
            temperature_end=0.5,
            temperature_decay=0.999,
            chunk_tokens=1024,
        ),
    )


def _small() -> ModelConfig:
    """The ``study`` budget's model: tiny's vocabulary and interfaces, twice as wide and
    deep: d 128, 4 heads, FFN 512, 4+4 layers, a 2-layer VQ extractor (3.9M parameters as a
    translation model, 5.5M as a VQ-SemFace model; tiny: 1.3M and 1.9M).

    Chosen by its cost on the 2-core CPU machine, one thread per process as the pipeline's two
    processes get: it does about four times tiny's FLOPs a step in about twice tiny's time,
    because tiny's matrices are too small to keep a core busy; wider models cost more time
    than they add capacity, and would leave the three-hour study fewer steps than the demo's
    (the ratios measured: docs/results.md). The ``study`` budget
    (megasemface/pipeline/config.py) turns them into hours.
    """
    tiny = _tiny()
    return dataclasses.replace(
        tiny,
        d_model=128,
        ffn_dim=512,
        encoder_layers=4,
        decoder_layers=4,
        extractor_layers=2,
        vq=dataclasses.replace(tiny.vq, hidden_dim=128),
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {"paper": _paper, "small": _small, "tiny": _tiny}


def _coerce(value: Any, hint: Any, key: str) -> Any:
    origin = typing.get_origin(hint)
    if origin is Literal:
        if value not in typing.get_args(hint):
            raise ValueError(f"{key} must be one of {typing.get_args(hint)}, got {value!r}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("1", "true", "yes"):
            return True
        if str(value).lower() in ("0", "false", "no"):
            return False
        raise ValueError(f"{key} must be true or false, got {value!r}")
    if hint in (int, float, str):
        try:
            return hint(value)
        except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
            raise ValueError(f"{key} must be {hint.__name__}, got {value!r}") from None
    raise ValueError(f"{key} cannot be set from {value!r}")


def _unknown(key: str, part: str, known: Iterable[str], prefix: str = "") -> ValueError:
    """The error for the model option ``key`` whose part ``part`` (after ``prefix``) is none
    of ``known``, the option names there, with the closest of them."""
    close = difflib.get_close_matches(part, list(known), n=1)
    hint = f"did you mean {prefix}{close[0]}?" if close else f"known: {', '.join(sorted(known))}"
    return ValueError(f"unknown model option {key!r} ({hint})")


def _set(config: Any, dotted: str, value: Any, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    fields = {f.name: f for f in dataclasses.fields(config)}
    if head not in fields:
        raise _unknown(prefix + dotted, head, fields, prefix)
    hints = typing.get_type_hints(type(config))
    current = getattr(config, head)
    if rest:
        if not dataclasses.is_dataclass(current):
            raise ValueError(f"{prefix}{head} has no sub-options (in {prefix + dotted!r})")
        _set(current, rest, value, f"{prefix}{head}.")
    elif dataclasses.is_dataclass(current):
        if not isinstance(value, dict):
            raise ValueError(f"{prefix}{head} takes a dict of sub-options, got {value!r}")
        for key, sub in value.items():
            _set(current, key, sub, f"{prefix}{head}.")
    else:
        setattr(config, head, _coerce(value, hints[head], prefix + dotted))


def apply_overrides(config: ModelConfig, overrides: Iterable[str | tuple[str, Any]]) -> ModelConfig:
    """Returns a copy with ``key=value`` (or (key, value)) overrides applied and validated."""
    config = dataclasses.replace(config, vq=dataclasses.replace(config.vq))
    for item in overrides:
        if isinstance(item, str):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"expected key=value, got {item!r}")
            item = (key.strip(), value.strip())
        _set(config, *item)
    # Re-run validation on the result.
    config.vq.__post_init__()
    config.__post_init__()
    return config


def model_option(key: str, value: bool | int | float | str) -> str:
    """The ``key=value`` override of a typed value, as ``--model`` and
    :func:`build_model_config` take it (``model_option("vq.diversity_loss", "eq6")``).

    Raises:
        ValueError: ``key`` names no option, or ``value`` is not of its type (an int for a
            float option is one).
    """
    config: Any = ModelConfig
    *heads, name = key.split(".")
    for depth, head in enumerate(heads):
        hints = typing.get_type_hints(config)
        if not (head in hints and dataclasses.is_dataclass(hints[head])):
            nested = [field for field, hint in hints.items() if dataclasses.is_dataclass(hint)]
            raise _unknown(key, head, nested, "".join(f"{h}." for h in heads[:depth]))
        config = hints[head]
    hints = typing.get_type_hints(config)
    hint = hints.get(name)
    if hint is None or dataclasses.is_dataclass(hint):
        values = [field for field, hint in hints.items() if not dataclasses.is_dataclass(hint)]
        raise _unknown(key, name, values, "".join(f"{h}." for h in heads))
    if typing.get_origin(hint) is Literal:
        _coerce(value, hint, key)  # one of its choices
    elif not (type(value) is hint or (hint is float and type(value) is int)):
        raise ValueError(f"model option {key} takes {hint.__name__}, got {value!r}")
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}"


def config_from_dict(data: dict[str, Any], preset: str = "paper") -> ModelConfig:
    """A config from a preset and a (possibly partial, nested) dict, e.g. a saved config."""
    return apply_overrides(_preset(preset), list(data.items()))


def _preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return PRESETS[name]()


def build_model_config(
    preset: str = "tiny",
    overrides: Iterable[str] = (),
    config_file: str | Path | None = None,
) -> ModelConfig:
    """The preset, then a JSON file's options, then ``key=value`` overrides, validated."""
    config = _preset(preset)
    if config_file is not None:
        data = json.loads(Path(config_file).read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise ValueError(f"{config_file}: expected a JSON object of model options")
        config = apply_overrides(config, list(data.items()))
    return apply_overrides(config, overrides)
