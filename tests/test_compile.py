"""``--compile``: each Transformer layer through torch.compile gives the eager losses and
weights to float rounding, keeps the model's names, and leaves decoding eager. (Exact
resume with compilation on: tests/test_train_launcher.py.)"""

from __future__ import annotations

import torch
from test_stages import model_for, random_batch, tiny

from megasemface.inference.search import SearchConfig, search
from megasemface.nn.compile import compile_layers
from megasemface.nn.config import build_model_config
from megasemface.nn.cpu_speed import apply_cpu_speed
from megasemface.nn.layers import TransformerLayer
from megasemface.nn.transformer import Seq2SeqModel


def _train(compiled: bool, steps: int = 4) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A few VQ-SemFace joint steps with dropout, batches of changing shapes."""
    config = tiny(dropout=0.1, attention_dropout=0.1)
    model = model_for("vq", config).train()
    apply_cpu_speed(model, "cpu")  # as the trainer builds it, before compiling
    names = list(model.state_dict())
    if compiled:
        layers = sum(isinstance(m, TransformerLayer) for m in model.modules())
        assert compile_layers(model) == layers > 0
        assert list(model.state_dict()) == names
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(1)  # dropout
    losses = []
    for step in range(steps):
        batch = random_batch(config, seed=step, length=8 + 3 * step)
        out = model.joint_loss(batch, torch.Generator().manual_seed(step))
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_compiled_steps_give_the_eager_losses_and_weights() -> None:
    eager_losses, eager_state = _train(compiled=False)
    compiled_losses, compiled_state = _train(compiled=True)
    torch.testing.assert_close(
        torch.tensor(compiled_losses), torch.tensor(eager_losses), rtol=1e-5, atol=0
    )
    # SGD, not Adam: Adam divides by the gradients' own scale, so where a gradient is near
    # zero a rounding difference would move a weight by a good part of a step.
    for name, tensor in eager_state.items():
        torch.testing.assert_close(
            compiled_state[name], tensor, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}"
        )


def test_decoding_with_compiled_layers_is_eager_decoding() -> None:
    """Search runs the cached steps eagerly and the encoder compiled: the same outputs."""
    torch.manual_seed(0)
    config = build_model_config("tiny", ["vocab_size=64"])
    model = Seq2SeqModel(config).eval()
    src = torch.randint(6, 64, (3, 7), generator=torch.Generator().manual_seed(2))
    src[:, -1] = 2
    args = (src, torch.ones_like(src, dtype=torch.bool), torch.zeros(3, dtype=torch.long))
    kwargs = {"tgt_tags": 5, "tgt_langs": 1, "max_positions": config.max_len, "eos_id": 2}
    for beam in (1, 3):
        eager = search(model, *args, config=SearchConfig(beam=beam), **kwargs)
        compile_layers(model)
        compiled = search(model, *args, config=SearchConfig(beam=beam), **kwargs)
        for layer in model.modules():
            if isinstance(layer, TransformerLayer):
                layer.compiled_block = None
        assert [h.tokens for h in compiled] == [h.tokens for h in eager]
