"""The README's main command: the SemFace pipeline in the low-resource regime of the paper's
claim, on the embedded real demo corpus.

SentencePiece -> shards -> cross-lingual embeddings -> XLM, mBART, CL-SemFace and
VQ-SemFace pre-training (``megasemface/train.py`` on 2 ranks) on every monolingual sentence
(the gettext catalogs' and, where installed, Debian's documentation's) -> connect ->
whether each connected model reads a translation -> supervised fine-tuning on 2,000
parallel pairs of catalog messages -> translation of the held-out test set (the Debian
Administrator's Handbook's held-out chapters where it is installed) -> BLEU and chrF, with
paired bootstrap tests against the same pipeline with no pre-training, and copying the
source as a floor -> an MLflow comparison table and plot. Meant to finish within 20 minutes
on 2 CPU cores, the install included (what it took, by machine: docs/results.md); run
again, it reuses what is built. Each step's wall time goes to ``<workdir>/timings.json``.

``make demo`` runs it with defaults; ``python -m megasemface.demo --help`` lists the
options (the same as ``tools/reproduce.py``, with the demo's systems and setting).
"""

from __future__ import annotations

from megasemface.cli.reproduce import build_parser, run


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__, systems="transformer,xlm,mbart,cl,vq", settings="supervised")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
