"""The SemFace interfaces' training options: each one's default by stage and interface, and
where each applies."""

from __future__ import annotations

from typing import TYPE_CHECKING

from megasemface.interfaces.registry import (
    CODEBOOK_INITS,
    DECODER_CODES,
    RANDOM_CODES,
    TABLE_CODES,
    interface,
)
from megasemface.objectives.options import PAPER_WORD_DROP
from megasemface.stages import stage

if TYPE_CHECKING:
    from megasemface.training.options import TrainConfig

__all__ = ["fill_interface_options"]


def fill_interface_options(config: TrainConfig) -> None:
    """The options of the SemFace interfaces: where each applies, and its default (filled in
    where the run left it None).

    Raises:
        ValueError: one line naming the option and where it applies.
    """
    run_stage, run_interface = stage(config.stage), interface(config.interface)
    if config.extractor_diversity and not (run_interface.codebook and run_stage.decoder):
        raise ValueError(
            "--extractor-diversity trains the VQ decoder stage's extractor: use it with "
            "--interface vq and --stage decoder or joint"
        )
    if config.vq_codebook_init not in CODEBOOK_INITS:
        raise ValueError(
            f"--vq-codebook-init must be one of {', '.join(CODEBOOK_INITS)}, "
            f"got {config.vq_codebook_init!r}"
        )
    if config.vq_codebook_init != RANDOM_CODES and not run_interface.codebook:
        raise ValueError(
            f"--vq-codebook-init {config.vq_codebook_init} starts VQ-SemFace's codebook: use it "
            "with --interface vq"
        )
    if not 0 <= config.decoder_word_drop < 1:
        raise ValueError("--decoder-word-drop must be in [0, 1)")
    noises_copy = run_interface.semface and run_stage.decoder
    if config.decoder_word_drop != PAPER_WORD_DROP and not noises_copy:
        raise ValueError(
            "--decoder-word-drop noises the SemFace decoder stage's copy: use it with "
            "--interface cl or vq and --stage decoder or joint"
        )
    if config.cl_trainable is None:
        config.cl_trainable = run_interface.table and run_stage.joint
    cl_mlm = run_interface.table and run_stage.encoder
    where = "use it with --interface cl and --stage encoder or joint"
    _default_where_it_applies(
        config, "cl_unit_logits", cl_mlm, f"scales CL-SemFace's MLM output layer: {where}"
    )
    if config.decoder_codes is None:
        tied = run_interface.codebook and run_stage.joint and not config.extractor_diversity
        config.decoder_codes = "encoder-trained" if tied else "extractor"
    if config.decoder_codes not in DECODER_CODES:
        raise ValueError(
            f"--decoder-codes must be one of {', '.join(DECODER_CODES)}, "
            f"got {config.decoder_codes!r}"
        )
    if config.decoder_codes != "extractor" and (
        not run_interface.semface or not run_stage.joint or config.extractor_diversity
    ):
        raise ValueError(
            f"--decoder-codes {config.decoder_codes} feeds the decoder stage the output of the "
            "encoder trained beside it: use it with --interface vq or cl and --stage joint, "
            "without --extractor-diversity (the extractor is then unused)"
        )
    # Off by default: Eq. 1 to the table's rows as they are scored higher on validation at the
    # low-resource budget on every seed (docs/reproduce.md); the unit scale stays an option.
    _default_where_it_applies(
        config,
        "cl_unit_mse",
        cl_mlm,
        f"scales the target of CL-SemFace's MSE term: {where}",
        default=False,
    )
    # On by default for CL: the encoder's input embeddings from the table scored higher on
    # validation at the low-resource budget on every seed (docs/reproduce.md). VQ-SemFace
    # reads the table only where its codebook starts from it.
    vq_table = run_interface.codebook and config.vq_codebook_init == TABLE_CODES
    _default_where_it_applies(
        config,
        "cl_table_input",
        (run_interface.table or vq_table) and run_stage.encoder,
        "initialises CL-SemFace's encoder input embeddings from the table: use it with "
        "--interface cl, or vq with --vq-codebook-init table, and --stage encoder or joint",
        default=run_interface.table,
    )
    if config.language_mean_weight is None:
        config.language_mean_weight = 1.0 if cl_mlm else 0.0
    if config.language_mean_weight < 0:
        raise ValueError("--language-mean-weight must be >= 0")
    if config.language_mean_weight and not (run_interface.semface and run_stage.encoder):
        raise ValueError(
            "--language-mean-weight pulls the SemFace encoder's languages to one mean output: "
            "use it with --interface cl or vq and --stage encoder or joint"
        )
    own_codes = config.decoder_codes != "extractor"
    if config.decoder_continuous is None:
        # VQ: half the tokens (measured better on validation and in the connected decoder's
        # NLL, docs/reproduce.md); CL: every token, the encoder's output alone.
        config.decoder_continuous = (1.0 if run_interface.table else 0.5) if own_codes else 0.0
    if not 0 <= config.decoder_continuous <= 1:
        raise ValueError("--decoder-continuous must be in [0, 1]")
    if config.decoder_continuous and not own_codes:
        raise ValueError(
            "--decoder-continuous mixes the encoder's output into the decoder stage's "
            "memory: use it with --decoder-codes encoder or encoder-trained"
        )
    if own_codes and run_interface.table and not config.decoder_continuous:
        raise ValueError(
            "--decoder-continuous 0 with CL-SemFace's --decoder-codes encoder reads the table's "
            "rows alone: use --decoder-codes extractor for that"
        )
    # The decoder stage reads the interface's memory at some tokens: the table's rows or,
    # of the encoder's own output, the codes or rows where it does not read the output.
    reads_interface = run_interface.semface and run_stage.joint and config.decoder_continuous < 1
    if config.decoder_memory_norm is None:
        config.decoder_memory_norm = run_interface.table and reads_interface
    if config.decoder_memory_norm and not reads_interface:
        raise ValueError(
            "--decoder-memory-norm passes the decoder stage's interface memory through the "
            "encoder's final norm: use it with --stage joint, --interface cl or vq and "
            "--decoder-continuous below 1 (the encoder's own output is normed already)"
        )


def _default_where_it_applies(
    config: TrainConfig, name: str, applies: bool, why: str, *, default: bool = True
) -> None:
    """A yes/no option, ``default`` where it ``applies`` and off elsewhere, refused where it
    does not apply."""
    if getattr(config, name) is None:
        setattr(config, name, applies and default)
    if getattr(config, name) and not applies:
        raise ValueError(f"--{name.replace('_', '-')} {why}")
