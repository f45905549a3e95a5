"""Checkpoint tools on real DeepSpeed checkpoints of real runs (2 CPU processes, gloo).

Four launched runs, each with the tiny preset in fp32, and each writing its live weights
beside every checkpoint (tests/launch.py):

- ``encoder``: VQ encoder stage, ZeRO-2, a checkpoint at every one of 3 steps, MLflow on;
- ``decoder``: VQ decoder stage on the encoder run's codebook, ZeRO-1 (which leaves frozen
  parameters out of its fp32 partitions);
- ``split``: VQ joint stage with the flat codebook split over 2 model-parallel ranks;
- ``mbart``: the mBART baseline under ZeRO-3.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from launch import ROOT, ds_config, environment, launch_chains, train_command
from safetensors.torch import load_file

from megasemface.checkpoints import (
    CheckpointError,
    average_checkpoints,
    codebook_state_for_rank,
    connect_mbart,
    connect_runs,
    keep_part,
    last_checkpoints,
    load_stage,
    write_pretraining_dir,
    write_seq2seq_dir,
)
from megasemface.cli.merge_checkpoints import main as merge_main
from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.textio import parse_lang_path
from megasemface.distributed.groups import ParallelGroups
from megasemface.interfaces.registry import recorded_weights
from megasemface.interfaces.vq.vector_quantized import VectorQuantizedInterface
from megasemface.interfaces.vq.weights import SPLIT_KEYS, CodebookWeights
from megasemface.models.model_dir import load_model_dir, load_seq2seq
from megasemface.models.seq2seq_init import ConnectError
from megasemface.nn.bridge import bridge_sources
from megasemface.nn.config import config_from_dict
from megasemface.nn.transformer import Seq2SeqModel

pytestmark = pytest.mark.launcher

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path) -> dict:
    root = tmp_path_factory.mktemp("merge-data")
    inputs = [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    config = ShardBuildConfig(tokens_per_sample=4096, samples_per_shard=4)
    build_shards(parse_lang_path(inputs), spm_model, root / "shards", config)
    return {"shards": root / "shards", "spm": spm_model, "dir": root}


# name: (ZeRO stage, steps, arguments)
RUNS: dict[str, tuple[int, int, tuple[str, ...]]] = {
    "encoder": (
        2,
        3,
        ("--stage", "encoder", "--interface", "vq", "--save-interval", "1", "--keep-last", "3"),
    ),
    "decoder": (1, 2, ("--stage", "decoder", "--interface", "vq", "--no-tracking")),
    "mbart": (3, 2, ("--stage", "mbart", "--interface", "none", "--no-tracking")),
    "split": (2, 2, ("--stage", "joint", "--interface", "vq", "--mp-size", "2", "--no-tracking")),
}


@pytest.fixture(scope="module")
def runs(data: dict, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The four runs in two launches side by side (tests/launch.py's ``chain``): the encoder,
    the decoder on its codebook and mBART one after another; the split run, whose ranks form
    a model-parallel group, in the other."""
    root = tmp_path_factory.mktemp("runs")

    def command(name: str) -> list[str]:
        zero, steps, args = RUNS[name]
        init = ["--init-from", str(root / "encoder")] if name == "decoder" else []
        config = ds_config(zero, data["dir"])
        out = root / name
        return train_command(
            data, out, *args, *init, "--steps", str(steps), config=config, live=True
        )

    groups = [["encoder", "decoder", "mbart"], ["split"]]
    launch_chains(groups, command, lambda name: (root / name, RUNS[name][1]))
    return {name: root / name for name in RUNS}


@pytest.fixture(scope="module")
def encoder_run(runs: dict[str, Path]) -> Path:
    return runs["encoder"]


@pytest.fixture(scope="module")
def decoder_run(runs: dict[str, Path]) -> Path:
    return runs["decoder"]


@pytest.fixture(scope="module")
def split_run(runs: dict[str, Path]) -> Path:
    return runs["split"]


@pytest.fixture(scope="module")
def mbart_run(runs: dict[str, Path]) -> Path:
    return runs["mbart"]


def _checkpoint(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step-{step:08d}"


def _live(run: Path, step: int, mp_rank: int = 0) -> dict[str, torch.Tensor]:
    return load_file(str(run / "live" / f"step-{step:08d}-mp{mp_rank}.safetensors"))


def _assert_equal(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> None:
    assert sorted(ours) == sorted(theirs)
    differ = [k for k in ours if not torch.equal(ours[k], theirs[k])]
    assert not differ, differ[:5]


def test_consolidation_equals_the_live_weights_under_zero_1_2_3(
    encoder_run: Path, decoder_run: Path, mbart_run: Path
) -> None:
    for step in (1, 2, 3):
        state, meta = load_stage(_checkpoint(encoder_run, step))
        _assert_equal(state, _live(encoder_run, step))
        assert meta["source"]["zero_stage"] == 2 and meta["source"]["from_module_state"] == []
    state, meta = load_stage(decoder_run)  # the run directory: its newest checkpoint
    _assert_equal(state, _live(decoder_run, 2))
    # ZeRO-1 keeps the frozen encoder and codebook out of the fp32 partitions.
    frozen = meta["source"]["from_module_state"]
    assert "interface.quantizer.codebook" in frozen and "encoder.final_norm.weight" in frozen
    assert not any(k.startswith("decoder.") for k in frozen)
    state, meta = load_stage(mbart_run)
    _assert_equal(state, _live(mbart_run, 2))
    assert meta["source"]["zero_stage"] == 3 and meta["interface"] == {"kind": "mbart"}


def test_deepspeeds_zero_to_fp32_script_agrees(
    encoder_run: Path, decoder_run: Path, mbart_run: Path, tmp_path: Path
) -> None:
    # DeepSpeed copies zero_to_fp32.py into the save directory (<run>/checkpoints) at every
    # ZeRO save; it is run here as its documentation says, without a tag: it follows the
    # `latest` file to the newest complete checkpoint (its sharding needs huggingface_hub, a
    # dev dependency of megasemface).
    jobs = {"zero2": (encoder_run, 3), "zero1": (decoder_run, 2), "zero3": (mbart_run, 2)}
    for name, (run, step) in jobs.items():
        script = run / "checkpoints" / "zero_to_fp32.py"
        assert script.is_file()
        assert (run / "checkpoints" / "latest").read_text() == f"step-{step:08d}"
        result = subprocess.run(
            [
                sys.executable,
                str(script),
                str(run / "checkpoints"),
                str(tmp_path / name),
                "--safe_serialization",
            ],
            capture_output=True,
            text=True,
            env=environment(),
            cwd=ROOT,
            timeout=180,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    for name, (run, step) in jobs.items():
        theirs = load_file(str(tmp_path / name / "model.safetensors"))
        ours, meta = load_stage(_checkpoint(run, step))
        missing = sorted(set(ours) - set(theirs))
        assert missing == meta["source"]["from_module_state"]  # ZeRO-1's frozen parameters
        assert (name == "zero1") == bool(missing)
        _assert_equal({k: ours[k] for k in theirs}, theirs)


def test_model_parallel_codebook_is_gathered_and_resplit_exactly(split_run: Path) -> None:
    state, meta = load_stage(split_run)
    config = config_from_dict(meta["model"])
    weights = recorded_weights(meta)
    assert isinstance(weights, CodebookWeights)
    shards = [_live(split_run, 2, rank) for rank in (0, 1)]
    assert meta["source"]["gathered"] == [k for k in SPLIT_KEYS if k in state]
    assert "interface.quantizer.codebook" in meta["source"]["gathered"]
    for key in state:
        if key in SPLIT_KEYS:
            assert torch.equal(state[key], torch.cat([shards[0][key], shards[1][key]]))
        else:  # replicated: both ranks hold it
            assert torch.equal(state[key], shards[0][key]) and torch.equal(
                state[key], shards[1][key]
            )
    for size in (1, 2, 4):
        parts = weights.resplit(state, config, size)
        _assert_equal(weights.gather(parts, config), state)
    two = weights.resplit(state, config, 2)
    for rank in (0, 1):
        _assert_equal(two[rank], shards[rank])
        layer = codebook_state_for_rank(split_run, rank, 2)
        _assert_equal(layer, weights.own_state(shards[rank]))

    # meta.json's fingerprint hashes rank 0's shard; loading replaced it by the gathered
    # layer's, which is what a model-parallel-size-1 layer holding the codebook records.
    recorded = json.loads((_checkpoint(split_run, 2) / "meta.json").read_text())["interface"]
    assert meta["interface_recorded"] == recorded != meta["interface"]
    assert weights.fingerprint(two[0], config, torch.float32, mp_size=2) == recorded
    single = VectorQuantizedInterface(config, ParallelGroups.single(), seed=5)
    single.quantizer.load_state_dict(weights.own_state(state))
    assert single.fingerprint() == meta["interface"]


def test_averaging_is_the_exact_mean_of_the_consolidated_weights(
    encoder_run: Path, decoder_run: Path
) -> None:
    sources = last_checkpoints(encoder_run, 3)
    states = [load_stage(path)[0] for path in sources]
    mean, meta = average_checkpoints(sources)
    frozen = {k for k in mean if all(torch.equal(s[k], states[0][k]) for s in states)}
    # The decoder and the VQ feature extractor are frozen in the encoder stage.
    assert {k.split(".")[0] for k in frozen} == {"decoder", "interface"}
    for key, value in mean.items():
        if key in frozen:  # kept as it was: (w + w + w) / 3 need not round back to w
            assert torch.equal(value, states[2][key])
        else:
            assert torch.equal(value, (states[0][key] + states[1][key] + states[2][key]) / 3)
    assert meta["averaged"]["steps"] == [1, 2, 3]
    assert meta["interface"] == CodebookWeights().fingerprint(
        mean, config_from_dict(meta["model"]), torch.float32
    )
    with pytest.raises(CheckpointError, match="different stage"):
        average_checkpoints([sources[-1], _checkpoint(decoder_run, 2)])
    with pytest.raises(CheckpointError, match="4 were asked for"):
        last_checkpoints(encoder_run, 4)


def test_connecting_matching_stages_keeps_both_and_records_provenance(
    encoder_run: Path, decoder_run: Path, tmp_path: Path
) -> None:
    connected = connect_runs(encoder_run, decoder_run)
    encoder, _ = load_stage(encoder_run)
    decoder, _ = load_stage(decoder_run)
    for key, value in connected.state.items():
        origin = connected.parameters[key]
        source = encoder if origin.startswith("encoder-stage:") else decoder
        assert torch.equal(value, source[origin.split(":", 1)[1]])
        assert origin.startswith("encoder-stage:encoder.") == key.startswith("encoder.")
    out = write_seq2seq_dir(tmp_path / "semface", connected)
    model, info = load_seq2seq(out)
    assert (
        info.meta["mode"] == "semface"
        and info.vocab_sha256 == connected.sources["encoder"]["vocab_sha256"]
    )
    _assert_equal({k: v for k, v in model.state_dict().items()}, connected.state)
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["sources"]["decoder"]["checkpoint"] == str(
        _checkpoint(decoder_run, 2).resolve()
    )
    assert provenance["sources"]["encoder"]["mlflow_run_id"]  # the encoder run was tracked
    assert provenance["parameters"] == connected.parameters


def test_connect_refuses_a_decoder_stage_of_another_interface(
    split_run: Path, decoder_run: Path
) -> None:
    # The decoder stage was pre-trained against the encoder run's codebook, not this one.
    with pytest.raises(ConnectError, match="different semantic interfaces") as error:
        connect_runs(split_run, decoder_run)
    assert str(split_run) in str(error.value) and str(decoder_run) in str(error.value)


def test_xlm_style_and_mbart_initialisations(
    encoder_run: Path, mbart_run: Path, tmp_path: Path
) -> None:
    xlm = connect_runs(encoder_run)
    assert xlm.mode == "xlm"
    assert torch.equal(
        xlm.state["decoder.layers.1.ffn.fc1.weight"], xlm.state["encoder.layers.1.ffn.fc1.weight"]
    )
    assert xlm.parameters["decoder.layers.0.cross_attn.q_proj.weight"] == "random"
    load_seq2seq(write_seq2seq_dir(tmp_path / "xlm", xlm))

    mbart = connect_mbart(mbart_run)
    trained, _ = load_stage(mbart_run)
    _assert_equal(mbart.state, {k[len("model.") :]: v for k, v in trained.items()})
    _, info = load_seq2seq(write_seq2seq_dir(tmp_path / "mbart", mbart))
    assert info.meta["mode"] == "mbart"


def test_one_half_kept_and_the_other_drawn_as_a_fresh_model(
    encoder_run: Path,
    decoder_run: Path,
    mbart_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    mbart = connect_mbart(mbart_run)
    torch.manual_seed(5)
    fresh = Seq2SeqModel(mbart.config).state_dict()
    for part, drawn in (("encoder", "decoder."), ("decoder", "encoder.")):
        half = keep_part(mbart, part, seed=5)
        assert half.mode == f"mbart, {part} alone" and half.config == mbart.config
        assert half.sources == mbart.sources  # both halves come from the one run
        for key, value in half.state.items():
            source = fresh if key.startswith(drawn) else mbart.state
            assert torch.equal(value, source[key]), key
            assert (half.parameters[key] == "random") == key.startswith(drawn)
    assert keep_part(mbart, "whole") is mbart
    with pytest.raises(ValueError, match="part 'both': choose from whole, encoder, decoder"):
        keep_part(mbart, "both")

    # A SemFace connection keeps its decoder's pre-trained cross-attention, the encoder drawn.
    semface = keep_part(connect_runs(encoder_run, decoder_run), "decoder", seed=1)
    assert semface.parameters["decoder.layers.0.cross_attn.q_proj.weight"].startswith(
        "decoder-stage:"
    )
    assert semface.parameters["encoder.layers.0.ffn.fc1.weight"] == "random"
    assert list(semface.sources) == ["decoder"]  # the drawn encoder names no stage

    # The command line writes the half with its provenance.
    out = tmp_path / "mbart-decoder"
    args = ["connect", "--mbart", str(mbart_run), "--part", "decoder", "--seed", "5"]
    assert merge_main([*args, "--out", str(out)]) == 0
    model, info = load_seq2seq(out)
    assert info.meta["mode"] == "mbart, decoder alone"
    _assert_equal(model.state_dict(), keep_part(mbart, "decoder", seed=5).state)
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["parameters"]["encoder.final_norm.weight"] == "random"
    capsys.readouterr()
    fused = ["connect", "--encoder", str(encoder_run), "--fusion", "deep", "--part", "encoder"]
    assert merge_main([*fused, "--out", str(tmp_path / "x")]) == 2
    assert "deep fusion's decoder is random" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before anything is connected or written


def _tool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "merge_checkpoints.py"), *args],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=ROOT,
        timeout=180,
    )


def test_command_line_consolidate_connect_and_clear_errors(
    encoder_run: Path,
    decoder_run: Path,
    split_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    enc_dir = tmp_path / "encoder"
    result = _tool("consolidate", str(encoder_run), "--out", str(enc_dir))
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["kind"] == "pretraining" and summary["peak_rss_mib"] > 0
    state, info = load_model_dir(enc_dir, "pretraining")
    _assert_equal(state, _live(encoder_run, 3))
    meta = json.loads((_checkpoint(encoder_run, 3) / "meta.json").read_text())
    assert info.meta["mlflow_run_id"] == meta["mlflow_run_id"] and info.meta["stage"] == "encoder"
    assert info.interface == meta["interface"]

    # A consolidated encoder stage is a source like its run (the same command in-process).
    s2s = tmp_path / "s2s"
    args = ["connect", "--encoder", str(enc_dir), "--decoder", str(decoder_run), "--out", str(s2s)]
    assert merge_main(args) == 0
    assert json.loads(capsys.readouterr().out)["mode"] == "semface"
    load_seq2seq(s2s)

    # Re-split for 4 model-parallel ranks (the files consolidate --mp-size 4 writes).
    split_state, split_meta = load_stage(split_run)
    split_dir = write_pretraining_dir(tmp_path / "split", split_state, split_meta, mp_size=4)
    for rank in range(4):
        shard = load_file(str(split_dir / f"codebook-mp4-rank{rank}.safetensors"))
        _assert_equal(shard, codebook_state_for_rank(split_dir, rank, 4))

    # Bad input: a message naming the file and what to do, exit code 2, no traceback.
    broken = tmp_path / "broken" / "checkpoints" / "step-00000003"
    shutil.copytree(_checkpoint(encoder_run, 3), broken)
    (broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert merge_main(["consolidate", str(broken.parent.parent), "--out", str(tmp_path / "x")]) == 2
    error = capsys.readouterr().err
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in error and "damaged" in error
    (broken / "COMPLETE").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_stage(broken)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        load_stage(broken.parent.parent)
    assert merge_main(["connect", "--mbart", str(s2s), "--out", str(tmp_path / "y")]) == 2
    assert "'seq2seq' model, a 'pretraining' model is needed" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="not a VQ encoder-stage"):
        codebook_state_for_rank(decoder_run, 0, 1)


def test_the_codebook_bridge_keeps_the_encoder_stages_vq_layer(
    encoder_run: Path, decoder_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bridged"
    args = ["connect", "--encoder", str(encoder_run), "--decoder", str(decoder_run)]
    assert merge_main([*args, "--bridge", "codebook", "--out", str(out)]) == 0
    capsys.readouterr()
    model, info = load_seq2seq(out)
    assert info.model.bridge == "codebook" and model.bridge is not None
    encoder, _ = load_stage(encoder_run)
    vq = CodebookWeights().own_state(encoder)
    provenance = json.loads((out / "provenance.json").read_text())["parameters"]
    assert info.model.vq.logits == "distance"
    for name, key in bridge_sources(info.model.vq.logits).items():
        assert torch.equal(model.state_dict()[f"bridge.{name}"], encoder[key])
        assert provenance[f"bridge.{name}"] == f"encoder-stage:{key}"
    # The memory is the VQ layer's noise-free code distribution over its codebook: by
    # default, the logits are minus the squared distances to the codes over sqrt(d).
    src = torch.randint(5, info.model.vocab_size, (2, 6))
    mask = torch.ones_like(src, dtype=torch.bool)
    langs = torch.tensor([0, 1])
    with torch.no_grad():
        hidden = model.encoder(src, mask, langs).hidden_BTD
        distances = (hidden[:, :, None, :] - vq["codebook"]).square().sum(-1)
        scores = -distances / info.model.d_model**0.5
        expected = torch.softmax(scores / info.model.bridge_temperature, -1) @ vq["codebook"]
        torch.testing.assert_close(model.encode(src, mask, langs).hidden_BTD, expected)
    # Only a VQ encoder stage joined with its decoder stage has a codebook to bridge through.
    assert (
        merge_main(
            [
                "connect",
                "--encoder",
                str(encoder_run),
                "--bridge",
                "codebook",
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "no decoder stage" in capsys.readouterr().err
