"""The systems a pipeline compares (the rows of the paper's tables) and the settings they are
fine-tuned in.

A *system* is one row: how the translation model is initialised before fine-tuning (which
pre-training run, with which options, connected how). A *setting* is how it is fine-tuned:
supervised on a low-resource slice of parallel data, or unsupervised (denoising and
back-translation on monolingual data).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from megasemface.checkpoints.connect import PARTS
from megasemface.interfaces.registry import NONE, TABLE_CODES, interface
from megasemface.nn.config import model_option
from megasemface.pipeline.settings import SETTINGS
from megasemface.stages import stage
from megasemface.training.options import TrainConfig, typed_overrides

__all__ = [
    "ABLATIONS",
    "FINETUNE_FIELDS",
    "PAPER_SCALE",
    "RELATED",
    "RUN_FIELDS",
    "SYSTEMS",
    "System",
]


RUN_FIELDS = frozenset(
    {
        "stage",
        "interface",
        "data",
        "spm_model",
        "output_dir",
        "cl_table",
        "model_options",
        "steps",
        "seed",
        "experiment",
        "run_name",
        "tracking_uri",
        "tags",
        "ras_dictionary",
    }
)
"""TrainConfig fields the pipeline sets for every run from its own configuration, so not a
system's ``options`` (a system has its own ``stage``, ``interface`` and ``model``; the
pipeline gives its RAS dictionary to the runs that substitute)."""

_RAS_FILE = [Path("en-de.tsv")]
"""A dictionary in the configs that check a system's options (no file is read there)."""
_TABLE_FILE = Path("table.safetensors")
"""A cross-lingual table in the configs that check a system's options."""


@dataclasses.dataclass(frozen=True)
class System:
    """One pre-training recipe and how its stages are connected.

    Raises:
        ValueError: naming the system, for options its pre-training run cannot take.
    """

    key: str
    display: str
    """The name in tables and plots (the paper's row label)."""
    stage: str | None
    """train.py --stage of the pre-training run; None: no pre-training."""
    interface: str = NONE
    options: Mapping[str, object] = dataclasses.field(default_factory=dict, hash=False)
    """TrainConfig fields of the pre-training run by name (ablations), e.g.
    ``{"diversity_weight": 0.0}``; they replace the pipeline's values (docs/options.md lists
    the fields)."""
    model: Mapping[str, bool | int | float | str] = dataclasses.field(
        default_factory=dict, hash=False
    )
    """Model options of the pre-training run, dotted as ``--model`` names them, e.g.
    ``{"vq.diversity_loss": "eq6"}``; after the pipeline's own."""
    connect: str = "semface"
    """semface (encoder and decoder of the run), xlm (encoder into both), fusion (the run's
    encoder through deep fusion's layer-wise coordinator into a random decoder, fine-tuned
    with ``--finetune-mode fusion``), mbart, mrasp or veco (the run's sequence-to-sequence
    model as it is)."""
    bridge: str = "none"
    """semface: how the encoder reaches the cross-attention (``ModelConfig.bridge``)."""
    pretraining: str | None = None
    """The system whose pre-training run this one connects, when it differs only in how it
    is connected (that run is trained once and shared); None: its own."""
    finetune: Mapping[str, object] = dataclasses.field(default_factory=dict, hash=False)
    """TrainConfig fields of its fine-tuning runs by name, e.g. ``{"finetune_ras": True}``."""
    part: str = "whole"
    """What of the connected model fine-tuning starts from (``checkpoints.keep_part``):
    whole, or the encoder or the decoder alone with the other half drawn at random."""

    def __post_init__(self) -> None:
        try:
            options = self._checked_options()
            finetune = self._checked_finetune()
            self._check_part()
        except ValueError as exc:
            raise ValueError(f"system {self.key!r}: {exc}") from None
        # Read-only, as the rest of a frozen System.
        object.__setattr__(self, "options", types.MappingProxyType(options))
        object.__setattr__(self, "model", types.MappingProxyType(dict(self.model)))
        object.__setattr__(self, "finetune", types.MappingProxyType(finetune))

    @property
    def pretraining_ras(self) -> bool:
        """Its pre-training substitutes words (mRASP, or RAS in the decoder noise)."""
        substitutes = self.stage is not None and stage(self.stage).substitutes
        return substitutes or bool(self.options.get("decoder_noise_ras"))

    @property
    def finetuning_ras(self) -> bool:
        """Its supervised fine-tuning substitutes source words."""
        return bool(self.finetune.get("finetune_ras"))

    @property
    def reads_table(self) -> bool:
        """Its pre-training reads the cross-lingual table: CL-SemFace's, or VQ-SemFace's
        codebook started from it (``--vq-codebook-init table``)."""
        table_codes = self.options.get("vq_codebook_init") == TABLE_CODES
        return self.stage is not None and (interface(self.interface).table or table_codes)

    @property
    def pretraining_data(self) -> str | None:
        """The shards its pre-training reads (``Stage.data``), None without one."""
        return None if self.stage is None else stage(self.stage).data

    @property
    def pretraining_pairs(self) -> bool:
        """Its pre-training reads parallel pairs (mRASP's, VECO's)."""
        return self.pretraining_data not in (None, "monolingual")

    @property
    def fusion(self) -> bool:
        """Connected by deep fusion, and fine-tuned with its four losses on parallel pairs."""
        return self.connect == "fusion"

    def finetune_mode(self, setting: str) -> str:
        """``--finetune-mode`` of its runs in ``setting``."""
        return "fusion" if self.fusion else SETTINGS[setting].finetune_mode

    def runs_in(self, setting: str) -> bool:
        """Whether it has a run in ``setting``: one that trains on parallel pairs (mRASP's
        and VECO's pre-training, RAS or deep fusion's losses in fine-tuning) has no
        unsupervised setting."""
        pairs = self.pretraining_pairs or self.finetuning_ras or self.fusion
        return SETTINGS[setting].parallel or not pairs

    def _checked_options(self) -> dict[str, Any]:
        if self.stage is None:
            if self.options or self.model:
                raise ValueError("options belong to a pre-training run, and it has none")
            return {}
        reserved = sorted(RUN_FIELDS & set(self.options))
        if reserved:
            raise ValueError(f"the pipeline sets {', '.join(reserved)} for every run")
        options = typed_overrides(self.options)
        for key, value in self.model.items():
            model_option(key, value)  # a known option, a value of its type
        # What TrainConfig refuses together (e.g. extractor_diversity with a CL interface).
        paths: dict[str, Any] = {"data": Path(), "spm_model": Path(), "output_dir": Path()}
        ras = stage(self.stage).substitutes or options.get("decoder_noise_ras")
        paths |= {"ras_dictionary": _RAS_FILE} if ras else {}
        paths |= {"cl_table": _TABLE_FILE} if self.reads_table else {}
        TrainConfig(stage=self.stage, interface=self.interface, **paths, **options)
        return options

    def _check_part(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"part {self.part!r}: choose from {', '.join(PARTS)}")
        if self.part != "whole" and (self.stage is None or self.fusion):
            raise ValueError("part keeps a half of a pre-trained model; it has none to keep")

    def _checked_finetune(self) -> dict[str, Any]:
        reserved = sorted((RUN_FIELDS | FINETUNE_FIELDS) & set(self.finetune))
        if reserved:
            raise ValueError(f"the pipeline sets {', '.join(reserved)} for every fine-tuning")
        finetune = typed_overrides(self.finetune)
        paths: dict[str, Any] = {"data": Path(), "spm_model": Path(), "output_dir": Path()}
        paths |= {"ras_dictionary": _RAS_FILE} if finetune.get("finetune_ras") else {}
        TrainConfig(stage="finetune", interface="none", **paths, **finetune)
        return finetune

    @property
    def model_options(self) -> list[str]:
        """``model`` as train.py's ``--model`` KEY=VALUE options."""
        return [model_option(key, value) for key, value in self.model.items()]


FINETUNE_FIELDS = frozenset(
    {
        "finetune_mode",
        "init_from",
        "valid_prefix",
        "valid_interval",
        "valid_max_sentences",
        "warmup_steps",
        "lr",
        "denoise_schedule",
        "no_repeat_ngram_size",
    }
)
"""TrainConfig fields the pipeline sets for every fine-tuning run, so not a system's
``finetune`` options."""

SYSTEMS: dict[str, System] = {
    s.key: s
    for s in (
        System("transformer", "Transformer", None),
        System("xlm", "XLM", "encoder", "none", connect="xlm"),
        System("mbart", "mBART", "mbart", "none", connect="mbart"),
        System("cl", "CL-SemFace", "joint", "cl"),
        System("vq", "VQ-SemFace", "joint", "vq"),
    )
}
"""The paper's Tables 3 and 4, in their order."""

ABLATIONS: dict[str, System] = {
    s.key: s
    for s in (
        System("cl-no-mse", "CL-SemFace w/o MSE", "joint", "cl", {"mse_weight": 0.0}),
        System("vq-no-div", "VQ-SemFace w/o diversity", "joint", "vq", {"diversity_weight": 0.0}),
        System("vq-no-l2", "VQ-SemFace w/o L2", "joint", "vq", {"l2_weight": 0.0}),
        System("cl-mlm", "CL-SemFace decoder MLM", "joint", "cl", {"decoder_objective": "mlm"}),
        System("vq-mlm", "VQ-SemFace decoder MLM", "joint", "vq", {"decoder_objective": "mlm"}),
        System(
            "vq-eq6",
            "VQ-SemFace, Eq. 6 diversity",
            "joint",
            "vq",
            model={"vq.diversity_loss": "eq6"},
        ),
        System("vq-commit", "VQ-SemFace + commitment", "joint", "vq", {"commitment_weight": 0.25}),
        System(
            "vq-mlp",
            "VQ-SemFace, MLP logits (the paper's)",
            "joint",
            "vq",
            model={"vq.logits": "mlp"},
        ),
        System(
            "vq-extractor",
            "VQ-SemFace, the paper's feature extractor",
            "joint",
            "vq",
            {"decoder_codes": "extractor"},
        ),
        System(
            "vq-k4096",
            "VQ-SemFace, 4,096 codes",
            "joint",
            "vq",
            model={"vq.num_codes": 4096},
        ),
        System(
            "vq-paper-losses",
            "VQ-SemFace, paper's losses",
            "joint",
            "vq",
            {"token_entropy_weight": 0.0, "diversity_weight": 1.0},
        ),
        System(
            "vq-extractor-div",
            "VQ-SemFace, extractor diversity",
            "joint",
            "vq",
            {"extractor_diversity": True, "decoder_codes": "extractor"},
        ),
        System(
            "vq-tied",
            "VQ-SemFace, encoder's codes",
            "joint",
            "vq",
            {"decoder_codes": "encoder"},
        ),
        System(
            "vq-tied-bridge",
            "VQ-SemFace, encoder's codes, codebook bridge",
            "joint",
            "vq",
            bridge="codebook",
            pretraining="vq-tied",
        ),
        System("cl-fixed", "CL-SemFace, fixed table", "joint", "cl", {"cl_trainable": False}),
        System(
            "cl-no-lang-mean",
            "CL-SemFace, languages' mean outputs left free",
            "joint",
            "cl",
            {"language_mean_weight": 0.0},
        ),
        System(
            "cl-table-logits",
            "CL-SemFace, MLM logits on the table's rows",
            "joint",
            "cl",
            {"cl_unit_logits": False},
        ),
        System(
            "cl-encoder-trained",
            "CL-SemFace, decoder on the encoder's output",
            "joint",
            "cl",
            {"decoder_codes": "encoder-trained"},
        ),
        System(
            "vq-bridge",
            "VQ-SemFace, codebook bridge",
            "joint",
            "vq",
            bridge="codebook",
            pretraining="vq",
        ),
        System(
            "cl-xlm-init",
            "CL-SemFace's encoder into both, XLM-style",
            "joint",
            "cl",
            connect="xlm",
            pretraining="cl",
        ),
        System("vq-ras", "VQ-SemFace, RAS noise", "joint", "vq", {"decoder_noise_ras": True}),
        System("cl-ras", "CL-SemFace, RAS noise", "joint", "cl", {"decoder_noise_ras": True}),
        System(
            "vq-ras-ft",
            "VQ-SemFace, RAS fine-tuning",
            "joint",
            "vq",
            finetune={"finetune_ras": True},
            pretraining="vq",
        ),
        System(
            "cl-unit-mse",
            "CL-SemFace, MSE to the table's rows at unit norm",
            "joint",
            "cl",
            {"cl_unit_mse": True},
        ),
        System(
            "cl-own-input",
            "CL-SemFace, encoder input embeddings of its own",
            "joint",
            "cl",
            {"cl_table_input": False},
        ),
        System(
            "cl-half-output",
            "CL-SemFace, decoder on the encoder's output at half the tokens",
            "joint",
            "cl",
            {"decoder_codes": "encoder-trained", "decoder_continuous": 0.5},
        ),
        System(
            "cl-mse-half",
            "CL-SemFace, Eq. 1 at half weight",
            "joint",
            "cl",
            {"mse_weight": 0.5},
        ),
        System(
            "cl-raw-memory",
            "CL-SemFace, decoder on the table's rows as they are",
            "joint",
            "cl",
            {"decoder_memory_norm": False},
        ),
        System(
            "vq-codes-only",
            "VQ-SemFace, decoder on the codes alone",
            "joint",
            "vq",
            {"decoder_continuous": 0.0},
        ),
        System(
            "vq-anneal",
            "VQ-SemFace, temperature annealed within the run",
            "joint",
            "vq",
            model={"vq.temperature_decay": 0.995},
        ),
        # The decoder stage rebuilding more of the sentence than a light copy leaves out; for
        # VQ, whose decoder's loss trains its encoder, the encoder too must carry more of it.
        *(
            System(
                f"{base.key}-drop30",
                f"{base.display}, 30% of the copy's words dropped",
                base.stage,
                base.interface,
                {"decoder_word_drop": 0.3},
            )
            for base in (SYSTEMS["cl"], SYSTEMS["vq"])
        ),
        System(
            "cl-paper",
            "CL-SemFace as printed",
            "joint",
            "cl",
            {
                "cl_trainable": False,
                "decoder_memory_norm": False,
                "cl_unit_mse": True,
                "cl_table_input": False,
                "language_mean_weight": 0.0,
            },
        ),
        # The flat layout: the paper preset's product layout has no codes to start from it.
        System(
            "vq-table",
            "VQ-SemFace, codebook and input embeddings from the CL table",
            "joint",
            "vq",
            {"vq_codebook_init": TABLE_CODES, "cl_table_input": True},
            model={"vq.layout": "flat"},
        ),
        System(
            "vq-paper",
            "VQ-SemFace as printed",
            "joint",
            "vq",
            {"decoder_codes": "extractor", "token_entropy_weight": 0.0, "diversity_weight": 1.0},
            model={"vq.logits": "mlp", "vq.diversity_loss": "eq6", "extractor_layers": 2},
        ),
        # Which half of a pre-training carries its gain: the other half starts as the
        # Transformer's does.
        *(
            System(
                f"{base.key}-{part}",
                f"{base.display}, {part} alone",
                base.stage,
                base.interface,
                connect=base.connect,
                pretraining=base.key,
                part=part,
            )
            for base in (SYSTEMS["xlm"], SYSTEMS["mbart"], SYSTEMS["cl"], SYSTEMS["vq"])
            for part in PARTS
            if part != "whole"
        ),
        System(
            "vq-bt-len",
            "VQ-SemFace, back-translations of half the source length or more",
            "joint",
            "vq",
            finetune={"bt_min_len_a": 0.5},
            pretraining="vq",
        ),
    )
}
"""The paper's Table 5, then what differs from the paper: Eq. 6 as printed (the default diversity
loss is wav2vec 2.0's form), the paper's VQ losses alone (the default adds a per-token entropy
term, with diversity weight 2), the paper's Linear-ReLU-Linear code logits (the default takes
them from the distance to each code, Eq. 4's nearest neighbour), the paper's feature extractor
picking the decoder stage's codes (the default reads the encoder's own codes and lets the
decoder's loss train the encoder too), CL-SemFace's table kept as built (the default trains
it with the encoder); then options beyond the paper that are off by default: a commitment
term tying the encoder's outputs to their codes, the decoder stage reading the encoder's own
codes without gradient, diversity terms for the decoder stage's extractor, VQ-SemFace's
pre-training connected through its codebook instead of without the interface,
CL-SemFace's pre-training connected as XLM connects its own (the encoder into encoder and
decoder, the pre-trained decoder left out: what the decoder stage adds), mRASP's
random aligned substitution in the decoder stage's noise of either interface (the interface
reads a copy with some words in the other language) or on the source side of supervised
fine-tuning (VQ-SemFace's pre-training run, fine-tuned with RAS; it has no unsupervised
setting), and unsupervised back-translations that may not end before half their source's
length (VQ-SemFace's pre-training run; ``--bt-min-len-a``)."""

PAPER_SCALE: dict[str, System] = {
    s.key: s
    for s in (
        System("vq-flat", "VQ-SemFace, one flat table", "joint", "vq", model={"vq.layout": "flat"}),
        System(
            "vq-w2v-diversity",
            "VQ-SemFace, wav2vec 2.0's perplexity diversity",
            "joint",
            "vq",
            model={"vq.diversity_loss": "perplexity"},
        ),
        System(
            "vq-no-copy",
            "VQ-SemFace, Gumbel straight-through alone",
            "joint",
            "vq",
            model={"vq.copy_gradient": 0.0},
        ),
        System(
            "vq-distance-128",
            "VQ-SemFace, distance logits of the default scale",
            "joint",
            "vq",
            model={"vq.distance_width": 128},
        ),
    )
}
"""Each of the paper preset's VQ choices undone: its product layout, ``entropy`` diversity,
copied gradient and distance logits over sqrt(512) (docs/reproduce.md, "The encoders at the
paper's scale"). For ``--preset paper`` runs (``tools/learning_curves.py``, the ``gpu``
budget): the tiny and small presets keep the flat table and wav2vec 2.0's settings, where
these equal ``vq``."""

RELATED: dict[str, System] = {
    s.key: s
    for s in (
        System("mrasp", "mRASP", "mrasp", "none", connect="mrasp"),
        System("veco", "VECO", "veco", "none", connect="veco"),
        System(
            "xlm-fusion", "XLM, deep fusion", "encoder", "none", connect="fusion", pretraining="xlm"
        ),
        System(
            "cl-fusion",
            "CL-SemFace, deep fusion",
            "joint",
            "cl",
            connect="fusion",
            pretraining="cl",
        ),
        System(
            "vq-fusion",
            "VQ-SemFace, deep fusion",
            "joint",
            "vq",
            connect="fusion",
            pretraining="vq",
        ),
    )
}
"""Related work beside the paper's systems (``--systems related``), not in ``--systems
paper``: mRASP pre-trains the whole sequence-to-sequence model on the parallel pairs with
random aligned substitution; VECO pre-trains it with in-sequence and cross-sequence MLM on
the monolingual text and the parallel pairs together. Both are then fine-tuned as the others
(docs/pretraining.md says how they differ from the papers) and have no unsupervised
setting. Deep fusion (``*-fusion``) takes the encoder of XLM's, CL-SemFace's or
VQ-SemFace's pre-training run (the same run as ``xlm``, ``cl``, ``vq``) as its pre-trained
model, feeds each layer of a random decoder its own mix of the encoder's layers through the
layer-wise coordinator, and fine-tunes with translation, target-words, target-sentence and
MLM losses, each on its partition of the model (docs/finetuning.md); supervised only."""
