"""The comparison's fine-tuning settings, by name (``tools/reproduce.py --settings``): what
data each fine-tunes on, which system its gains are measured from and how its models are
named. The pipeline asks :func:`setting` for a :class:`Setting` instead of comparing names."""

from __future__ import annotations

import dataclasses

from megasemface.stages import add_record, finetune_mode

__all__ = ["SETTINGS", "Setting", "register_setting", "setting", "setting_names"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setting:
    """One fine-tuning setting every system of the comparison runs in."""

    name: str
    finetune_mode: str
    """The ``--finetune-mode`` of its runs (a system connected by deep fusion runs its own)."""
    baseline: str
    """The system its gains are measured from, when the comparison has it."""
    no_repeat_ngram: int = 0
    """Its runs' ``--no-repeat-ngram-size`` unless the pipeline is given one."""
    model_suffix: str = ""
    """Appended to its registered models' names, so that each setting's model of a pair and
    system is a model of its own."""

    @property
    def parallel(self) -> bool:
        """Fine-tunes on parallel pairs (its mode is not monolingual)."""
        return not finetune_mode(self.finetune_mode).monolingual


SETTINGS: dict[str, Setting] = {}
"""Every setting by name, in the order the comparison reports them."""


def register_setting(spec: Setting) -> Setting:
    """Adds ``spec`` to :data:`SETTINGS`; its fine-tuning mode must be registered."""
    finetune_mode(spec.finetune_mode)
    return add_record(SETTINGS, spec.name, spec, "setting")


def setting_names() -> tuple[str, ...]:
    """The settings' names, in registration order."""
    return tuple(SETTINGS)


def setting(name: str) -> Setting:
    """The setting ``name``.

    Raises:
        ValueError: an unknown name, with the known ones.
    """
    if name not in SETTINGS:
        raise ValueError(f"unknown setting {name!r}; known: {', '.join(SETTINGS)}")
    return SETTINGS[name]


# The paper's Table 3 fine-tunes on a low-resource slice of the parallel data and measures
# from the Transformer without pre-training.
register_setting(Setting(name="supervised", finetune_mode="supervised", baseline="transformer"))
# Table 4: denoising and back-translation on monolingual text, measured from XLM, since a
# model without pre-training learns next to nothing. A weak model's loops ("the the the")
# would feed back-translation; an output may not repeat a 3-gram.
register_setting(
    Setting(
        name="unsupervised",
        finetune_mode="unsupervised",
        baseline="xlm",
        no_repeat_ngram=3,
        model_suffix="unsupervised",
    )
)
