"""The pipeline: data -> pre-training -> connect -> fine-tuning -> test BLEU -> comparison.

Every step writes under ``config.workdir`` and is skipped when its output is complete, so a
second run reuses the corpus, tokenizer, shards, tables, finished runs and scores (and says
so); an interrupted training run resumes from its newest checkpoint. Every training run and
every test score goes to one MLflow store, ``<workdir>/mlflow.db`` (or ``--tracking-uri``'s
server), where the comparison
reads them back; each fine-tuned model is registered in its model registry, with its test
scores, as a version of ``megasemface-<pair>-<system>`` (``-<setting>`` when unsupervised).

The data is built once; the training runs, connected models and test translations are made
once per seed of ``config.run_seeds``, in ``<name>`` for seed 0 (a single-seed pipeline's
paths, so its work is reused) and ``<name>-s<seed>`` for the others, each run tagged
``seed``.

Over several languages (``PipelineConfig.languages``) the corpus, tokenizer, monolingual
shards, CL table and each system's pre-training are built once over all of them; each pair
en-xx then has its parallel shards, validation and test sets, and per system a fine-tuning
run ``<setting>-<system>-<pair>`` (tagged ``pair``) from the one pre-trained model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, NamedTuple

from megasemface.checkpoints.layout import is_model_dir, newest_complete_step
from megasemface.data.text.lines import read_lines, write_lines
from megasemface.evaluation.diagnostics import DiagnosticsConfig
from megasemface.evaluation.metrics import evaluate
from megasemface.inference.search import SearchConfig
from megasemface.inference.translate import Translator
from megasemface.interfaces.registry import interface
from megasemface.nn.config import build_model_config
from megasemface.pipeline import data_steps
from megasemface.pipeline.config import PipelineConfig, cuda_devices, seeded
from megasemface.pipeline.connecting import connect_system
from megasemface.pipeline.launcher import (
    LaunchError,
    changed_settings,
    default_ds_config,
    launch_command,
    launch_environment,
    lineage,
    run_logged,
    training_complete,
)
from megasemface.pipeline.pretraining_figures import diagnose_run, encoder_mlm_of_run
from megasemface.pipeline.report import EncoderMlmRow, GridChoice, Report, build_report
from megasemface.pipeline.run_inputs import changed_inputs, record_inputs
from megasemface.pipeline.scores import best_valid_bleu
from megasemface.pipeline.settings import SETTINGS
from megasemface.pipeline.systems import System
from megasemface.stages import stage
from megasemface.tracking.model_registry import default_model_name, register_best_model
from megasemface.tracking.report_run import log_report_run
from megasemface.tracking.run_scores import log_scores
from megasemface.training.options import TrainConfig

__all__ = ["PairData", "Pipeline"]


def _clock(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}:{rest:02d}"


class PairData(NamedTuple):
    """One pair's data of a pipeline over several languages."""

    parallel: Path
    """Parallel shards of its low-resource slice of training pairs."""
    valid: Path
    """Validation set prefix (``<prefix>.<lang>``)."""
    test: Path
    """Test set prefix."""
    mixed: Path | None = None
    """Its pairs and its languages' monolingual text in one directory (deep fusion's
    fine-tuning data), when a system needs them."""


class Pipeline:
    def __init__(self, config: PipelineConfig, corpus: Path | None = None) -> None:
        self.config = config
        self.workdir = config.workdir.resolve()
        self.config.workdir = self.workdir
        self.corpus_arg = corpus
        self.tracking_uri = config.tracking_uri or f"sqlite:///{self.workdir / 'mlflow.db'}"
        self.ds_config = (config.deepspeed_config or default_ds_config()).resolve()
        self.model_config = build_model_config(config.model_preset, list(config.model_options))
        self.started = time.perf_counter()
        self.count = 0
        self.steps: list[tuple[str, str, float]] = []
        """(kind, title, start in seconds from the pipeline's start) of every step so far."""
        self.ras_dictionary: Path | None = None
        """The word dictionary of the runs that substitute."""
        self.mixed: Path | None = None
        """Monolingual and parallel shards in one directory (VECO's, deep fusion's)."""
        self.diagnostics: list[tuple[str, int, dict[str, Any]]] = []
        """(system, seed, figures) of every SemFace pre-training, for the report."""
        self.encoder_mlms: list[EncoderMlmRow] = []
        """The encoder MLM on validation text of every pre-training that trains one."""
        self.grid: list[GridChoice] = []
        """Every fine-tuning's settings tried and the one chosen on validation (with a
        ``finetune_grid``), for the report."""
        self.by_pair: dict[str, PairData] = {}
        """Several languages: each pair's parallel shards, validation and test sets (one
        pair: ``parallel``, ``valid`` and ``test``)."""

    def _step(self, title: str, kind: str = "data") -> None:
        self.count += 1
        now = time.perf_counter() - self.started
        self.steps.append((kind, title, now))
        minutes, seconds = divmod(int(now), 60)
        print(f"\n== {self.count}. {title}  [{minutes:02d}:{seconds:02d}]", flush=True)

    def _record_times(self) -> Path:
        """Writes ``<workdir>/timings.json`` (each step's wall time, the sum per kind of step,
        the total) and prints the sums: where this invocation's time went. A step reused
        from an earlier invocation counts its few seconds of checking."""
        total = time.perf_counter() - self.started
        ends = [start for _, _, start in self.steps[1:]] + [total]
        steps = [
            {"kind": kind, "step": title, "seconds": round(end - start, 2)}
            for (kind, title, start), end in zip(self.steps, ends, strict=True)
        ]
        by_kind: dict[str, float] = {}
        for step in steps:
            by_kind[step["kind"]] = by_kind.get(step["kind"], 0.0) + step["seconds"]
        record = {
            "total_seconds": round(total, 2),
            "by_kind": {kind: round(seconds, 2) for kind, seconds in by_kind.items()},
            "steps": steps,
        }
        path = self.workdir / "timings.json"
        path.write_text(json.dumps(record, indent=1), encoding="utf-8")
        minutes, seconds = divmod(int(total), 60)
        shares = ", ".join(f"{kind} {_clock(s)}" for kind, s in by_kind.items())
        print(f"\npipeline finished in {minutes} min {seconds} s ({shares}); each step: {path}")
        return path

    # The whole pipeline -----------------------------------------------------------------

    def run(self) -> Report:
        cfg = self.config
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._step("corpus")
        self.corpus = data_steps.build_corpus(cfg, self.corpus_arg)
        self._step("joint SentencePiece model")
        self.spm = data_steps.build_tokenizer(cfg, self.corpus)
        self._step("monolingual shards")
        self.mono = data_steps.build_mono_shards(cfg, self.corpus, self.spm)
        if cfg.multilingual:  # supervised only (PipelineConfig says so)
            for pair in cfg.pairs:
                self._step(f"{pair}: parallel shards of the first {cfg.train_pairs:,} pairs")
                self.by_pair[pair] = PairData(
                    data_steps.build_parallel_shards(cfg, self.corpus, self.spm, pair),
                    data_steps.slice_parallel(cfg, self.corpus, "valid", cfg.valid_sentences, pair),
                    data_steps.slice_parallel(cfg, self.corpus, "test", cfg.test_sentences, pair),
                )
        elif any(SETTINGS[name].parallel for name in cfg.settings):
            self._step(f"parallel shards of the first {cfg.train_pairs:,} training pairs")
            self.parallel = data_steps.build_parallel_shards(cfg, self.corpus, self.spm)
        systems = []
        for system in map(cfg.system, cfg.systems):
            if any(system.runs_in(setting) for setting in cfg.settings):
                systems.append(system)
            else:  # mRASP's pre-training, or its fine-tuning, reads parallel pairs
                print(f"left out {system.display}: it trains on parallel pairs, so it has no run")
        self.cl_table: Path | None = None
        # The training pairs seed the cross-lingual mapping in a supervised run only.
        seeds = data_steps.cl_seed_pairs(cfg, self.corpus)
        if any(s.reads_table for s in systems):
            self._step("cross-lingual embeddings (CL-SemFace's interface)")
            self.cl_table = data_steps.build_cl_table(
                cfg, self.mono, self.spm, self.model_config.d_model, self.corpus, seeds
            )
        self.mixed = None
        fusion = any(s.fusion for s in systems)
        if any(s.pretraining_data == "mixed" for s in systems) or (fusion and not cfg.multilingual):
            self._step("monolingual and parallel shards in one directory (VECO, deep fusion)")
            self.mixed = data_steps.build_mixed_shards(cfg, self.corpus, self.spm)
        if fusion and cfg.multilingual:
            for pair, data in self.by_pair.items():
                self._step(f"{pair}: monolingual and parallel shards in one directory (fusion)")
                mixed = data_steps.build_mixed_shards(cfg, self.corpus, self.spm, pair)
                self.by_pair[pair] = data._replace(mixed=mixed)
        self.ras_dictionary = None
        if any(s.pretraining_ras or s.finetuning_ras for s in systems):
            self._step("word dictionary of random aligned substitution (mRASP)")
            self.ras_dictionary = data_steps.build_ras_dictionary(
                cfg, self.mono, self.spm, self.model_config.d_model, self.corpus, seeds
            )
        if cfg.multilingual:
            first = self.by_pair[cfg.pairs[0]]
            self.valid, self.test = first.valid, first.test
        else:
            self.valid = data_steps.slice_parallel(cfg, self.corpus, "valid", cfg.valid_sentences)
            self.test = data_steps.slice_parallel(cfg, self.corpus, "test", cfg.test_sentences)
        for seed in cfg.run_seeds:
            self.run_seed(systems, seed)
        self._step("comparison", "report")
        tests = {pair: data.test for pair, data in self.by_pair.items()}
        report = build_report(
            cfg,
            self.tracking_uri,
            self.workdir,
            self.test,
            diagnostics=self.diagnostics,
            encoder_mlms=self.encoder_mlms,
            pair_tests=tests or None,
            grid=self.grid,
        )
        run_id = log_report_run(
            self.tracking_uri, cfg.experiment_name, self.workdir, report.markdown, report.plots
        )
        if run_id is not None:
            print(f"the report is also MLflow run {run_id} (tag stage=report)")
        self._record_times()
        return report

    def run_seed(self, systems: list[System], seed: int) -> None:
        """Every system once with ``seed``: pre-training and connect, then per setting
        fine-tuning and test translation."""
        cfg = self.config
        # Only a pipeline of several seeds says which one a step belongs to.
        of_seed = f", seed {seed}" if len(cfg.run_seeds) > 1 else ""
        inits: dict[str, Path | None] = {}
        for system in systems:
            if system.stage is None:
                inits[system.key] = None
                continue
            # A system that connects another's run names the run it trains (or reuses).
            trained = cfg.system(system.pretraining) if system.pretraining else system
            self._step(
                f"pre-training {trained.display} ({system.stage} stage){of_seed}", "pre-training"
            )
            run = self.pretrain(system, seed)
            inits[system.key] = model_dir = self.connect(system, run, seed)
            # A run's figures are measured once, on the model its own system connects (deep
            # fusion's is no translation model); a SemFace run's are reported for each system.
            owns_run = system.pretraining is None
            if not system.fusion and (owns_run or interface(system.interface).semface):
                self._step(f"interface diagnostics of {system.display}{of_seed}", "diagnostics")
                figures = self.diagnose(system, run, model_dir)
                self.diagnostics.append((system.display, seed, figures))
            if stage(system.stage).encoder:
                title = f"encoder MLM on validation text of {system.display}{of_seed}"
                self._step(title, "diagnostics")
                figures = self.encoder_mlm(run)
                self.encoder_mlms.append(EncoderMlmRow(system.key, system.display, seed, figures))
        for setting in cfg.settings:
            left_out = [s.display for s in systems if not s.runs_in(setting)]
            if left_out:  # their pre-training or fine-tuning reads parallel pairs
                print(f"\nno {setting} run of {', '.join(left_out)}: it trains on parallel pairs")
            for system in [s for s in systems if s.runs_in(setting)]:
                # One pair: the pipeline's own names; several: each pair from the same
                # pre-trained model, its runs named and tagged with the pair.
                for pair in cfg.pairs if cfg.multilingual else (None,):
                    on = f"{pair} " if pair else ""
                    self._step(
                        f"fine-tuning {system.display}, {on}{setting}{of_seed}", "fine-tuning"
                    )
                    run_dir = self.finetune_chosen(system, setting, inits[system.key], seed, pair)
                    self._step(
                        f"translating the {on}test set with {system.display}, {setting}{of_seed}",
                        "translation",
                    )
                    scores = self.test_scores(run_dir, pair)
                    self.register(system, setting, run_dir, scores, pair)

    # Training runs --------------------------------------------------------------------------

    def _run_config(
        self, run_dir: Path, steps: int, seed: int, tags: list[str], **values: Any
    ) -> TrainConfig:
        """A training run of the pipeline: its shapes, budget, seed, logging and MLflow
        store, with ``values`` (the stage, data and what the run changes)."""
        cfg = self.config
        return TrainConfig(
            spm_model=self.spm,
            output_dir=run_dir,
            preset=cfg.model_preset,
            steps=steps,
            max_tokens=cfg.max_tokens,
            compile=cfg.compile,
            seed=seed,
            log_interval=max(1, steps // 10),
            save_interval=max(1, steps // cfg.checkpoints_per_run),
            keep_last=1,
            tracking_uri=self.tracking_uri,
            experiment=cfg.experiment_name,
            run_name=run_dir.name,
            tags=[f"seed={seed}", *tags],
            **values,
        )

    def _train(self, config: TrainConfig) -> None:
        run_dir = config.output_dir
        changed = changed_settings(run_dir, config)
        if changed:
            raise LaunchError(
                f"{run_dir} was trained with other settings ({'; '.join(changed)}): remove that "
                "directory to train it again with these, or give another --workdir"
            )
        rebuilt = changed_inputs(run_dir, config)
        if rebuilt:
            raise LaunchError(
                f"{run_dir} was trained on other contents of {', '.join(rebuilt)}: remove that "
                "directory to train it again on these, or give another --workdir"
            )
        # A fine-tuning records its model directory's parent runs as its own (a run started
        # from another run's checkpoint records that run instead: not compared here).
        if config.init_from is not None and is_model_dir(config.init_from):
            _, wanted = lineage(config.init_from)
            _, started = lineage(run_dir)
            if started and started != wanted:
                raise LaunchError(
                    f"{run_dir} was started from another pre-training (runs {started}) than "
                    f"{config.init_from} holds now ({wanted}): remove that directory to "
                    "train it again"
                )
        if training_complete(run_dir, config.steps):
            print(f"reusing {run_dir} (finished, {config.steps} steps)")
            return
        trained = newest_complete_step(run_dir)
        if trained > config.steps:
            # train.py would resume past the end and save nothing at config.steps.
            raise LaunchError(
                f"{run_dir} is trained to step {trained}, past the {config.steps} asked: ask "
                f"for {trained} steps to reuse it, or remove that directory to train it again"
            )
        record_inputs(run_dir, config)
        cfg = self.config
        cmd = launch_command(
            config, ds_config=self.ds_config, procs=cfg.procs, hostfile=cfg.hostfile
        )
        seconds = run_logged(cmd, run_dir / "launcher.log", env=launch_environment(cfg.procs))
        if not training_complete(run_dir, config.steps):
            # train.py exits 0 when stopped by SIGTERM or SIGINT, after saving: the run
            # is not finished, and nothing after it may read it as a trained model.
            raise LaunchError(
                f"{run_dir} stopped before step {config.steps} (its checkpoints are kept; log: "
                f"{run_dir / 'launcher.log'}): run the same command again to continue it"
            )
        print(f"   finished in {seconds:.0f}s; log: {run_dir / 'launcher.log'}")

    def _ras(self, wanted: bool) -> list[Path]:
        """``ras_dictionary`` of a run: the pipeline's dictionary when the run substitutes."""
        if not wanted:
            return []
        assert self.ras_dictionary is not None, "a system substitutes: the dictionary is built"
        return [self.ras_dictionary]

    def _pretraining_data(self, system: System) -> Path:
        """The monolingual shards; mRASP's: the parallel ones; VECO's: both in one
        directory."""
        if system.pretraining_data == "parallel":
            return self.parallel
        if system.pretraining_data == "mixed":
            assert self.mixed is not None, "a system is VECO: its shards are built"
            return self.mixed
        return self.mono

    def pretrain_config(self, system: System, seed: int) -> TrainConfig:
        """The pre-training run of ``system``: its stage and interface on its shards with the
        pre-training learning rate, and its own options."""
        cfg = self.config
        assert system.stage is not None, f"{system.key} has no pre-training"
        if system.pretraining is not None:  # trained once for both: the other system's run
            return self.pretrain_config(cfg.system(system.pretraining), seed)
        values: dict[str, Any] = {
            "stage": system.stage,
            "interface": system.interface,
            "data": self._pretraining_data(system),
            "lr": cfg.pretrain_lr,
            "ras_dictionary": self._ras(system.pretraining_ras),
            "cl_table": self.cl_table if system.reads_table else None,
            "model_options": [*cfg.model_options, *system.model_options],
            **system.options,
        }
        run_dir = self.workdir / "runs" / seeded(f"pretrain-{system.key}", seed)
        tags = [f"system={system.display}"]
        return self._run_config(run_dir, cfg.pretrain_steps, seed, tags, **values)

    def pretrain(self, system: System, seed: int) -> Path:
        config = self.pretrain_config(system, seed)
        self._train(config)
        return config.output_dir

    def diagnose(self, system: System, run_dir: Path, model_dir: Path) -> dict[str, Any]:
        """The diagnostics of a pre-training and of the model connected from it, on the
        validation text (:func:`~megasemface.pipeline.pretraining_figures.diagnose_run`): a
        SemFace interface's figures, and for every pre-trained system whether the connected
        model reads a translation before fine-tuning (mBART's and XLM's are the references)."""
        semface = interface(system.interface).semface
        # Whether translations share codes (the paper's Fig. 5) is a question for VQ codes;
        # of several pairs, the first one's dictionary answers it.
        dictionary = self.corpus / "dict" / f"{self.config.pairs[0]}.tsv"
        has_dictionary = interface(system.interface).codebook and dictionary.is_file()
        texts = self._validation_texts()
        # The validation pair's two sides translate each other line by line; of several
        # pairs, each pair's English side is its own, so only one pair is read as such.
        src, tgt = self.config.pairs[0].split("-")
        aligned = not self.by_pair
        config = DiagnosticsConfig(
            checkpoint=run_dir if semface else None,
            model_dir=model_dir,
            spm_model=self.spm,
            texts=texts,
            dictionary=dictionary if has_dictionary else None,
            max_sentences=self.config.valid_sentences,
            translations=(src, tgt) if aligned else None,
        )
        return diagnose_run(config, run_dir, self.tracking_uri)

    def encoder_mlm(self, run_dir: Path) -> dict[str, Any]:
        """The encoder MLM of a finished pre-training on the validation text the fine-tunings
        validate on (:func:`~megasemface.pipeline.pretraining_figures.encoder_mlm_of_run`)."""
        texts, sentences = self._validation_texts(), self.config.valid_sentences
        return encoder_mlm_of_run(run_dir, self.spm, texts, sentences, self.tracking_uri)

    def _validation_texts(self) -> dict[str, Path]:
        """Each language's validation text: the pair's both sides; of several pairs, each
        xx side of its pair and English of the first."""
        if not self.by_pair:
            return {lang: Path(f"{self.valid}.{lang}") for lang in self.config.langs}
        source = self.config.all_langs[0]
        texts = {source: Path(f"{self.valid}.{source}")}
        for pair, data in self.by_pair.items():
            tgt = pair.split("-")[1]
            texts[tgt] = Path(f"{data.valid}.{tgt}")
        return texts

    def connect(self, system: System, run_dir: Path, seed: int) -> Path:
        out = self.workdir / "models" / seeded(system.key, seed)
        return connect_system(system, run_dir, out, self.spm, seed)

    def finetune_config(
        self,
        system: System,
        setting: str,
        init: Path | None,
        seed: int,
        pair: str | None = None,
        choice: tuple[float, int] | None = None,
    ) -> TrainConfig:
        """The fine-tuning run of ``system`` in ``setting``, from the connected model
        ``init`` (None: from scratch), with the system's fine-tuning options; on ``pair`` of
        several (run ``<setting>-<system>-<pair>``, tagged ``pair``), else the one pair.
        ``choice``: its (peak learning rate, warm-up steps), one of a grid's (the run named
        ``...-lr<lr>-w<warm-up>``); None: the pipeline's ``lr`` and ``warmup_steps``."""
        cfg = self.config
        name = f"{setting}-{system.key}" if pair is None else f"{setting}-{system.key}-{pair}"
        lr, warmup = cfg.lr, cfg.warmup_steps
        if choice is not None:
            lr, warmup = choice
            name += f"-lr{lr:g}-w{warmup}"
        run_dir = self.workdir / "runs" / seeded(name, seed)
        tags = [f"system={system.display}", f"system_key={system.key}", f"setting={setting}"]
        suffix = SETTINGS[setting].model_suffix  # read when it is registered by hand
        tags += [f"{k}={v}" for k, v in (("pair", pair), ("model_suffix", suffix)) if v]
        # Deep fusion's MLM reads the pair's monolingual text beside its pairs.
        if pair is not None:
            data = self.by_pair[pair]
            parallel, valid = (data.mixed if system.fusion else data.parallel), data.valid
        elif SETTINGS[setting].parallel:
            parallel, valid = (self.mixed if system.fusion else self.parallel), self.valid
        else:  # a pipeline of unsupervised runs only builds no parallel shards
            parallel, valid = None, self.valid
        return self._run_config(
            run_dir,
            cfg.finetune_steps,
            seed,
            tags,
            stage="finetune",
            interface="none",
            finetune_mode=system.finetune_mode(setting),
            data=parallel if SETTINGS[setting].parallel else self.mono,
            model_options=list(cfg.model_options),
            valid_prefix=valid,
            valid_interval=cfg.valid_interval,
            valid_max_sentences=cfg.valid_sentences,
            warmup_steps=warmup,
            lr=lr,
            denoise_schedule=cfg.denoise_schedule,
            no_repeat_ngram_size=cfg.no_repeat_ngram(setting),
            init_from=init,
            ras_dictionary=self._ras(system.finetuning_ras),
            **system.finetune,
        )

    def finetune(
        self,
        system: System,
        setting: str,
        init: Path | None,
        seed: int,
        pair: str | None = None,
        choice: tuple[float, int] | None = None,
    ) -> Path:
        config = self.finetune_config(system, setting, init, seed, pair, choice)
        self._train(config)
        return config.output_dir

    def finetune_chosen(
        self, system: System, setting: str, init: Path | None, seed: int, pair: str | None = None
    ) -> Path:
        """The fine-tuning run to test: the one run, or of a ``finetune_grid``'s runs the
        one whose best validation BLEU is highest (the first of equals)."""
        choices = self.config.finetune_choices
        if not self.config.finetune_grid:
            return self.finetune(system, setting, init, seed, pair)
        scores: dict[tuple[float, int], float] = {}
        runs: dict[tuple[float, int], Path] = {}
        for choice in choices:
            print(f"   peak learning rate {choice[0]:g}, {choice[1]} warm-up steps", flush=True)
            runs[choice] = self.finetune(system, setting, init, seed, pair, choice)
            scores[choice] = best_valid_bleu(runs[choice])
        chosen = max(choices, key=lambda choice: scores[choice])
        self.grid.append(GridChoice(system.display, setting, seed, pair, scores, chosen))
        shown = ", ".join(f"{lr:g}/{w}: {scores[lr, w]:.2f}" for lr, w in choices)
        print(f"   best validation BLEU by lr/warm-up: {shown}; chosen {chosen[0]:g}/{chosen[1]}")
        return runs[chosen]

    # Test scores ----------------------------------------------------------------------------

    def test_scores(self, run_dir: Path, pair: str | None = None) -> dict[str, Any]:
        """Test BLEU and chrF of both directions of ``pair`` (default: the one pair)."""
        path = run_dir / "test-scores.json"
        if path.is_file():
            scores = json.loads(path.read_text())
            print(f"reusing {path}: BLEU {scores['test_bleu']:.2f}")
            return scores
        # Decoded where the runs trained: on the GPU where there is one.
        device = "cuda" if cuda_devices() else "cpu"
        translator = Translator.from_model_dir(run_dir / "best", device)
        # The fine-tuning run's own setting, so the test decodes as its validation did.
        trained = json.loads((run_dir / "config.json").read_text())["train"]
        search = SearchConfig(
            beam=self.config.beam, no_repeat_ngram=int(trained.get("no_repeat_ngram_size", 0))
        )
        src, tgt = self.config.langs if pair is None else pair.split("-")
        test = self.test if pair is None else self.by_pair[pair].test
        scores: dict[str, Any] = {"signatures": {}}
        for a, b in ((src, tgt), (tgt, src)):
            started = time.perf_counter()
            sources = read_lines(f"{test}.{a}")
            hypotheses = translator.translate(sources, src_lang=a, tgt_lang=b, config=search)
            write_lines(run_dir / f"test.{a}-{b}.{b}", hypotheses)
            result = evaluate(hypotheses, read_lines(f"{test}.{b}"))
            scores[f"test_bleu_{a}-{b}"] = result.bleu.score
            scores[f"test_chrf_{a}-{b}"] = result.chrf.score
            scores["signatures"] = {"bleu": result.bleu.signature, "chrf": result.chrf.signature}
            print(
                f"   {a}->{b}: {result.bleu.details} | chrF {result.chrf.score:.2f} "
                f"({len(sources)} sentences in {time.perf_counter() - started:.0f}s on {device})"
            )
        for metric in ("bleu", "chrf"):
            values = [v for k, v in scores.items() if k.startswith(f"test_{metric}_")]
            scores[f"test_{metric}"] = sum(values) / len(values)
        best = json.loads((run_dir / "best" / "config.json").read_text())["meta"]
        log_scores(
            self.tracking_uri,
            best["parent_runs"]["finetune"],
            {key: float(value) for key, value in scores.items() if key.startswith("test_")},
            {f"test_{name}_signature": sig for name, sig in scores["signatures"].items()},
            files=[run_dir / f"test.{a}-{b}.{b}" for a, b in ((src, tgt), (tgt, src))],
            texts={"test-scores.json": json.dumps(scores, indent=1)},
            artifact_path="test",
        )
        path.write_text(json.dumps(scores, indent=1))
        return scores

    def register(
        self,
        system: System,
        setting: str,
        run_dir: Path,
        scores: dict[str, Any],
        pair: str | None = None,
    ) -> None:
        """Registers the run's best model with its lineage and test scores (a second time,
        the version registered before is reused), as a model of its pair."""
        langs = self.config.langs if pair is None else pair.split("-")
        version = register_best_model(
            self.tracking_uri,
            run_dir / "best",
            name=default_model_name(langs, system.key, SETTINGS[setting].model_suffix),
            tags={"interface": system.interface, "system_key": system.key},
            scores=scores,
        )
        print(f"   {'registered as' if version.created else 'reusing'} {version.uri}")
