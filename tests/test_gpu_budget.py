"""The ``gpu`` budget of tools/reproduce.py: the paper's five systems at the paper preset, in
step counts whose arithmetic fits 8 minutes on one H200."""

from __future__ import annotations

import math

from megasemface.cli.reproduce import build_parser, config_from_args
from megasemface.nn.config import build_model_config
from megasemface.pipeline.config import BUDGETS, PipelineConfig
from megasemface.pipeline.systems import SYSTEMS

EIGHT_MINUTES = 8 * 60

# docs/reproduce.md#the-gpu-budget: seconds a step of each stage takes on one H200 at the
# paper preset with 16,384-token batches (measured, the translation-shaped step scaled from
# a benchmark), and the work besides the steps (estimated).
H200_STEP_SECONDS: dict[str, float] = {
    "joint": 0.34,
    "encoder": 16_384 / 100_000,
    "mbart": 0.16,
    "finetune": 0.16,
}
H200_FIXED_SECONDS: dict[str, float] = {
    "data": 30,
    "cl_table": 45,
    "pretraining_run": 25,
    "finetuning_run": 20,
    "connect": 8,
    "diagnostics": 10,
    "validation": 5,
    "test_translation": 6,
    "report": 5,
}


def _gpu_config() -> PipelineConfig:
    return config_from_args(build_parser("reproduce").parse_args(["--budget", "gpu"]))


def test_the_gpu_budget_runs_the_paper_systems_at_the_paper_preset() -> None:
    config = _gpu_config()
    assert config.systems == tuple(SYSTEMS) and config.settings == ("supervised",)
    model = build_model_config(config.model_preset, list(config.model_options))
    assert (model.d_model, model.encoder_layers, model.decoder_layers) == (1024, 6, 6)
    assert model.vq.combinations == 102_400
    # One H200, at the batch the step times were measured at.
    assert config.procs == 1 and config.max_tokens == 16_384
    assert str(config.workdir) == "runs/gpu"


def _estimate(config: PipelineConfig) -> float:
    """The budget's seconds on one H200, as docs/reproduce.md adds them up."""
    fixed, step = H200_FIXED_SECONDS, H200_STEP_SECONDS
    seconds = fixed["data"] + fixed["report"]
    systems = [config.system(key) for key in config.systems]
    if any(system.interface == "cl" for system in systems):
        seconds += fixed["cl_table"]
    validations = math.ceil(config.finetune_steps / config.valid_interval)
    for system in systems:
        if system.stage is not None:
            seconds += config.pretrain_steps * step[system.stage] + fixed["pretraining_run"]
            seconds += fixed["connect"] + fixed["diagnostics"]
        for _ in config.settings:
            seconds += config.finetune_steps * step["finetune"] + fixed["finetuning_run"]
            seconds += validations * fixed["validation"] + fixed["test_translation"]
    return seconds


def test_the_gpu_budget_fits_eight_minutes_on_one_h200() -> None:
    config = _gpu_config()
    total = _estimate(config)
    assert total <= EIGHT_MINUTES
    assert round(total) == 479  # the docs' sum
    # The steps are what is left: twice as many would not fit.
    longer = PipelineConfig(
        **{
            **BUDGETS["gpu"],
            "pretrain_steps": 2 * config.pretrain_steps,
            "finetune_steps": 2 * config.finetune_steps,
            "valid_interval": 2 * config.valid_interval,
        }  # type: ignore[arg-type]
    )
    assert _estimate(longer) > EIGHT_MINUTES
    # Each run saves one checkpoint, its last (a paper-preset save takes about 10 s).
    assert config.checkpoints_per_run == 1
