"""The pipeline: data -> pre-training -> connect -> fine-tuning -> test BLEU -> comparison.

Every step writes under ``config.workdir`` and is skipped when its output is complete, so a
second run reuses the corpus, tokenizer, shards, tables, finished runs and scores (and says
so); an interrupted training run resumes from its newest checkpoint. Every training run and
every test score goes to one MLflow store, ``<workdir>/mlflow.db``, where the comparison
reads them back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from megasemface.checkpoints import connect_mbart, connect_runs, write_seq2seq_dir
from megasemface.evaluation.lines import read_lines, write_lines
from megasemface.evaluation.metrics import evaluate
from megasemface.inference.search import SearchConfig
from megasemface.inference.translate import Translator
from megasemface.models.config import build_model_config
from megasemface.pipeline import data_steps
from megasemface.pipeline.config import PipelineConfig, System
from megasemface.pipeline.launcher import (
    deepspeed_command,
    default_ds_config,
    launch_environment,
    run_logged,
    training_complete,
)
from megasemface.pipeline.report import Report, build_report

__all__ = ["Pipeline"]


class Pipeline:
    def __init__(self, config: PipelineConfig, corpus: Path | None = None) -> None:
        self.config = config
        self.workdir = config.workdir.resolve()
        self.config.workdir = self.workdir
        self.corpus_arg = corpus
        self.tracking_uri = f"sqlite:///{self.workdir / 'mlflow.db'}"
        self.ds_config = (config.deepspeed_config or default_ds_config()).resolve()
        self.model_config = build_model_config(config.model_preset, list(config.model_options))
        self.started = time.perf_counter()
        self.count = 0

    def _step(self, title: str) -> None:
        self.count += 1
        minutes, seconds = divmod(int(time.perf_counter() - self.started), 60)
        print(f"\n== {self.count}. {title}  [{minutes:02d}:{seconds:02d}]", flush=True)

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
        if "supervised" in cfg.settings:
            self._step(f"parallel shards of the first {cfg.train_pairs:,} training pairs")
            self.parallel = data_steps.build_parallel_shards(cfg, self.corpus, self.spm)
        systems = [cfg.system(key) for key in cfg.systems]
        self.cl_table: Path | None = None
        if any(s.interface == "cl" for s in systems):
            self._step("cross-lingual embeddings (CL-SemFace's interface)")
            self.cl_table = data_steps.build_cl_table(
                cfg, self.mono, self.spm, self.model_config.d_model, self.corpus
            )
        self.valid = data_steps.slice_parallel(cfg, self.corpus, "valid", cfg.valid_sentences)
        self.test = data_steps.slice_parallel(cfg, self.corpus, "test", cfg.test_sentences)
        inits: dict[str, Path | None] = {}
        for system in systems:
            if system.stage is None:
                inits[system.key] = None
                continue
            self._step(f"pre-training {system.display} ({system.stage} stage)")
            run = self.pretrain(system)
            inits[system.key] = self.connect(system, run)
        for setting in cfg.settings:
            for system in systems:
                self._step(f"fine-tuning {system.display}, {setting}")
                run_dir = self.finetune(system, setting, inits[system.key])
                self._step(f"translating the test set with {system.display}, {setting}")
                self.test_scores(run_dir)
        self._step("comparison")
        report = build_report(cfg, self.tracking_uri, self.workdir, self.test)
        minutes, seconds = divmod(int(time.perf_counter() - self.started), 60)
        print(f"\npipeline finished in {minutes} min {seconds} s")
        return report

    # Training runs --------------------------------------------------------------------------

    def _train(self, run_dir: Path, steps: int, args: list[str]) -> None:
        if training_complete(run_dir, steps):
            print(f"reusing {run_dir} (finished, {steps} steps)")
            return
        cfg = self.config
        common = [
            "--deepspeed_config",
            str(self.ds_config),
            "--spm-model",
            str(self.spm),
            "--output-dir",
            str(run_dir),
            "--preset",
            cfg.model_preset,
            *[x for option in cfg.model_options for x in ("--model", option)],
            "--steps",
            str(steps),
            "--max-tokens",
            str(cfg.max_tokens),
            "--seed",
            str(cfg.seed),
            "--log-interval",
            str(max(1, steps // 10)),
            "--save-interval",
            str(max(1, steps // 4)),
            "--keep-last",
            "1",
            "--tracking-uri",
            self.tracking_uri,
            "--experiment",
            cfg.experiment_name,
            "--run-name",
            run_dir.name,
        ]
        cmd = deepspeed_command([*common, *args], procs=cfg.procs, hostfile=cfg.hostfile)
        seconds = run_logged(cmd, run_dir / "launcher.log", env=launch_environment(cfg.procs))
        print(f"   finished in {seconds:.0f}s; log: {run_dir / 'launcher.log'}")

    def pretrain(self, system: System) -> Path:
        run_dir = self.workdir / "runs" / f"pretrain-{system.key}"
        args = [
            "--stage",
            str(system.stage),
            "--interface",
            system.interface,
            "--data",
            str(self.mono),
            "--tag",
            f"system={system.display}",
            "--lr",
            str(self.config.pretrain_lr),
            *system.options,
        ]
        if system.interface == "cl":
            args += ["--cl-table", str(self.cl_table)]
        self._train(run_dir, self.config.pretrain_steps, args)
        return run_dir

    def connect(self, system: System, run_dir: Path) -> Path:
        out = self.workdir / "models" / system.key
        if (out / "config.json").is_file():
            print(f"reusing {out}")
            return out
        if system.connect == "mbart":
            connected = connect_mbart(run_dir)
        elif system.connect == "xlm":
            connected = connect_runs(run_dir)
        else:  # the joint stage trained both: its encoder and decoder, minus the interface
            connected = connect_runs(run_dir, run_dir)
        write_seq2seq_dir(out, connected, spm_model=self.spm)
        taken = sum(1 for origin in connected.parameters.values() if origin != "random")
        print(f"connected {out}: {taken} of {len(connected.parameters)} tensors pre-trained")
        return out

    def finetune(self, system: System, setting: str, init: Path | None) -> Path:
        cfg = self.config
        run_dir = self.workdir / "runs" / f"{setting}-{system.key}"
        args = [
            "--stage",
            "finetune",
            "--finetune-mode",
            setting,
            "--data",
            str(self.parallel if setting == "supervised" else self.mono),
            "--valid-prefix",
            str(self.valid),
            "--valid-interval",
            str(cfg.valid_interval),
            "--valid-max-sentences",
            str(cfg.valid_sentences),
            "--warmup-steps",
            str(cfg.warmup_steps),
            "--lr",
            str(cfg.lr),
            "--denoise-schedule",
            cfg.denoise_schedule,
            "--tag",
            f"system={system.display}",
            "--tag",
            f"system_key={system.key}",
            "--tag",
            f"setting={setting}",
        ]
        if init is not None:
            args += ["--init-from", str(init)]
        self._train(run_dir, cfg.finetune_steps, args)
        return run_dir

    # Test scores ----------------------------------------------------------------------------

    def test_scores(self, run_dir: Path) -> dict[str, Any]:
        path = run_dir / "test-scores.json"
        if path.is_file():
            scores = json.loads(path.read_text())
            print(f"reusing {path}: BLEU {scores['test_bleu']:.2f}")
            return scores
        translator = Translator.from_model_dir(run_dir / "best")
        search = SearchConfig(beam=self.config.beam)
        src, tgt = self.config.langs
        scores: dict[str, Any] = {"signatures": {}}
        for a, b in ((src, tgt), (tgt, src)):
            started = time.perf_counter()
            sources = read_lines(f"{self.test}.{a}")
            hypotheses = translator.translate(sources, src_lang=a, tgt_lang=b, config=search)
            write_lines(run_dir / f"test.{a}-{b}.{b}", hypotheses)
            result = evaluate(hypotheses, read_lines(f"{self.test}.{b}"))
            scores[f"test_bleu_{a}-{b}"] = result.bleu.score
            scores[f"test_chrf_{a}-{b}"] = result.chrf.score
            scores["signatures"] = {"bleu": result.bleu.signature, "chrf": result.chrf.signature}
            print(
                f"   {a}->{b}: {result.bleu.details} | chrF {result.chrf.score:.2f} "
                f"({len(sources)} sentences in {time.perf_counter() - started:.0f}s)"
            )
        for metric in ("bleu", "chrf"):
            values = [v for k, v in scores.items() if k.startswith(f"test_{metric}_")]
            scores[f"test_{metric}"] = sum(values) / len(values)
        best = json.loads((run_dir / "best" / "config.json").read_text())["meta"]
        _log_scores(self.tracking_uri, best["parent_runs"]["finetune"], scores)
        path.write_text(json.dumps(scores, indent=1))
        return scores


def _log_scores(tracking_uri: str, run_id: str, scores: dict[str, Any]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    for key, value in scores.items():
        if key.startswith("test_"):
            client.log_metric(run_id, key, float(value))
    for name, signature in scores["signatures"].items():
        client.set_tag(run_id, f"test_{name}_signature", signature)
