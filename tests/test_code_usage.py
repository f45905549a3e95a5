"""The codebook collapse warning judges a window against what its token count allows: silent on
a broad choice of codes at 512 and 102,400 codes, firing on a collapse onto a handful."""

from __future__ import annotations

import math

import pytest
import torch

from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.vq.code_usage import (
    PERPLEXITY_FLOOR,
    CodeUsage,
    collapse_warning,
    count_codes,
    uniform_codes,
)

PAPER_CODES = 102_400
PAPER_WINDOW = (11, 16_224)
"""A paper-preset logging window: 11 batches of about 16k tokens (178,464 tokens), the
window the issue's runs warned about."""
TINY_WINDOW = (10, 4096)


def _window(codes: int, sample, steps: int, tokens: int, seed: int = 0) -> dict[str, float]:
    """The figures ``CodeUsage`` reports for ``steps`` batches of ``tokens`` code ids drawn by
    ``sample(generator, n)``."""
    generator = torch.Generator().manual_seed(seed)
    usage = CodeUsage(codes, ParallelGroups.single())
    for _ in range(steps):
        usage.update(sample(generator, tokens))
    return usage.summary()


def _uniform(codes: int):
    return lambda g, n: torch.randint(0, codes, (n,), generator=g)


def _zipf(codes: int, exponent: float = 1.0):
    """Code ids with P(rank r) proportional to r^-exponent, the ranks shuffled over the codes:
    the word-frequency shape of natural text, spread over every code."""
    weights = torch.arange(1, codes + 1, dtype=torch.float64) ** -exponent
    order = torch.randperm(codes, generator=torch.Generator().manual_seed(1))
    return lambda g, n: order[torch.multinomial(weights, n, replacement=True, generator=g)]


def _few(codes: int, used: int):
    """A collapsed codebook: every token on one of ``used`` codes, one of them taking half."""
    chosen = torch.randperm(codes, generator=torch.Generator().manual_seed(2))[:used]
    weights = torch.full((used,), 0.5 / (used - 1), dtype=torch.float64)
    weights[0] = 0.5
    return lambda g, n: chosen[torch.multinomial(weights, n, replacement=True, generator=g)]


def _warn(figures: dict[str, float]) -> str | None:
    return collapse_warning(figures, codes_share=0.25, part="encoder", step=10)


def test_uniform_codes_matches_the_distinct_codes_of_uniform_draws() -> None:
    generator = torch.Generator().manual_seed(0)
    for codes, tokens in ((512, 600), (512, 4096), (102_400, 16_384), (102_400, 178_461)):
        drawn = [
            int(
                (
                    count_codes(torch.randint(0, codes, (tokens,), generator=generator), codes) > 0
                ).sum()
            )
            for _ in range(20 if codes < 1000 else 4)
        ]
        mean = sum(drawn) / len(drawn)
        assert uniform_codes(tokens, codes) == pytest.approx(mean, rel=0.01)
        assert uniform_codes(tokens, codes) == pytest.approx(
            codes * (1 - (1 - 1 / codes) ** tokens)
        )
    assert uniform_codes(178_461, 102_400) == pytest.approx(84_477, abs=1)
    assert uniform_codes(0, 512) == 0.0 and uniform_codes(5, 1) == 1.0
    assert uniform_codes(10**9, 512) == 512.0


@pytest.mark.parametrize(
    ("codes", "window"),
    [(512, TINY_WINDOW), (PAPER_CODES, PAPER_WINDOW), (PAPER_CODES, (1, 16_384))],
)
@pytest.mark.parametrize("shape", ["uniform", "zipf"])
def test_a_broad_choice_of_codes_is_not_called_collapsed(
    codes: int, window: tuple[int, int], shape: str
) -> None:
    sample = _uniform(codes) if shape == "uniform" else _zipf(codes)
    figures = _window(codes, sample, *window)
    if codes == PAPER_CODES and shape == "zipf":
        # Few effective codes for a window this long: the perplexity alone would call it
        # collapsed, its support (40% of the uniform codes and more) says it is not.
        assert figures["code_perplexity"] < PERPLEXITY_FLOOR * min(codes, figures["tokens"])
        assert figures["codes_used"] > 0.4 * uniform_codes(figures["tokens"], codes)
    assert _warn(figures) is None


@pytest.mark.parametrize(
    ("codes", "used", "window"),
    [
        (512, 8, TINY_WINDOW),
        (512, 40, TINY_WINDOW),
        (PAPER_CODES, 15, PAPER_WINDOW),
        (PAPER_CODES, 24, PAPER_WINDOW),
        (PAPER_CODES, 24, (1, 16_384)),
    ],
)
def test_a_collapse_onto_a_handful_of_codes_warns(
    codes: int, used: int, window: tuple[int, int]
) -> None:
    figures = _window(codes, _few(codes, used), *window)
    assert figures["codes_used"] == used
    warning = _warn(figures)
    assert warning is not None
    tokens = window[0] * window[1]
    # The window's token count, what a uniform choice would give, and what to do.
    assert f"picked {used} of {codes:,} VQ codes for {tokens:,} tokens" in warning
    assert f"a uniform choice would pick {uniform_codes(tokens, codes):,.0f}" in warning
    assert f"of at most {min(tokens, codes):,}" in warning
    assert "--diversity-weight" in warning and "step 10: the encoder" in warning


def test_each_part_of_the_threshold_alone_is_not_a_collapse() -> None:
    codes, tokens = PAPER_CODES, 178_461
    uniform = uniform_codes(tokens, codes)
    # Zipf-like over every code: few effective codes (perplexity 2% of the ceiling) but a
    # broad support, 40% of the uniform codes.
    broad = {"tokens": tokens, "codes_used": 0.4 * uniform, "code_perplexity": 2000.0}
    # 12,000 codes used about equally: 14% of the uniform codes, a perplexity of 11% of the
    # ceiling.
    even = {"tokens": tokens, "codes_used": 12_000.0, "code_perplexity": 11_500.0}
    for figures in (broad, even):
        figures["dead_codes"] = codes - figures["codes_used"]
        assert _warn(figures) is None
    even_small = {**even, "code_perplexity": PERPLEXITY_FLOOR * codes - 1}
    assert _warn(even_small) is not None
    assert collapse_warning(even_small, codes_share=0.01, part="encoder", step=1) is None


def test_the_share_of_uniform_codes_is_the_option() -> None:
    figures = _window(512, _few(512, 40), *TINY_WINDOW)
    assert figures["code_perplexity"] < PERPLEXITY_FLOOR * 512
    assert collapse_warning(figures, codes_share=0.25, part="encoder", step=3) is not None
    # 40 codes are 7.8% of the 512 a uniform choice picks: a share below that is silent.
    assert math.isclose(40 / uniform_codes(40_960, 512), 0.078, abs_tol=0.001)
    assert collapse_warning(figures, codes_share=0.05, part="encoder", step=3) is None


def test_the_vq_interface_warns_of_its_own_collapse_and_counts_its_own_codes() -> None:
    """What the pre-training unit and the validation read through the interface: the
    collapse warning of the window the health figures cover, and the usage of the codes the
    encoder head picked, against a direct count."""
    from megasemface.interfaces.base import NoInterface
    from megasemface.interfaces.vq.vector_quantized import VectorQuantizedInterface
    from megasemface.nn.config import PRESETS

    config = PRESETS["tiny"]()
    vq = VectorQuantizedInterface(config, ParallelGroups.single(), seed=0)
    codes = config.vq.num_codes
    generator = torch.Generator().manual_seed(0)
    for _ in range(TINY_WINDOW[0]):
        vq.encoder_usage.update(_few(codes, 8)(generator, TINY_WINDOW[1]))
    figures = vq.health()
    (warning,) = vq.health_warnings(figures, codes_share=0.25, step=7)
    assert f"picked 8 of {codes:,} VQ codes" in warning and "step 7: the encoder" in warning
    (field,) = vq.health_fields(figures)  # the progress line's, the extractor's window empty
    perplexity = figures["vq_code_perplexity"]
    assert field == f"enc codes 8/{codes:,} ppl {perplexity:,.1f}"
    assert vq.health_warnings(vq.health(), codes_share=0.25, step=8) == []  # a new window
    assert NoInterface().health_warnings(figures, codes_share=0.25, step=7) == []

    picked = _few(codes, 8)(generator, 1000)
    usage = vq.code_figures(picked)
    share = torch.bincount(picked).double()
    share = share[share > 0] / 1000
    assert usage["codes_used"] == len(torch.unique(picked)) == 8
    assert usage["code_tokens"] == 1000 and usage["codewords"] == codes
    assert usage["code_perplexity"] == pytest.approx(math.exp(-(share * share.log()).sum()))
    with pytest.raises(ValueError, match="picks no codes"):
        NoInterface().code_figures(picked)
