"""Transformer layers against a naive reference, presets and overrides, connecting stages."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.vq.gumbel_quantizer import GumbelVectorQuantizer
from megasemface.models.seq2seq_init import ConnectError, connect_stages
from megasemface.nn.bridge import CodebookBridge, bridge_state
from megasemface.nn.config import (
    PRESETS,
    ModelConfig,
    VQConfig,
    apply_overrides,
    build_model_config,
)
from megasemface.nn.dropout import scaled_dot_product_attention
from megasemface.nn.layers import MultiHeadAttention, attention_mask
from megasemface.nn.transformer import Seq2SeqModel, TransformerEncoder, parameter_shapes


def naive_attention(
    attn: MultiHeadAttention, x: torch.Tensor, src: torch.Tensor, allowed: torch.Tensor
) -> torch.Tensor:
    """Head by head, position by position: the textbook formula."""
    batch, length, dim = x.shape
    heads = attn.num_heads
    size = dim // heads
    q = attn.q_proj(x)
    k, v = attn.kv_proj(src).split(dim, dim=-1)
    out = torch.zeros(batch, length, dim)
    for b in range(batch):
        for h in range(heads):
            cols = slice(h * size, (h + 1) * size)
            scores = q[b, :, cols] @ k[b, :, cols].t() / math.sqrt(size)
            scores = scores.masked_fill(~allowed[b, 0], float("-inf"))
            out[b, :, cols] = torch.softmax(scores, -1) @ v[b, :, cols]
    return attn.out_proj(out)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_the_formula(causal: bool) -> None:
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 4, dropout=0.0).eval()
    x = torch.randn(3, 5, 16)
    key_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    allowed = attention_mask(key_mask, 5, causal)
    torch.testing.assert_close(attn(x, x, allowed), naive_attention(attn, x, x, allowed))
    memory = torch.randn(3, 7, 16)
    cross = attention_mask(torch.ones(3, 7, dtype=torch.bool), 5, causal=False)
    torch.testing.assert_close(attn(x, memory, cross), naive_attention(attn, x, memory, cross))


@pytest.mark.parametrize("causal", [False, True])
def test_cpu_attention_with_dropout_is_the_formula_and_its_gradient(causal: bool) -> None:
    """With dropout on a CPU, attention runs its own unfused path (nn/dropout.py); at a
    rate that rounds to no drop it must be SDPA's values and gradients."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 4, 5, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    key_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], dtype=torch.bool)
    mask = attention_mask(key_mask, 5, causal)
    ours = scaled_dot_product_attention(q, k, v, mask, dropout_p=1e-7)
    grads = torch.autograd.grad(ours.sum(), (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ours, sdpa)
    for got, want in zip(grads, torch.autograd.grad(sdpa.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, want)


def test_cpu_attention_dropout_drops_probabilities_not_outputs() -> None:
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16)
    v = torch.ones(2, 4, 64, 16)
    out = scaled_dot_product_attention(q, k, v, None, dropout_p=0.5)
    # Each output row is its dropped and rescaled probabilities summed: the same in every
    # column, 1 on average, and rarely 0 or 2 (which dropping the outputs would give).
    assert torch.equal(out, out[..., :1].expand_as(out))
    assert float(out.mean()) == pytest.approx(1.0, abs=0.05)
    assert float(((out == 0) | (out == 2)).float().mean()) < 0.05
    # A query with every key masked (padding) stays finite.
    none_allowed = torch.zeros(2, 1, 64, 64, dtype=torch.bool)
    assert torch.isfinite(scaled_dot_product_attention(q, k, v, none_allowed, 0.5)).all()


def test_padding_does_not_change_real_positions() -> None:
    torch.manual_seed(0)
    config = build_model_config("tiny", ["vocab_size=50", "dropout=0.0"])
    encoder = TransformerEncoder(config).eval()
    tokens = torch.randint(5, 50, (1, 6))
    langs = torch.zeros(1, dtype=torch.long)
    short = encoder(tokens, torch.ones(1, 6, dtype=torch.bool), langs).hidden_BTD
    padded_tokens = torch.cat([tokens, torch.full((1, 4), config.pad_id)], dim=1)
    mask = torch.arange(10)[None] < 6
    padded = encoder(padded_tokens, mask, langs).hidden_BTD
    torch.testing.assert_close(padded[:, :6], short)


def test_presets_and_overrides() -> None:
    paper = PRESETS["paper"]()
    assert (paper.encoder_layers, paper.decoder_layers, paper.d_model, paper.num_heads) == (
        6,
        6,
        1024,
        8,
    )
    assert (paper.ffn_dim, paper.max_len, paper.vocab_size) == (4096, 256, 60_000)
    # The paper's 102,400 codes as wav2vec 2.0's 2 x 320 (nn/config.py says why).
    assert (paper.vq.layout, paper.vq.groups, paper.vq.entries) == ("product", 2, 320)
    assert paper.vq.combinations == 102_400
    assert (paper.vq.diversity_loss, paper.vq.copy_gradient) == ("entropy", 1.0)
    assert paper.vq.distance_width == paper.d_model // paper.vq.groups  # logits over sqrt(w)
    assert VQConfig(layout="product", groups=2, entries=320).combinations == 102_400
    tiny = build_model_config("tiny", ["d_model=32", "vq.layout=product", "dropout=0"])
    assert tiny.d_model == 32 and tiny.vq.layout == "product" and tiny.dropout == 0.0
    with pytest.raises(ValueError, match="unknown model option"):
        build_model_config("tiny", ["depth=3"])
    with pytest.raises(ValueError, match="divisible"):
        build_model_config("tiny", ["d_model=30"])
    with pytest.raises(ValueError, match="one of"):
        apply_overrides(ModelConfig(), ["vq.layout=tree"])
    with pytest.raises(ValueError, match="unknown preset"):
        build_model_config("huge")


def test_config_file(tmp_path: Path) -> None:
    path = tmp_path / "model.json"
    path.write_text('{"d_model": 48, "num_heads": 4, "vq": {"num_codes": 64}}')
    config = build_model_config("tiny", ["num_heads=6"], config_file=path)
    assert (config.d_model, config.num_heads, config.vq.num_codes) == (48, 6, 64)


def _stage_states(config: ModelConfig) -> tuple[dict, dict]:
    torch.manual_seed(1)
    encoder_stage = {f"encoder.{k}": v for k, v in TransformerEncoder(config).state_dict().items()}
    encoder_stage["mlm_bias"] = torch.randn(config.vocab_size)
    encoder_stage["interface.table"] = torch.randn(config.vocab_size, config.d_model)
    torch.manual_seed(2)
    decoder_stage = {
        k: v for k, v in Seq2SeqModel(config).state_dict().items() if k.startswith("decoder.")
    }
    return encoder_stage, decoder_stage


def _meta(config: ModelConfig, **extra: object) -> dict:
    return {
        "model": config.to_dict(),
        "languages": ["en", "de"],
        "interface": {"kind": "cl"},
        **extra,
    }


def test_connect_keeps_pretrained_cross_attention_and_reports_provenance() -> None:
    config = build_model_config("tiny", ["vocab_size=100"])
    enc, dec = _stage_states(config)
    model, provenance = connect_stages(config, enc, _meta(config), dec, _meta(config))
    state = model.state_dict()
    torch.testing.assert_close(
        state["encoder.layers.0.self_attn.q_proj.weight"],
        enc["encoder.layers.0.self_attn.q_proj.weight"],
    )
    key = "decoder.layers.1.cross_attn.kv_proj.weight"
    torch.testing.assert_close(state[key], dec[key])
    assert provenance[key] == "decoder-stage:layers.1.cross_attn.kv_proj.weight"
    assert set(provenance) == set(state) and "random" not in provenance.values()
    assert not any("interface" in k or "mlm_bias" in k for k in state)


def test_connect_without_decoder_stage_is_the_xlm_initialisation() -> None:
    config = build_model_config("tiny", ["vocab_size=100"])
    enc, _ = _stage_states(config)
    model, provenance = connect_stages(config, enc, _meta(config, interface={"kind": "none"}))
    state = model.state_dict()
    torch.testing.assert_close(
        state["decoder.layers.0.ffn.fc1.weight"], enc["encoder.layers.0.ffn.fc1.weight"]
    )
    torch.testing.assert_close(state["decoder.output_bias"], enc["mlm_bias"])
    assert provenance["decoder.layers.0.cross_attn.q_proj.weight"] == "random"
    assert provenance["decoder.embed.tokens.weight"] == "encoder-stage:embed.tokens.weight"


def test_connect_refuses_mismatches() -> None:
    config = build_model_config("tiny", ["vocab_size=100"])
    enc, dec = _stage_states(config)
    other_vocab = build_model_config("tiny", ["vocab_size=120"])
    with pytest.raises(ConnectError, match="vocab_size=120"):
        connect_stages(config, enc, _meta(other_vocab), dec, _meta(config))
    with pytest.raises(ConnectError, match="languages"):
        connect_stages(
            config, enc, _meta(config), dec, {**_meta(config), "languages": ["en", "fr"]}
        )
    with pytest.raises(ConnectError, match="different semantic interfaces"):
        connect_stages(
            config,
            enc,
            _meta(config),
            dec,
            _meta(config, interface={"kind": "cl", "table_sha256": "x"}),
        )
    shrunk = {k: v for k, v in dec.items() if "layers.1" not in k}
    with pytest.raises(ConnectError, match="missing"):
        connect_stages(config, enc, _meta(config), shrunk, _meta(config))


def test_connect_checks_shapes_before_building_a_damaged_config() -> None:
    """A config whose vocabulary was damaged to 10^9 (a model of 250 GB) is refused from
    the stage tensors' shapes, before any model is built: the test would run out of memory
    otherwise."""
    config = build_model_config("tiny", ["vocab_size=100"])
    enc, dec = _stage_states(config)
    damaged = dataclasses.replace(config, vocab_size=10**9)
    with pytest.raises(ConnectError, match=r"has shape \(100, .*the model needs \(1000000000,"):
        connect_stages(damaged, enc, _meta(damaged), dec, _meta(damaged))
    assert parameter_shapes(config) == {
        k: tuple(v.shape) for k, v in Seq2SeqModel(config).state_dict().items()
    }


@pytest.mark.parametrize("layout", ["flat", "product"])
def test_codebook_bridge_with_distance_logits_mixes_by_the_vq_layers_logits(layout: str) -> None:
    """With ``vq.logits=distance`` the bridge holds the codebook only and weighs the codes by
    the VQ layer's own logits (minus the scaled squared distances)."""
    options = ["vocab_size=100", f"vq.layout={layout}", "vq.logits=distance"]
    config = build_model_config("tiny", [*options, "bridge=codebook"])
    groups = ParallelGroups.single()
    quantizer = GumbelVectorQuantizer(config.vq, config.d_model, groups, seed=5).eval()
    stage_state = {"interface.quantizer." + k: v for k, v in quantizer.state_dict().items()}
    bridge = CodebookBridge(config).eval()
    assert [name for name, _ in bridge.named_parameters()] == ["codebook"]
    bridge.load_state_dict(bridge_state(stage_state, "distance"))
    h = torch.randn(2, 6, config.d_model, generator=torch.Generator().manual_seed(1))
    logits = quantizer.code_logits(h.reshape(12, -1))
    g = 1 if layout == "flat" else config.vq.groups
    probs = torch.softmax(logits.view(12, g, -1) / config.bridge_temperature, dim=-1)
    table = quantizer.codebook.detach().reshape(g, -1, config.d_model // g)
    expected = torch.einsum("ngv,gvk->ngk", probs, table).reshape(2, 6, -1)
    torch.testing.assert_close(bridge(h), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", ["flat", "product"])
def test_codebook_bridge_is_the_soft_code_mixture(layout: str) -> None:
    config = build_model_config(
        "tiny",
        [
            "vocab_size=100",
            f"vq.layout={layout}",
            "vq.logits=mlp",
            "bridge=codebook",
            "vq.chunk_tokens=5",
        ],
    )
    torch.manual_seed(0)
    model = Seq2SeqModel(config).eval()
    bridge = model.bridge
    assert bridge is not None
    src = torch.randint(5, 100, (3, 7))
    mask = torch.ones_like(src, dtype=torch.bool)
    langs = torch.tensor([0, 1, 0])
    encoded = model.encoder(src, mask, langs).hidden_BTD
    bridged = model.encode(src, mask, langs).hidden_BTD
    # Directly: Linear-ReLU-Linear logits, a softmax per group, the groups' mixtures joined.
    scores = torch.relu(encoded @ bridge.hidden.weight.t() + bridge.hidden.bias)
    scores = (scores @ bridge.logits.weight.t() + bridge.logits.bias) / config.bridge_temperature
    groups = 1 if layout == "flat" else config.vq.groups
    table = bridge.codebook.reshape(groups, -1, config.d_model // groups)
    parts = [
        torch.softmax(chunk, -1) @ table[g] for g, chunk in enumerate(scores.chunk(groups, dim=-1))
    ]
    torch.testing.assert_close(bridged, torch.cat(parts, -1), rtol=1e-5, atol=1e-6)
    # 21 tokens in chunks of 5, recomputed in backward: the same gradients as in one piece.
    config_whole = build_model_config(
        "tiny", ["vocab_size=100", f"vq.layout={layout}", "vq.logits=mlp", "bridge=codebook"]
    )
    whole = Seq2SeqModel(config_whole)
    whole.load_state_dict(model.state_dict())
    for m in (model, whole):
        m.eval()
        m.encode(src, mask, langs).hidden_BTD.pow(2).sum().backward()
    for name, param in model.named_parameters():
        other = dict(whole.named_parameters())[name]
        if param.grad is not None:
            torch.testing.assert_close(param.grad, other.grad, rtol=1e-4, atol=1e-6)


def test_connect_with_the_bridge_takes_the_vq_layer() -> None:
    config = build_model_config("tiny", ["vocab_size=100", "vq.logits=mlp", "bridge=codebook"])
    enc, dec = _stage_states(config)
    torch.manual_seed(3)
    vq = {
        "interface.quantizer.hidden.weight": torch.randn(config.vq.hidden_dim, config.d_model),
        "interface.quantizer.hidden.bias": torch.randn(config.vq.hidden_dim),
        "interface.quantizer.logits_weight": torch.randn(config.vq.num_codes, config.vq.hidden_dim),
        "interface.quantizer.logits_bias": torch.randn(config.vq.num_codes),
        "interface.quantizer.codebook": torch.randn(config.vq.num_codes, config.d_model),
    }
    meta = _meta(config, interface={"kind": "vq"})
    model, provenance = connect_stages(
        config, {**enc, **vq}, meta, dec, meta, encoder_codebook=True
    )
    state = model.state_dict()
    torch.testing.assert_close(state["bridge.codebook"], vq["interface.quantizer.codebook"])
    torch.testing.assert_close(
        state["bridge.logits.weight"], vq["interface.quantizer.logits_weight"]
    )
    assert provenance["bridge.hidden.bias"] == "encoder-stage:interface.quantizer.hidden.bias"
    assert "random" not in provenance.values()
    with pytest.raises(ConnectError, match="lacks its VQ layer"):
        connect_stages(config, enc, meta, dec, meta, encoder_codebook=True)
    with pytest.raises(ConnectError, match="'cl' encoder stage"):
        connect_stages(config, {**enc, **vq}, _meta(config), dec, _meta(config))
    with pytest.raises(ConnectError, match="no decoder stage"):
        connect_stages(config, {**enc, **vq}, meta, encoder_codebook=True)
    # Distance logits: the codebook is the whole VQ layer, and all the bridge takes.
    config = build_model_config("tiny", ["vocab_size=100", "bridge=codebook"])
    assert config.vq.logits == "distance"
    table = {"interface.quantizer.codebook": vq["interface.quantizer.codebook"]}
    model, provenance = connect_stages(
        config, {**enc, **table}, meta, dec, meta, encoder_codebook=True
    )
    assert [k for k in model.state_dict() if k.startswith("bridge.")] == ["bridge.codebook"]
    assert provenance["bridge.codebook"] == "encoder-stage:interface.quantizer.codebook"
    assert "random" not in provenance.values()
