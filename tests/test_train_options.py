"""train.py's options: one TrainConfig, its command line and back, typed overrides of its
fields, and docs/options.md made from its parser and field docstrings."""

from __future__ import annotations

import argparse
import dataclasses
import inspect
from pathlib import Path

import pytest
from launch import parse_train_argv

from megasemface.cli.options_doc import COMMAND, DOC, render
from megasemface.data.loading.loader import LoaderConfig
from megasemface.inference.search import SearchConfig
from megasemface.interfaces.registry import BuildOptions, interface_option_sections
from megasemface.objectives.objective import ObjectiveConfig
from megasemface.training.options import (
    TrainConfig,
    add_train_arguments,
    field_docs,
    option_sections,
    train_argv,
    typed_overrides,
)

PATHS = {"data": Path("shards/mono"), "spm_model": Path("spm/j.model"), "output_dir": Path("o")}


def test_every_option_survives_the_command_line() -> None:
    """A config with every field away from its default: train.py parses its command line
    back into the same config."""
    config = TrainConfig(
        stage="joint",
        interface="vq",
        data=Path("shards/en"),
        spm_model=Path("spm/joint.model"),
        output_dir=Path("runs/all options"),
        preset="small",
        model_options=["d_model=128", "vq.layout=product"],
        model_config_file=Path("model.json"),
        cl_table=Path("cl.safetensors"),
        cl_trainable=True,
        init_from=Path("runs/encoder"),
        decoder_objective="mlm",
        decoder_memory_norm=True,
        decoder_word_drop=0.3,
        mse_weight=0.5,
        diversity_weight=1.0,
        l2_weight=0.0,
        commitment_weight=0.25,
        extractor_diversity=True,
        token_entropy_weight=1e-3,
        codebook_warn_fraction=0.1,
        vq_codebook_init="table",
        mp_size=2,
        steps=7,
        seed=3,
        max_tokens=512,
        num_workers=2,
        compile=True,
        save_interval=3,
        keep_last=2,
        log_interval=1,
        max_consecutive_skips=2,
        experiment="x",
        run_name="run",
        tracking_uri="sqlite:///m.db",
        no_tracking=True,
        log_sample_ids=True,
        inject_nan_at=[2, 5],
        tags=["system=VQ-SemFace, Eq. 6", "seed=3"],
        lr=2e-4,
        lr_schedule="inverse_sqrt",
        warmup_steps=10,
        finetune_mode="unsupervised",
        directions=["en-de", "de-en"],
        label_smoothing=0.0,
        fusion_weights="1,0.5,0,2",
        denoise_schedule="0:1,5:0",
        valid_prefix=Path("corpus/valid"),
        valid_interval=5,
        valid_max_sentences=10,
        valid_beam=4,
        max_len_a=1.5,
        max_len_b=3,
        no_repeat_ngram_size=3,
        bt_min_len_a=0.5,
        ras_dictionary=[Path("dict/en-de.tsv"), Path("dict/de-fr.tsv")],
        ras_prob=0.5,
        decoder_noise_ras=True,
    )
    defaults = TrainConfig(stage="encoder", interface="cl", **PATHS)
    same = [
        f.name
        for f in dataclasses.fields(TrainConfig)
        if getattr(config, f.name) == getattr(defaults, f.name)
    ]
    # --register-model needs a tracked fine-tuning run, --finetune-ras supervised
    # fine-tuning, --cl-unit-mse CL-SemFace, --decoder-codes encoder (and
    # --decoder-continuous, which reads the encoder's codes) no --extractor-diversity: below.
    assert sorted(same) == [
        "cl_unit_mse",
        "decoder_codes",
        "decoder_continuous",
        "finetune_ras",
        "register_model",
    ], "set these fields away from their defaults"
    assert parse_train_argv(train_argv(config)) == config
    registering = TrainConfig(
        stage="finetune",
        interface="none",
        valid_prefix=Path("corpus/valid"),
        register_model="megasemface-en-de-cl",
        finetune_ras=True,
        ras_dictionary=[Path("dict/en-de.tsv")],
        **PATHS,
    )
    assert parse_train_argv(train_argv(registering)) == registering
    for codes in ("extractor", "encoder", "encoder-trained"):
        tied = TrainConfig(stage="joint", interface="vq", decoder_codes=codes, **PATHS)
        assert parse_train_argv(train_argv(tied)) == tied
    mixed = TrainConfig(stage="joint", interface="vq", decoder_continuous=0.25, **PATHS)
    assert parse_train_argv(train_argv(mixed)) == mixed
    for changed in ({"cl_unit_logits": False}, {"cl_unit_mse": True}, {"cl_table_input": False}):
        table_rows = TrainConfig(stage="joint", interface="cl", **changed, **PATHS)
        assert parse_train_argv(train_argv(table_rows)) == table_rows
    raw = TrainConfig(stage="joint", interface="cl", decoder_memory_norm=False, **PATHS)
    assert parse_train_argv(train_argv(raw)) == raw


def test_the_cl_mlm_reads_unit_rows_by_default_where_there_is_one() -> None:
    """CL-SemFace's encoder and joint stages divide the tied table by sqrt(d_model) for the
    MLM unless told not to; other stages have no such layer and refuse the option."""
    base = ["--data", "d", "--spm-model", "s", "--output-dir", "o", "--cl-table", "t"]
    for stage in ("encoder", "joint"):
        assert parse_train_argv(["--stage", stage, "--interface", "cl", *base]).cl_unit_logits
        off = ["--stage", stage, "--interface", "cl", "--no-cl-unit-logits", *base]
        assert parse_train_argv(off).cl_unit_logits is False
    assert not parse_train_argv(["--stage", "decoder", "--interface", "cl", *base]).cl_unit_logits
    assert not parse_train_argv(["--stage", "joint", "--interface", "vq", *base]).cl_unit_logits
    with pytest.raises(ValueError, match="--interface cl and --stage encoder or joint"):
        TrainConfig(stage="decoder", interface="cl", cl_unit_logits=True, **PATHS)


def test_the_table_input_is_on_where_cl_has_an_encoder_stage_and_refused_elsewhere() -> None:
    """--cl-table-input is on in CL-SemFace's encoder and joint stages unless turned off, and
    refused by the decoder stage (its encoder comes from --init-from) and by the other
    interfaces (no table), where it is off."""
    base = ["--data", "d", "--spm-model", "s", "--output-dir", "o", "--cl-table", "t"]
    for stage in ("encoder", "joint"):
        assert parse_train_argv(["--stage", stage, "--interface", "cl", *base]).cl_table_input
        off = ["--stage", stage, "--interface", "cl", "--no-cl-table-input", *base]
        assert parse_train_argv(off).cl_table_input is False
    for stage, kind in (("decoder", "cl"), ("joint", "vq"), ("encoder", "none")):
        assert TrainConfig(stage=stage, interface=kind, **PATHS).cl_table_input is False
        with pytest.raises(ValueError, match="--cl-table-input initialises CL-SemFace's encoder"):
            TrainConfig(stage=stage, interface=kind, cl_table_input=True, **PATHS)


def test_the_language_mean_term_is_on_for_cl_s_encoder_and_refused_without_one() -> None:
    """--language-mean-weight is 1 in CL-SemFace's encoder and joint stages, 0 elsewhere; a
    weight is taken by any SemFace encoder (VQ's too) and refused where no SemFace encoder
    trains (the decoder stage, the baselines) or below 0."""
    for stage in ("encoder", "joint"):
        assert TrainConfig(stage=stage, interface="cl", **PATHS).language_mean_weight == 1.0
        given = TrainConfig(stage=stage, interface="cl", language_mean_weight=0.0, **PATHS)
        assert given.language_mean_weight == 0.0
    assert TrainConfig(stage="joint", interface="vq", **PATHS).language_mean_weight == 0.0
    vq = TrainConfig(stage="joint", interface="vq", language_mean_weight=0.5, **PATHS)
    assert vq.language_mean_weight == 0.5
    for stage, kind in (("decoder", "cl"), ("encoder", "none"), ("mbart", "none")):
        assert TrainConfig(stage=stage, interface=kind, **PATHS).language_mean_weight == 0.0
        with pytest.raises(ValueError, match="--language-mean-weight pulls the SemFace encoder"):
            TrainConfig(stage=stage, interface=kind, language_mean_weight=1.0, **PATHS)
    with pytest.raises(ValueError, match="--language-mean-weight must be >= 0"):
        TrainConfig(stage="joint", interface="cl", language_mean_weight=-1.0, **PATHS)


def test_the_connection_options_default_by_stage_and_refuse_where_they_mean_nothing() -> None:
    """CL-SemFace's MSE takes the table's rows as they are unless told to take unit rows (in
    the stages with an MLM), and its joint stage's decoder reads the table's rows through the
    encoder's final norm; VQ keeps its memory. Each option refuses a stage or interface where
    it has nothing to act on."""
    base = ["--data", "d", "--spm-model", "s", "--output-dir", "o", "--cl-table", "t"]
    joint = parse_train_argv(["--stage", "joint", "--interface", "cl", *base])
    assert joint.cl_unit_mse is False and joint.decoder_memory_norm
    encoder = parse_train_argv(["--stage", "encoder", "--interface", "cl", *base])
    assert encoder.cl_unit_mse is False and not encoder.decoder_memory_norm
    for stage in ("encoder", "joint"):
        unit = ["--stage", stage, "--interface", "cl", "--cl-unit-mse", *base]
        assert parse_train_argv(unit).cl_unit_mse
    vq = parse_train_argv(["--stage", "joint", "--interface", "vq", *base])
    assert not vq.cl_unit_mse and not vq.decoder_memory_norm and vq.decoder_continuous == 0.5
    extractor = parse_train_argv(
        ["--stage", "joint", "--interface", "vq", "--decoder-codes", "extractor", *base]
    )
    assert extractor.decoder_continuous == 0  # the extractor's codes: no output to mix in
    assert joint.decoder_continuous == 0  # CL's memory: the table's rows
    own = ["--decoder-codes", "encoder-trained"]
    cl_own = parse_train_argv(["--stage", "joint", "--interface", "cl", *own, *base])
    assert cl_own.decoder_continuous == 1  # the encoder's output at every token
    assert not cl_own.decoder_memory_norm  # the encoder's output is normed already
    half = parse_train_argv(
        ["--stage", "joint", "--interface", "cl", *own, "--decoder-continuous", "0.5", *base]
    )
    assert half.decoder_memory_norm  # the table's rows at the other half, normed
    with pytest.raises(ValueError, match="--cl-unit-mse"):
        TrainConfig(stage="joint", interface="vq", cl_unit_mse=True, **PATHS)
    with pytest.raises(ValueError, match="--decoder-memory-norm"):
        TrainConfig(stage="encoder", interface="cl", decoder_memory_norm=True, **PATHS)
    with pytest.raises(ValueError, match="--decoder-memory-norm"):
        TrainConfig(
            stage="joint",
            interface="vq",
            decoder_codes="encoder-trained",
            decoder_continuous=1.0,
            decoder_memory_norm=True,
            **PATHS,
        )
    with pytest.raises(ValueError, match="--decoder-continuous"):
        TrainConfig(stage="joint", interface="vq", decoder_continuous=1.5, **PATHS)
    with pytest.raises(ValueError, match="--decoder-continuous"):
        TrainConfig(stage="joint", interface="cl", decoder_continuous=0.5, **PATHS)
    rows_alone = {"decoder_codes": "encoder", "decoder_continuous": 0.0}
    with pytest.raises(ValueError, match="--decoder-codes extractor"):
        TrainConfig(stage="joint", interface="cl", **rows_alone, **PATHS)  # type: ignore[arg-type]


def test_the_decoder_stages_word_drop_reaches_its_noise_and_nothing_else_takes_it() -> None:
    """--decoder-word-drop sets the share of words C(x) drops in the SemFace decoder stage
    (the paper's 0.1 by default); a stage without that copy, or a share of 1 that would leave
    the interface nothing to read, is refused."""
    from megasemface.training.units.base import objective_config_from

    base = ["--data", "d", "--spm-model", "s", "--output-dir", "o", "--cl-table", "t"]
    base += ["--init-from", "runs/encoder"]  # the VQ decoder stage's codebook
    for interface in ("cl", "vq"):
        for stage in ("decoder", "joint"):
            default = parse_train_argv(["--stage", stage, "--interface", interface, *base])
            assert objective_config_from(default).decoder_word_drop == 0.1
            assert "--decoder-word-drop" not in train_argv(default)
            heavy = [*base, "--decoder-word-drop", "0.3"]
            config = parse_train_argv(["--stage", stage, "--interface", interface, *heavy])
            assert objective_config_from(config).decoder_word_drop == 0.3
            assert train_argv(config)[-2:] == ["--decoder-word-drop", "0.3"]
    for stage, interface in (("encoder", "cl"), ("mbart", "none"), ("finetune", "cl")):
        with pytest.raises(ValueError, match="--decoder-word-drop noises"):
            TrainConfig(
                stage=stage,
                interface=interface,
                init_from=Path("m"),
                decoder_word_drop=0.3,
                **PATHS,
            )
    with pytest.raises(ValueError, match=r"--decoder-word-drop must be in \[0, 1\)"):
        TrainConfig(stage="joint", interface="vq", decoder_word_drop=1.0, **PATHS)


def test_the_cl_table_is_trained_by_default_in_the_joint_stage_only() -> None:
    """The joint CL stage trains its table; the separate stages keep it as built (the
    decoder stage reads it from --cl-table, so an encoder stage that trained it would leave
    the two stages on different tables). --no-cl-trainable turns it off where it is on."""
    base = ["--data", "d", "--spm-model", "s", "--output-dir", "o", "--cl-table", "t"]
    joint = parse_train_argv(["--stage", "joint", "--interface", "cl", *base])
    assert joint.cl_trainable is True
    assert "--cl-trainable" not in train_argv(joint)
    for stage in ("encoder", "decoder"):
        separate = parse_train_argv(["--stage", stage, "--interface", "cl", *base])
        assert separate.cl_trainable is False
        assert "--cl-trainable" not in train_argv(separate)
    fixed = parse_train_argv(["--stage", "joint", "--interface", "cl", "--no-cl-trainable", *base])
    assert fixed.cl_trainable is False
    assert "--no-cl-trainable" in train_argv(fixed)
    assert parse_train_argv(train_argv(fixed)) == fixed
    trained = parse_train_argv(["--stage", "encoder", "--interface", "cl", "--cl-trainable", *base])
    assert trained.cl_trainable is True
    assert parse_train_argv(train_argv(trained)) == trained


def test_decoder_codes_default_to_the_encoders_in_the_joint_vq_stage_only() -> None:
    """The joint VQ stage reads the encoder's codes, trained, unless told otherwise; every
    other run keeps the extractor, the only choice there. The command line names the
    choice only where it is not that default."""
    base = ["--data", "d", "--spm-model", "s", "--output-dir", "o"]
    joint = parse_train_argv(["--stage", "joint", "--interface", "vq", *base])
    assert joint.decoder_codes == "encoder-trained"
    assert "--decoder-codes" not in train_argv(joint)
    others = [
        ["--stage", "joint", "--interface", "cl"],
        ["--stage", "encoder", "--interface", "vq"],
        ["--stage", "decoder", "--interface", "vq", "--init-from", "runs/enc"],
        ["--stage", "joint", "--interface", "vq", "--extractor-diversity"],
        ["--stage", "finetune"],
    ]
    for argv in others:
        config = parse_train_argv([*argv, *base])
        assert config.decoder_codes == "extractor", argv
        assert "--decoder-codes" not in train_argv(config), argv
    paper = parse_train_argv(["--stage", "joint", "--decoder-codes", "extractor", *base])
    assert paper.decoder_codes == "extractor"
    assert train_argv(paper)[-2:] == ["--decoder-codes", "extractor"]
    assert parse_train_argv(train_argv(paper)) == paper
    cl = ["--stage", "joint", "--interface", "cl", "--decoder-codes", "encoder-trained", *base]
    assert parse_train_argv(cl).decoder_codes == "encoder-trained"
    with pytest.raises(ValueError, match="--decoder-codes encoder-trained"):
        parse_train_argv(
            ["--stage", "encoder", "--interface", "cl", "--decoder-codes", "encoder-trained", *base]
        )


def test_the_command_line_holds_what_differs_from_the_defaults() -> None:
    config = TrainConfig(stage="finetune", interface="none", **PATHS)
    argv = ["--stage", "finetune", "--interface", "none", "--data", "shards/mono"]
    assert train_argv(config) == [*argv, "--spm-model", "spm/j.model", "--output-dir", "o"]
    assert parse_train_argv(train_argv(config)) == config


def test_the_interface_defaults_by_stage_and_finetune_refuses_one_without_a_model() -> None:
    base = ["--data", "d", "--spm-model", "s", "--output-dir", "o"]
    assert parse_train_argv(["--stage", "joint", *base]).interface == "vq"
    assert parse_train_argv(["--stage", "finetune", *base]).interface == "none"
    init = ["--init-from", "models/vq"]
    assert parse_train_argv(["--stage", "finetune", "--interface", "vq", *init, *base])
    with pytest.raises(ValueError, match="--stage finetune --interface vq needs --init-from"):
        parse_train_argv(["--stage", "finetune", "--interface", "vq", *base])


def test_the_whole_model_pre_trainings_have_no_interface_and_no_validation() -> None:
    base = ["--data", "d", "--spm-model", "s", "--output-dir", "o"]
    for stage in ("mbart", "mrasp", "veco"):
        ras = ["--ras-prob", "0"] if stage == "mrasp" else []
        assert parse_train_argv(["--stage", stage, *ras, *base]).interface == "none"
    with pytest.raises(ValueError, match="--stage veco pre-trains; validation belongs"):
        parse_train_argv(["--stage", "veco", "--valid-prefix", "corpus/valid", *base])
    with pytest.raises(ValueError, match="--stage veco has no codebook to split"):
        parse_train_argv(["--stage", "veco", "--mp-size", "2", *base])


def test_typed_overrides_are_checked_against_the_fields() -> None:
    checked = typed_overrides({"diversity_weight": 0, "cl_trainable": True, "lr": None})
    assert checked == {"diversity_weight": 0.0, "cl_trainable": True, "lr": None}
    assert isinstance(checked["diversity_weight"], float)
    assert typed_overrides({"tags": ["a=b"], "init_from": Path("m")})
    for overrides, message in [
        ({"diversity": 0.0}, "'diversity' is not a TrainConfig field"),
        ({"diversity_weight": "0"}, "diversity_weight takes float, got '0'"),
        ({"steps": 1.5}, "steps takes int, got 1.5"),
        ({"steps": True}, "steps takes int, got True"),
        ({"cl_trainable": 1}, r"cl_trainable takes bool \| None, got 1"),
        ({"tags": "a=b"}, r"tags takes list\[str\], got 'a=b'"),
        ({"init_from": "m"}, r"init_from takes Path \| None, got 'm'"),
    ]:
        with pytest.raises(ValueError, match=message):
            typed_overrides(overrides)


def test_options_the_units_read_are_checked_up_front() -> None:
    base = {"stage": "finetune", "interface": "none", **PATHS}
    with pytest.raises(ValueError, match="--direction takes SRC-TGT, got 'en'"):
        TrainConfig(directions=["en"], **base)
    unsupervised = {**base, "finetune_mode": "unsupervised"}
    with pytest.raises(ValueError, match="back-translates the batches of both languages"):
        TrainConfig(directions=["en-de"], **unsupervised)
    TrainConfig(directions=["en-de", "de-en"], **unsupervised)
    TrainConfig(directions=["en-de"], **base)  # supervised: one direction is enough
    with pytest.raises(ValueError, match="--denoise-schedule: schedule steps must increase"):
        TrainConfig(denoise_schedule="5:1,0:0", **base)
    with pytest.raises(ValueError, match="--num-workers must be >= 0"):
        TrainConfig(num_workers=-1, **base)
    for weights in ("1,1,1", "1,-1,1,1", "0,0,0,0", "1,x,1,1"):
        with pytest.raises(ValueError, match="--fusion-weights takes four weights >= 0"):
            TrainConfig(fusion_weights=weights, finetune_mode="fusion", **base)
    with pytest.raises(ValueError, match="--no-repeat-ngram-size must be >= 0"):
        TrainConfig(no_repeat_ngram_size=-1, **base)
    with pytest.raises(ValueError, match="--bt-min-len-a must be in"):
        TrainConfig(bt_min_len_a=1.5, max_len_a=1.2, **base)


def test_every_field_has_a_docstring() -> None:
    assert set(field_docs()) == {f.name for f in dataclasses.fields(TrainConfig)}
    assert all(doc and "\n" not in doc for doc in field_docs().values())


def test_docs_options_md_is_current() -> None:
    assert DOC.read_text(encoding="utf-8") == render(), (
        f"docs/options.md is out of date: run {COMMAND}"
    )


def _own_defaults(section: type) -> dict[str, object]:
    """The fields ``section`` itself declares (not a base's), with their defaults."""
    own = inspect.get_annotations(section)
    out: dict[str, object] = {}
    for field in dataclasses.fields(section):
        if field.name not in own:
            continue
        if field.default is not dataclasses.MISSING:
            out[field.name] = field.default
        elif field.default_factory is not dataclasses.MISSING:
            out[field.name] = field.default_factory()
        else:
            out[field.name] = dataclasses.MISSING
    return out


def test_every_option_is_defined_once_with_one_default() -> None:
    """Each train.py flag sets the field of one section, and takes that field's default; the
    components the options configure declare none of them with a default of their own."""
    missing = set(interface_option_sections()) - set(option_sections())
    assert not missing, f"TrainConfig does not hold the interfaces' sections {missing}"
    owners: dict[str, type] = {}
    for section in option_sections():
        for name in _own_defaults(section):
            assert name not in owners, f"{name} is defined in {owners[name]} and {section}"
            owners[name] = section
    actions = [
        action
        for action in add_train_arguments(argparse.ArgumentParser(add_help=False))
        if action.dest != "local_rank"  # the launcher's
    ]
    assert sorted(action.dest for action in actions) == sorted(owners)
    for action in actions:
        default = _own_defaults(owners[action.dest])[action.dest]
        if default is dataclasses.MISSING:  # required, or the stage's own (--interface)
            assert action.required or action.default is None, action.dest
        else:
            assert action.default == default, (action.dest, action.default, default)
    # A component that keeps a default of its own for an option reads the same definition
    # (one constant object both name), never a second literal.
    for component in (ObjectiveConfig, SearchConfig, LoaderConfig, BuildOptions):
        twice = {
            name
            for name, default in _own_defaults(component).items()
            if name in owners
            and default is not dataclasses.MISSING
            and default is not _own_defaults(owners[name])[name]
        }
        assert not twice, f"{component.__name__} gives {sorted(twice)} defaults of its own"


def test_the_tiny_preset_on_gpus_warns_and_workers_follow_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from megasemface.training.preflight import preset_warning
    from megasemface.training.units.base import loader_workers

    def config(**options: object) -> TrainConfig:
        paths = {"data": Path("d"), "spm_model": Path("s"), "output_dir": Path("o")}
        return TrainConfig(stage="encoder", interface="cl", **paths, **options)  # type: ignore[arg-type]

    line = preset_warning(config(), "cuda")
    assert line is not None and "\n" not in line and "--preset paper" in line
    assert preset_warning(config(), "cpu") is None
    assert preset_warning(config(preset="paper"), "cuda") is None
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    assert loader_workers(config()) == 0  # on the CPU a worker would take the training's core
    assert loader_workers(config(num_workers=3)) == 3
