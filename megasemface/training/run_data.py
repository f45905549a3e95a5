"""What a training run reads besides its model: the shards and their tokenizer, checked once."""

from __future__ import annotations

import dataclasses

import torch

from megasemface.data.shards.shard_format import Manifest
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.objectives.sequences import SpecialTokens
from megasemface.training.options import TrainConfig

__all__ = ["RunData"]


@dataclasses.dataclass(frozen=True)
class RunData:
    """The shard manifest and the SentencePiece model of a run, known to belong together."""

    manifest: Manifest
    tokenizer: Tokenizer
    special: SpecialTokens

    @classmethod
    def load(cls, config: TrainConfig) -> RunData:
        """Reads ``config.data`` and ``config.spm_model``; refuses a tokenizer the shards were
        not built with, or one without a language tag the data needs."""
        manifest = Manifest.load(config.data)
        tokenizer = Tokenizer.load(config.spm_model)
        if tokenizer.sha256 != manifest.spm_sha256:
            raise ValueError(
                f"{config.spm_model} is not the SentencePiece model the shards in {config.data} "
                "were built with (sha256 differs); pass the model given to build_shards"
            )
        data = cls(manifest, tokenizer, SpecialTokens.from_tokenizer(tokenizer))
        missing = sorted(data.data_languages() - set(data.languages))
        if missing:
            raise ValueError(f"the tokenizer has no language tag for {missing}")
        return data

    @property
    def languages(self) -> list[str]:
        """The tokenizer's languages; a language's index is its embedding row."""
        return self.tokenizer.languages

    @property
    def pairs(self) -> dict[str, tuple[str, str]]:
        """Parallel data: ``{pair name: (source, target)}``; empty for monolingual shards."""
        return dict(self.manifest.pairs)

    def data_languages(self) -> set[str]:
        """Every language the shards hold text in."""
        pairs = self.pairs
        found = {lang for pair in pairs.values() for lang in pair}
        return found | (set(self.manifest.languages) - set(pairs))

    def lang_index(self, lang: str, size: int) -> torch.Tensor:
        """``size`` copies of the index of ``lang``: a batch's language column."""
        return torch.full((size,), self.languages.index(lang), dtype=torch.long)
