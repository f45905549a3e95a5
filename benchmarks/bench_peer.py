"""Peer benchmark: megasemface's translation training step beside Hugging Face BART.

The peer is ``transformers.BartForConditionalGeneration`` built from a ``BartConfig`` with the
same shape (d_model, heads, FFN size, encoder and decoder layers, vocabulary, max positions,
dropout), randomly initialised in this process (nothing is downloaded). Both run the same step
on the same batches, one after the other and alternating, with the same threads and dtype:

- megasemface: ``model(model.translation_loss, src, tgt)``, the teacher-forced
  label-smoothed (0.1) cross-entropy of fine-tuning, then backward and an Adam step;
- BART: the same source (``x </s>``), decoder inputs (``<tag> y``) and labels (``y </s>``, pads
  ignored), the same label-smoothed cross-entropy from its logits, backward and Adam.

Adam is torch's fused kernel for both: what megasemface's engine runs, and the Hugging Face
Trainer's default (``adamw_torch_fused``) with torch 2.8 or later.

Figures: median target tokens/s (labels, with </s>) of each and their ratio (goal: megasemface
faster, ratio > 1), FLOPs per step (torch's FlopCounterMode, ``megasemface/flop_count.py``)
as FLOP/s beside this machine's fp32 matmul peak (CPU) or the GPU's dense bf16 peak (model
FLOPs utilisation), and activation memory (bytes autograd saves for backward, parameters
excluded; on a GPU also the step's peak allocation above its start). On a GPU both models
run under bf16 autocast.

The models differ where their designs do, which the figures include: megasemface has separate
encoder and decoder token embeddings plus language embeddings (BART shares one table), pre-norm
layers (BART post-norm), and computes the output layer on real target positions only (BART on
every position, pads included).

Run: ``python benchmarks/bench_peer.py [--shapes tiny,mid] [--repeats N] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from bench_model import matmul_peak  # sibling script

from megasemface.flop_count import flop_counter
from megasemface.models.translation import TranslationModel
from megasemface.nn.config import ModelConfig, build_model_config
from megasemface.nn.cpu_speed import apply_cpu_speed, prepare_process
from megasemface.objectives.sequences import (
    SequenceBatch,
    SpecialTokens,
    append_token,
    lengths_to_mask,
    prepend_tokens,
)
from megasemface.training.throughput import datasheet_peak

SPECIAL = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))
IGNORE = -100  # label id that cross-entropy skips (padding)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A model shape and the batch it trains on."""

    preset: str
    overrides: tuple[str, ...]
    sentences: int
    src_len: int
    """Longest source sentence (tokens, without </s>)."""
    tgt_len: int
    """Longest target sentence (tokens, without </s>)."""
    repeats: int
    """Timed steps per model by default (more for cheap steps: a loaded machine is noisy)."""


SHAPES = {
    "tiny": Shape("tiny", (), 64, 32, 32, repeats=15),
    # A mid-size translation model that a 2-core CPU steps in a few seconds.
    "mid": Shape(
        "paper",
        ("vocab_size=8000", "d_model=512", "num_heads=8", "ffn_dim=2048"),
        64,
        32,
        32,
        repeats=5,
    ),
    "paper": Shape("paper", (), 128, 32, 32, repeats=5),
}


def gpu_bf16_peak(name: str) -> float | None:
    """Dense bf16 FLOP/s of a GPU from its device name, or None when it is not in the table
    (the datasheet table train.py's MFU reads, megasemface/training/throughput.py)."""
    return datasheet_peak(name, torch.bfloat16)


def bart_config(config: ModelConfig) -> Any:
    """A ``BartConfig`` of the same shape as ``config``."""
    from transformers import BartConfig

    return BartConfig(
        vocab_size=config.vocab_size,
        d_model=config.d_model,
        encoder_layers=config.encoder_layers,
        decoder_layers=config.decoder_layers,
        encoder_attention_heads=config.num_heads,
        decoder_attention_heads=config.num_heads,
        encoder_ffn_dim=config.ffn_dim,
        decoder_ffn_dim=config.ffn_dim,
        max_position_embeddings=config.max_len,
        activation_function="gelu",
        # megasemface drops out inside the FFN at the residual rate.
        dropout=config.dropout,
        activation_dropout=config.dropout,
        attention_dropout=config.attention_dropout,
        encoder_layerdrop=0.0,
        decoder_layerdrop=0.0,
        scale_embedding=False,
        pad_token_id=SPECIAL.pad,
        bos_token_id=SPECIAL.bos,
        eos_token_id=SPECIAL.eos,
        decoder_start_token_id=SPECIAL.lang_tags[1],
        forced_eos_token_id=None,
        use_cache=False,
        attn_implementation="sdpa",
    )


def make_batches(
    shape: Shape, vocab: int, device: torch.device
) -> tuple[SequenceBatch, SequenceBatch]:
    """Source and target sentences of random ids, lengths within 80-100% of the longest (as
    the loader's length-bucketed batches have)."""
    g = torch.Generator().manual_seed(0)
    n = shape.sentences

    def side(length: int, lang: int) -> SequenceBatch:
        lengths = torch.randint(int(0.8 * length), length + 1, (n,), generator=g)
        tokens = torch.randint(7, vocab, (n, length), generator=g)
        tokens[~lengths_to_mask(lengths, length)] = SPECIAL.pad
        langs = torch.full((n,), lang)
        return SequenceBatch(tokens.to(device), lengths.to(device), langs.to(device))

    return side(shape.src_len, 0), side(shape.tgt_len, 1)


def bart_inputs(src: SequenceBatch, tgt: SequenceBatch) -> dict[str, torch.Tensor]:
    """BART's tensors for the layout megasemface trains on: ``x </s>`` -> ``<tag> y`` ->
    ``y </s>``."""
    source, source_lengths = append_token(src.tokens_BT, src.lengths_B, SPECIAL.eos, SPECIAL.pad)
    tags = torch.tensor(SPECIAL.lang_tags, device=tgt.langs_B.device)[tgt.langs_B]
    inputs, lengths = prepend_tokens(tgt.tokens_BT, tgt.lengths_B, tags)
    labels, _ = append_token(tgt.tokens_BT, tgt.lengths_B, SPECIAL.eos, SPECIAL.pad)
    target_mask = lengths_to_mask(lengths, labels.shape[1])
    return {
        "input_ids": source,
        "attention_mask": lengths_to_mask(source_lengths, source.shape[1]).long(),
        "decoder_input_ids": inputs,
        "decoder_attention_mask": target_mask.long(),
        "labels": labels.masked_fill(~target_mask, IGNORE),
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _saved_activation_bytes(model: torch.nn.Module) -> Iterator[list[int]]:
    """Counts the distinct storages autograd saves for backward, parameters excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    total: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield total
    total.append(sum(storages.values()))


class Runner:
    """One model with its optimizer and the loss of one batch."""

    def __init__(self, name: str, model: torch.nn.Module, loss: Callable[[], torch.Tensor]) -> None:
        self.name = name
        self.model = model
        self.loss = loss
        self.optimizer = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
        self.params_m = sum(p.numel() for p in model.parameters()) / 1e6

    def step(self, device: torch.device) -> float:
        """One training step; returns its wall time."""
        _sync(device)
        started = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with _autocast(device):
            loss = self.loss()
        loss.backward()
        self.optimizer.step()
        _sync(device)
        return time.perf_counter() - started

    def measured_step(self, device: torch.device) -> dict[str, float]:
        """One training step that also counts the FLOPs of its forward and backward
        (``megasemface/flop_count.py``), the activations autograd saves and, on a GPU, the
        step's peak allocation above its start. Slower than ``step``: it doubles as a warm-up."""
        self.optimizer.zero_grad(set_to_none=True)
        _sync(device)
        start = 0
        if device.type == "cuda":
            start = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        with flop_counter() as counter:
            with _saved_activation_bytes(self.model) as saved, _autocast(device):
                loss = self.loss()
            loss.backward()
        self.optimizer.step()
        _sync(device)
        result = {"flops_per_step": float(counter.get_total_flops()), "saved_mb": saved[0] / 2**20}
        if device.type == "cuda":
            result["step_peak_mb"] = (torch.cuda.max_memory_allocated(device) - start) / 2**20
        return result


def build_runners(shape: Shape, device: torch.device) -> tuple[ModelConfig, list[Runner], int, int]:
    """megasemface and BART of one shape; returns the config, the runners and the target and
    source token counts of the batch."""
    from transformers import BartForConditionalGeneration

    config = build_model_config(shape.preset, list(shape.overrides))
    src, tgt = make_batches(shape, config.vocab_size, device)
    torch.manual_seed(0)
    ours = TranslationModel(config, SPECIAL, label_smoothing=0.1)
    apply_cpu_speed(ours, device)  # as the trainer builds it
    ours = ours.to(device).train()
    torch.manual_seed(0)
    bart = BartForConditionalGeneration(bart_config(config)).to(device).train()
    inputs = bart_inputs(src, tgt)
    labels = inputs.pop("labels")

    def ours_loss() -> torch.Tensor:
        # Through the module's call, as DeepSpeed's engine runs it (its hooks included).
        return ours(ours.translation_loss, src, tgt).loss

    def bart_loss() -> torch.Tensor:
        logits = bart(**inputs, use_cache=False).logits
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),
            labels.reshape(-1),
            ignore_index=IGNORE,
            label_smoothing=ours.label_smoothing,
        )

    target_tokens = int((labels != IGNORE).sum())
    source_tokens = int(inputs["attention_mask"].sum())
    runners = [Runner("megasemface", ours, ours_loss), Runner("HF BART", bart, bart_loss)]
    return config, runners, target_tokens, source_tokens


def bench(
    shape_name: str, repeats: int | None, device: torch.device, scale: float = 1.0
) -> dict[str, Any]:
    """Both models on one shape; ``scale`` multiplies the batch's sentence count."""
    shape = SHAPES[shape_name]
    repeats = repeats or shape.repeats
    shape = dataclasses.replace(shape, sentences=max(1, round(shape.sentences * scale)))
    config, runners, target_tokens, source_tokens = build_runners(shape, device)
    counted: dict[str, dict[str, float]] = {}
    for runner in runners:  # warm-up (allocator, thread pools) while counting
        counted[runner.name] = runner.measured_step(device)
        runner.step(device)
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for i in range(repeats):
        # Alternate the order so that neither model always runs on a cache the other warmed.
        for runner in runners if i % 2 == 0 else runners[::-1]:
            times[runner.name].append(runner.step(device))
    models = {}
    for runner in runners:
        seconds = statistics.median(times[runner.name])
        models[runner.name] = {
            "params_m": runner.params_m,
            "step_s": seconds,
            "tokens_per_s": target_tokens / seconds,
            **counted[runner.name],
        }
        models[runner.name]["flops_per_s"] = models[runner.name]["flops_per_step"] / seconds
    # Steps next to each other share the machine's load: the median of the per-round ratios
    # is steadier than the ratio of the medians.
    ours_times, peer_times = (times[r.name] for r in runners)
    paired = statistics.median(p / o for o, p in zip(ours_times, peer_times, strict=True))
    ours, peer = (models[r.name] for r in runners)
    return {
        "shape": {
            "d_model": config.d_model,
            "heads": config.num_heads,
            "ffn": config.ffn_dim,
            "layers": f"{config.encoder_layers}+{config.decoder_layers}",
            "vocab": config.vocab_size,
            "max_len": config.max_len,
            "dropout": config.dropout,
            "attention_dropout": config.attention_dropout,
            "sentences": shape.sentences,
            "target_tokens": target_tokens,
            "source_tokens": source_tokens,
        },
        "repeats": repeats,
        "models": models,
        "ratio": paired,
        "ratio_of_medians": ours["tokens_per_s"] / peer["tokens_per_s"],
    }


def run(
    shapes: list[str],
    repeats: int | None = None,
    device: torch.device | None = None,
    scale: float = 1.0,
) -> dict[str, Any]:
    """Every shape, plus the peak the FLOP/s are read against."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    import transformers

    results: dict[str, Any] = {
        "device": str(device),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        results["device_name"] = name
        results["peak_flops"] = gpu_bf16_peak(name)
        results["peak_kind"] = f"dense bf16 peak of {name}"
        results["shapes"] = {name: bench(name, repeats, device, scale) for name in shapes}
    else:
        # Measured before and after the models, the best kept: a loaded machine only lowers it.
        before = matmul_peak()
        results["shapes"] = {name: bench(name, repeats, device, scale) for name in shapes}
        results["peak_flops"] = max(before, matmul_peak())
        results["peak_kind"] = "fp32 matmul peak measured on this machine"
    return results


def report(results: dict[str, Any]) -> str:
    peak = results["peak_flops"]
    cuda = results["device"].startswith("cuda")
    where = (
        f"{results.get('device_name', 'GPU')}, bf16 autocast"
        if cuda
        else f"CPU, fp32, {results['threads']} torch threads for both"
    )
    lines = [
        f"megasemface vs Hugging Face BART (transformers {results['transformers']}, random "
        f"init, SDPA attention) on {where}: the same batches, teacher-forced label-smoothed "
        "cross-entropy, backward and fused Adam, dropout equal; medians of alternating steps. "
        "Tokens are target tokens (labels with </s>).",
        "",
    ]
    if peak is None:
        lines += [f"{results['device_name']} is not in the table of bf16 peaks: no MFU.", ""]
    else:
        lines += [f"{results['peak_kind']}: {peak / 1e12:,.3g} TFLOP/s", ""]
    if not cuda:
        lines += ["GPU model FLOPs utilisation: skipped (no CUDA device).", ""]
    share = "MFU" if cuda else "share of peak"
    memory = "saved activations / step peak (MiB)" if cuda else "saved activations (MiB)"
    lines += [
        f"| shape | model | params | step | target tokens/s | GFLOP/step | FLOP/s ({share}) "
        f"| {memory} |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results["shapes"].items():
        s = r["shape"]
        label = (
            f"{name}: d {s['d_model']}, {s['heads']} heads, ffn {s['ffn']}, {s['layers']} "
            f"layers, vocab {s['vocab']:,}; {s['sentences']} sent., "
            f"{s['source_tokens']:,} src / {s['target_tokens']:,} tgt tokens"
        )
        for model, m in r["models"].items():
            used = "" if peak is None else f" ({m['flops_per_s'] / peak:.1%})"
            mem = f"{m['saved_mb']:,.0f}"
            if "step_peak_mb" in m:
                mem += f" / {m['step_peak_mb']:,.0f}"
            lines.append(
                f"| {label} | {model} | {m['params_m']:.1f}M | {m['step_s'] * 1e3:,.0f} ms "
                f"| {m['tokens_per_s']:,.0f} | {m['flops_per_step'] / 1e9:,.1f} "
                f"| {m['flops_per_s'] / 1e9:,.1f} G{used} | {mem} |"
            )
            label = ""
    lines.append("")
    for name, r in results["shapes"].items():
        # Within 3% is within the step-to-step noise of a shared machine.
        verdict = "faster" if r["ratio"] > 1.03 else "slower" if r["ratio"] < 0.97 else "on par"
        lines.append(
            f"- {name}: megasemface / BART tokens/s = {r['ratio']:.2f}x (median of {r['repeats']} "
            f"paired steps; ratio of the medians {r['ratio_of_medians']:.2f}x): megasemface "
            f"{verdict}; goal > 1."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--shapes", help=f"of {sorted(SHAPES)} (default: tiny,mid; GPU mid,paper)")
    parser.add_argument("--repeats", type=int, help="timed steps per model (default: by shape)")
    parser.add_argument("--batch-scale", type=float, default=1.0, help="x sentences per batch")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    prepare_process()  # as train.py and translate.py run
    if args.threads:
        torch.set_num_threads(args.threads)
    default = "mid,paper" if torch.cuda.is_available() else "tiny,mid"
    shapes = (args.shapes or default).split(",")
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {sorted(SHAPES)}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        parser.error("the peer needs transformers: pip install -e '.[bench]'")
    results = run(shapes, args.repeats, scale=args.batch_scale)
    print(report(results))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(results, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
