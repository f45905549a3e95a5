"""Model benchmark: training-step throughput and FLOP utilisation beside the machine's peak.

For the tiny and the paper preset (batch sized to this machine), one SemFace joint step as
``train.py`` runs it by default (encoder loss through the VQ interface, decoder loss on the
encoder's own codes; forward, backward and Adam) is timed, and its FLOPs are counted with
torch's FlopCounterMode (with the in-place products and CPU attention that it leaves out:
``megasemface/flop_count.py``). Beside them, the same run measures the machine's fp32
matrix-multiply peak, so that "model FLOPs/s" reads as a share of what this machine can do. The VQ
layer's share of step time (its calls timed in isolation on the same tokens) stands beside
its share of the step's FLOPs, for the flat and the product codebook. Beside the step, the
same step with the output layer and its cross-entropy through autograd (logits,
``F.cross_entropy``, an argmax for the accuracy) instead of the fused pass of
``objectives/output_loss.py``: what the fusion buys. And the same step with compiled layers
(``train.py --compile``), with the seconds its first call spends compiling (into a fresh
inductor cache: what a run on a new machine pays), after the first eager step, whose time
is reported too: at the paper preset it compiles the flat VQ layer's passes
(``nn/cpu_passes.py``). The step, the peak matmul, the VQ calls,
the autograd step and the compiled step take turns, and each share or ratio is the median of
per-round ratios, so load from other processes cancels out. A round in which a call grew
the process's heap (the kernel zero-filling fresh pages, which a training run pays in its
first steps only) is timed again, and the report counts them.

The steps run with freed host memory kept for reuse, as ``train.py`` runs them
(``megasemface/host_memory.py``). Beside them, the tiny joint step on batches of demo-like,
varying shapes (64 sentences of 20 to 45 tokens) in fresh processes taking turns, with that
setting and with glibc's own: the speed-up and the page faults a step of each.

Run: ``python benchmarks/bench_model.py [--presets tiny,paper] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from megasemface.flop_count import flop_counter
from megasemface.host_memory import keep_freed_memory
from megasemface.interfaces.factory import build_interface
from megasemface.models import semface
from megasemface.models.semface import SemFaceModel
from megasemface.nn import cpu_gemm
from megasemface.nn.compile import compile_layers
from megasemface.nn.config import build_model_config
from megasemface.nn.cpu_speed import apply_cpu_speed, prepare_process
from megasemface.objectives.output_loss import OutputLoss
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.training.options import TrainConfig
from megasemface.training.units.base import objective_config_from

SPECIAL = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))
TRAIN_OBJECTIVE = objective_config_from(
    TrainConfig(stage="joint", interface="vq", data=Path(), spm_model=Path(), output_dir=Path())
)
"""The losses of ``train.py --stage joint --interface vq`` without other options (its
decoder stage reads the encoder's own codes), which are not the library's defaults."""
SHAPES = {"tiny": (32, 32), "paper": (4, 32)}  # sentences x tokens per batch
REPEATS = {"tiny": 15, "paper": 5}
"""Timed rounds by default: a tiny step is short enough for one burst of load to move a
median of three, and cheap enough for more. A paper step taking turns with the other calls
now and then ran 1.6x long (1,630-1,654 ms and one 2,613 in five rounds), which moved a
median of three: the heap grew in that round (:data:`HEAP_GROWTH_FAULTS`)."""


PEAK_SIZE = 2048


def _matmul_operands(size: int = PEAK_SIZE) -> Callable[[], None]:
    a, b = torch.randn(size, size), torch.randn(size, size)

    def matmul() -> None:
        # The product the models run: oneDNN's where it is faster than torch's BLAS
        # (megasemface/nn/cpu_gemm.py), so that no share of the peak reads above 100%.
        cpu_gemm.mm(a, b)

    return matmul


def matmul_peak(size: int = PEAK_SIZE, repeats: int = 5) -> float:
    """fp32 FLOP/s of a large square matmul: the machine's practical peak (through oneDNN
    where the models' products go through it)."""
    matmul = _matmul_operands(size)
    matmul()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        matmul()
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best


HEAP_GROWTH_FAULTS = 2_000
"""Page faults in one call that mark a round in which the heap grew (8 MB of fresh pages):
the kernel zero-fills them, up to 0.6 s at the paper preset. The paper preset's step
repeated alone stopped growing its heap after 17 steps (then none in 43 more); five
workloads taking turns in one process keep re-fragmenting it, and it grew again every ten
rounds or so. Such a round is timed again (at most ``repeats`` times in all), and the
report says how many were."""


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _alternating(
    fns: dict[str, Callable[[], None]], repeats: int, retime_heap_growth: bool = False
) -> tuple[dict[str, list[float]], int]:
    """Seconds of each call, the calls taking turns: on a shared machine a burst of load
    then slows neighbouring calls alike, and per-round ratios stay true. Two warm-up calls
    each: a step's first two grow the heap that later steps reuse (at the paper preset
    about 1.3M and 0.2M page faults, then few: ``megasemface/host_memory.py``). With
    ``retime_heap_growth`` (freed memory kept, where a fault is fresh memory and not a
    step's own allocation), a round in which a call grew the heap is timed again
    (:data:`HEAP_GROWTH_FAULTS`). Returns the times and the rounds timed again."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    timed = retimed = 0
    while timed < repeats:
        round_times, grew = {}, False
        for name, fn in fns.items():
            faults = _minor_faults()
            started = time.perf_counter()
            fn()
            round_times[name] = time.perf_counter() - started
            grew |= _minor_faults() - faults > HEAP_GROWTH_FAULTS
        if grew and retime_heap_growth and retimed < repeats:
            retimed += 1
            continue
        for name, seconds in round_times.items():
            times[name].append(seconds)
        timed += 1
    return times, retimed


def autograd_output_loss(
    hidden_ND: torch.Tensor,
    weight_VD: torch.Tensor,
    bias_V: torch.Tensor | None,
    targets_N: torch.Tensor,
    smoothing: float = 0.0,
) -> OutputLoss:
    """The output layer and its loss as autograd computes them, unfused: the peer of
    ``output_cross_entropy``."""
    bias = None if bias_V is None else bias_V.to(hidden_ND.dtype)
    logits_NV = F.linear(hidden_ND, weight_VD.to(hidden_ND.dtype), bias).float()
    loss = F.cross_entropy(logits_NV, targets_N, label_smoothing=smoothing)
    with torch.no_grad():
        nll = F.cross_entropy(logits_NV, targets_N) if smoothing else loss.detach()
        accuracy = (logits_NV.argmax(-1) == targets_N).float().mean()
    return OutputLoss(loss, nll, accuracy)


def _batch(vocab: int, sentences: int, length: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(7, vocab, (sentences, length), generator=g)
    return SequenceBatch(tokens, torch.full((sentences,), length), torch.arange(sentences) % 2)


def bench(
    preset: str, layout: str, repeats: int, kept_memory: bool = False, compile: bool = True
) -> dict[str, float]:
    """One preset and codebook layout; the step, the peak matmul and the VQ calls alternate.
    ``kept_memory``: freed memory is kept (:func:`keep_freed_memory` applied), so that a
    round whose calls grew the heap is timed again. ``compile``: time the compiled step too
    (its first call compiles, minutes on a busy machine)."""
    matmul = _matmul_operands()
    config = build_model_config(preset, [f"vq.layout={layout}"])
    torch.manual_seed(0)
    model = SemFaceModel(config, build_interface("vq", config), SPECIAL, TRAIN_OBJECTIVE)
    apply_cpu_speed(model, "cpu")  # as the trainer builds it
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    batch = _batch(config.vocab_size, *SHAPES[preset])
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model.joint_loss(batch, generator).loss.backward()
        optimizer.step()

    def autograd_step() -> None:
        with mock.patch.object(semface, "output_cross_entropy", autograd_output_loss):
            step()

    with flop_counter() as counter:
        model.joint_loss(batch, generator).loss.backward()
    total = counter.get_total_flops()
    # torch's own count too (no in-place products, no CPU attention), over torch's own
    # products (it does not see oneDNN's): the count of the figures before
    # megasemface/flop_count.py, for comparison with them.
    with FlopCounterMode(display=False) as counter, cpu_gemm.blas_only():
        model.joint_loss(batch, generator).loss.backward()
    stock = counter.get_total_flops()
    # The first step outside FLOP counting: at the paper preset it compiles the VQ layer's
    # passes (nn/cpu_passes.py), which every run pays once.
    started = time.perf_counter()
    step()
    first_step = time.perf_counter() - started

    calls: dict[str, Callable[[], None]] = {}
    first_compiled = 0.0
    if compile:
        torch.manual_seed(0)
        compiled = SemFaceModel(config, build_interface("vq", config), SPECIAL, TRAIN_OBJECTIVE)
        apply_cpu_speed(compiled, "cpu")
        compile_layers(compiled)
        compiled_optimizer = torch.optim.Adam(compiled.parameters(), lr=1e-4, fused=True)

        def compiled_step() -> None:
            compiled_optimizer.zero_grad(set_to_none=True)
            compiled.joint_loss(batch, generator).loss.backward()
            compiled_optimizer.step()

        started = time.perf_counter()
        compiled_step()
        first_compiled = time.perf_counter() - started
        calls["compiled"] = compiled_step

    # The VQ layer's two calls per joint step, timed alone on the same number of tokens.
    quantizer = model.interface.quantizer
    tokens = int(batch.lengths_B.sum()) + len(batch.lengths_B)  # with </s>
    h = torch.randn(tokens, config.d_model, requires_grad=True)

    def vq_calls() -> None:
        out = quantizer(h)
        (out.quantized.sum() + out.diversity_loss).backward()
        quantizer(h, detach_weights=True).quantized.sum().backward()

    # Counted on the same isolated calls: FlopCounterMode attributes a custom autograd
    # Function's backward (the chunked VQ recomputation) to no module.
    with flop_counter() as counter:
        vq_calls()
    vq_flops = counter.get_total_flops()

    times, retimed = _alternating(
        {
            "step": step,
            "matmul": matmul,
            "vq": vq_calls,
            "autograd": autograd_step,
            **calls,
        },
        repeats,
        retime_heap_growth=kept_memory,
    )
    step_time = statistics.median(times["step"])
    peak_flops = [2 * PEAK_SIZE**3 / t for t in times["matmul"]]
    real_tokens = float(batch.lengths_B.sum())
    compiled_figures = (
        {
            "compiled_step_s": statistics.median(times["compiled"]),
            "compiled_speedup": statistics.median(
                t / c for t, c in zip(times["step"], times["compiled"], strict=True)
            ),
            "compile_s": first_compiled - statistics.median(times["compiled"]),
        }
        if compile
        else {}
    )
    return {
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "step_s": step_time,
        "first_step_s": first_step,
        "tokens_per_s": 2 * real_tokens / step_time,  # each sentence feeds both stages
        "flops_per_step": float(total),
        "flops_per_s": total / step_time,
        "matmul_peak": statistics.median(peak_flops),
        "share_of_peak": statistics.median(
            total / t / peak for t, peak in zip(times["step"], peak_flops, strict=True)
        ),
        "stock_share_of_peak": statistics.median(
            stock / t / peak for t, peak in zip(times["step"], peak_flops, strict=True)
        ),
        "vq_time_share": statistics.median(
            v / t for v, t in zip(times["vq"], times["step"], strict=True)
        ),
        "vq_flop_share": vq_flops / total,
        "autograd_step_s": statistics.median(times["autograd"]),
        "fused_speedup": statistics.median(
            a / t for a, t in zip(times["autograd"], times["step"], strict=True)
        ),
        **compiled_figures,
        "rounds_retimed": float(retimed),
    }


def allocator_child(mode: str, steps: int) -> dict[str, object]:
    """In a fresh process: the tiny joint step on varying batch shapes, freed memory kept
    (``keep``) or under glibc's own settings (``glibc``); seconds and page faults a step."""
    if mode == "keep" and not keep_freed_memory():
        raise SystemExit("keep_freed_memory() did not apply here (not glibc, or MALLOC_* set)")
    config = build_model_config("tiny", [])
    torch.manual_seed(0)
    model = SemFaceModel(config, build_interface("vq", config), SPECIAL, TRAIN_OBJECTIVE)
    apply_cpu_speed(model, "cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    shapes = random.Random(0)
    batches = [_batch(config.vocab_size, 64, shapes.randint(20, 45)) for _ in range(steps + 2)]
    generator = torch.Generator().manual_seed(0)
    seconds, faults = [], []
    for index, batch in enumerate(batches):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        model.joint_loss(batch, generator).loss.backward()
        optimizer.step()
        if index >= 2:  # the first steps grow the heap either way
            seconds.append(time.perf_counter() - started)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return {"seconds": sum(seconds), "faults_per_step": statistics.mean(faults)}


def allocator_comparison(rounds: int, steps: int = 8) -> dict[str, float]:
    """Kept freed memory against glibc's settings, fresh processes taking turns."""
    runs: dict[str, list[dict]] = {"keep": [], "glibc": []}
    for _ in range(rounds):
        for mode in runs:
            command = [sys.executable, __file__, "--allocator-child", mode, "--steps", str(steps)]
            command += ["--threads", str(torch.get_num_threads())]
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            runs[mode].append(json.loads(out))
    pairs = zip(runs["glibc"], runs["keep"], strict=True)
    return {
        "allocator_speedup": statistics.median(g["seconds"] / k["seconds"] for g, k in pairs),
        "keep_step_s": statistics.median(r["seconds"] / steps for r in runs["keep"]),
        "glibc_step_s": statistics.median(r["seconds"] / steps for r in runs["glibc"]),
        "keep_faults_per_step": statistics.median(r["faults_per_step"] for r in runs["keep"]),
        "glibc_faults_per_step": statistics.median(r["faults_per_step"] for r in runs["glibc"]),
    }


def _compiled_cell(r: dict[str, float]) -> str:
    if "compiled_step_s" not in r:
        return "not timed (--no-compile)"
    return (
        f"{r['compiled_step_s'] * 1e3:,.0f} ms ({r['compiled_speedup']:.2f}x), "
        f"{r['compile_s']:.0f} s"
    )


def report(results: dict[str, dict[str, float]], allocator: dict[str, float] | None) -> str:
    rows = [
        f"fp32 matmul peak ({PEAK_SIZE}-square, timed in turn with each step): "
        + ", ".join(f"{name} {r['matmul_peak'] / 1e9:,.1f}" for name, r in results.items())
        + " GFLOP/s",
        "",
        "| preset, codebook | params | step (the first, compiling the VQ passes) | tokens/s "
        "| model FLOP/s (share of peak; by torch's own count) "
        "| VQ time share / FLOP share | output loss through autograd: step (fused speed-up) "
        "| compiled layers: step (speed-up), compile time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        rows.append(
            f"| {name} | {r['params_m']:.1f}M | {r['step_s'] * 1e3:,.0f} ms "
            f"({r['first_step_s']:,.1f} s) "
            f"| {r['tokens_per_s']:,.0f} | {r['flops_per_s'] / 1e9:,.1f} G "
            f"({r['share_of_peak']:.0%}; {r['stock_share_of_peak']:.0%}) "
            f"| {r['vq_time_share']:.0%} / "
            f"{r['vq_flop_share']:.0%} | {r['autograd_step_s'] * 1e3:,.0f} ms "
            f"({r['fused_speedup']:.2f}x) | {_compiled_cell(r)} |"
        )
    retimed = {name: int(r["rounds_retimed"]) for name, r in results.items()}
    if any(retimed.values()):
        rows += [
            "",
            "Rounds timed again because a call grew the heap in them (page faults over "
            f"{HEAP_GROWTH_FAULTS:,}): " + ", ".join(f"{n} {k}" for n, k in retimed.items()),
        ]
    if allocator:
        a = allocator
        rows += [
            "",
            f"Tiny joint step, varying shapes, fresh processes in turn: freed memory kept "
            f"{a['keep_step_s'] * 1e3:,.0f} ms ({a['keep_faults_per_step']:,.0f} page faults "
            f"a step), glibc's settings {a['glibc_step_s'] * 1e3:,.0f} ms "
            f"({a['glibc_faults_per_step']:,.0f}): {a['allocator_speedup']:.2f}x",
        ]
    return "\n".join(rows)


def run(
    presets: list[str], repeats: int | None = None, kept_memory: bool = False, compile: bool = True
) -> dict[str, dict[str, float]]:
    return {
        f"{preset}, {layout}": bench(
            preset, layout, repeats or REPEATS[preset], kept_memory, compile
        )
        for preset in presets
        for layout in ("flat", "product")
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", default="tiny,paper")
    parser.add_argument("--repeats", type=int, help="timed rounds (default: 15 tiny, 5 paper)")
    parser.add_argument("--json", help="also write the figures as JSON")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled step")
    parser.add_argument("--allocator-child", choices=("keep", "glibc"), help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=8, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    unknown = sorted(set(args.presets.split(",")) - set(SHAPES))
    if unknown:
        parser.error(f"unknown presets {unknown}; known: {sorted(SHAPES)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.allocator_child:
        print(json.dumps(allocator_child(args.allocator_child, args.steps)))
        return 0
    kept_memory = prepare_process()  # as train.py
    # An empty kernel cache: the first compile pays what a run on a new machine pays; later
    # rows reuse the graphs of layers of the same shapes, as a pipeline's later runs do.
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="bench-inductor-"))
    results = run(args.presets.split(","), args.repeats, kept_memory, not args.no_compile)
    allocator = allocator_comparison(args.repeats or 3) if "tiny" in args.presets else None
    print(report(results, allocator))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"results": results, "allocator": allocator}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
