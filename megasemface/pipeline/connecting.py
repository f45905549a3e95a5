"""The pipeline's connect step: a pre-training run's weights as the translation model a
system fine-tunes (``tools/merge_checkpoints.py connect`` for one system), made once and
reused while the run it was made from is the same."""

from __future__ import annotations

from pathlib import Path

from megasemface.checkpoints import (
    connect_fusion,
    connect_mbart,
    connect_runs,
    keep_part,
    write_seq2seq_dir,
)
from megasemface.checkpoints.connect import SEQ2SEQ_STAGES
from megasemface.pipeline.launcher import LaunchError, lineage
from megasemface.pipeline.systems import System

__all__ = ["connect_system"]


def connect_system(system: System, run_dir: Path, out: Path, spm: Path, seed: int) -> Path:
    """The model directory ``out`` connected from ``run_dir`` as ``system`` connects it.

    Raises:
        LaunchError: ``out`` exists but was connected from another run.
    """
    if (out / "config.json").is_file():
        source, _ = lineage(run_dir)
        made_from = set(lineage(out)[1].values())
        if source is not None and made_from and made_from != {source}:
            raise LaunchError(
                f"{out} was connected from another run (MLflow {', '.join(made_from)}) "
                f"than {run_dir} holds now ({source}): remove it, and the runs fine-tuned "
                "from it, to connect it again"
            )
        print(f"reusing {out}")
        return out
    if system.connect in SEQ2SEQ_STAGES:  # the run's model as it is
        connected = connect_mbart(run_dir)
    elif system.connect == "xlm":
        connected = connect_runs(run_dir)
    elif system.fusion:  # the run's encoder as deep fusion's pre-trained model
        connected = connect_fusion(run_dir)
    else:  # the joint stage trained both: its encoder and decoder, minus the interface
        connected = connect_runs(run_dir, run_dir, bridge=system.bridge)
    connected = keep_part(connected, system.part, seed=seed)
    write_seq2seq_dir(out, connected, spm_model=spm)
    taken = sum(1 for origin in connected.parameters.values() if origin != "random")
    print(f"connected {out}: {taken} of {len(connected.parameters)} tensors pre-trained")
    return out
