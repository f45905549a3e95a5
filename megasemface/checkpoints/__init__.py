"""Checkpoint tools: consolidation, model-parallel codebooks, averaging, connecting stages.

- :func:`load_stage`: a pre-training stage's full fp32 weights and metadata from a run,
  checkpoint or model directory (DeepSpeed's consolidation per model-parallel rank, the
  flat codebook gathered, the interface fingerprint recomputed for the gathered layer).
- :func:`codebook_state_for_rank`: the interface weights (VQ-SemFace's layer) one
  model-parallel rank of a decoder stage loads from an encoder stage. How an interface's
  weights split, gather and fingerprint is the interface's own
  (:class:`~megasemface.interfaces.weights.TrainedWeights`).
- :func:`average_checkpoints`: the exact fp32 mean of checkpoints of one stage.
- :func:`connect_runs`, :func:`connect_mbart`, :func:`connect_fusion`: sequence-to-sequence
  initialisations (deep fusion: an encoder stage through the layer-wise coordinator);
  :func:`keep_part`: one half of such an initialisation, the other drawn at random.
- :func:`write_pretraining_dir`, :func:`write_seq2seq_dir`: self-contained model directories.

``tools/merge_checkpoints.py`` is the command line over these.
"""

from megasemface.checkpoints.average import average_checkpoints, last_checkpoints
from megasemface.checkpoints.connect import (
    PARTS,
    Connected,
    connect_fusion,
    connect_mbart,
    connect_runs,
    keep_part,
)
from megasemface.checkpoints.consolidate import (
    Codebook,
    codebook_state_for_rank,
    consolidate_checkpoint,
    load_checkpoint,
    load_codebook,
    load_stage,
)
from megasemface.checkpoints.export import (
    resolve_spm_model,
    write_pretraining_dir,
    write_seq2seq_dir,
)
from megasemface.checkpoints.layout import (
    CheckpointError,
    CheckpointInfo,
    complete_checkpoints,
    find_checkpoint,
)

__all__ = [
    "PARTS",
    "CheckpointError",
    "CheckpointInfo",
    "Codebook",
    "Connected",
    "average_checkpoints",
    "codebook_state_for_rank",
    "complete_checkpoints",
    "connect_fusion",
    "connect_mbart",
    "connect_runs",
    "consolidate_checkpoint",
    "find_checkpoint",
    "keep_part",
    "last_checkpoints",
    "load_checkpoint",
    "load_codebook",
    "load_stage",
    "resolve_spm_model",
    "write_pretraining_dir",
    "write_seq2seq_dir",
]
