"""Export benchmark: CTranslate2 int8 and float32 beside megasemface's own search.

A trained translation model directory is exported to CTranslate2 twice (float32 weights and
int8 weights, into a temporary directory) and the same test sentences are translated with
greedy search and with beam 5 by megasemface's batched search (the model directory) and by
both exports. Every engine gets the same threads, batches of at most the same number of
source tokens and the same limits (megasemface's default maximum length for the longest
source, no minimum length, the same banned ids). Figures: sentences/s and output tokens/s
(the returned tokens; the engines' translations may differ in length, int8's most). The
engines take turns, best of the rounds for each, so load from other processes slows them
alike.

The model is a trained one because random weights give degenerate output; by default the
demo's CL-SemFace model and test set (``make demo``).

Run: ``python benchmarks/bench_export.py [--model-dir D] [--input F] [--sentences N]
[--threads N] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megasemface.export.run import export_ctranslate2
from megasemface.inference.search import SearchConfig, max_lengths
from megasemface.inference.translate import Translator

DEMO = Path("runs/demo")
DEFAULT_MODEL = DEMO / "runs" / "supervised-cl" / "best"
DEFAULT_INPUT = DEMO / "corpus" / "parallel" / "en-de" / "test.en"
BATCH_TOKENS = 4096
SEARCHES = (("greedy", 1), ("beam 5", 5))


def bench(
    model_dir: Path, input_path: Path, sentences: int, src: str, tgt: str, rounds: int
) -> dict[str, dict[str, float]]:
    import ctranslate2

    translator = Translator.from_model_dir(model_dir)
    tokenizer = translator.tokenizer
    lines = [s for s in input_path.read_text(encoding="utf-8").splitlines() if s][:sentences]
    ids = tokenizer.encode(lines)
    pieces = [tokenizer.processor.encode(line, out_type=str) for line in lines]
    limit = int(max_lengths(torch.tensor([max(len(s) for s in ids) + 1]), SearchConfig(), 10**6)[0])
    limit = min(limit, translator.max_positions - 1)
    banned = [[tokenizer.processor.IdToPiece(i)] for i in translator.banned_ids]
    threads = torch.get_num_threads()

    runs: dict[str, Callable[[], int]] = {}
    for name, beam in SEARCHES:
        # One limit for every sentence, as CTranslate2 has: max_len_a 0, max_len_b limit.
        config = SearchConfig(beam=beam, max_len_a=0, max_len_b=limit)

        def ours(config: SearchConfig = config) -> int:
            hypotheses = translator.translate_ids(
                ids, src_lang=src, tgt_lang=tgt, config=config, batch_tokens=BATCH_TOKENS
            )
            return sum(len(h.tokens) for h in hypotheses)

        runs[f"megasemface | {name}"] = ours
    with tempfile.TemporaryDirectory() as tmp:
        for quantization in ("float32", "int8"):
            out = Path(tmp) / quantization
            export_ctranslate2(model_dir, src, tgt, out, quantization=quantization)
            engine = ctranslate2.Translator(str(out), device="cpu", intra_threads=threads)
            for name, beam in SEARCHES:

                def theirs(engine=engine, beam: int = beam) -> int:  # type: ignore[no-untyped-def]
                    results = engine.translate_batch(
                        pieces,
                        beam_size=beam,
                        max_batch_size=BATCH_TOKENS,
                        batch_type="tokens",
                        max_decoding_length=limit,
                        min_decoding_length=0,
                        suppress_sequences=banned,
                    )
                    return sum(len(r.hypotheses[0]) for r in results)

                runs[f"CTranslate2 {quantization} | {name}"] = theirs

        for fn in runs.values():
            fn()  # warm-up
        best = dict.fromkeys(runs, float("inf"))
        tokens = dict.fromkeys(runs, 0)
        for _ in range(max(rounds, 2)):
            for name, fn in runs.items():
                started = time.perf_counter()
                tokens[name] = fn()
                best[name] = min(best[name], time.perf_counter() - started)
    return {
        name: {
            "seconds": seconds,
            "sentences_per_s": len(lines) / seconds,
            "tokens_per_s": tokens[name] / seconds,
            "sentences": len(lines),
        }
        for name, seconds in best.items()
    }


def report(results: dict[str, dict[str, float]], model_dir: Path) -> str:
    rows = [
        f"{torch.get_num_threads()} threads; {model_dir}; "
        f"{next(iter(results.values()))['sentences']:.0f} sentences",
        "",
        "| engine | search | sentences/s | output tokens/s | speed-up over megasemface |",
        "|---|---|---|---|---|",
    ]
    for name, r in results.items():
        engine, search = name.split(" | ")
        base = results[f"megasemface | {search}"]["sentences_per_s"]
        rows.append(
            f"| {engine} | {search} | {r['sentences_per_s']:,.1f} | {r['tokens_per_s']:,.0f} "
            f"| {r['sentences_per_s'] / base:.2f}x |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--threads", type=int, help="threads (default: torch's choice)")
    parser.add_argument("--json", help="also write the figures as JSON")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--input", type=Path, default=DEFAULT_INPUT)
    parser.add_argument("--src-lang", default="en")
    parser.add_argument("--tgt-lang", default="de")
    parser.add_argument("--sentences", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds (best of)")
    args = parser.parse_args(argv)
    # Both engines get this many threads (CTranslate2's intra_threads).
    torch.set_num_threads(args.threads or torch.get_num_threads())
    for path in (args.model_dir, args.input):
        if not path.exists():
            print(f"bench_export: error: {path} does not exist; run make demo or pass it")
            return 2
    results = bench(
        args.model_dir, args.input, args.sentences, args.src_lang, args.tgt_lang, args.rounds
    )
    print(report(results, args.model_dir))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
