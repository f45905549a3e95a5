"""Training pieces that need no launcher: configs, checkpoint bookkeeping, options."""

from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from megasemface.checkpoints.manager import CheckpointManager, DiskFullError
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.distributed.engine import load_ds_config, on_device
from megasemface.nn.transformer import DecoderCache
from megasemface.objectives.sequences import SequenceBatch, SpecialTokens
from megasemface.training.options import TrainConfig
from megasemface.training.preflight import check_before_start, lr_schedule_of
from megasemface.training.run_data import RunData
from megasemface.training.units.base import model_config_from

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_deepspeed_config_is_valid(path: Path) -> None:
    raw = json.loads(path.read_text())
    assert raw["gradient_clipping"] == 1.0
    assert raw["train_micro_batch_size_per_gpu"] == 1
    assert raw["optimizer"]["params"]["lr"] == 1e-4  # the paper's constant pre-training rate
    if raw.get("fp16", {}).get("enabled") and not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp16"):
            load_ds_config(path)
        assert raw["fp16"]["loss_scale"] == 0  # dynamic loss scaling
    else:
        config = load_ds_config(path, accumulation=4)
        assert config["gradient_accumulation_steps"] == 4
        # torch's fused Adam on every device: exact resume on CPU, no nvcc build on a GPU.
        assert config["optimizer"]["params"]["torch_adam"] is True
        assert config["optimizer"]["params"]["fused"] is True


def test_the_engine_moves_batches_to_its_device() -> None:
    """The loader reads batches into host memory; the engine's forward takes their tensors,
    also inside a batch dataclass, to the model's device (here the meta device)."""
    batch = SequenceBatch(torch.ones(2, 3, dtype=torch.long), torch.tensor([3, 2]), torch.zeros(2))
    generator = torch.Generator()
    moved = on_device((batch, generator, "supervised", 0.5), torch.device("meta"))
    assert isinstance(moved, tuple)  # not a tensor or dataclass: as it is
    batch_on = on_device(batch, torch.device("meta"))
    assert isinstance(batch_on, SequenceBatch)
    assert {t.device.type for t in vars(batch_on).values()} == {"meta"}
    assert batch.tokens_BT.device.type == "cpu"  # the host copy is left alone
    assert on_device(generator, torch.device("meta")) is generator
    # Already there: the object itself, so that a step's in-place updates (a decoding cache's
    # length) reach the caller.
    assert on_device(batch, torch.device("cpu")) is batch
    cache = DecoderCache()
    assert on_device(cache, torch.device("meta")) is cache
    assert on_device("encode", torch.device("meta")) == "encode"


def test_bad_deepspeed_configs_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1}')
    with pytest.raises(ValueError, match="gradient_clipping"):
        load_ds_config(path)
    path.write_text('{"gradient_clipping": 1.0, "scheduler": {"type": "WarmupLR", "params": {}}}')
    with pytest.raises(ValueError, match="linear"):
        load_ds_config(path)
    path.write_text('{"gradient_clipping": 1.0, "train_micro_batch_size_per_gpu": 8}')
    with pytest.raises(ValueError, match="max-tokens"):
        load_ds_config(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_ds_config(path)
    with pytest.raises(FileNotFoundError):
        load_ds_config(tmp_path / "missing.json")


def _save(manager: CheckpointManager, step: int, complete: bool = True) -> None:
    def write_engine(root: Path, tag: str) -> None:
        (root / tag).mkdir(parents=True, exist_ok=True)
        (root / tag / "model_states.pt").write_bytes(b"x")

    if complete:
        manager.save(step, write_engine, {"step": step}, lambda: None)
    else:  # a save killed before every rank finished: no COMPLETE marker
        write_engine(manager.root, manager.tag(step))


def test_checkpoints_resume_from_newest_complete_and_keep_last(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2, rank=0)
    assert manager.newest() is None
    for step in (10, 20, 30):
        _save(manager, step)
    _save(manager, 40, complete=False)
    assert manager.newest() == (30, "step-00000030")  # the interrupted one is never used
    assert manager.rank_states("step-00000030") == [{"step": 30}]
    kept = sorted(p.name for p in manager.root.iterdir())
    assert kept == ["latest", "step-00000020", "step-00000030", "step-00000040"]
    # DeepSpeed's pointer names the newest complete one, never the interrupted 40.
    assert (manager.root / "latest").read_text() == "step-00000030"
    _save(manager, 50)
    kept = sorted(p.name for p in manager.root.iterdir())
    assert kept == ["latest", "step-00000030", "step-00000050"]  # the partial 40 is gone too
    assert (manager.root / "latest").read_text() == "step-00000050"
    # A rank of a run with more ranks than wrote the checkpoint reads every writer's state.
    other_rank = CheckpointManager(tmp_path, keep_last=2, rank=3)
    assert other_rank.rank_states("step-00000050") == [{"step": 50}]
    (manager.root / "step-00000050" / "rank-00000.json").unlink()
    with pytest.raises(FileNotFoundError, match="holds no rank-"):
        other_rank.rank_states("step-00000050")


def test_a_save_clears_the_half_written_folder_of_its_step_first(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, keep_last=2, rank=0)
    _save(manager, 10)
    _save(manager, 20, complete=False)  # a run killed while saving 20
    (manager.root / "step-00000020" / "rank-00007.json").write_text("{}")  # of another layout
    _save(manager, 20)  # the resumed run saves 20 again
    assert sorted(p.name for p in (manager.root / "step-00000020").iterdir()) == [
        "COMPLETE",
        "model_states.pt",
        "rank-00000.json",
    ]


def _write_tensor(nbytes: int) -> Callable[[Path, str], None]:
    def write_engine(root: Path, tag: str) -> None:
        (root / tag).mkdir(parents=True, exist_ok=True)
        torch.save({"w": torch.zeros(nbytes // 4)}, root / tag / "optim_states.pt")

    return write_engine


def test_a_full_disk_stops_the_save_and_keeps_the_previous_checkpoint(
    tmpfs: Callable[[int], Path],
) -> None:
    disk = tmpfs(4 << 20)
    manager = CheckpointManager(disk, keep_last=1, rank=0)
    manager.save(10, _write_tensor(1 << 20), {"step": 10}, lambda: None)
    before = {p.name: p.read_bytes() for p in (manager.root / "step-00000010").iterdir()}
    # torch's zip writer reports a full disk as a RuntimeError without an errno.
    with pytest.raises(DiskFullError) as failed:
        manager.save(20, _write_tensor(4 << 20), {"step": 20}, lambda: None)
    message = str(failed.value)
    assert (
        "\n" not in message and f"checkpoint {manager.root / 'step-00000020'} (step 20)" in message
    )
    assert "the disk is full" in message and "step-00000010 is intact" in message
    assert "takes 1.0 MiB" in message and not failed.value.quiet
    del failed  # its traceback holds torch's writer, whose open file keeps the space
    gc.collect()
    assert manager.newest() == (10, "step-00000010")
    assert (manager.root / "latest").read_text() == "step-00000010"
    assert {p.name: p.read_bytes() for p in (manager.root / "step-00000010").iterdir()} == before

    def write_json(root: Path, tag: str) -> None:  # Python's own writes: OSError(ENOSPC)
        (root / tag).mkdir(parents=True, exist_ok=True)
        (root / tag / "meta.json").write_text("x" * (4 << 20))

    with pytest.raises(DiskFullError, match="step 20"):
        manager.save(20, write_json, {"step": 20}, lambda: None)
    gc.collect()
    assert manager.newest() == (10, "step-00000010")
    shutil.rmtree(manager.root / "step-00000020")  # space freed: the same save succeeds
    manager.save(20, _write_tensor(1 << 20), {"step": 20}, lambda: None)
    assert manager.newest() == (20, "step-00000020")
    assert not (manager.root / "step-00000010").exists()  # pruned only now


def test_a_failed_save_on_a_disk_with_room_is_not_called_full(tmp_path: Path) -> None:
    def broken(root: Path, tag: str) -> None:
        raise RuntimeError("something else")

    with pytest.raises(RuntimeError, match="something else"):
        CheckpointManager(tmp_path, keep_last=1, rank=0).save(10, broken, {}, lambda: None)


def test_train_options_refuse_impossible_combinations() -> None:
    base = {"data": Path("d"), "spm_model": Path("m"), "output_dir": Path("o")}
    with pytest.raises(ValueError, match="--init-from"):
        TrainConfig(stage="decoder", interface="vq", **base)
    with pytest.raises(ValueError, match="only an encoder stage"):
        TrainConfig(stage="joint", interface="none", **base)
    with pytest.raises(ValueError, match="--stage"):
        TrainConfig(stage="pretrain", interface="cl", **base)
    with pytest.raises(ValueError, match="--mp-size 1"):
        TrainConfig(stage="finetune", interface="none", mp_size=2, **base)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        TrainConfig(stage="finetune", interface="none", tags=["system"], **base)
    with pytest.raises(ValueError, match="--finetune-mode"):
        TrainConfig(stage="finetune", interface="none", finetune_mode="semi", **base)
    with pytest.raises(ValueError, match="--steps"):
        TrainConfig(stage="encoder", interface="cl", steps=0, **base)
    with pytest.raises(ValueError, match="--extractor-diversity"):
        TrainConfig(stage="encoder", interface="vq", extractor_diversity=True, **base)
    with pytest.raises(ValueError, match="--extractor-diversity"):
        TrainConfig(stage="joint", interface="cl", extractor_diversity=True, **base)
    with pytest.raises(ValueError, match="--commitment-weight must be >= 0"):
        TrainConfig(stage="joint", interface="vq", commitment_weight=-0.1, **base)
    with pytest.raises(ValueError, match="--mse-weight must be >= 0"):
        TrainConfig(stage="joint", interface="cl", mse_weight=-1, **base)
    TrainConfig(stage="joint", interface="vq", extractor_diversity=True, **base)
    with pytest.raises(ValueError, match="--decoder-codes encoder"):
        TrainConfig(stage="encoder", interface="vq", decoder_codes="encoder", **base)
    with pytest.raises(ValueError, match="--decoder-codes encoder"):
        TrainConfig(
            stage="joint", interface="vq", decoder_codes="encoder", extractor_diversity=True, **base
        )
    with pytest.raises(ValueError, match="--decoder-codes must be"):
        TrainConfig(stage="joint", interface="vq", decoder_codes="table", **base)
    TrainConfig(stage="joint", interface="vq", decoder_codes="encoder", **base)


def test_cpu_runs_use_torch_fused_adam_for_exact_resume(tmp_path: Path) -> None:
    shipped = Path(__file__).resolve().parents[1] / "ds_configs" / "cpu_fp32_zero2.json"
    if torch.cuda.is_available():
        pytest.skip("the choice applies on the CPU accelerator")
    params = load_ds_config(shipped)["optimizer"]["params"]
    assert params["torch_adam"] is True and params["fused"] is True
    raw = json.loads(shipped.read_text())
    raw["optimizer"]["params"]["fused"] = False  # the user's explicit choice stays
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(raw))
    assert load_ds_config(path)["optimizer"]["params"]["fused"] is False
    del raw["optimizer"]["params"]["fused"]
    raw["optimizer"]["params"]["torch_adam"] = False  # the user's explicit choice stays
    raw["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    path.write_text(json.dumps(raw))
    assert load_ds_config(path)["optimizer"]["params"]["torch_adam"] is False
    assert "fused" not in load_ds_config(path)["optimizer"]["params"]
    del raw["optimizer"]["params"]["torch_adam"]
    path.write_text(json.dumps(raw))
    assert "torch_adam" not in load_ds_config(path)["optimizer"]["params"]  # offload: as given


def test_options_are_checked_before_distributed_start_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = {"data": Path("d"), "spm_model": Path("m"), "output_dir": Path("o")}
    plain: dict = {"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    scheduled = {**plain, "scheduler": {"type": "WarmupLR", "params": {}}}
    finetune = TrainConfig(stage="finetune", interface="none", **base)
    assert lr_schedule_of(finetune, plain) == "inverse_sqrt"  # the fine-tuning unit's own
    encoder = TrainConfig(stage="encoder", interface="vq", **base)
    assert lr_schedule_of(encoder, plain) == "deepspeed"
    assert lr_schedule_of(TrainConfig(stage="joint", interface="vq", lr=1e-3, **base), plain) == (
        "constant"
    )
    with pytest.raises(ValueError, match="replaces DeepSpeed's scheduler"):
        lr_schedule_of(finetune, scheduled)
    with pytest.raises(ValueError, match="fight"):
        lr_schedule_of(TrainConfig(stage="encoder", interface="cl", lr=1e-3, **base), scheduled)
    check_before_start(TrainConfig(stage="joint", interface="vq", mp_size=2, **base), plain, 4)
    compiled = TrainConfig(stage="joint", interface="vq", compile=True, **base)
    check_before_start(compiled, {**plain, "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="--compile works under ZeRO stage 1 or 2"):
        check_before_start(compiled, {**plain, "zero_optimization": {"stage": 3}})
    monkeypatch.setenv("MEGASEMFACE_CPU_GEMM", "mkl")
    with pytest.raises(ValueError, match="MEGASEMFACE_CPU_GEMM must be auto, blas or onednn"):
        check_before_start(compiled, plain)
    monkeypatch.delenv("MEGASEMFACE_CPU_GEMM")
    with pytest.raises(ValueError, match="--mp-size 2 does not divide the 3 processes"):
        check_before_start(TrainConfig(stage="joint", interface="vq", mp_size=2, **base), plain, 3)
    with pytest.raises(ValueError, match=r"vq\.num_codes 512 is not divisible by --mp-size 3"):
        check_before_start(TrainConfig(stage="joint", interface="vq", mp_size=3, **base), plain, 3)
    with pytest.raises(ValueError, match="d_model"):
        bad_shape = TrainConfig(
            stage="encoder", interface="cl", model_options=["d_model=65"], **base
        )
        check_before_start(bad_shape, plain)
    with pytest.raises(ValueError, match="--bridge codebook"):
        bridged = TrainConfig(
            stage="finetune", interface="none", model_options=["bridge=codebook"], **base
        )
        check_before_start(bridged, plain)


def test_a_resume_with_another_model_parallel_size_is_refused_before_start_up(
    tmp_path: Path,
) -> None:
    """Only the number of data-parallel ranks may change on resume: one line names the
    checkpoint and the --mp-size to resume with, before any process group exists."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step-00000003"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text(json.dumps({"train_config": {"mp_size": 2}}))
    for name in ("COMPLETE", "rank-00000.json", "rank-00001.json"):
        (checkpoint / name).write_text("{}")
    base = {"data": Path("d"), "spm_model": Path("m"), "output_dir": tmp_path / "run"}
    plain: dict = {"optimizer": {"type": "Adam", "params": {"lr": 1e-4}}}
    check_before_start(TrainConfig(stage="encoder", interface="cl", mp_size=2, **base), plain, 4)
    with pytest.raises(ValueError) as refused:
        check_before_start(TrainConfig(stage="encoder", interface="cl", **base), plain, 2)
    message = str(refused.value)
    assert "\n" not in message and str(checkpoint) in message
    assert "--mp-size 2, this run has --mp-size 1" in message
    assert "resume with --mp-size 2" in message


def test_the_tokenizer_sets_the_vocabulary_and_refuses_a_contradicting_option(
    spm_model: Path,
) -> None:
    tokenizer = Tokenizer.load(spm_model)
    data = RunData(None, tokenizer, SpecialTokens.from_tokenizer(tokenizer))  # type: ignore[arg-type]
    base = {"data": Path("d"), "spm_model": spm_model, "output_dir": Path("o")}
    config = model_config_from(TrainConfig(stage="joint", interface="vq", **base), data)
    assert (config.vocab_size, config.num_langs) == (tokenizer.vocab_size, len(tokenizer.languages))
    assert (config.pad_id, config.mask_id) == (tokenizer.pad_id, tokenizer.mask_id)
    same = [f"vocab_size={tokenizer.vocab_size}", "dropout=0.3"]
    config = model_config_from(
        TrainConfig(stage="joint", interface="vq", model_options=same, **base), data
    )
    assert config.dropout == 0.3
    other = TrainConfig(stage="joint", interface="vq", model_options=["vocab_size=999"], **base)
    with pytest.raises(ValueError, match="vocab_size=999 contradicts"):
        model_config_from(other, data)


def test_a_bad_cpu_product_setting_stops_commands_before_they_start(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The variable is read by the first matrix product, deep in a run: commands refuse a
    bad value at their start, in one line, with nothing built."""
    from megasemface.cli import reproduce, translate

    monkeypatch.setenv("MEGASEMFACE_CPU_GEMM", "mkl")
    args = ["--model-dir", str(tmp_path), "--input", str(tmp_path / "in.txt")]
    assert translate.main([*args, "--src-lang", "en", "--tgt-lang", "de"]) == 2
    assert "MEGASEMFACE_CPU_GEMM must be auto, blas or onednn" in capsys.readouterr().err
    assert reproduce.main(["--budget", "smoke", "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "error: MEGASEMFACE_CPU_GEMM must be auto, blas or onednn, got 'mkl'" in err
    assert "Traceback" not in err and not (tmp_path / "run").exists()


def test_the_progress_line_shows_the_loss_parts_and_the_units_fields(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The loop knows no stage: it prints the parts the step's loss names and the fields
    the unit gives, nothing it would pick out of the metrics by name."""
    from megasemface.training.trainer import _Progress

    metrics = {
        "loss": 2.5,
        "mt": 2.25,
        "mt_nll": 2.0,
        "mt_accuracy": 0.5,
        "denoise_weight": 0.1,
        "lr": 1e-3,
        "tokens_per_s": 1234.0,
    }
    _Progress(True, total=10, start=0).update(4, metrics, ["mt", "mt_nll"], ["enc codes 8/512"])
    line = capsys.readouterr().out
    assert line.startswith("step 4/10 | 1,234 tok/s | loss 2.500 mt=2.250 mt_nll=2.000 | ")
    assert "| enc codes 8/512 | lr 1.00e-03 | ETA " in line
    assert "accuracy" not in line and "denoise_weight" not in line
