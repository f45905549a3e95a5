"""mRASP's pre-training: translation on parallel shards with random aligned substitution.

The whole sequence-to-sequence model learns to translate, in both directions of every pair
(one direction a step, drawn as supervised fine-tuning draws it), from sources whose
dictionary words are replaced by a translation with probability ``--ras-prob``
(:mod:`megasemface.data.text.ras`). Language tags are on both sides: the encoder reads the source
with its language's embedding (kept when words are substituted, as mRASP keeps ``<en>`` on a
code-switched English sentence) and the decoder starts from the target language's tag.

It is the supervised fine-tuning unit with substitution always on and without validation:
the same model, loss and checkpoints, so the run connects like mBART's
(``tools/merge_checkpoints.py connect --mbart RUN``) and fine-tunes as any initialisation.
Pre-training keeps the pre-training schedule (the DeepSpeed config's, with ``--lr``).
"""

from __future__ import annotations

from megasemface.training.units.translation import SupervisedUnit

__all__ = ["MraspUnit"]


class MraspUnit(SupervisedUnit):
    """``--stage mrasp``: translation pre-training with random aligned substitution."""

    lr_schedule = "deepspeed"

    def _check_data(self) -> None:
        if not self.data.pairs:
            raise ValueError(
                f"{self.config.data} holds monolingual shards; --stage mrasp pre-trains on "
                "parallel shards (tools/build_shards.py --parallel SRC-TGT:SRC_FILE,TGT_FILE)"
            )

    def substitutes(self) -> bool:
        return True

    def run_tags(self) -> dict[str, str]:
        return {"interface": "none"}
