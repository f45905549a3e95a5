"""The tiny joint SemFace step at this revision beside the same step at an earlier one.

The earlier revision (default: the last before the speed work of issue 13) is checked out
into a temporary git worktree, and the step of each revision runs in fresh processes taking
turns, so that a burst of load slows both alike. The step is that of ``bench_model.py``:
the tiny preset, 32 sentences of 32 tokens, the joint loss's forward and backward and an
Adam step, with the model the earlier revision builds (its VQ logits, an MLP, where this
revision's default is the distance to the codes: ``vq.logits=mlp`` here). Each revision's
step runs as its ``train.py`` ran it: the earlier one with torch's single-tensor Adam and
glibc's allocator settings, this one with the fused Adam and freed host memory kept
(``megasemface/host_memory.py``). A third row runs the earlier model code under this
revision's optimizer and allocator: what the model code alone gained.

Each process reports the median seconds of its steps and the step's FLOPs under torch's own
``FlopCounterMode`` (torch's products only, as the earlier revision's benchmark counted):
the earlier revision recomputes work this one keeps (the VQ logits in backward), so its
count is higher for the same model and FLOP/s understates the gain that the time shows.

Run: ``python benchmarks/bench_revision.py [--against REV] [--rounds 2] [--json out.json]``
(needs the repository's git history).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
HOST_MEMORY = ROOT / "megasemface" / "host_memory.py"
BEFORE_SPEED_WORK = "3cf4fdb"
"""The last commit before issue 13's speed work (the fused output loss came next)."""
SIDES = ("before", "before, with this code's optimizer and allocator", "now")


def _child(args: argparse.Namespace) -> dict[str, float]:
    """One revision's step, in this process: seconds a step and FLOPs."""
    if args.tree:
        # Import the checked-out revision, not the editable install of this one (its finder
        # would also supply modules that the revision does not have).
        sys.path.insert(0, args.tree)
        sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in type(f).__module__]
    if args.current_settings:
        # This revision's allocator settings, loaded from its file: the earlier revision
        # has no such module.
        spec = importlib.util.spec_from_file_location("host_memory", HOST_MEMORY)
        assert spec is not None and spec.loader is not None
        host_memory = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(host_memory)
        if not host_memory.keep_freed_memory():
            raise SystemExit("keep_freed_memory() did not apply here (not glibc, or MALLOC_* set)")

    import torch
    from torch.utils.flop_counter import FlopCounterMode

    import megasemface
    from megasemface.interfaces.factory import build_interface
    from megasemface.objectives.sequences import SequenceBatch, SpecialTokens

    try:
        from megasemface.models.semface import SemFaceModel
        from megasemface.nn.config import build_model_config
    except ModuleNotFoundError:  # where the earlier revision's layout kept them
        from megasemface.models.config import build_model_config
        from megasemface.objectives.stages import SemFaceModel

    where = Path(megasemface.__file__).resolve()
    if args.tree and Path(args.tree).resolve() not in where.parents:
        raise SystemExit(f"imported {where}, not the revision in {args.tree}")
    overrides = [f"vq.layout={args.layout}"]
    if not args.tree:
        overrides.append("vq.logits=mlp")  # the earlier revision's only kind
    config = build_model_config("tiny", overrides)
    torch.manual_seed(0)
    special = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))
    model = SemFaceModel(config, build_interface("vq", config), special)
    if not args.tree:  # this revision's CPU speed code, as its trainer applies it
        from megasemface.nn.cpu_speed import apply_cpu_speed

        apply_cpu_speed(model, "cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=args.current_settings)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(7, config.vocab_size, (32, 32), generator=g)
    batch = SequenceBatch(tokens, torch.full((32,), 32), torch.arange(32) % 2)
    generator = torch.Generator().manual_seed(0)

    blas_only = contextlib.nullcontext()
    if not args.tree:  # torch's own products, so that its counter sees every one
        from megasemface.nn import cpu_gemm

        blas_only = cpu_gemm.blas_only()
    with FlopCounterMode(display=False) as counter, blas_only:
        model.joint_loss(batch, generator).loss.backward()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model.joint_loss(batch, generator).loss.backward()
        optimizer.step()

    for _ in range(3):  # the first steps grow the heap
        step()
    seconds = []
    for _ in range(args.steps):
        started = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - started)
    return {"step_s": statistics.median(seconds), "flops": float(counter.get_total_flops())}


def _run_child(
    layout: str, steps: int, tree: str | None, current_settings: bool
) -> dict[str, float]:
    command = [sys.executable, __file__, "--child", "--layout", layout, "--steps", str(steps)]
    command += ["--tree", tree] if tree else []
    command += ["--current-settings"] if current_settings else []
    done = subprocess.run(command, capture_output=True, text=True, cwd=tempfile.gettempdir())
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        where = f"at {tree}" if tree else "here"
        raise SystemExit(f"the step {where} failed: {last} (rerun: {' '.join(command)})")
    return json.loads(done.stdout.splitlines()[-1])


def compare(against: str, rounds: int, steps: int) -> dict[str, dict[str, float]]:
    """Per layout: each side's median step and FLOP/s, and the ratios of now to before."""
    with tempfile.TemporaryDirectory(prefix="bench-revision-") as scratch:
        tree = str(Path(scratch) / "tree")
        git = ["git", "-C", str(ROOT)]
        add = [*git, "worktree", "add", "--detach", tree, against]
        if subprocess.run(add, capture_output=True).returncode:
            raise SystemExit(f"git could not check out {against} (not a revision of this clone)")
        try:
            results = {}
            for layout in ("flat", "product"):
                runs: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}
                for _ in range(rounds):
                    runs[SIDES[0]].append(_run_child(layout, steps, tree, current_settings=False))
                    runs[SIDES[1]].append(_run_child(layout, steps, tree, current_settings=True))
                    runs[SIDES[2]].append(_run_child(layout, steps, None, current_settings=True))
                results[layout] = _figures(runs)
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", tree], capture_output=True)
    return results


def _figures(runs: dict[str, list[dict[str, float]]]) -> dict[str, float]:
    figures: dict[str, float] = {}
    for key, side in zip(("before", "before_current", "now"), SIDES, strict=True):
        figures[f"{key}_step_s"] = statistics.median(r["step_s"] for r in runs[side])
        figures[f"{key}_flops"] = runs[side][0]["flops"]
        figures[f"{key}_flops_per_s"] = statistics.median(
            r["flops"] / r["step_s"] for r in runs[side]
        )
    for key, side in (("before", SIDES[0]), ("before_current", SIDES[1])):
        # Per-round ratios: each round's processes ran next to each other.
        pairs = list(zip(runs[side], runs[SIDES[2]], strict=True))
        figures[f"speedup_vs_{key}"] = statistics.median(
            b["step_s"] / n["step_s"] for b, n in pairs
        )
        figures[f"flops_per_s_ratio_vs_{key}"] = statistics.median(
            (n["flops"] / n["step_s"]) / (b["flops"] / b["step_s"]) for b, n in pairs
        )
    return figures


def report(against: str, results: dict[str, dict[str, float]]) -> str:
    rows = [
        f"Tiny joint step at {against} and now, fresh processes taking turns "
        "(FLOP/s by torch's own count):",
        "",
        "| layout | before | before, with this code's optimizer and allocator | now "
        "| now vs before: time (FLOP/s) "
        "| now vs before with this code's optimizer: time (FLOP/s) |",
        "|---|---|---|---|---|---|",
    ]
    for layout, f in results.items():
        cells = [
            f"{f[f'{key}_step_s'] * 1e3:,.1f} ms, {f[f'{key}_flops_per_s'] / 1e9:,.1f} GFLOP/s"
            for key in ("before", "before_current", "now")
        ]
        rows.append(
            f"| {layout} | " + " | ".join(cells) + f" | {f['speedup_vs_before']:.2f}x "
            f"({f['flops_per_s_ratio_vs_before']:.2f}x) | {f['speedup_vs_before_current']:.2f}x "
            f"({f['flops_per_s_ratio_vs_before_current']:.2f}x) |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default=BEFORE_SPEED_WORK, help="the earlier revision")
    parser.add_argument("--rounds", type=int, default=2, help="turns of each side's process")
    parser.add_argument("--steps", type=int, default=15, help="timed steps a process")
    parser.add_argument("--json", help="also write the figures as JSON")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--layout", default="flat", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--current-settings", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.child:
        print(json.dumps(_child(args)))
        return 0
    results = compare(args.against, args.rounds, args.steps)
    print(report(args.against, results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"against": args.against, "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
