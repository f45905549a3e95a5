"""The VQ layer on one process: straight-through, Eq. 5/6 by hand, layouts, chunking, dtypes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from megasemface.distributed.groups import DeepSpeedMpu, ParallelGroups
from megasemface.flop_count import flop_counter
from megasemface.interfaces.vq import randomness as vq_random
from megasemface.interfaces.vq.code_probabilities import code_log_probs
from megasemface.interfaces.vq.gumbel_quantizer import (
    SPLIT_PARAMETERS,
    GumbelVectorQuantizer,
    gather_codebook,
    gather_state_dicts,
    shard_state_dict,
    split_codebook,
)
from megasemface.interfaces.vq.randomness import gumbel_noise
from megasemface.nn import cpu_passes, cpu_speed, kernels
from megasemface.nn.code_distance import distance_scale
from megasemface.nn.config import VQConfig

D = 8


def make_vq(layout: str = "flat", seed: int = 3, **overrides: object) -> GumbelVectorQuantizer:
    """A small layer; with the MLP logits unless told (their weights let the tests below
    write the logits out; the tests parametrized on ``logits`` cover the default too)."""
    options: dict[str, object] = {
        "logits": "mlp",
        "layout": layout,
        "num_codes": 40,
        "groups": 2,
        "entries": 5,
        "hidden_dim": 16,
        "chunk_tokens": 5,
        "temperature_start": 1.5,
        "temperature_end": 0.5,
        "temperature_decay": 0.9,
    }
    options.update(overrides)
    return GumbelVectorQuantizer(VQConfig(**options), D, ParallelGroups.single(), seed=seed)


def features(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, D, generator=gen).to(dtype).requires_grad_()


def dense_logits(vq: GumbelVectorQuantizer, h: torch.Tensor) -> torch.Tensor:
    """The code logits written out: Linear-ReLU-Linear, or minus the squared distance to each
    code over sqrt(width) (Eq. 4), grouped for the product layout."""
    if vq.config.logits == "mlp":
        return F.relu(vq.hidden(h)) @ vq.logits_weight.t() + vq.logits_bias
    table = vq.codebook if vq.layout == "product" else vq.codebook[None]  # [G, V, w]
    width = table.shape[-1]
    parts = h.view(h.shape[0], table.shape[0], width)  # [N, G, w], G = 1 for flat
    dist = (parts[:, :, None, :] - table[None]).square().sum(-1)  # [N, G, V]
    return (-dist * _distance_scale(width, vq.config.distance_width)).flatten(1)


def _distance_scale(width: int, distance_width: int) -> float:
    """1 / sqrt(w), and sqrt(distance_width) / w for codes wider than distance_width."""
    return 1 / math.sqrt(width) if width <= distance_width else math.sqrt(distance_width) / width


def dense_flat(vq: GumbelVectorQuantizer, h: torch.Tensor, key: int, sample: bool):
    """Eq. 5 and Eq. 6 written out densely with plain autograd: the reference."""
    logits = dense_logits(vq, h)
    scores = logits + gumbel_noise(key, 0, h.shape[0], 0, vq.num_codes) if sample else logits
    soft = torch.softmax(scores / vq.temperature, dim=-1)
    hard = F.one_hot(scores.argmax(-1), vq.num_codes).float()
    out = (hard + (soft - soft.detach())) @ vq.codebook
    pbar = (soft if vq.config.diversity_from_gumbel else torch.softmax(logits, -1)).mean(0)
    entropy = -(pbar * pbar.log()).sum()
    if vq.config.diversity_loss == "eq6":
        diversity = -entropy / vq.num_codes
    elif vq.config.diversity_loss == "entropy":
        diversity = torch.relu(math.log(min(vq.num_codes, h.shape[0])) - entropy)
    else:
        diversity = (vq.num_codes - entropy.exp()) / vq.num_codes
    log_r = torch.log_softmax(logits, -1)
    token_entropy = -(log_r.exp() * log_r).sum(-1).mean()
    return out, scores.argmax(-1), diversity, token_entropy


def grads_of(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in module.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["flat", "product"])
def test_straight_through_forward_is_exactly_the_chosen_code(layout: str) -> None:
    vq = make_vq(layout)
    vq.train()
    out = vq(features(13))
    assert out.quantized.shape == (13, D) and out.codes.dtype == torch.int64
    assert torch.equal(out.quantized, vq.lookup(out.codes))
    if layout == "flat":
        assert torch.equal(out.quantized, vq.codebook[out.codes])


@pytest.mark.parametrize("logits", ["mlp", "distance"])
@pytest.mark.parametrize("from_gumbel", [False, True])
@pytest.mark.parametrize("sample", [True, False])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.7])
@pytest.mark.parametrize("keep_mib", [0, 1])  # recomputed in backward; kept from forward
@pytest.mark.parametrize("form", ["perplexity", "entropy"])
def test_flat_gradients_match_dense_reference(
    logits: str, from_gumbel: bool, sample: bool, entropy_weight: float, keep_mib: int, form: str
) -> None:
    vq = make_vq(
        diversity_from_gumbel=from_gumbel,
        logits=logits,
        keep_logits_mib=keep_mib,
        diversity_loss=form,
        num_codes=10,  # fewer codes than the 13 tokens: the entropy form's ceiling is ln K
    )
    vq.set_step(2)
    h = features(13)
    target = torch.randn(13, D, generator=torch.Generator().manual_seed(1))
    out = vq(h, sample=sample, noise_key=7)
    loss = (out.quantized * target).sum() + 3 * out.diversity_loss
    if entropy_weight:  # else the token entropy is unused: no gradient flows from it
        loss = loss + entropy_weight * out.token_entropy
    loss.backward()
    got, got_h = grads_of(vq), h.grad.clone()
    assert set(got) == {name for name, _ in vq.named_parameters()}  # logits layer and table
    assert all(g.abs().sum() > 0 for g in got.values())

    vq.zero_grad()
    h_ref = h.detach().clone().requires_grad_()
    ref_out, ref_codes, ref_div, ref_entropy = dense_flat(vq, h_ref, vq._noise_key(7), sample)
    ((ref_out * target).sum() + 3 * ref_div + entropy_weight * ref_entropy).backward()
    torch.testing.assert_close(out.token_entropy, ref_entropy, rtol=1e-6, atol=1e-6)
    assert torch.equal(out.codes, ref_codes)
    torch.testing.assert_close(out.quantized, ref_out, rtol=0, atol=1e-6)
    # (K - exp(H)) / K cancels: an ulp of exp(H) near K is 1e-7 of K.
    torch.testing.assert_close(out.diversity_loss, ref_div, rtol=1e-6, atol=1e-6)
    for name, grad in grads_of(vq).items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(got_h, h_ref.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("logits", "from_gumbel", "keep_mib"), [("distance", 0, 1), ("mlp", 1, 0)])
def test_compiled_passes_match_dense_reference(
    monkeypatch: pytest.MonkeyPatch, logits: str, from_gumbel: int, keep_mib: int
) -> None:
    """The flat layer's passes through torch.compile, as a CPU runs them from 4M logits a
    chunk (here every chunk): the dense reference's values, with every pass compiled. Under
    a dispatch mode (FLOP counting) they run eagerly, which leaves them compiled after."""
    monkeypatch.setattr(cpu_passes, "MIN_COMPILED_ELEMENTS", 0)
    monkeypatch.setattr(kernels, "_installed", cpu_speed.CPU_KERNELS)  # as a CPU run installs
    with flop_counter():
        make_vq(logits=logits)(features(13), noise_key=7).quantized.sum().backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        test_flat_gradients_match_dense_reference(
            logits, bool(from_gumbel), True, 0.7, keep_mib, "perplexity"
        )
    regions = [e for e in prof.events() if e.name.startswith("Torch-Compiled Region")]
    # 13 tokens in chunks of 5: per chunk the noise and the exponentials in forward, the
    # two backward passes, and without kept buffers the forward's two again.
    assert len(regions) == 3 * (4 if keep_mib else 6)
    assert not cpu_passes._failed


def test_passes_that_do_not_compile_run_eagerly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a working compiler: one warning, then the eager passes and their values."""

    def step() -> tuple[torch.Tensor, ...]:
        vq = make_vq(logits="distance")
        h = features(13)
        out = vq(h, noise_key=7)
        (out.quantized.square().sum() + out.diversity_loss + out.token_entropy).backward()
        return out.codes, out.quantized, h.grad, *grads_of(vq).values()

    monkeypatch.setattr(kernels, "_installed", cpu_speed.CPU_KERNELS)  # as a CPU run installs
    eager = step()
    monkeypatch.setattr(cpu_passes, "MIN_COMPILED_ELEMENTS", 0)
    monkeypatch.setattr(cpu_passes, "_compiled", {})
    monkeypatch.setattr(cpu_passes, "_failed", [])
    monkeypatch.setattr(cpu_passes, "_built", set())

    def no_compiler(fn: object, **_options: object) -> object:
        def broken(*_args: object) -> None:
            raise RuntimeError("C++ compile error\nthe compiler's output")

        return broken

    monkeypatch.setattr(torch, "compile", no_compiler)
    with pytest.warns(UserWarning, match=r"compiled passes did not build \(RuntimeError: C\+\+"):
        failed = step()
    assert cpu_passes._failed == ["RuntimeError: C++ compile error"]
    assert all(torch.equal(a, b) for a, b in zip(failed, eager, strict=True))


@pytest.mark.parametrize("layout", ["flat", "product"])
def test_eval_is_the_noise_free_argmax(layout: str) -> None:
    vq = make_vq(layout).eval()
    h = features(17)
    with torch.no_grad():
        first, second = vq(h), vq(h)
        logits = F.relu(vq.hidden(h)) @ vq.logits_weight.t() + vq.logits_bias
    assert torch.equal(first.codes, second.codes)
    if layout == "flat":
        assert torch.equal(first.codes, logits.argmax(-1))
    else:
        idx = logits.view(17, 2, 5).argmax(-1)
        assert torch.equal(first.codes, idx[:, 0] * 5 + idx[:, 1])
    # Training draws noise: different codes for some token, different from call to call.
    vq.train()
    noisy = [vq(h).codes for _ in range(3)]
    assert any(not torch.equal(c, first.codes) for c in noisy)
    assert not torch.equal(noisy[0], noisy[1])


@pytest.mark.parametrize("distance_width", [128, 2])
@pytest.mark.parametrize("layout", ["flat", "product"])
def test_distance_logits_pick_the_nearest_code(layout: str, distance_width: int) -> None:
    """Eq. 4: the noise-free code is the nearest one (per group), the codebook is the only
    weight, and the logits are minus the squared distance over sqrt(width), up to the
    per-token constant ||h||^2 / sqrt(width) that no softmax sees; codes wider than
    ``distance_width`` (here 8 and 4 against 2) over width / sqrt(distance_width)."""
    vq = make_vq(layout, logits="distance", distance_width=distance_width).eval()
    assert [name for name, _ in vq.named_parameters()] == ["codebook"]
    h = features(17).detach()
    table = vq.codebook.detach() if layout == "product" else vq.codebook.detach()[None]
    groups, entries, width = table.shape
    parts = h.view(17, groups, width)
    nearest = [torch.cdist(parts[:, g], table[g]).argmin(-1) for g in range(groups)]
    expected = nearest[0] if layout == "flat" else nearest[0] * entries + nearest[1]
    assert torch.equal(vq(h).codes, expected)
    scale = _distance_scale(width, distance_width)
    norms = (parts.square().sum(-1) * scale).repeat_interleave(entries, dim=1)
    torch.testing.assert_close(vq.code_logits(h), dense_logits(vq, h) + norms)
    log_probs = code_log_probs(vq, h)  # checks itself against the layer's argmax
    assert log_probs.shape == (17, vq.num_codes)


def test_wide_codes_keep_the_logit_gap_of_an_alignment() -> None:
    """Up to ``distance_width`` the scale is 1 / sqrt(w); beyond it, the logit by which a
    state at a given cosine to a code (both of norm sqrt(w), as LayerNorm'd states and N(0, 1)
    codes have) leads an orthogonal code, 2 s cos w, stays what it is at distance_width,
    where with 1 / sqrt(w) it would grow as sqrt(w) (64 at d 1,024 for a full alignment)."""
    for width in (4, 64, 128):
        assert distance_scale(width, 128) == 1 / math.sqrt(width)
    at_limit = 2 * 0.3 * 128 * distance_scale(128, 128)
    for width in (256, 1024, 4096):
        assert 2 * 0.3 * width * distance_scale(width, 128) == pytest.approx(at_limit)
    with pytest.raises(ValueError, match=r"vq\.distance_width"):
        VQConfig(distance_width=0)


def test_unknown_logits_are_refused() -> None:
    with pytest.raises(ValueError, match=r"vq\.logits"):
        VQConfig(logits="cosine")  # type: ignore[arg-type]


def test_ties_resolve_to_the_smallest_index() -> None:
    vq = make_vq().eval()
    with torch.no_grad():
        vq.logits_weight.zero_()
        vq.logits_bias.zero_()
        vq.logits_bias[[7, 12, 30]] = 2.0
    assert vq(features(4)).codes.tolist() == [7, 7, 7, 7]


def test_temperature_schedule() -> None:
    vq = make_vq(temperature_start=2.0, temperature_end=0.5, temperature_decay=0.9)
    assert vq.temperature == 2.0
    vq.set_step(3)
    assert vq.temperature == pytest.approx(2.0 * 0.9**3)
    vq.set_step(100)
    assert vq.temperature == 0.5
    out = vq(features(3))
    assert out.temperature == 0.5
    with pytest.raises(ValueError):
        vq.set_step(-1)


def test_noise_keys_differ_by_call_and_step_and_reset() -> None:
    vq = make_vq()
    vq.set_step(4)
    keys = [vq._noise_key(None), vq._noise_key(None)]
    vq.set_step(4)
    assert vq._noise_key(None) == keys[0] != keys[1]
    vq.set_step(5)
    assert vq._noise_key(None) not in keys


def test_diversity_and_perplexities_by_hand() -> None:
    vq = make_vq(num_codes=4, hidden_dim=3).eval()
    with torch.no_grad():
        vq.hidden.weight.copy_(torch.eye(3, D))
        vq.hidden.bias.zero_()
        vq.logits_weight.copy_(torch.tensor([[1.0, 0, 0], [0, 1, 0], [0, 0, 1], [0, 0, 0]]))
        vq.logits_bias.zero_()
    h = torch.zeros(3, D)
    h[0, 0], h[1, 1], h[2, :3] = 2.0, 1.0, torch.tensor([0.5, 0.0, 3.0])
    # Logits by hand: [2,0,0,0], [0,1,0,0], [0.5,0,3,0]; codes 0, 1, 2.
    rows = [[2.0, 0, 0, 0], [0, 1.0, 0, 0], [0.5, 0, 3.0, 0]]
    probs = [[math.exp(v) / sum(math.exp(x) for x in row) for v in row] for row in rows]
    pbar = [sum(p[k] for p in probs) / 3 for k in range(4)]
    entropy = -sum(p * math.log(p) for p in pbar)
    out = vq(h)
    assert out.codes.tolist() == [0, 1, 2]
    assert float(out.metrics()["vq_diversity_loss"]) == pytest.approx((4 - math.exp(entropy)) / 4)
    eq6 = make_vq(num_codes=4, hidden_dim=3, diversity_loss="eq6").eval()
    eq6.load_state_dict(vq.state_dict())
    assert float(eq6(h).diversity_loss.detach()) == pytest.approx(-entropy / 4, rel=1e-6)
    assert float(out.prob_perplexity) == pytest.approx(math.exp(entropy), rel=1e-6)
    assert float(out.code_perplexity) == pytest.approx(3.0, rel=1e-6)  # 3 codes, once each
    assert float(out.codes_used) == pytest.approx(0.75)
    assert out.code_counts.tolist() == [1, 1, 1, 0]
    h[1] = h[0]  # codes 0, 0, 2: histogram (2/3, 1/3)
    hist_entropy = -(2 / 3 * math.log(2 / 3) + 1 / 3 * math.log(1 / 3))
    assert float(vq(h).code_perplexity) == pytest.approx(math.exp(hist_entropy), rel=1e-6)


def test_product_layout_shapes_codes_and_diversity() -> None:
    vq = make_vq("product", groups=2, entries=5).eval()
    h = features(9)
    out = vq(h)
    assert out.quantized.shape == (9, D) and out.code_counts.shape == (10,)
    with torch.no_grad():
        logits = (F.relu(vq.hidden(h)) @ vq.logits_weight.t() + vq.logits_bias).view(9, 2, 5)
    idx = logits.argmax(-1)
    assert torch.equal(out.codes, idx[:, 0] * 5 + idx[:, 1])
    expected = torch.cat([vq.codebook[0, idx[:, 0]], vq.codebook[1, idx[:, 1]]], dim=1)
    assert torch.equal(out.quantized, expected)
    pbar = torch.softmax(logits, -1).mean(0)  # [G, V]
    ppl = torch.exp(-(pbar * pbar.log()).sum(-1)).sum()
    torch.testing.assert_close(out.diversity_loss, (10 - ppl) / 10, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(out.prob_perplexity, ppl, rtol=1e-6, atol=1e-6)
    eq6 = make_vq("product", groups=2, entries=5, diversity_loss="eq6").eval()
    eq6.load_state_dict(vq.state_dict())
    ref = ((pbar * pbar.log()).sum(-1) / 5).mean()
    torch.testing.assert_close(eq6(h).diversity_loss, ref, rtol=1e-6, atol=1e-7)
    assert vq.num_codes == 25 and vq(h, sample=True).codes.max() < 25


@pytest.mark.parametrize("logits", ["mlp", "distance"])
def test_product_gradients_reach_everything(logits: str) -> None:
    vq = make_vq("product", logits=logits).train()
    h = features(11)
    out = vq(h)
    (out.quantized.square().sum() + out.diversity_loss).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in vq.parameters())
    assert h.grad is not None and h.grad.abs().sum() > 0


@pytest.mark.parametrize("logits", ["mlp", "distance"])
@pytest.mark.parametrize("layout", ["flat", "product"])
def test_frozen_weights_pass_gradient_to_the_input_only(layout: str, logits: str) -> None:
    vq = make_vq(layout, logits=logits).train().freeze()
    h = features(12)
    out = vq(h)
    out.quantized.square().sum().backward()
    assert all(p.grad is None for p in vq.parameters())
    assert h.grad is not None and h.grad.abs().sum() > 0
    # The same gradient reaches h as with trainable weights.
    live = make_vq(layout, logits=logits).train()
    h2 = h.detach().clone().requires_grad_()
    live(h2, noise_key=0).quantized.square().sum().backward()
    frozen_h = h.detach().clone().requires_grad_()
    vq(frozen_h, noise_key=0).quantized.square().sum().backward()
    torch.testing.assert_close(frozen_h.grad, h2.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("logits", ["mlp", "distance"])
@pytest.mark.parametrize("from_gumbel", [False, True])
def test_chunking_gives_identical_results(from_gumbel: bool, logits: str) -> None:
    results = []
    for chunk in (3, 7, 1000):
        vq = make_vq(
            num_codes=48, chunk_tokens=chunk, diversity_from_gumbel=from_gumbel, logits=logits
        )
        h = features(29)
        out = vq(h, noise_key=5)
        (out.quantized.sin().sum() + 2 * out.diversity_loss).backward()
        results.append((out, grads_of(vq), h.grad))
    (ref, ref_grads, ref_h) = results[-1]
    for out, grads, grad_h in results[:-1]:
        assert torch.equal(out.codes, ref.codes)
        assert torch.equal(out.quantized, ref.quantized)
        # pbar sums the chunks' probabilities in another order: the last bits differ.
        torch.testing.assert_close(out.diversity_loss, ref.diversity_loss, rtol=4e-6, atol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(grad_h, ref_h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("from_gumbel", [False, True])
@pytest.mark.parametrize("entropy_weight", [0.0, 0.7])
def test_kept_buffers_give_the_recomputed_results(from_gumbel: bool, entropy_weight: float) -> None:
    n_tok, n_codes = 29, 48
    results, saved_numel = [], []
    for keep_mib in (0, 1):  # 3 x 29 x 48 fp32 buffers: 16 KiB, in chunks of 5 tokens
        vq = make_vq(num_codes=n_codes, diversity_from_gumbel=from_gumbel, logits="distance")
        vq.config.keep_logits_mib = keep_mib
        h = features(n_tok)
        sizes: list[int] = []

        def pack(t: torch.Tensor, sizes: list[int] = sizes) -> torch.Tensor:
            if t.dim() == 2 and t.shape[1] == n_codes:  # [tokens, codes]
                sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = vq(h, noise_key=5)
        (
            out.quantized.sin().sum() + 2 * out.diversity_loss + entropy_weight * out.token_entropy
        ).backward()
        results.append((out, grads_of(vq), h.grad))
        saved_numel.append(sum(sizes))
    # Kept: each chunk's centred logits, their exponentials and Gumbel softmax.
    assert saved_numel == [0, 3 * n_tok * n_codes]
    (out, grads, grad_h), (ref, ref_grads, ref_h) = results
    assert torch.equal(out.codes, ref.codes) and torch.equal(out.quantized, ref.quantized)
    assert torch.equal(out.diversity_loss, ref.diversity_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name
    assert torch.equal(grad_h, ref_h)


def _peak_bytes(fn) -> int:
    """Peak of tensor bytes allocated while ``fn`` runs (CPU allocator events)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]"
    )
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak


@pytest.mark.parametrize("logits", ["mlp", "distance"])
def test_activation_memory_is_bounded_by_the_chunk(logits: str) -> None:
    n_tok, n_codes, hidden = 1024, 4096, 16
    h = features(n_tok)
    # Recomputed in backward (nothing kept), as at the paper's shapes.
    vq = make_vq(
        num_codes=n_codes, hidden_dim=hidden, chunk_tokens=16, logits=logits, keep_logits_mib=0
    )
    params = {p.data_ptr() for p in vq.parameters()}
    saved: dict[int, torch.Tensor] = {}  # by storage: a tensor saved twice is held once

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in params:
            saved[t.data_ptr()] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out = vq(h)
    # Activations kept for backward: O(N (H + d)) plus a few O(K) statistics, no [N, K]; and
    # no [K, d] copy of the table (distance logits read the table itself).
    assert all(t.numel() < n_tok * n_codes // 8 for t in saved.values())
    assert not any(t.shape == (n_codes, D) for t in saved.values())
    bound = n_tok * (2 * hidden + 2 * D + 8) + 8 * n_codes
    assert sum(t.numel() for t in saved.values()) <= bound
    out.quantized.sum().backward()

    def run(chunk: int) -> int:
        vq = make_vq(
            num_codes=n_codes,
            hidden_dim=hidden,
            chunk_tokens=chunk,
            logits=logits,
            keep_logits_mib=0,
        )
        vq(h).quantized.sum()  # warm up allocations outside the measurement

        def step() -> None:
            out = vq(h)
            (out.quantized.sum() + out.diversity_loss).backward()

        return _peak_bytes(step)

    small, large = run(16), run(n_tok)
    logits_bytes = n_tok * n_codes * 4
    assert large > logits_bytes  # the unchunked run holds [N, K] fp32 at least once
    assert small < large / 3
    # Chunked: a few [chunk, K] buffers plus the O(K) gradients, far below one [N, K].
    assert small < logits_bytes / 4


def test_bf16_inputs_weights_and_autocast() -> None:
    h = features(10, dtype=torch.bfloat16)
    vq = make_vq().train()
    out = vq(h)
    assert out.quantized.dtype == torch.bfloat16
    assert torch.equal(out.quantized, vq.codebook[out.codes].to(torch.bfloat16))
    (out.quantized.float().square().sum() + out.diversity_loss).backward()
    assert h.grad is not None and h.grad.dtype == torch.bfloat16 and h.grad.abs().sum() > 0
    assert out.diversity_loss.dtype == torch.float32

    for layout in ("flat", "product"):
        vq16 = make_vq(layout).to(torch.bfloat16).train()
        h16 = features(10, dtype=torch.bfloat16)
        out16 = vq16(h16)
        assert out16.quantized.dtype == torch.bfloat16
        assert torch.equal(out16.quantized, vq16.lookup(out16.codes))
        (out16.quantized.float().sum() + out16.diversity_loss).backward()
        assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in vq16.parameters())

    # Under autocast the logits stay fp32: the codes equal an fp32 recomputation from the
    # (autocast) bf16 ReLU activations.
    vq = make_vq().eval()
    h32 = features(10)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = vq(h32)
        act = F.relu(vq.hidden(h32))
    assert out.quantized.dtype == torch.float32
    logits = act.float() @ vq.logits_weight.t() + vq.logits_bias
    assert torch.equal(out.codes, logits.argmax(-1))


def test_gumbel_noise_is_tiling_independent_and_gumbel_distributed() -> None:
    full = gumbel_noise(1234, 0, 40, 0, 300)
    assert torch.equal(gumbel_noise(1234, 10, 7, 0, 300), full[10:17])
    assert torch.equal(gumbel_noise(1234, 0, 40, 150, 150), full[:, 150:])
    assert torch.equal(gumbel_noise(1234, 33, 7, 77, 100), full[33:, 77:177])
    assert not torch.equal(gumbel_noise(1235, 0, 40, 0, 300), full)
    big = gumbel_noise(7, 0, 200, 0, 5000)
    assert torch.isfinite(big).all()
    assert float(big.mean()) == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni
    assert float(big.std()) == pytest.approx(math.pi / math.sqrt(6), abs=0.01)
    # Rows and columns are not copies of each other.
    assert float(torch.corrcoef(big[:2])[0, 1]).__abs__() < 0.05


def test_gumbel_noise_is_splitmix64_of_its_indices() -> None:
    """Element (t, c) from the documented hash on Python integers, with the full finaliser
    (the tensor version leaves out a last step that cannot reach the bits it reads)."""
    key, t0, c0 = 99, 1000, 5000
    noise = gumbel_noise(key, t0, 3, c0, 64)
    m64, golden = (1 << 64) - 1, vq_random._GOLDEN
    for t in range(3):
        row = vq_random._fmix64((t0 + t + 1) * golden + key)
        bits = [vq_random._fmix64(row + (c0 + c + 1) * golden) >> 41 for c in range(64)]
        assert all(0 <= b < 1 << 23 for b in bits) and row <= m64
        u = (torch.tensor(bits, dtype=torch.float32) + 0.5) * 2.0**-23
        assert torch.equal(noise[t], -torch.log(-torch.log(u)))


def test_flat_split_checks_divisibility_and_init_is_split_independent() -> None:
    cfg = VQConfig(num_codes=41, hidden_dim=16)
    fake = ParallelGroups(
        mp_group=None, dp_group=None, mp_rank=1, mp_size=2, dp_rank=0, dp_size=1, mp_ranks=(0, 1)
    )
    with pytest.raises(ValueError, match="divisible"):
        GumbelVectorQuantizer(cfg, D, fake, seed=0)
    full = make_vq(num_codes=3000)  # spans several init blocks of 1024 rows
    cfg = VQConfig(num_codes=3000, hidden_dim=16, logits="mlp")
    shards = []
    for rank in range(3):
        groups = ParallelGroups(
            mp_group=None,
            dp_group=None,
            mp_rank=rank,
            mp_size=3,
            dp_rank=0,
            dp_size=1,
            mp_ranks=(0, 1, 2),
        )
        part = GumbelVectorQuantizer(cfg, D, groups, seed=3)
        assert part.codebook.shape == (1000, D) and part.code_offset == 1000 * rank
        assert getattr(part.codebook, "tensor_model_parallel", False)
        shards.append(part.state_dict())
    merged = gather_state_dicts(shards)
    for key, value in full.state_dict().items():
        assert torch.equal(merged[key], value), key


def test_shard_helpers_round_trip() -> None:
    table = torch.arange(24.0).view(6, 4)
    parts = [split_codebook(table, r, 3) for r in range(3)]
    assert torch.equal(parts[1], table[2:4])
    assert torch.equal(gather_codebook(parts), table)
    with pytest.raises(ValueError):
        split_codebook(table, 0, 4)
    state = make_vq().state_dict()
    shards = [shard_state_dict(state, r, 2) for r in range(2)]
    assert shards[1]["codebook"].shape == (20, D)
    assert torch.equal(shards[1]["hidden.weight"], state["hidden.weight"])
    restored = gather_state_dicts(shards)
    assert all(torch.equal(restored[k], state[k]) for k in state)
    assert set(SPLIT_PARAMETERS) <= set(state)


def test_code_usage_counts_the_noise_free_argmax() -> None:
    vq = make_vq(num_codes=40).train()
    vq.set_step(2)
    h = features(50)
    out = vq(h, noise_key=5)
    with torch.no_grad():
        logits = F.relu(vq.hidden(h)) @ vq.logits_weight.t() + vq.logits_bias
    assert torch.equal(out.greedy_codes, logits.argmax(-1))
    assert not torch.equal(out.greedy_codes, out.codes)  # the sampled codes differ
    assert torch.equal(vq.eval()(h).greedy_codes, vq(h).codes)

    usage = vq.code_usage()
    usage.update(out.greedy_codes)
    usage.update(out.greedy_codes[:7])
    counts = torch.bincount(
        torch.cat([out.greedy_codes, out.greedy_codes[:7]]), minlength=40
    ).double()
    q = counts[counts > 0] / counts.sum()
    summary = usage.summary()
    assert summary["tokens"] == 57.0
    assert summary["codes_used"] == float((counts > 0).sum())
    assert summary["codes_used_fraction"] == float((counts > 0).sum()) / 40
    assert summary["dead_codes"] == 40 - summary["codes_used"]
    assert summary["code_perplexity"] == pytest.approx(float(torch.exp(-(q * q.log()).sum())))
    assert usage.summary() == {}  # a new window starts empty

    product = make_vq("product").train()
    out = product(h, noise_key=1)
    with torch.no_grad():
        logits = F.relu(product.hidden(h)) @ product.logits_weight.t() + product.logits_bias
    idx = logits.view(50, 2, 5).argmax(-1)
    assert torch.equal(out.greedy_codes, idx[:, 0] * 5 + idx[:, 1])
    usage = product.code_usage()
    usage.update(out.greedy_codes)
    assert usage.summary()["dead_codes"] == 25 - len(set(out.greedy_codes.tolist()))


@pytest.mark.parametrize("codes", [512, 102_400])
def test_diversity_gradient_does_not_vanish_with_the_codebook_size(codes: int) -> None:
    """d L / d H: wav2vec 2.0's form pulls about -exp(H)/K (near -1 while codes are in use)
    at any K; Eq. 6 pulls -1/K, nothing at the paper's K."""

    def grad_wrt_entropy(form: str) -> float:
        vq = GumbelVectorQuantizer(
            VQConfig(
                num_codes=codes, hidden_dim=4, diversity_loss=form, chunk_tokens=64, logits="mlp"
            ),
            D,
            ParallelGroups.single(),
            seed=0,
        )
        with torch.no_grad():
            vq.logits_weight.mul_(0.01)  # near-uniform codes: the start of training
        h = features(64)
        out = vq.eval()(h)
        (grad_bias,) = torch.autograd.grad(out.diversity_loss, vq.logits_bias)
        # The same logits with entropy as the loss: the ratio is dL/dH.
        vq.zero_grad()
        logits = F.relu(vq.hidden(h)) @ vq.logits_weight.t() + vq.logits_bias
        pbar = torch.softmax(logits, -1).mean(0)
        (grad_h,) = torch.autograd.grad(-(pbar * pbar.log()).sum(), vq.logits_bias)
        return float((grad_bias @ grad_h) / (grad_h @ grad_h))

    perplexity, eq6 = grad_wrt_entropy("perplexity"), grad_wrt_entropy("eq6")
    assert eq6 == pytest.approx(-1 / codes, rel=1e-3)
    assert perplexity < -0.5  # exp(H) / K stays near 1 for a codebook in use


@pytest.mark.parametrize("layout", ["flat", "product"])
@pytest.mark.parametrize("tokens", [3, 12, 40])
def test_entropy_diversity_is_the_shortfall_below_the_batch_ceiling(
    layout: str, tokens: int
) -> None:
    """``max(0, ln min(K, N) - H(pbar))`` written out, per group for the product layout: a
    batch of fewer tokens than codes is asked for ln N, which tokens committed to distinct
    codes reach, not ln K."""
    vq = make_vq(layout, num_codes=20, groups=2, entries=5, diversity_loss="entropy").eval()
    h = features(tokens, seed=tokens)
    out = vq(h)
    with torch.no_grad():
        logits = F.relu(vq.hidden(h)) @ vq.logits_weight.t() + vq.logits_bias
    if layout == "flat":
        pbar = torch.softmax(logits, -1).mean(0)
        entropy = -(pbar * pbar.log()).sum()
        ref = max(0.0, math.log(min(20, tokens)) - float(entropy))
    else:
        pbar = torch.softmax(logits.view(tokens, 2, 5), -1).mean(0)  # [G, V]
        entropy_g = -(pbar * pbar.log()).sum(-1)
        ref = float(torch.relu(math.log(min(5, tokens)) - entropy_g).mean())
    assert float(out.diversity_loss) == pytest.approx(ref, rel=1e-5, abs=1e-6)


def test_entropy_diversity_pulls_a_nat_whatever_the_codebook_state() -> None:
    """d L / d H(pbar) is -1 on a collapsed codebook and on a used one, and 0 above the
    ceiling; the perplexity form pulls -exp(H)/K, which fades as the codebook collapses."""

    def pull(form: str, spread: float, tokens: int) -> tuple[float, float]:
        vq = make_vq(num_codes=64, hidden_dim=4, diversity_loss=form).eval()
        with torch.no_grad():
            vq.logits_weight.mul_(spread)
        h = features(tokens)
        out = vq(h)
        (got,) = torch.autograd.grad(out.diversity_loss, vq.logits_bias)
        logits = F.relu(vq.hidden(h)) @ vq.logits_weight.t() + vq.logits_bias
        pbar = torch.softmax(logits, -1).mean(0)
        (ref,) = torch.autograd.grad(-(pbar * pbar.log()).sum(), vq.logits_bias)
        return float((got @ ref) / (ref @ ref)), float(out.prob_perplexity)

    collapsed, in_use = 60.0, 0.01  # logits spread wide: a few codes take every token
    assert pull("entropy", collapsed, 256)[0] == pytest.approx(-1.0, rel=1e-4)
    faded, perplexity = pull("perplexity", collapsed, 256)
    assert perplexity < 64 / 3 and faded == pytest.approx(-perplexity / 64, rel=1e-3)
    assert pull("entropy", in_use, 256)[0] == pytest.approx(-1.0, rel=1e-4)
    # 16 tokens over 64 near-uniform codes: H(pbar) ~ ln 64 is above the ceiling ln 16.
    assert pull("entropy", in_use, 16)[0] == 0.0


@pytest.mark.parametrize("layout", ["flat", "product"])
@pytest.mark.parametrize("logits", ["mlp", "distance"])
def test_copy_gradient_adds_the_code_gradient_to_h(layout: str, logits: str) -> None:
    """``copy_gradient = g``: the output is still exactly the chosen code, and h's gradient
    is the Gumbel path's plus g times the output's (VQ-VAE's straight-through); the
    weights' gradients are unchanged."""
    target = torch.randn(13, D, generator=torch.Generator().manual_seed(1))

    def run(gain: float) -> tuple[torch.Tensor, ...]:
        vq = make_vq(layout, logits=logits, copy_gradient=gain)
        vq.set_step(2)
        h = features(13)
        out = vq(h, noise_key=7)
        ((out.quantized * target).sum() + out.diversity_loss).backward()
        return out.quantized, out.codes, h.grad, *grads_of(vq).values()

    plain, copied = run(0.0), run(0.5)
    assert torch.equal(plain[0], copied[0]) and torch.equal(plain[1], copied[1])
    torch.testing.assert_close(copied[2], plain[2] + 0.5 * target, rtol=1e-6, atol=1e-6)
    for got, ref in zip(copied[3:], plain[3:], strict=True):
        torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_empty_batch_and_input_checks() -> None:
    vq = make_vq()
    out = vq(torch.zeros(0, D))
    assert out.quantized.shape == (0, D) and float(out.metrics()["vq_diversity_loss"]) == 0.0
    with pytest.raises(ValueError):
        vq(torch.zeros(3, D + 1))


def test_single_groups_and_mpu_answer_without_distributed() -> None:
    groups = ParallelGroups.single()
    mpu = DeepSpeedMpu(groups)
    assert groups.is_single and mpu.get_model_parallel_world_size() == 1
    assert mpu.get_data_parallel_rank() == 0 and mpu.get_data_parallel_group_ranks() == [0]
    assert mpu.get_tensor_model_parallel_src_rank() == 0
    assert not hasattr(mpu, "initialize_sequence_parallel")
