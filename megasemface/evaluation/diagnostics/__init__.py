"""Interface diagnostics: does the semantic interface connect what SemFace says it does?

The paper's Fig. 5 analysis and the figures first measured by hand for the project
(``docs/diagnostics.md``), for an encoder, decoder or joint pre-training stage and its
connected translation model:

- :func:`diagnose_interface` with a :class:`DiagnosticsConfig`: every figure over text,
  returned as :class:`Diagnostics` (JSON, MLflow metrics, a table);
- :func:`load_models`: the parts a stage and a model directory contribute;
- :mod:`.figures`: each figure as a function of tensors (cosine, NLL with a given memory,
  code agreement of translation pairs); :mod:`.dictionary`: the gold dictionary's words in
  text and their codes. What depends on the interface (its codes and their usage, what the
  encoder's outputs are compared with) is the interface's own: ``SemanticInterface``'s
  ``diagnostic_targets``, ``reading_codes``, ``code_figures`` and ``code_log_probs``.

``tools/diagnose_interface.py`` is the command line over these.
"""

from megasemface.evaluation.diagnostics.diagnose import (
    MEASURES,
    DiagnosticsConfig,
    diagnose_interface,
)
from megasemface.evaluation.diagnostics.figures import (
    CodeAgreement,
    CodeUsageFigures,
    WordCodes,
    code_agreement,
    teacher_forced_nll,
    word_codes,
)
from megasemface.evaluation.diagnostics.report import (
    Diagnostics,
    DictionaryFigures,
    LanguageFigures,
    log_to_run,
)
from megasemface.evaluation.diagnostics.sources import (
    DiagnosticModels,
    DiagnosticsError,
    load_models,
)

__all__ = [
    "MEASURES",
    "CodeAgreement",
    "CodeUsageFigures",
    "DiagnosticModels",
    "Diagnostics",
    "DiagnosticsConfig",
    "DiagnosticsError",
    "DictionaryFigures",
    "LanguageFigures",
    "WordCodes",
    "code_agreement",
    "diagnose_interface",
    "load_models",
    "log_to_run",
    "teacher_forced_nll",
    "word_codes",
]
