"""Pre-training learning curves of several systems on the same data, steps and batches, side
by side: what to look at before spending a cluster on a configuration.

Each system's pre-training run is the pipeline's own (:meth:`Pipeline.pretrain_config`: its
stage, interface and options; XLM's encoder stage, the SemFace systems' joint stage), with
the model preset, ``--model`` options, batch, steps, seed and learning rate given here for
all of them, trained through the pipeline's launcher on the given monolingual shards. The
runs are written to ``<workdir>/runs/pretrain-<system>`` and reused when finished (a
longer ``steps`` continues them), as the pipeline reuses its steps. The encoder MLM and the
decoder stage's loss of every logged step are then read back (from MLflow, else the runs'
logs) into ``<workdir>/curves.md`` and ``<workdir>/curves.png``; with tracking, the report is
also an MLflow run of the experiment (tag ``stage=report``) beside the training runs.

Every ``valid_every`` steps each run also scores held-out sentences of every language
(``valid_prefix``; the demo's validation split by default) in eval mode, with noise-free codes
and the same masks each time (training/units/pretraining_validation.py): the validation MLM is
the curve to compare. A training step's MLM is one batch's, and VQ-SemFace's reads
Gumbel-sampled codes, so it lags its validation while the codebook's choices are spread.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from megasemface.pipeline.config import BUDGETS, PipelineConfig, seeded
from megasemface.pipeline.data_steps import build_cl_table
from megasemface.pipeline.launcher import LaunchError, lineage
from megasemface.pipeline.pipeline import Pipeline
from megasemface.pipeline.systems import System
from megasemface.stages import stage_names
from megasemface.tracking.compare.curves import (
    Curve,
    curve_from_log,
    curve_from_mlflow,
    curves_table,
    plot_learning_curves,
)

__all__ = ["DEMO_DATA", "CurvesConfig", "CurvesReport", "curve_systems", "run_curves"]

DEMO_DATA = Path("runs/demo")
"""Where the demo (``make demo``, ``tools/reproduce.py``) builds its data: the default
shards (``shards/mono``), SentencePiece model (``spm/joint.model``) and validation text
(``corpus/parallel/en-de/valid.{en,de}``)."""

CURVE_STAGES = stage_names(lambda spec: spec.encoder)
"""Pre-training stages whose runs have an encoder MLM to compare."""


@dataclasses.dataclass(kw_only=True)
class CurvesConfig:
    """What a learning-curve comparison trains; every system gets the same of each."""

    workdir: Path = Path("runs/curves")
    """Runs, CL table, MLflow store and the report."""
    systems: tuple[str, ...] = ("xlm", "cl", "vq")
    """Pipeline systems (``--systems`` of tools/reproduce.py) whose pre-training is the
    encoder or joint stage: the paper's XLM, CL-SemFace and VQ-SemFace, or ablations."""
    preset: str = "tiny"
    model_options: tuple[str, ...] = ()
    """``--model`` KEY=VALUE options of every run (after the preset)."""
    max_tokens: int = 2048
    """Tokens per batch and process."""
    steps: int = 200
    log_every: int = 10
    seed: int = 0
    lr: float | None = None
    """Pre-training learning rate; None: the budgets' for the preset (1e-4 for ``paper``,
    the demo's 1e-3 otherwise)."""
    shards: Path = DEMO_DATA / "shards" / "mono"
    spm_model: Path = DEMO_DATA / "spm" / "joint.model"
    cl_table: Path | None = None
    """CL-SemFace's table; None: built from ``shards`` at the model's width, as the
    pipeline builds it (``<workdir>/cl/table.safetensors``)."""
    valid_prefix: Path | None = DEMO_DATA / "corpus" / "parallel" / "en-de" / "valid"
    """Validation text, ``PREFIX.<lang>`` for every language of the shards; None: none."""
    valid_every: int = 20
    """Steps between validations (and the last step)."""
    valid_sentences: int = 200
    """Validation sentences of each language."""
    procs: int = 2
    """Training processes (GPUs, or CPU processes)."""
    deepspeed_config: Path | None = None
    """Default: ds_configs/cpu_fp32_zero2.json on CPU, ds_configs/zero2_bf16.json on GPU."""
    tracking: bool = True
    """Track the runs and the report in ``<workdir>/mlflow.db``."""
    experiment: str = "megasemface-curves"

    def __post_init__(self) -> None:
        for name in ("steps", "log_every", "max_tokens", "procs", "valid_every", "valid_sentences"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.lr is not None and not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not self.systems:
            raise ValueError("--systems: give at least one system")
        repeated = sorted({key for key in self.systems if self.systems.count(key) > 1})
        if repeated:
            raise ValueError(f"--systems: {repeated[0]} is given more than once")

    @property
    def pretrain_lr(self) -> float:
        if self.lr is not None:
            return self.lr
        budget = BUDGETS.get(self.preset, {})
        return float(budget.get("pretrain_lr", PipelineConfig.pretrain_lr))  # type: ignore[arg-type]

    def pipeline_config(self) -> PipelineConfig:
        """The pipeline whose pre-training runs these are (it checks the systems)."""
        return PipelineConfig(
            workdir=self.workdir,
            systems=self.systems,
            model_preset=self.preset,
            model_options=self.model_options,
            max_tokens=self.max_tokens,
            pretrain_steps=self.steps,
            pretrain_lr=self.pretrain_lr,
            procs=self.procs,
            deepspeed_config=self.deepspeed_config,
            seed=self.seed,
            experiment=self.experiment,
        )


def curve_systems(config: PipelineConfig) -> list[System]:
    """The systems of ``config``, each with a run of its own in an encoder or joint stage.

    Raises:
        ValueError: one naming a system that cannot be compared, and why.
    """
    systems = []
    for key in config.systems:
        system = config.system(key)
        if system.stage not in CURVE_STAGES:
            what = "no pre-training" if system.stage is None else f"the {system.stage} stage"
            raise ValueError(
                f"--systems: {key} has {what}, no encoder MLM to compare; give systems that "
                "pre-train in the encoder or joint stage (xlm, cl, vq and their ablations)"
            )
        if system.pretraining is not None:
            raise ValueError(
                f"--systems: {key} only connects {system.pretraining}'s pre-training "
                f"differently; give {system.pretraining}"
            )
        if system.pretraining_ras:
            raise ValueError(
                f"--systems: {key} substitutes words from a bilingual dictionary, which a "
                "comparison on monolingual shards does not build; leave it out"
            )
        systems.append(system)
    return systems


@dataclasses.dataclass(frozen=True)
class CurvesReport:
    curves: list[Curve]
    markdown: Path
    plot: Path
    vocab_size: int
    run_id: str | None
    """The report's MLflow run (None without tracking)."""


class _CurvesPipeline(Pipeline):
    """The pipeline's pre-training runs on given shards, each with the comparison's logging
    pace and tracking."""

    def __init__(self, config: CurvesConfig) -> None:
        super().__init__(config.pipeline_config())
        self.curves = config
        self.spm = config.spm_model.resolve()
        self.mono = config.shards.resolve()
        self.cl_table = None

    def prepare_cl_table(self) -> None:
        given = self.curves.cl_table
        if given is not None:
            self.cl_table = given.resolve()
            return
        # The demo's layout keeps its corpus beside the shards: its gold dictionary, where
        # there is one, only adds the table's precision to the build's log.
        corpus = self.mono.parents[1] / "corpus"
        self.cl_table = build_cl_table(
            self.config, self.mono, self.spm, self.model_config.d_model, corpus
        )

    def train_curve(self, system: System) -> Path:
        curves = self.curves
        config = dataclasses.replace(
            self.pretrain_config(system, self.config.seed),
            log_interval=curves.log_every,
            no_tracking=not curves.tracking,
            valid_prefix=curves.valid_prefix.resolve() if curves.valid_prefix else None,
            valid_interval=curves.valid_every,
            valid_max_sentences=curves.valid_sentences,
        )
        self._train(config)
        return config.output_dir

    def read_curve(self, system: System, run_dir: Path) -> Curve:
        """From the run's MLflow metrics when it was tracked in this store, else from the
        progress lines of its log (a run trained with tracking off, then reused)."""
        run_id, _ = lineage(run_dir)
        if self.curves.tracking and run_id is not None:
            return curve_from_mlflow(self.tracking_uri, run_id, system.display)
        return curve_from_log(run_dir / "launcher.log", system.display)


def _check_data(config: CurvesConfig) -> None:
    """The shards, SentencePiece model and CL table exist, before anything starts."""
    found = {
        "--shards": (config.shards, (config.shards / "manifest.json").is_file()),
        "--spm-model": (config.spm_model, config.spm_model.is_file()),
    }
    for option, (path, exists) in found.items():
        if not exists:
            demo = path in (CurvesConfig.shards, CurvesConfig.spm_model)
            hint = "make demo builds the demo's data there; or " if demo else ""
            raise FileNotFoundError(
                f"{option} {path}: not found; {hint}give {option} (tools/build_shards.py "
                "and tools/train_spm.py make them)"
            )
    if config.cl_table is not None and not config.cl_table.is_file():
        raise FileNotFoundError(f"--cl-table {config.cl_table}: no such file")
    prefix = config.valid_prefix
    if prefix is not None and not any(prefix.parent.glob(f"{prefix.name}.*")):
        hint = "make demo builds the demo's there; " if prefix == CurvesConfig.valid_prefix else ""
        raise FileNotFoundError(
            f"--valid-prefix {prefix}: no {prefix.name}.<lang> files; {hint}give "
            "--valid-prefix, or --no-validation"
        )


def run_curves(config: CurvesConfig) -> CurvesReport:
    """Trains (or reuses) every system's pre-training run, then writes the table and the plot
    and, with tracking, logs them as the report run.

    Raises:
        ValueError, FileNotFoundError: bad options or missing data, before anything trains.
        LaunchError: a run failed (its log is named).
    """
    from megasemface.data.text.tokenizer import Tokenizer
    from megasemface.tracking.report_run import log_report_run

    systems = curve_systems(config.pipeline_config())
    pipeline = _CurvesPipeline(config)  # checks the preset and --model options
    _check_data(config)
    vocab_size = Tokenizer.load(config.spm_model).vocab_size
    pipeline.workdir.mkdir(parents=True, exist_ok=True)
    if any(system.reads_table for system in systems):
        print("\n== CL-SemFace's cross-lingual table", flush=True)
        pipeline.prepare_cl_table()
    curves = []
    for system in systems:
        name = seeded(f"pretrain-{system.key}", config.seed)
        print(f"\n== {system.display}: {system.stage} stage, {config.steps} steps ({name})")
        run_dir = pipeline.train_curve(system)
        curve = pipeline.read_curve(system, run_dir)
        if not curve.encoder:
            raise LaunchError(f"{curve.source} holds no encoder MLM of {system.display}")
        curves.append(curve)
    markdown = pipeline.workdir / "curves.md"
    title = (
        f"{config.preset} preset{''.join(f', {o}' for o in config.model_options)}, "
        f"{config.max_tokens:,} tokens x {config.procs} processes, seed {config.seed}"
    )
    table = curves_table(curves, vocab_size)
    markdown.write_text(f"# Pre-training learning curves: {title}\n\n{table}", encoding="utf-8")
    plot = plot_learning_curves(curves, pipeline.workdir / "curves.png", vocab_size, title)
    print(f"\n{table}\nwrote {markdown} and {plot}")
    run_id = None
    if config.tracking:
        run_id = log_report_run(
            pipeline.tracking_uri, config.experiment, pipeline.workdir, markdown, [plot]
        )
        if run_id is not None:
            print(f"the comparison is MLflow run {run_id} in {pipeline.tracking_uri}")
    return CurvesReport(curves, markdown, plot, vocab_size, run_id)
