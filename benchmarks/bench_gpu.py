"""GPU benchmark: the SemFace joint step at the paper preset under DeepSpeed, beside HF BART.

One process, one GPU. The joint step of ``train.py --stage joint --interface vq`` (encoder
loss through the flat 102,400-code VQ layer, whose Gumbel noise is drawn on the GPU, and the
decoder loss on the encoder's codes; forward, backward, DeepSpeed's step) runs in bf16 under
ZeRO-2 and under ZeRO-3, through the same ``DeepSpeedEngine`` as ``train.py`` and the
configs in ``ds_configs/``. Beside them, in the same rounds: megasemface's translation step
and Hugging Face BART's of the same shape (``bench_peer.py``: bf16 autocast, the same
batches and loss), the ZeRO-2 step with DeepSpeed's own per-tensor gradient checks in place
of ``distributed/zero_grad_checks.py``'s multi-tensor ones, and a large bf16 matrix product
(the measured matmul peak). FLOPs are
counted per step with torch's FlopCounterMode (``megasemface/flop_count.py``); model FLOPs
utilisation (MFU) is FLOP/s over the GPU's dense bf16 peak from its datasheet, and the
measured peak stands beside it. The
compiled joint step (``train.py --compile``, ZeRO-2) then takes turns with the eager one,
with its compile time.

Without a GPU it says so and stops (``make bench`` reports it skipped); ``--cpu --preset
tiny`` runs the same code on DeepSpeed's CPU accelerator (bf16) to check it, with a CPU's
figures.

``--phases`` times each call of the ZeRO-2 step on the host and on the GPU and lists the
calls that make the host wait for the GPU.

Run: ``python benchmarks/bench_gpu.py [--preset paper] [--sentences 512] [--profile]
[--phases] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before DeepSpeed is imported

from bench_model import TRAIN_OBJECTIVE  # sibling script
from bench_peer import SPECIAL, Shape, _sync, build_runners, gpu_bf16_peak, make_batches

from megasemface.distributed import zero_grad_checks
from megasemface.distributed.engine import DeepSpeedEngine, init_distributed, load_ds_config
from megasemface.distributed.groups import ParallelGroups
from megasemface.flop_count import flop_counter
from megasemface.interfaces.factory import build_interface
from megasemface.models.semface import SemFaceModel
from megasemface.nn.compile import compile_layers
from megasemface.nn.config import PRESETS, build_model_config
from megasemface.nn.cpu_speed import prepare_process
from megasemface.objectives.sequences import SequenceBatch

ROOT = Path(__file__).resolve().parents[1]


def _timed(fn: Callable[[], None], device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


class JointStep:
    """The joint SemFace step of one preset through DeepSpeed, on one batch."""

    def __init__(
        self,
        preset: str,
        ds_config: str,
        groups: ParallelGroups,
        batch: SequenceBatch,
        *,
        compiled: bool = False,
        fused: bool = True,
        per_tensor_checks: bool = False,
    ) -> None:
        config = build_model_config(preset, ["vq.layout=flat", f"vq.fused_kernels={fused}"])
        torch.manual_seed(0)
        interface = build_interface("vq", config, groups=groups, seed=0)
        model = SemFaceModel(config, interface, SPECIAL, TRAIN_OBJECTIVE)
        model.stage = "joint"
        if compiled:
            compile_layers(model)
        self.params_m = sum(p.numel() for p in model.parameters()) / 1e6
        self.noise_device = ""
        self.engine = DeepSpeedEngine(
            model, load_ds_config(ROOT / "ds_configs" / ds_config), groups, list(model.parameters())
        )
        if per_tensor_checks:  # DeepSpeed's own gradient norm and inf/NaN check
            zero_grad_checks.uninstall(self.engine.optimizer)
        self.engine.train()
        self.batch = batch
        self.generator = torch.Generator().manual_seed(0)

    def __call__(self) -> None:
        out = self.engine.forward(self.batch, self.generator)
        # The quantizer's tensors (and so its hashed Gumbel noise) live where its logits do.
        self.noise_device = str(out.loss.device)
        self.engine.backward(out.loss)
        self.engine.step()

    def flops(self) -> float:
        """FLOPs of one forward and backward (the step it runs is a real one)."""
        with flop_counter() as counter:
            out = self.engine.forward(self.batch, self.generator)
            self.engine.backward(out.loss)
        self.engine.step()
        return float(counter.get_total_flops())


def _matmul(device: torch.device) -> tuple[Callable[[], None], float]:
    """A large product in the step's dtype and its FLOPs: bf16 on a GPU, fp32 on a CPU."""
    size, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)

    def matmul() -> None:
        a @ b

    return matmul, 2.0 * size**3


def _rounds(
    fns: dict[str, Callable[[], None]], repeats: int, device: torch.device
) -> dict[str, list[float]]:
    """Seconds of each call, taking turns (order reversed every other round)."""
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(repeats):
        for name in names if i % 2 == 0 else names[::-1]:
            times[name].append(_timed(fns[name], device))
    return times


def profile_table(fn: Callable[[], None], device: torch.device, rows: int = 15) -> str:
    """The operators of one call of ``fn`` by their own device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        started = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - started
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=rows)
    # Beside the table's device time total: the call's wall time under the profiler.
    return f"{table}\nThe profiled call took {wall * 1e3:,.1f} ms."


def _mark(marks: list[float], events: list[Any]) -> None:
    """As a call returns: the host's clock, and an event in the GPU's queue."""
    marks.append(time.perf_counter())
    if events:
        events[len(marks) - 1].record()


def phase_times(step: JointStep, device: torch.device, rounds: int = 6) -> dict[str, Any]:
    """Host time of each call of one step (forward, backward, DeepSpeed's step) beside the
    GPU time between events recorded as each call returns (medians), and the calls that
    make the host wait for the GPU (torch's sync debug mode, by source line).

    The host runs ahead of a GPU-bound step: its calls return early and it waits at the
    end. Where each call's host time equals its GPU time, the GPU waited for the host."""
    import warnings

    cuda = device.type == "cuda"
    names = ("forward", "backward", "step")
    host: dict[str, list[float]] = {name: [] for name in (*names, "wait", "whole")}
    gpu: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(rounds):
        _sync(device)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)] if cuda else []
        marks: list[float] = []
        _mark(marks, events)
        out = step.engine.forward(step.batch, step.generator)
        _mark(marks, events)
        step.engine.backward(out.loss)
        _mark(marks, events)
        step.engine.step()
        _mark(marks, events)
        _sync(device)
        marks.append(time.perf_counter())
        for i, name in enumerate(names):
            host[name].append(marks[i + 1] - marks[i])
            if cuda:
                gpu[name].append(events[i].elapsed_time(events[i + 1]) / 1e3)
        host["wait"].append(marks[4] - marks[3])
        host["whole"].append(marks[4] - marks[0])
    result: dict[str, Any] = {
        "host_s": {k: statistics.median(v) for k, v in host.items()},
        "gpu_s": {k: statistics.median(v) for k, v in gpu.items() if v},
    }
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
                _sync(device)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        sites: dict[str, int] = {}
        for w in caught:
            where = f"{'/'.join(Path(w.filename).parts[-2:])}:{w.lineno}"
            sites[where] = sites.get(where, 0) + 1
        result["syncs"] = dict(sorted(sites.items()))
    return result


def report_phases(p: dict[str, Any]) -> str:
    lines = ["ZeRO-2 joint step by call (medians): host time, GPU time between the calls' returns"]
    for name in ("forward", "backward", "step"):
        gpu = p["gpu_s"].get(name)
        lines.append(
            f"  {name:8s} host {p['host_s'][name] * 1e3:7.1f} ms"
            + (f", GPU {gpu * 1e3:7.1f} ms" if gpu is not None else "")
        )
    lines.append(
        f"  waiting for the GPU after the step {p['host_s']['wait'] * 1e3:.1f} ms; "
        f"whole step {p['host_s']['whole'] * 1e3:.1f} ms"
    )
    if "syncs" in p:
        lines.append(f"  calls that wait for the GPU in one step: {sum(p['syncs'].values())}")
        lines += [f"    {count:3d} {where}" for where, count in p["syncs"].items()]
    return "\n".join(lines)


def run(
    preset: str,
    sentences: int,
    length: int,
    repeats: int,
    compiled: bool,
    save: Callable[[dict[str, Any]], None],
    profiled: bool = False,
    phases: bool = False,
) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    groups = init_distributed(1)
    shape = Shape(preset, (), sentences, length, length, repeats)
    config = build_model_config(preset, [])
    src, _ = make_batches(shape, config.vocab_size, torch.device("cpu"))  # as the loader reads
    tokens = int(src.lengths_B.sum())
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "preset": preset,
        "sentences": sentences,
        "tokens_per_step": tokens,
        "datasheet_peak": gpu_bf16_peak(torch.cuda.get_device_name(device))
        if device.type == "cuda"
        else None,
    }
    steps = {
        "ZeRO-2": JointStep(preset, "zero2_bf16.json", groups, src),
        "ZeRO-3": JointStep(preset, "zero3_bf16.json", groups, src),
        # The VQ layer's passes over its logits as eager PyTorch operations (as on a CPU).
        "ZeRO-2 eager VQ": JointStep(preset, "zero2_bf16.json", groups, src, fused=False),
        # DeepSpeed's per-tensor gradient checks in place of zero_grad_checks' multi-tensor ones.
        "ZeRO-2 per-tensor checks": JointStep(
            preset, "zero2_bf16.json", groups, src, per_tensor_checks=True
        ),
    }
    _, runners, target_tokens, _ = build_runners(dataclasses.replace(shape), device)
    flops = {name: step.flops() for name, step in steps.items()}
    for runner in runners:
        flops[runner.name] = runner.measured_step(device)["flops_per_step"]
    matmul, matmul_flops = _matmul(device)
    fns: dict[str, Callable[[], None]] = {**steps, "matmul": matmul}
    for runner in runners:
        fns[runner.name] = lambda r=runner: r.step(device)  # type: ignore[misc]
    for fn in fns.values():
        fn()  # warm-up
    times = _rounds(fns, repeats, device)
    peak = [matmul_flops / t for t in times["matmul"]]
    results["matmul_peak"] = statistics.median(peak)
    results["steps"] = {}
    for name in [*steps, *(r.name for r in runners)]:
        seconds = statistics.median(times[name])
        counted = tokens if name in steps else target_tokens
        entry = {
            "step_s": seconds,
            "tokens_per_s": counted / seconds,
            "flops_per_step": flops[name],
            "flops_per_s": flops[name] / seconds,
            "share_of_measured_peak": statistics.median(
                flops[name] / t / p for t, p in zip(times[name], peak, strict=True)
            ),
        }
        if name in steps:
            entry["params_m"] = steps[name].params_m
            entry["noise_device"] = steps[name].noise_device
        if results["datasheet_peak"]:
            entry["mfu"] = entry["flops_per_s"] / results["datasheet_peak"]
        results["steps"][name] = entry
    if device.type == "cuda":
        results["max_memory_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    print(report(results), flush=True)
    save(results)
    if profiled:
        results["profiles"] = {
            "joint step, ZeRO-2": profile_table(steps["ZeRO-2"], device),
            "joint step, ZeRO-2, per-tensor checks": profile_table(
                steps["ZeRO-2 per-tensor checks"], device
            ),
            "translation step": profile_table(fns[runners[0].name], device),
        }
        for name, table in results["profiles"].items():
            print(f"\nProfile of one {name}:\n{table}", flush=True)
        save(results)
    if phases:
        results["phases"] = phase_times(steps["ZeRO-2"], device)
        print(report_phases(results["phases"]), flush=True)
        save(results)
    if compiled:
        results["compiled"] = _compiled(preset, groups, src, steps["ZeRO-2"], repeats, device)
        print(report_compiled(results["compiled"]), flush=True)
        save(results)
    return results


def _compiled(
    preset: str,
    groups: ParallelGroups,
    batch: SequenceBatch,
    eager: JointStep,
    repeats: int,
    device: torch.device,
) -> dict[str, float]:
    step = JointStep(preset, "zero2_bf16.json", groups, batch, compiled=True)
    first = _timed(step, device)
    times = _rounds({"eager": eager, "compiled": step}, repeats, device)
    return {
        "first_step_s": first,
        "compile_s": first - statistics.median(times["compiled"]),
        "step_s": statistics.median(times["compiled"]),
        "speedup": statistics.median(
            e / c for e, c in zip(times["eager"], times["compiled"], strict=True)
        ),
    }


def report(r: dict[str, Any]) -> str:
    peak = r["datasheet_peak"]
    lines = [
        f"{r['device']} (torch {r['torch']}), preset {r['preset']}: {r['sentences']} sentences, "
        f"{r['tokens_per_step']:,} tokens a step; bf16 matmul measured "
        f"{r['matmul_peak'] / 1e12:,.0f} TFLOP/s"
        + (f", datasheet dense bf16 peak {peak / 1e12:,.0f} TFLOP/s" if peak else ""),
        "",
        "| step | step time | tokens/s | TFLOP/step | TFLOP/s | MFU (datasheet) "
        "| of the measured peak |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in r["steps"].items():
        label = f"joint SemFace, VQ flat, bf16 {name}" if name.startswith("ZeRO") else name
        if name == "megasemface":
            label = "megasemface translation step (autocast bf16)"
        elif name == "HF BART":
            label = "HF BART translation step (autocast bf16)"
        mfu = f"{s['mfu']:.1%}" if "mfu" in s else "-"
        lines.append(
            f"| {label} | {s['step_s'] * 1e3:,.1f} ms | {s['tokens_per_s']:,.0f} "
            f"| {s['flops_per_step'] / 1e12:,.2f} | {s['flops_per_s'] / 1e12:,.1f} | {mfu} "
            f"| {s['share_of_measured_peak']:.1%} |"
        )
    if "max_memory_allocated_gib" in r:
        lines.append(f"\nGPU memory: at most {r['max_memory_allocated_gib']:,.1f} GiB allocated.")
    return "\n".join(lines)


def report_compiled(c: dict[str, float]) -> str:
    return (
        f"compiled joint step (ZeRO-2): {c['step_s'] * 1e3:,.1f} ms, {c['speedup']:.2f}x the "
        f"eager step (median of paired rounds); first step {c['first_step_s']:,.1f} s, of "
        f"which compiling about {c['compile_s']:,.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", default="paper", choices=sorted(PRESETS))
    parser.add_argument("--sentences", type=int, default=512, help="sentences a step")
    parser.add_argument("--length", type=int, default=32, help="longest sentence (tokens)")
    parser.add_argument("--repeats", type=int, default=10, help="timed rounds")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled step")
    parser.add_argument("--profile", action="store_true", help="print each step's top operators")
    parser.add_argument(
        "--phases", action="store_true", help="host and GPU time of each call, host waits"
    )
    parser.add_argument("--cpu", action="store_true", help="run without a GPU (a check)")
    parser.add_argument("--json", type=Path, help="also write the figures as JSON")
    args = parser.parse_args(argv)
    for name in ("sentences", "length", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not torch.cuda.is_available() and not args.cpu:
        print("GPU benchmark: skipped (no CUDA device; --cpu runs it on this CPU as a check).")
        if args.json:
            args.json.write_text(json.dumps({"skipped": "no CUDA device"}) + "\n")
        return 0
    prepare_process()

    def save(results: dict[str, Any]) -> None:
        if args.json:
            args.json.write_text(json.dumps(results, indent=1) + "\n")

    run(
        args.preset,
        args.sentences,
        args.length,
        args.repeats,
        not args.no_compile,
        save,
        args.profile,
        args.phases,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
