"""The pre-training losses' options: train.py's flags and the objective read this one
definition, each option with its one default."""

from __future__ import annotations

import dataclasses

__all__ = [
    "DECODER_OBJECTIVES",
    "PAPER_WORD_DROP",
    "PRETRAINING_LABEL_SMOOTHING",
    "PretrainingOptions",
]

DECODER_OBJECTIVES = ("clm", "mlm")
"""The decoder stage's losses: causal LM (Eq. 3) or MLM over a bidirectional decoder (Eq. 2)."""

PAPER_WORD_DROP = 0.1
"""The share of words the decoder stage's noise C(x) drops by default, Lample et al.'s, which
the paper uses."""

PRETRAINING_LABEL_SMOOTHING = 0.0
"""The pre-training losses are XLM's and the paper's, unsmoothed; label smoothing is
fine-tuning's option (``--label-smoothing``)."""


@dataclasses.dataclass(kw_only=True)
class PretrainingOptions:
    """What the pre-training stages' losses read. None: chosen by the run's stage and
    interface (:func:`megasemface.training.interface_options.fill_interface_options`)."""

    decoder_objective: str = "clm"
    """Decoder stage loss: clm (causal LM, Eq. 3) or mlm (a bidirectional decoder, Eq. 2)."""
    mse_weight: float | None = None
    """CL-SemFace: weight of the MSE term of Eq. 1; 0: off (the 'w/o MSE' ablation).
    Default: 1 up to d_model 128, 0.01 wider, where the term, summed over the dimensions,
    outweighs the MLM (objectives/objective.py, default_mse_weight)."""
    # Without the diversity terms only the decoder's loss trains the extractor, and it picks
    # a small part of the codebook: the cross-attention is then pre-trained on few of the
    # codes the encoder uses.
    extractor_diversity: bool = False
    """VQ: train the decoder stage's extractor with the diversity and token-entropy terms
    too (not in the paper)."""
    # The extractor and the encoder each learn their own assignment of the fixed codebook
    # and pick the same code for under 1% of the tokens (docs/reproduce.md): reading the
    # encoder's codes pre-trains the cross-attention on what the connected model gives it,
    # and with encoder-trained the decoder's loss reaches the encoder through the codes'
    # straight-through gradient, so the codes carry what rebuilding the sentence needs.
    decoder_codes: str | None = None
    """What the decoder stage reads. VQ: ``extractor`` (the codes of the paper's feature
    extractor), ``encoder`` (the encoder's own codes, without gradient; not in the paper) or
    ``encoder-trained`` (the encoder's own codes, and the decoder's loss trains the encoder
    too; not in the paper). CL (joint stage): ``extractor`` is the table's rows (the
    paper's), ``encoder`` and ``encoder-trained`` the encoder's outputs (--decoder-continuous
    says at which share). Default: ``encoder-trained`` for --interface vq --stage joint
    (measured better on validation, docs/reproduce.md), else ``extractor``, the only choice
    of the separate stages and --extractor-diversity."""
    decoder_memory_norm: bool | None = None
    """The decoder stage reads the interface's memory through the encoder's final LayerNorm
    (its weights held fixed), the normalisation the connected decoder's memory, the
    encoder's output, comes through: CL-SemFace's table rows of the noised copy become
    LN(E(C(x))). Default: on for --interface cl --stage joint where it reads the table's
    rows (--decoder-codes extractor, or --decoder-continuous below 1)."""
    language_mean_weight: float | None = None
    """SemFace encoder stage: the weight of a term that pulls each language's mean output,
    normalised as the final LayerNorm normalises it (before its gain and bias) and taken over
    the batch's tokens of that language, to zero, so that the encoder's outputs for two
    languages differ by no shift of their own (not in the paper). A decoder pre-trained on
    one language at a time reads such a shift in the connected model as noise (the
    diagnostics' recentred reading measures it). Default: 1 for --interface cl with
    --stage encoder or joint (measured on validation, docs/results.md), else 0."""
    decoder_word_drop: float = PAPER_WORD_DROP
    """SemFace decoder stage: the share of words C(x) drops from the copy the interface reads."""
    decoder_continuous: float | None = None
    """With --decoder-codes encoder or encoder-trained: the share of tokens, drawn per
    token, at which the decoder stage reads the encoder's continuous output instead of the
    interface's memory of it (VQ: its code; CL: the token's table row), so that the
    cross-attention is pre-trained on what the connected model gives it too (not in the
    paper). Default with the encoder's codes: 0.5 for VQ (measured better on validation and
    in the connected decoder's NLL, docs/reproduce.md), 1 for CL; else 0."""
