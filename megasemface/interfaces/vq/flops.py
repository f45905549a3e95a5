"""The VQ layer's model FLOPs (the ``vq`` record's ``flops``), counted as
``training/model_flops.py`` counts the rest of a step. Torch-free."""

from __future__ import annotations

from megasemface.nn.config import ModelConfig
from megasemface.nn.flop_terms import BACKWARD_FACTOR, Backward, linear

__all__ = ["quantizer_flops"]


def quantizer_flops(config: ModelConfig, tokens: int, backward: Backward) -> float:
    """The VQ layer over ``tokens`` real tokens. ``input``: its weights detached (the
    decoder stage's codes), gradients to the tokens only."""
    vq, d_model = config.vq, config.d_model
    logit_in, rows, width = vq.code_products(d_model)
    logits = linear(tokens, logit_in, rows)
    total = 0.0 if vq.logits == "distance" else linear(tokens, d_model, vq.hidden_dim)
    total *= BACKWARD_FACTOR[backward]
    if vq.layout == "flat":
        # Forward: the logits; backward: the code probabilities' straight-through gradient
        # (through the codes' vectors), then the logits' gradients of the input and weights.
        if backward == "off":
            return total + logits
        straight = linear(tokens, width, rows)
        weights = logits if backward == "train" else 0.0
        return total + 2 * logits + straight + weights
    # Product layout: a dense logit layer over the groups' entries, then each group's
    # probabilities times its table (autograd's products).
    mix = linear(tokens, rows, width)
    return total + (logits + mix) * BACKWARD_FACTOR[backward]
