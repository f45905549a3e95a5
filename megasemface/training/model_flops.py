"""Model FLOPs of a training step, from the model's shape and the batch's.

What MFU divides by the device's peak (:mod:`megasemface.training.throughput`). Counted as torch's
``FlopCounterMode`` counts a step (:mod:`megasemface.flop_count`; ``tests/test_model_flops.py``
checks the two agree): 2 m n k for every matrix product, forward and backward, at the padded
shapes the products run at; attention 4 B T S D forward (scores and values, every head) and
2.5 times that backward (torch's count for its fused kernels: the scores again, then four
gradients). Elementwise work, normalisation, softmax and embeddings lookups are not counted.

A product of weights that train with an input that needs a gradient costs 3x its forward
(the input's and the weight's gradients); one whose input needs no gradient 2x, a frozen
one whose input needs one 2x, one without backward 1x. The output layers' fused loss
(:mod:`megasemface.objectives.output_loss`) always makes its three products.

Shapes a step only knows on the device are taken at their bound: a noised copy (word drop,
span infilling) at its sentence's width and token count, back-translations at the length the
loop generated. The FLOPs of generating back-translations (decoding, no gradient) are not
part of the training step's.
"""

from __future__ import annotations

from megasemface import stages
from megasemface.interfaces import registry
from megasemface.nn.config import ModelConfig
from megasemface.nn.flop_terms import BACKWARD_FACTOR, Backward, linear

__all__ = [
    "ATTENTION_BACKWARD",
    "Backward",
    "decoder_stack",
    "encoder_stack",
    "output_layer",
    "semface_step",
    "seq2seq_body",
    "veco_body",
]

ATTENTION_BACKWARD = 2.5
"""Attention's backward FLOPs over its forward (torch's count for its fused kernels)."""


def _attention(batch: int, queries: int, keys: int, d_model: int, backward: bool) -> float:
    forward = 4.0 * batch * queries * keys * d_model
    return forward * (1.0 + ATTENTION_BACKWARD) if backward else forward


def _layer_products(config: ModelConfig, rows: float) -> float:
    """Self-attention's projections (q, kv, out) and the feed-forward of ``rows`` tokens."""
    d, f = config.d_model, config.ffn_dim
    return linear(rows, d, 4 * d) + linear(rows, d, f) + linear(rows, f, d)


def encoder_stack(
    config: ModelConfig, batch: int, length: int, layers: int, backward: Backward = "train"
) -> float:
    """``layers`` encoder layers over ``batch`` x ``length`` (padded) tokens."""
    products = _layer_products(config, batch * length) * BACKWARD_FACTOR[backward]
    attention = _attention(batch, length, length, config.d_model, backward != "off")
    return layers * (products + attention)


def decoder_stack(
    config: ModelConfig, batch: int, length: int, memory: int, memory_grad: bool
) -> float:
    """The trained decoder over ``batch`` x ``length`` tokens, cross-attending to ``memory``
    positions (whose keys and values get the memory's gradient when ``memory_grad``)."""
    d, rows = config.d_model, batch * length
    own = (_layer_products(config, rows) + linear(rows, d, 2 * d)) * BACKWARD_FACTOR["train"]
    keys = linear(batch * memory, d, 2 * d) * BACKWARD_FACTOR["train" if memory_grad else "input"]
    attention = _attention(batch, length, length + memory, d, True)
    return config.decoder_layers * (own + keys + attention)


def output_layer(config: ModelConfig, targets: int) -> float:
    """The fused output loss over ``targets`` predicted tokens: logits and both gradients."""
    return 3.0 * linear(targets, config.d_model, config.vocab_size)


def _bridge(config: ModelConfig, tokens: int) -> float:
    """A connected VQ model's codebook bridge over ``tokens`` (padded) positions, trained."""
    if config.bridge != "codebook":
        return 0.0
    vq = config.vq
    logit_in, rows, width = vq.code_products(config.d_model)
    hidden = 0.0 if vq.logits == "distance" else linear(tokens, config.d_model, vq.hidden_dim)
    logits = linear(tokens, logit_in if vq.logits == "mlp" else width, rows)
    return 3.0 * (hidden + logits + linear(tokens, rows, width))


def seq2seq_body(config: ModelConfig, batch: int, source: int, target: int) -> float:
    """A teacher-forced pass of the sequence-to-sequence model, trained, without its output
    layer: the encoder over ``source`` tokens and ``</s>``, the bridge, and the decoder over
    the target language's tag and ``target`` tokens."""
    return (
        encoder_stack(config, batch, source + 1, config.encoder_layers)
        + _bridge(config, batch * (source + 1))
        + decoder_stack(config, batch, target + 1, source + 1, memory_grad=True)
    )


def veco_body(config: ModelConfig, batch: int, width: int) -> float:
    """VECO's two encoder passes and two decoder passes (rows of x then of y, ``width`` the
    longer side), the decoder reading the detached states of the other side."""
    rows, length = 2 * batch, width + 1
    return encoder_stack(config, rows, length, config.encoder_layers) + decoder_stack(
        config, rows, length, length, memory_grad=False
    )


def semface_step(
    config: ModelConfig,
    *,
    interface: str,
    stage: str,
    decoder_codes: str,
    batch: int,
    length: int,
    tokens: int,
) -> float:
    """A SemFace (or XLM) pre-training step without its output layers: ``batch`` sentences
    padded to ``length``, ``tokens`` real tokens."""
    total = 0.0
    spec = registry.interface(interface)
    layer = spec.flops() if spec.flops is not None else None  # a lookup's are not counted
    vq = spec.codebook
    if stages.stage(stage).encoder:  # MLM over x' </s>, through the interface's layer
        total += encoder_stack(config, batch, length + 1, config.encoder_layers)
        if layer is not None:
            total += layer(config, tokens + batch, "train")
    if stages.stage(stage).decoder:
        if decoder_codes == "extractor":  # the noised copy through the extractor
            memory, memory_grad = length, vq
            if vq:
                total += encoder_stack(config, batch, length, config.extractor_layers)
            if layer is not None:
                total += layer(config, tokens, "input")
        else:  # the noised copy through the encoder, trained by the decoder's loss or not
            trained = decoder_codes == "encoder-trained"
            memory, memory_grad = length + 1, trained
            layers = config.encoder_layers
            total += encoder_stack(config, batch, memory, layers, "train" if trained else "off")
            if layer is not None:
                backward: Backward = "input" if trained else "off"
                total += layer(config, tokens + batch, backward)
        total += decoder_stack(config, batch, length + 1, memory, memory_grad)
    return total
