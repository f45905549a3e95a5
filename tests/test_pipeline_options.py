"""The pipeline's options: ``--seeds`` on the command line, one run directory, model directory
and ``seed`` tag per seed, the order in which the pipeline runs them; the budgets' systems and
settings."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from launch import parse_train_argv

from megasemface.checkpoints.layout import MARKER, checkpoint_tag
from megasemface.cli.reproduce import build_parser, config_from_args, main
from megasemface.pipeline import pipeline as pipeline_module
from megasemface.pipeline.config import BUDGETS, PipelineConfig, parse_finetune_grid, seeded
from megasemface.pipeline.data_steps import build_corpus
from megasemface.pipeline.launcher import TRAIN_SCRIPT, LaunchError
from megasemface.pipeline.pipeline import PairData, Pipeline
from megasemface.pipeline.report import grid_table
from megasemface.pipeline.scores import best_valid_bleu
from megasemface.pipeline.settings import SETTINGS
from megasemface.pipeline.systems import (
    ABLATIONS,
    PAPER_SCALE,
    RELATED,
    SYSTEMS,
    System,
)
from megasemface.training.options import FILLED_IN, TrainConfig, train_argv


def _config(*argv: str) -> PipelineConfig:
    return config_from_args(build_parser("test").parse_args(list(argv)))


def test_a_budget_names_its_systems_and_settings_options_override_them() -> None:
    study = _config("--budget", "study")
    assert study.systems == ("transformer", "xlm", "mbart", "cl", "vq")
    assert study.settings == ("supervised",)
    assert (study.model_preset, study.run_seeds) == ("small", (0,))
    assert study.workdir == Path("runs/study")
    assert (study.pretrain_steps, study.finetune_steps) == (800, 1000)
    changed = _config("--budget", "study", "--systems", "vq", "--settings", "unsupervised")
    assert (changed.systems, changed.settings) == (("vq",), ("unsupervised",))
    # Budgets without their own take the entry point's: the paper's comparison, or the demo's.
    assert _config().systems == ("transformer", "xlm", "mbart", "cl", "vq")
    assert _config().settings == ("supervised", "unsupervised")
    demo = build_parser("demo", systems="transformer,cl,vq", settings="supervised")
    config = config_from_args(demo.parse_args(["--budget", "smoke"]))
    assert (config.systems, config.settings) == (("transformer", "cl", "vq"), ("supervised",))


def test_the_small_model_is_the_one_its_docstring_costs() -> None:
    import torch

    from megasemface.interfaces.factory import build_interface
    from megasemface.models.semface import SemFaceModel
    from megasemface.nn.config import build_model_config
    from megasemface.nn.transformer import Seq2SeqModel
    from megasemface.objectives.sequences import SpecialTokens

    small = build_model_config("small")
    layers = (small.encoder_layers, small.decoder_layers, small.extractor_layers)
    assert (small.d_model, small.num_heads, small.ffn_dim, *layers) == (128, 4, 512, 4, 4, 2)
    special = SpecialTokens(pad=3, bos=1, eos=2, mask=4, lang_tags=(5, 6))
    with torch.device("meta"):
        seq2seq = Seq2SeqModel(small)
        vq = SemFaceModel(small, build_interface("vq", small), special)
    assert round(sum(p.numel() for p in seq2seq.parameters()) / 1e6, 1) == 3.9
    assert round(sum(p.numel() for p in vq.parameters()) / 1e6, 1) == 5.5


def test_seeds_default_to_the_single_seed() -> None:
    assert _config().run_seeds == (0,)
    assert _config("--seed", "3").run_seeds == (3,)
    config = _config("--seeds", "2, 0,1")
    assert config.run_seeds == (2, 0, 1)  # in the order given
    assert config.seed == 0  # the data steps keep theirs
    assert _config("--seed", "5", "--seeds", "1,2").run_seeds == (1, 2)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("0,x", "--seeds takes comma-separated non-negative integers (e.g. 0,1,2), got 'x'"),
        ("0,,1", "got '' in '0,,1'"),
        ("-1", "got '-1'"),
        ("1.5", "got '1.5'"),
        ("1,0,1", "--seeds 1,0,1: seed 1 is given more than once"),
    ],
)
def test_bad_seeds_are_refused_in_one_line(
    value: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The error comes before any work: nothing is built in the work directory.
    assert main(["--seeds", value, "--workdir", str(tmp_path / "w")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and message in error
    assert "\n" not in error
    assert not (tmp_path / "w").exists()


def test_negative_seeds_are_refused_by_the_config() -> None:
    for values in ({"seed": -1}, {"seeds": (0, -2)}):
        with pytest.raises(ValueError, match="seeds must be >= 0"):
            PipelineConfig(**values)  # type: ignore[arg-type]


def test_seed_zero_keeps_the_single_seed_paths() -> None:
    assert seeded("pretrain-vq", 0) == "pretrain-vq"
    assert seeded("pretrain-vq", 2) == "pretrain-vq-s2"


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The deepspeed commands the pipeline would run, instead of running them."""
    commands: list[list[str]] = []

    def record(cmd: list[str], log_path: Path, **_: object) -> float:
        commands.append(list(cmd))
        run = _launched(cmd)  # the finished run's last checkpoint, as train.py leaves it
        (run.output_dir / "checkpoints" / checkpoint_tag(run.steps)).mkdir(parents=True)
        (run.output_dir / "checkpoints" / checkpoint_tag(run.steps) / MARKER).touch()
        return 0.0

    monkeypatch.setattr(pipeline_module, "run_logged", record)
    return commands


def test_a_run_stopped_before_its_last_step_stops_the_pipeline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train.py exits 0 when a signal stops it after a save: the pipeline must not go on to
    translate or register that run as a trained model, and says how to continue it."""
    monkeypatch.setattr(pipeline_module, "run_logged", lambda cmd, log, **_: 0.0)
    pipeline = _pipeline(tmp_path, (0,))
    vq = System("vq", "VQ-SemFace", "joint", "vq")
    with pytest.raises(LaunchError, match=r"stopped before step .*run the same command again"):
        pipeline.pretrain(vq, 0)


def _pipeline(tmp_path: Path, seeds: tuple[int, ...], **options: object) -> Pipeline:
    values = {**BUDGETS["smoke"], "workdir": tmp_path, "seeds": seeds, **options}
    config = PipelineConfig(**values)  # type: ignore[arg-type]
    pipeline = Pipeline(config)
    pipeline.spm, pipeline.mono, pipeline.parallel = (tmp_path / n for n in ("spm", "mono", "par"))
    pipeline.mixed = tmp_path / "mixed"
    pipeline.valid = tmp_path / "valid"
    pipeline.cl_table = tmp_path / "cl.safetensors"
    pipeline.ras_dictionary = tmp_path / "ras" / "en-de.tsv"
    return pipeline


def _launched(cmd: list[str]) -> TrainConfig:
    """The TrainConfig train.py makes of a command the pipeline launched."""
    assert cmd[cmd.index(str(TRAIN_SCRIPT)) + 1] == "--deepspeed_config"
    return parse_train_argv(cmd[cmd.index(str(TRAIN_SCRIPT)) + 1 :])


def test_every_seed_has_its_run_directories_and_seed_tag(
    tmp_path: Path, launches: list[list[str]]
) -> None:
    pipeline = _pipeline(tmp_path, (0, 1))
    vq = System("vq", "VQ-SemFace", "joint", "vq")
    for seed in (0, 1):
        pipeline.pretrain(vq, seed)
        pipeline.finetune(vq, "supervised", tmp_path / "models" / seeded("vq", seed), seed)
    runs = [_launched(cmd) for cmd in launches]
    expected = ["pretrain-vq", "supervised-vq", "pretrain-vq-s1", "supervised-vq-s1"]
    assert [r.output_dir for r in runs] == [tmp_path.resolve() / "runs" / n for n in expected]
    assert [r.run_name for r in runs] == expected
    assert [r.seed for r in runs] == [0, 0, 1, 1]
    assert [r.tag_dict()["seed"] for r in runs] == ["0", "0", "1", "1"]
    assert runs[3].init_from == tmp_path / "models" / "vq-s1"


def test_every_run_of_the_pipeline_survives_its_command_line(
    tmp_path: Path, launches: list[list[str]]
) -> None:
    """Each system's pre-training run and its fine-tuning runs, as typed configs: train.py
    parses the command line the pipeline launches back into the same config."""
    pipeline = _pipeline(tmp_path, (0, 2))
    pipeline.config.model_options = ("dropout=0.2",)
    configs = []
    groups = (SYSTEMS, ABLATIONS, PAPER_SCALE, RELATED)
    for system in [system for group in groups for system in group.values()]:
        if system.stage is not None:
            configs.append(pipeline.pretrain_config(system, 2))
        init = None if system.stage is None else tmp_path / "models" / system.key
        settings = [s for s in SETTINGS if system.runs_in(s)]
        configs += [pipeline.finetune_config(system, s, init, 0) for s in settings]
    for config in configs:
        assert parse_train_argv(train_argv(config)) == config, config.run_name
    pipeline.pretrain(ABLATIONS["vq-eq6"], 0)
    pipeline.finetune(SYSTEMS["transformer"], "unsupervised", None, 0)
    assert [_launched(cmd) for cmd in launches] == [
        pipeline.pretrain_config(ABLATIONS["vq-eq6"], 0),
        pipeline.finetune_config(SYSTEMS["transformer"], "unsupervised", None, 0),
    ]


def test_unsupervised_generation_blocks_repeated_trigrams_unless_told(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, (0,))
    vq, init = SYSTEMS["vq"], tmp_path / "models" / "vq"
    sizes = {s: pipeline.finetune_config(vq, s, init, 0).no_repeat_ngram_size for s in SETTINGS}
    assert sizes == {"supervised": 0, "unsupervised": 3}
    pipeline.config.no_repeat_ngram_size = 0
    assert pipeline.finetune_config(vq, "unsupervised", init, 0).no_repeat_ngram_size == 0
    with pytest.raises(ValueError, match="--no-repeat-ngram-size must be >= 0"):
        PipelineConfig(no_repeat_ngram_size=-1)


def test_back_translation_minimum_length_is_a_system_of_the_vq_pre_training(
    tmp_path: Path,
) -> None:
    pipeline = _pipeline(tmp_path, (0,))
    init = tmp_path / "models" / "vq"
    system = ABLATIONS["vq-bt-len"]
    held = pipeline.finetune_config(system, "unsupervised", init, 0)
    plain = pipeline.finetune_config(SYSTEMS["vq"], "unsupervised", init, 0)
    assert held.bt_min_len_a == 0.5 and plain.bt_min_len_a == 0.0
    same = {"output_dir": plain.output_dir, "run_name": plain.run_name, "tags": plain.tags}
    assert dataclasses.replace(held, bt_min_len_a=0.0, **same) == plain
    assert system.pretraining == "vq"


def test_unsupervised_runs_need_no_parallel_shards(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, (0,))
    del pipeline.parallel  # `--settings unsupervised` builds none
    config = pipeline.finetune_config(SYSTEMS["vq"], "unsupervised", tmp_path / "models", 0)
    assert config.data == pipeline.mono


def test_compile_reaches_every_training_run(tmp_path: Path) -> None:
    assert _config("--compile").compile and not _config().compile
    pipeline = _pipeline(tmp_path, (0,))
    pipeline.config = dataclasses.replace(pipeline.config, compile=True)
    pretrain = pipeline.pretrain_config(SYSTEMS["vq"], 0)
    finetune = pipeline.finetune_config(SYSTEMS["vq"], "supervised", tmp_path / "models", 0)
    assert pretrain is not None and pretrain.compile and finetune.compile


def test_a_tracking_server_reaches_every_training_run(tmp_path: Path) -> None:
    uri = "http://mlflow-host:5000"
    assert _config("--tracking-uri", uri).tracking_uri == uri and _config().tracking_uri is None
    assert _pipeline(tmp_path, (0,)).tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    pipeline = _pipeline(tmp_path, (0,), tracking_uri=uri)
    pretrain = pipeline.pretrain_config(SYSTEMS["vq"], 0)
    finetune = pipeline.finetune_config(SYSTEMS["vq"], "supervised", tmp_path / "models", 0)
    assert pretrain is not None and pretrain.tracking_uri == finetune.tracking_uri == uri


def test_an_ablation_changes_only_its_options(tmp_path: Path) -> None:
    """An ablation's pre-training run is its interface's (CL-SemFace's or VQ-SemFace's) with
    the ablation's options, in its own directory."""
    pipeline = _pipeline(tmp_path, (0,))
    pipeline.config.model_options = ("dropout=0.2",)
    for key, system in ABLATIONS.items():
        config = pipeline.pretrain_config(system, 0)
        if system.pretraining is not None:  # another connection of that system's run
            assert config == pipeline.pretrain_config(pipeline.config.system(system.pretraining), 0)
            continue
        base = pipeline.pretrain_config(SYSTEMS[system.interface], 0)
        # A default filled in from other options (FILLED_IN) follows what the system sets.
        changed = {
            f.name
            for f in dataclasses.fields(TrainConfig)
            if getattr(config, f.name) != getattr(base, f.name)
        } - (set(FILLED_IN) - set(system.options))
        assert changed == {"output_dir", "run_name", "tags", *system.options} | (
            {"model_options"} if system.model else set()
        ) | ({"ras_dictionary"} if system.pretraining_ras else set()) | (
            {"cl_table"} if system.reads_table != SYSTEMS[system.interface].reads_table else set()
        ), key
        assert config.output_dir.name == f"pretrain-{key}"
        assert config.tag_dict()["system"] == system.display
        assert {k: getattr(config, k) for k in system.options} == dict(system.options)
    eq6 = pipeline.pretrain_config(ABLATIONS["vq-eq6"], 0)
    assert eq6.model_options == ["dropout=0.2", "vq.diversity_loss=eq6"]
    paper = pipeline.pretrain_config(ABLATIONS["vq-paper-losses"], 0)
    assert (paper.token_entropy_weight, paper.diversity_weight) == (0.0, 1.0)
    table = pipeline.pretrain_config(ABLATIONS["vq-table"], 0)
    assert table.cl_table is not None and table.cl_table == pipeline.cl_table


def test_mrasp_pretrains_on_the_parallel_pairs_with_the_pipeline_s_dictionary(
    tmp_path: Path,
) -> None:
    """mRASP is not among the paper's systems; its pre-training reads the parallel shards
    and the dictionary, its fine-tuning is everyone's; RAS fine-tuning has no unsupervised
    run."""
    assert _config("--systems", "paper").systems == tuple(SYSTEMS) and "mrasp" not in SYSTEMS
    related = ("mrasp", "veco", "xlm-fusion", "cl-fusion", "vq-fusion", "transformer")
    assert _config("--systems", "related,transformer").systems == related
    pipeline = _pipeline(tmp_path, (0,))
    mrasp = RELATED["mrasp"]
    assert mrasp.display == "mRASP" and mrasp.pretraining_ras
    config = pipeline.pretrain_config(mrasp, 0)
    assert (config.stage, config.interface, config.data) == ("mrasp", "none", pipeline.parallel)
    assert config.ras_dictionary == [pipeline.ras_dictionary]
    assert config.lr == pipeline.config.pretrain_lr and config.ras_prob == 0.3
    assert config.tag_dict()["system"] == "mRASP"
    init = tmp_path / "models" / "mrasp"
    finetune = pipeline.finetune_config(mrasp, "supervised", init, 0)
    plain = pipeline.finetune_config(SYSTEMS["mbart"], "supervised", init, 0)
    assert finetune.ras_dictionary == [] and not finetune.finetune_ras
    assert dataclasses.replace(finetune, tags=plain.tags, run_name=plain.run_name,
                               output_dir=plain.output_dir) == plain  # fmt: skip
    assert not mrasp.runs_in("unsupervised") and SYSTEMS["mbart"].runs_in("unsupervised")
    ras_ft = pipeline.finetune_config(ABLATIONS["vq-ras-ft"], "supervised", init, 0)
    assert ras_ft.finetune_ras and ras_ft.ras_dictionary == [pipeline.ras_dictionary]
    assert not ABLATIONS["vq-ras-ft"].runs_in("unsupervised")
    assert pipeline.pretrain_config(ABLATIONS["vq-ras-ft"], 0) == pipeline.pretrain_config(
        SYSTEMS["vq"], 0
    )


@pytest.mark.parametrize("key", ["xlm-fusion", "cl-fusion", "vq-fusion"])
def test_deep_fusion_shares_its_encoders_run_and_fine_tunes_with_four_losses(
    key: str, tmp_path: Path
) -> None:
    """Deep fusion connects the pre-training run of XLM, CL- or VQ-SemFace (trained once,
    shared) through the coordinator and fine-tunes in the fusion mode, supervised only, on
    the pairs and their languages' monolingual text (its MLM loss reads the text)."""
    assert key in _config("--systems", "related").systems and key not in SYSTEMS
    pipeline = _pipeline(tmp_path, (0,))
    fusion = RELATED[key]
    base = SYSTEMS[key.split("-")[0]]
    assert fusion.connect == "fusion" and fusion.pretraining == base.key
    assert pipeline.pretrain_config(fusion, 0) == pipeline.pretrain_config(base, 0)
    init = tmp_path / "models" / key
    finetune = pipeline.finetune_config(fusion, "supervised", init, 0)
    plain = pipeline.finetune_config(base, "supervised", init, 0)
    assert finetune.finetune_mode == "fusion" and finetune.fusion_weights == "1,1,1,1"
    assert finetune.data == pipeline.mixed and plain.data == pipeline.parallel
    same = {"tags": plain.tags, "run_name": plain.run_name, "output_dir": plain.output_dir}
    changed = {"finetune_mode": "supervised", "data": plain.data}
    assert dataclasses.replace(finetune, **same, **changed) == plain
    assert fusion.runs_in("supervised") and not fusion.runs_in("unsupervised")


@pytest.mark.parametrize("base", ["xlm", "mbart", "cl", "vq"])
def test_each_half_of_a_pre_training_shares_its_run_and_connection(
    base: str, tmp_path: Path
) -> None:
    """``<system>-encoder`` and ``<system>-decoder`` fine-tune one half of the system's own
    pre-training run, connected as it is; only the connected model's other half differs."""
    pipeline = _pipeline(tmp_path, (0,))
    whole = SYSTEMS[base]
    for part in ("encoder", "decoder"):
        half = ABLATIONS[f"{base}-{part}"]
        assert (half.part, half.pretraining, half.connect) == (part, base, whole.connect)
        assert pipeline.pretrain_config(half, 0) == pipeline.pretrain_config(whole, 0)
        init = tmp_path / "models" / half.key
        finetune = pipeline.finetune_config(half, "supervised", init, 0)
        plain = pipeline.finetune_config(whole, "supervised", init, 0)
        same = {"tags": plain.tags, "run_name": plain.run_name, "output_dir": plain.output_dir}
        assert dataclasses.replace(finetune, **same) == plain


def test_veco_pretrains_on_the_mixed_shards_and_connects_as_it_is(tmp_path: Path) -> None:
    """VECO is a related system, not one of the paper's: its pre-training reads the
    monolingual and parallel shards in one directory, with no dictionary; the run connects
    as it is and is fine-tuned as everyone is, supervised only (it reads parallel pairs)."""
    assert "veco" not in SYSTEMS and "veco" in _config("--systems", "related").systems
    assert _config("--systems", "veco").systems == ("veco",)
    pipeline = _pipeline(tmp_path, (0,))
    veco = RELATED["veco"]
    assert (veco.display, veco.connect) == ("VECO", "veco") and veco.pretraining_pairs
    assert not (veco.pretraining_ras or veco.finetuning_ras)
    config = pipeline.pretrain_config(veco, 0)
    assert (config.stage, config.interface, config.data) == ("veco", "none", pipeline.mixed)
    assert config.ras_dictionary == [] and config.lr == pipeline.config.pretrain_lr
    assert config.tag_dict()["system"] == "VECO" and config.output_dir.name == "pretrain-veco"
    init = tmp_path / "models" / "veco"
    finetune = pipeline.finetune_config(veco, "supervised", init, 0)
    plain = pipeline.finetune_config(SYSTEMS["mbart"], "supervised", init, 0)
    assert finetune.tag_dict()["system"] == "VECO" and finetune.init_from == init
    assert dataclasses.replace(finetune, tags=plain.tags, run_name=plain.run_name,
                               output_dir=plain.output_dir) == plain  # fmt: skip
    assert veco.runs_in("supervised") and not veco.runs_in("unsupervised")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"finetune": {"finetune_ras": 1}}, "finetune_ras takes bool, got 1"),
        ({"finetune": {"lr": 1.0}}, "the pipeline sets lr for every fine-tuning"),
        ({"finetune": {"ras_dictionary": []}}, "sets ras_dictionary for every fine-tuning"),
        ({"options": {"ras_dictionary": []}}, "the pipeline sets ras_dictionary for every run"),
        ({"options": {"finetune_ras": True}}, "--finetune-ras"),
        ({"stage": None, "finetune": {"directions": ["en-xx"]}}, None),
    ],
)
def test_a_system_s_fine_tuning_options_are_checked_when_it_is_made(
    values: dict, message: str | None
) -> None:
    values = {"stage": "joint", "interface": "vq", **values}
    if message is None:  # a system without pre-training may still fine-tune differently
        assert System("t-new", "Transformer, new", **values).finetune == values["finetune"]
        return
    with pytest.raises(ValueError, match=message):
        System("vq-new", "VQ-SemFace, new", **values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"options": {"diversity": 0.0}}, "'diversity' is not a TrainConfig field"),
        ({"options": {"diversity_weight": "0"}}, "diversity_weight takes float, got '0'"),
        ({"options": {"steps": 10}}, "the pipeline sets steps for every run"),
        ({"model": {"vq.diversity": "eq6"}}, "unknown model option 'vq.diversity'"),
        ({"model": {"vq.diversity_loss": "eq7"}}, "vq.diversity_loss must be one of"),
        ({"model": {"d_model": 1.5}}, "model option d_model takes int, got 1.5"),
        ({"interface": "cl", "options": {"extractor_diversity": True}}, "--extractor-diversity"),
        ({"stage": None, "options": {"mse_weight": 0.0}}, "belong to a pre-training run"),
        ({"part": "both"}, "part 'both': choose from whole, encoder, decoder"),
        ({"stage": None, "part": "encoder"}, "keeps a half of a pre-trained model"),
        ({"connect": "fusion", "part": "decoder"}, "keeps a half of a pre-trained model"),
    ],
)
def test_a_system_s_options_are_checked_when_it_is_made(values: dict, message: str) -> None:
    values = {"stage": "joint", "interface": "vq", **values}
    with pytest.raises(ValueError, match=message) as error:
        System("vq-new", "VQ-SemFace, new", **values)
    assert str(error.value).startswith("system 'vq-new': ")


def test_a_system_s_options_are_read_only() -> None:
    options = {"diversity_weight": 0.0}
    system = System("vq-no-div", "VQ-SemFace w/o diversity", "joint", "vq", options)
    options["diversity_weight"] = 5.0
    assert system.options == {"diversity_weight": 0.0}
    with pytest.raises(TypeError):
        system.options["l2_weight"] = 0.0  # type: ignore[index]


def test_the_pipeline_runs_every_system_once_per_seed(tmp_path: Path) -> None:
    """The orchestration: per seed, pre-training, connect, the interface's diagnostics and
    the encoder MLM on validation text, then each setting's fine-tuning, test translation
    and registration, each step on that seed's directories; the diagnostics and the MLM are
    kept per system and seed for the report."""
    calls: list[tuple[str, ...]] = []

    class Recording(Pipeline):
        def pretrain(self, system: System, seed: int) -> Path:
            calls.append(("pretrain", system.key, str(seed)))
            return tmp_path / seeded(f"pretrain-{system.key}", seed)

        def diagnose(self, system: System, run_dir: Path, model_dir: Path) -> dict:
            calls.append(("diagnose", system.key, run_dir.name))
            return {"run": run_dir.name}

        def encoder_mlm(self, run_dir: Path) -> dict:
            calls.append(("encoder_mlm", run_dir.name))
            return {"mlm": run_dir.name}

        def connect(self, system: System, run_dir: Path, seed: int) -> Path:
            calls.append(("connect", system.key, run_dir.name))
            return tmp_path / seeded(system.key, seed)

        def finetune(
            self, system: System, setting: str, init: Path | None, seed: int, pair: str | None
        ) -> Path:
            assert pair is None  # one pair: the pipeline's own names
            calls.append(("finetune", system.key, init.name if init else "-", str(seed)))
            return tmp_path / seeded(f"{setting}-{system.key}", seed)

        def test_scores(self, run_dir: Path, pair: str | None) -> dict:
            calls.append(("test", run_dir.name))
            return {"test_bleu": 1.0}

        def register(
            self, system: System, setting: str, run_dir: Path, scores: dict, pair: str | None
        ) -> None:
            assert scores == {"test_bleu": 1.0}  # after the test, with its scores
            calls.append(("register", system.key, setting, run_dir.name))

    config = PipelineConfig(workdir=tmp_path, systems=("transformer", "vq"), seeds=(0, 3))
    pipeline = Recording(config)
    for seed in config.run_seeds:
        pipeline.run_seed([config.system(key) for key in config.systems], seed)
    assert calls == [
        ("pretrain", "vq", "0"),
        ("connect", "vq", "pretrain-vq"),
        ("diagnose", "vq", "pretrain-vq"),
        ("encoder_mlm", "pretrain-vq"),
        ("finetune", "transformer", "-", "0"),
        ("test", "supervised-transformer"),
        ("register", "transformer", "supervised", "supervised-transformer"),
        ("finetune", "vq", "vq", "0"),
        ("test", "supervised-vq"),
        ("register", "vq", "supervised", "supervised-vq"),
        ("pretrain", "vq", "3"),
        ("connect", "vq", "pretrain-vq-s3"),
        ("diagnose", "vq", "pretrain-vq-s3"),
        ("encoder_mlm", "pretrain-vq-s3"),
        ("finetune", "transformer", "-", "3"),
        ("test", "supervised-transformer-s3"),
        ("register", "transformer", "supervised", "supervised-transformer-s3"),
        ("finetune", "vq", "vq-s3", "3"),
        ("test", "supervised-vq-s3"),
        ("register", "vq", "supervised", "supervised-vq-s3"),
    ]
    assert pipeline.diagnostics == [
        ("VQ-SemFace", 0, {"run": "pretrain-vq"}),
        ("VQ-SemFace", 3, {"run": "pretrain-vq-s3"}),
    ]
    assert pipeline.encoder_mlms == [
        ("vq", "VQ-SemFace", 0, {"mlm": "pretrain-vq"}),
        ("vq", "VQ-SemFace", 3, {"mlm": "pretrain-vq-s3"}),
    ]


def test_every_pre_training_with_an_encoder_mlm_measures_it(tmp_path: Path) -> None:
    """XLM's encoder stage and the SemFace systems' joint stage have an encoder MLM; mBART's
    pre-training has none; every pre-trained system's connected model is diagnosed (whether
    it reads a translation; a SemFace system's interface too)."""
    measured: list[tuple[str, str]] = []

    class Recording(Pipeline):
        def pretrain(self, system: System, seed: int) -> Path:
            return tmp_path / f"pretrain-{system.key}"

        def connect(self, system: System, run_dir: Path, seed: int) -> Path:
            return tmp_path / system.key

        def diagnose(self, system: System, run_dir: Path, model_dir: Path) -> dict:
            measured.append(("diagnose", system.key))
            return {}

        def encoder_mlm(self, run_dir: Path) -> dict:
            measured.append(("encoder_mlm", run_dir.name))
            return {}

    systems = ("xlm", "mbart", "cl", "vq")
    config = PipelineConfig(workdir=tmp_path, systems=systems, settings=())
    Recording(config).run_seed([config.system(key) for key in systems], 0)
    assert measured == [
        ("diagnose", "xlm"),
        ("encoder_mlm", "pretrain-xlm"),
        ("diagnose", "mbart"),
        ("diagnose", "cl"),
        ("encoder_mlm", "pretrain-cl"),
        ("diagnose", "vq"),
        ("encoder_mlm", "pretrain-vq"),
    ]


def test_languages_make_every_pair_and_a_work_directory_of_their_own(tmp_path: Path) -> None:
    locale = tmp_path / "locale"
    for lang in ("de", "fr", "ro"):
        (locale / lang / "LC_MESSAGES").mkdir(parents=True)
        (locale / lang / "LC_MESSAGES" / "app.mo").write_bytes(b"")
    config = _config(
        "--budget", "smoke", "--languages", "en, de,fr,ro", "--locale-dir", str(locale)
    )
    assert config.languages == ("en", "de", "fr", "ro")
    assert config.settings == ("supervised",)  # without --settings
    assert config.pairs == ("en-de", "en-fr", "en-ro")
    assert config.all_langs == config.languages and config.multilingual
    # Beside the single pair's work directory, never in it: that one stays as it is.
    assert config.workdir == Path("runs/smoke-en-de-fr-ro")
    assert config.experiment_name == "megasemface-en-de-fr-ro"
    given = _config(
        "--languages", "en,de,fr", "--workdir", str(tmp_path / "w"), "--locale-dir", str(locale)
    )
    assert given.workdir == tmp_path / "w"
    # One pair: as before.
    single = _config("--budget", "smoke")
    assert (single.pairs, single.all_langs, single.multilingual) == (
        ("en-de",),
        ("en", "de"),
        False,
    )
    assert (single.workdir, single.experiment_name) == (Path("runs/smoke"), "megasemface-en-de")
    # Another single pair: beside the default pair's work directory too, unless given one.
    other = _config("--budget", "lowres", "--pair", "en-fr")
    assert (other.pairs, other.workdir) == (("en-fr",), Path("runs/lowres-en-fr"))
    assert _config("--budget", "lowres", "--pair", "en-de").workdir == Path("runs/lowres")
    named = _config("--pair", "en-fr", "--workdir", str(tmp_path / "fr"))
    assert named.workdir == tmp_path / "fr"


def test_a_work_directory_of_another_pair_is_refused_not_rebuilt(tmp_path: Path) -> None:
    """A pipeline for en-fr over an en-de work directory would build its corpus and
    tokenizer over the ones the en-de runs there were trained with."""
    corpus = tmp_path / "corpus"
    (corpus / "mono").mkdir(parents=True)
    for lang in ("en", "de"):
        (corpus / "mono" / f"{lang}.txt").write_text("a line\n", encoding="utf-8")
    report = {"pairs": {"en-de": {}}, "mono": {}}
    (corpus / "report.json").write_text(json.dumps(report), encoding="utf-8")
    before = sorted(p.name for p in corpus.rglob("*"))
    config = PipelineConfig(workdir=tmp_path, pair="en-fr", systems=("transformer",))
    with pytest.raises(ValueError, match=r"holds the corpus of en-de, not of --pair en-fr"):
        build_corpus(config)
    assert sorted(p.name for p in corpus.rglob("*")) == before
    # Its own pair is reused as before.
    same = PipelineConfig(workdir=tmp_path, pair="en-de", systems=("transformer",))
    assert build_corpus(same) == corpus


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--languages", "en,de"], "give en and at least two others"),
        (["--languages", "en"], "give en and at least two others"),
        (["--languages", "de,en,fr"], "must start with en"),
        (["--languages", "en,de,german"], "'german' is not a language code"),
        (["--languages", "en,de,de"], "de is given more than once"),
        (["--languages", "en,de,xx"], "no gettext catalogs (*.mo) for 'xx'"),
        (["--languages", "en,de,fr", "--settings", "supervised,unsupervised"], "supervised only"),
        (["--languages", "en,de,fr", "--systems", "mrasp"], "one pair's parallel data"),
        (["--languages", "en,de,fr", "--systems", "vq-ras"], "one pair's dictionary"),
    ],
)
def test_bad_languages_are_refused_in_one_line(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    locale = tmp_path / "locale"
    for lang in ("de", "fr"):
        (locale / lang / "LC_MESSAGES").mkdir(parents=True)
        (locale / lang / "LC_MESSAGES" / "app.mo").write_bytes(b"")
    workdir = tmp_path / "w"
    assert main([*argv, "--workdir", str(workdir), "--locale-dir", str(locale)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("error: ") and message in error, error
    assert "\n" not in error
    assert not workdir.exists()


def test_each_pair_is_fine_tuned_on_its_own_data_in_its_own_run(
    tmp_path: Path, launches: list[list[str]]
) -> None:
    values = {**BUDGETS["smoke"], "workdir": tmp_path, "languages": ("en", "de", "fr")}
    pipeline = Pipeline(PipelineConfig(**values))  # type: ignore[arg-type]
    pipeline.spm, pipeline.mono = tmp_path / "spm", tmp_path / "mono"
    for pair in pipeline.config.pairs:
        pipeline.by_pair[pair] = PairData(*(tmp_path / f"{n}-{pair}" for n in ("par", "val", "te")))
    vq, init = SYSTEMS["vq"], tmp_path / "models" / "vq"
    configs = [
        pipeline.finetune_config(vq, "supervised", init, s, p)
        for p in ("en-de", "en-fr")
        for s in (0, 1)
    ]
    assert [c.run_name for c in configs] == [
        "supervised-vq-en-de",
        "supervised-vq-en-de-s1",
        "supervised-vq-en-fr",
        "supervised-vq-en-fr-s1",
    ]
    assert [c.data.name for c in configs] == ["par-en-de", "par-en-de", "par-en-fr", "par-en-fr"]
    assert [c.valid_prefix.name for c in configs] == [
        "val-en-de",
        "val-en-de",
        "val-en-fr",
        "val-en-fr",
    ]
    assert [c.tag_dict()["pair"] for c in configs] == ["en-de", "en-de", "en-fr", "en-fr"]
    assert all(c.init_from == init for c in configs)  # the one pre-trained model
    for config in configs:
        assert parse_train_argv(train_argv(config)) == config
    # The single pair's run has no pair in its name or tags.
    single = _pipeline(tmp_path / "single", (0,)).finetune_config(vq, "supervised", init, 0)
    assert single.run_name == "supervised-vq" and "pair" not in single.tag_dict()


def test_a_single_pair_keeps_its_shard_and_data_paths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A work directory of one pair is reused as it is: its parallel shards and slices keep
    their names; the pairs of several languages have their own beside them."""
    from megasemface.pipeline import data_steps

    built: list[Path] = []

    def build(corpora: object, spm: Path, out: Path, *_: object, **__: object) -> dict:
        built.append(out)
        return {"already_built": True}

    monkeypatch.setattr(data_steps, "build_shards", build)
    corpus = tmp_path / "corpus"
    for pair in ("en-de", "en-fr"):
        for lang in pair.split("-"):
            for split in ("train", "valid"):
                path = corpus / "parallel" / pair / f"{split}.{lang}"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text("a\nb\nc\n")
    single = PipelineConfig(workdir=tmp_path, train_pairs=2)
    several = PipelineConfig(workdir=tmp_path, train_pairs=2, languages=("en", "de", "fr"))
    data_steps.build_parallel_shards(single, corpus, tmp_path / "spm")
    data_steps.build_parallel_shards(several, corpus, tmp_path / "spm", "en-fr")
    assert built == [tmp_path / "shards" / "parallel-2", tmp_path / "shards" / "parallel-en-fr-2"]
    assert data_steps.slice_parallel(single, corpus, "valid", 2) == tmp_path / "data" / "valid-2"
    valid = data_steps.slice_parallel(several, corpus, "valid", 2, "en-fr")
    assert valid == tmp_path / "data" / "en-fr" / "valid-2"
    assert (tmp_path / "data" / "en-fr" / "valid-2.fr").read_text() == "a\nb\n"


def test_each_training_rank_has_a_gpu_of_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two ranks by default (the demo's), one per GPU on a machine with fewer GPUs; more
    ranks than GPUs are refused before any step runs, unless a hostfile spreads them."""
    from megasemface.pipeline import config as config_module

    for gpus, default in ((0, 2), (1, 1), (8, 2)):
        monkeypatch.setattr(config_module, "cuda_devices", lambda gpus=gpus: gpus)
        assert PipelineConfig().procs == default
    monkeypatch.setattr(config_module, "cuda_devices", lambda: 1)
    with pytest.raises(ValueError, match="--procs 2: each rank takes a GPU, this machine has 1"):
        PipelineConfig(procs=2)
    assert PipelineConfig(procs=2, hostfile=Path("hosts")).procs == 2
    monkeypatch.setattr(config_module, "cuda_devices", lambda: 0)
    assert PipelineConfig(procs=4).procs == 4  # CPU processes


def test_the_finetune_grid_is_parsed_and_bad_items_are_refused_in_one_line() -> None:
    """``--finetune-grid LR[:WARMUP],...``: a warm-up left out is --warmup-steps; --lr or
    --warmup-steps alone ask for that one setting instead of the budget's grid."""
    assert parse_finetune_grid("1e-3:400, 4e-3") == ((1e-3, 400), (4e-3, None))
    config = _config("--finetune-grid", "1e-3:400,4e-3", "--warmup-steps", "50")
    assert config.finetune_choices == ((1e-3, 400), (4e-3, 50))
    lowres = _config("--budget", "lowres")
    assert lowres.finetune_choices == ((2e-3, 100), (4e-3, 100), (8e-3, 100))
    assert _config("--budget", "lowres", "--lr", "3e-3").finetune_choices == ((3e-3, 100),)
    assert lowres.train_pairs * 10 <= 24_256  # at most a tenth of the monolingual German
    assert lowres.pretrain_steps >= lowres.finetune_steps
    assert lowres.settings == ("supervised",)  # the low-resource setting is supervised
    for text in ("1e-3:x", "fast", "1e-3:400:2"):
        with pytest.raises(ValueError, match="--finetune-grid takes LR or LR:WARMUP"):
            parse_finetune_grid(text)
    for grid, message in (
        (((0.0, 10),), "learning rates must be > 0"),
        (((1e-3, 0),), "warm-ups >= 1"),
        (((1e-3, 10), (1e-3, 10)), "more than once"),
    ):
        with pytest.raises(ValueError, match=message):
            PipelineConfig(finetune_grid=grid)


def test_the_grid_tests_the_fine_tuning_best_on_validation(tmp_path: Path) -> None:
    """With a grid, each setting is fine-tuned in a run of its own (its learning rate and
    warm-up in the run's config), the one whose best model scores highest on validation is
    the run tested, and every setting's score reaches the report's table."""
    valid = {1e-3: 3.5, 2e-3: 7.25, 4e-3: 6.0}
    trained: list[TrainConfig] = []

    class Recording(Pipeline):
        def _train(self, config: TrainConfig) -> None:
            trained.append(config)
            best = config.output_dir / "best"
            best.mkdir(parents=True)
            meta = {"meta": {"valid_bleu": valid[config.lr], "step": 2}}
            (best / "config.json").write_text(json.dumps(meta))

        def test_scores(self, run_dir: Path, pair: str | None = None) -> dict:
            return {"run": run_dir.name}

        def register(self, *args: object) -> None:
            pass

    config = PipelineConfig(
        workdir=tmp_path, systems=("transformer",), finetune_grid=tuple((lr, 20) for lr in valid)
    )
    pipeline = Recording(config)
    pipeline.spm, pipeline.parallel, pipeline.valid = Path("s.model"), Path("p"), Path("v")
    chosen = pipeline.finetune_chosen(config.system("transformer"), "supervised", None, 0)
    assert chosen.name == "supervised-transformer-lr0.002-w20"
    assert [(c.lr, c.warmup_steps, c.output_dir.name) for c in trained] == [
        (lr, 20, f"supervised-transformer-lr{lr:g}-w20") for lr in valid
    ]
    (row,) = pipeline.grid
    assert row.chosen == (2e-3, 20) and row.scores == {(lr, 20): v for lr, v in valid.items()}
    table = grid_table(pipeline.grid)
    assert "| Transformer | supervised | 0 | 3.50 | **7.25** | 6.00 |" in table
    (tmp_path / "runs" / "supervised-transformer-lr0.001-w20" / "best" / "config.json").unlink()
    with pytest.raises(LaunchError, match="no best model with a validation BLEU"):
        best_valid_bleu(tmp_path / "runs" / "supervised-transformer-lr0.001-w20")


def test_only_a_supervised_run_seeds_the_cl_mapping_with_its_training_pairs(
    tmp_path: Path,
) -> None:
    """The table is built once for all the run's settings: the low-resource slice of the
    training pairs seeds it when every setting fine-tunes on them, never validation or
    test pairs; several pairs map each language onto English with its own pairs."""
    from megasemface.pipeline import data_steps

    corpus = tmp_path / "corpus"
    for pair in ("en-de", "en-fr"):
        for lang in pair.split("-"):
            for split in ("train", "valid", "test"):
                path = corpus / "parallel" / pair / f"{split}.{lang}"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(f"{split} a\n{split} b\n{split} c\n")
    supervised = PipelineConfig(workdir=tmp_path, train_pairs=2, settings=("supervised",))
    seeds = data_steps.cl_seed_pairs(supervised, corpus)
    data = tmp_path / "data"
    assert seeds == [("en-de", data / "train-2.en", data / "train-2.de")]
    assert (data / "train-2.de").read_text() == "train a\ntrain b\n"
    command = data_steps._cl_embeddings_command(
        supervised, tmp_path / "shards", tmp_path / "spm", 64, corpus, tmp_path / "cl", seeds
    )
    item = f"en-de:{data / 'train-2.en'},{data / 'train-2.de'}"
    assert command[command.index("--seed-parallel") + 1] == item and "--pivot" not in command
    assert command[command.index("--max-iterations") + 1] == "0"
    for settings in (("unsupervised",), ("supervised", "unsupervised")):
        config = dataclasses.replace(supervised, settings=settings)
        assert data_steps.cl_seed_pairs(config, corpus) == []
    unseeded = data_steps._cl_embeddings_command(
        supervised, tmp_path / "shards", tmp_path / "spm", 64, corpus, tmp_path / "cl"
    )
    assert "--seed-parallel" not in unseeded and "--max-iterations" not in unseeded
    several = PipelineConfig(
        workdir=tmp_path, train_pairs=2, settings=("supervised",), languages=("en", "de", "fr")
    )
    seeds = data_steps.cl_seed_pairs(several, corpus)
    assert [(pair, src.parent.name) for pair, src, _ in seeds] == [
        ("en-de", "en-de"),
        ("en-fr", "en-fr"),
    ]
    command = data_steps._cl_embeddings_command(
        several, tmp_path / "shards", tmp_path / "spm", 64, corpus, tmp_path / "cl", seeds
    )
    assert command.count("--seed-parallel") == 2
    assert command[command.index("--pivot") + 1] == "en"
