"""train.py through the real ``deepspeed`` launcher with 2 CPU processes over gloo (and,
where a test is about the trainer rather than the launcher, through the pipeline's launcher,
which gives the same run bit for bit: test_local_launcher_trains_as_deepspeeds_does)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from launch import (
    ROOT,
    environment,
    free_port,
    kill_after_checkpoint,
    launch,
    losses,
    rewind,
    train_command,
)
from safetensors.torch import save_file

from megasemface.data.shards.shard_build_config import ShardBuildConfig
from megasemface.data.shards.shard_builder import build_shards
from megasemface.data.text.textio import parse_lang_path
from megasemface.data.text.tokenizer import Tokenizer
from megasemface.distributed.engine import consolidated_state

CONFIGS = {
    1: ROOT / "ds_configs" / "zero1_bf16.json",  # bf16 works on the CPU accelerator too
    2: ROOT / "ds_configs" / "cpu_fp32_zero2.json",
    3: ROOT / "ds_configs" / "cpu_fp32_zero3.json",
}
EXTENSIONS = "extensions"
"""The folder of a run where its ranks would build C++ extensions (TORCH_EXTENSIONS_DIR)."""


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, demo_corpus: Path, spm_model: Path) -> dict:
    root = tmp_path_factory.mktemp("train-data")
    inputs = [f"{lang}:{demo_corpus / 'mono' / f'{lang}.txt'}" for lang in ("en", "de")]
    config = ShardBuildConfig(tokens_per_sample=4096, samples_per_shard=4)
    build_shards(parse_lang_path(inputs), spm_model, root / "shards", config)
    tokenizer = Tokenizer.load(spm_model)
    table = torch.randn(tokenizer.vocab_size, 64, generator=torch.Generator().manual_seed(0))
    save_file({"embeddings": table * 0.3}, str(root / "cl.safetensors"))
    return {"shards": root / "shards", "spm": spm_model, "cl": root / "cl.safetensors"}


def command(
    data: dict, out: Path, *args: str, zero: int = 2, procs: int = 2, deepspeed: bool = True
) -> list[str]:
    cl = ["--cl-table", str(data["cl"])]
    return train_command(
        data, out, *cl, *args, config=CONFIGS[zero], procs=procs, deepspeed=deepspeed
    )


def run_status(out: Path) -> str:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    runs = client.search_runs(client.search_experiments()[0].experiment_id)
    assert len(runs) == 1
    return runs[0].info.status


def check_finished(result: subprocess.CompletedProcess[str], out: Path, steps: int) -> None:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    found = losses(out)
    assert sorted(found) == list(range(1, steps + 1))
    assert all(v == v and abs(v) < 1e4 for v in found.values())
    assert (out / "checkpoints" / f"step-{steps:08d}" / "COMPLETE").is_file()
    assert run_status(out) == "FINISHED"


@pytest.fixture(scope="module")
def vq_encoder_run(data: dict, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run through DeepSpeed's launcher whose ranks would build C++ extensions into an
    empty folder of their own (``extensions`` in the run's folder)."""
    out = tmp_path_factory.mktemp("vq-encoder")
    (out / EXTENSIONS).mkdir()
    cmd = command(data, out, "--stage", "encoder", "--interface", "vq", "--steps", "4")
    check_finished(launch(cmd, env={"TORCH_EXTENSIONS_DIR": str(out / EXTENSIONS)}), out, 4)
    return out


@pytest.mark.launcher
def test_vq_encoder_stage_zero2(vq_encoder_run: Path) -> None:
    meta = json.loads((vq_encoder_run / "checkpoints" / "step-00000004" / "meta.json").read_text())
    assert meta["stage"] == "encoder" and meta["interface"]["kind"] == "vq"
    config = json.loads((vq_encoder_run / "config.json").read_text())
    assert config["deepspeed"]["zero_optimization"]["stage"] == 2


@pytest.mark.launcher
def test_no_extension_is_built(vq_encoder_run: Path) -> None:
    """DeepSpeed's shared-memory all-reduce for CPUs, which only its inference all-reduce
    calls, is not built in a new environment (a minute of the first launch)."""
    assert list((vq_encoder_run / EXTENSIONS).iterdir()) == []


@pytest.mark.launcher
def test_local_launcher_trains_as_deepspeeds_does(
    data: dict, vq_encoder_run: Path, tmp_path: Path
) -> None:
    """The pipeline's launcher of one machine's ranks (megasemface.distributed.launch)
    gives train.py what DeepSpeed's gives it: the same run, bit for bit."""
    out = tmp_path / "run"
    args = ["--stage", "encoder", "--interface", "vq", "--steps", "4"]
    cl = ["--cl-table", str(data["cl"])]
    cmd = train_command(data, out, *cl, *args, config=CONFIGS[2])
    check_finished(launch(cmd), out, 4)
    assert losses(out) == losses(vq_encoder_run)
    tag = "step-00000004"
    local = consolidated_state(out / "checkpoints", tag)
    reference = consolidated_state(vq_encoder_run / "checkpoints", tag)
    assert local.keys() == reference.keys()
    assert all(torch.equal(local[k], reference[k]) for k in local)


@pytest.mark.launcher
def test_joint_stage_under_zero1_in_bf16(data: dict, tmp_path: Path) -> None:
    """bf16 works on the CPU accelerator too. (Every stage under ZeRO-2 or 3 in fp32:
    tests/test_stage_losses.py.)"""
    out = tmp_path / "run"
    args = ["--stage", "joint", "--interface", "vq", "--steps", "3"]
    check_finished(launch(command(data, out, *args, zero=1)), out, 3)


@pytest.mark.launcher
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_killed_run_resumes_exactly(data: dict, tmp_path: Path, compiled: bool) -> None:
    """Also with --compile: the compiled layers draw dropout as eager ones do. (The compiled
    run resumes from the reference rewound to its checkpoint of step 3, what the kill leaves:
    the eager case shows that a killed run leaves that, and one launch less to compile.)"""
    args = [
        "--stage",
        "joint",
        "--interface",
        "vq",
        "--steps",
        "7",
        "--save-interval",
        "3",
        "--log-sample-ids",
        *(["--compile"] if compiled else []),
    ]
    reference = tmp_path / "reference"
    check_finished(launch(command(data, reference, *args, deepspeed=False)), reference, 7)

    out = tmp_path / "killed"
    if compiled:
        rewind(reference, out, 3)
    else:
        kill_after_checkpoint(command(data, out, *args, deepspeed=False), out, 3)
    assert not (out / "checkpoints" / "step-00000007").exists()

    result = launch(command(data, out, *args, deepspeed=False))
    assert "resuming from" in result.stdout
    check_finished(result, out, 7)
    assert losses(out) == losses(reference)  # identical, not just close
    # The losses are float32 scalars: a last-bit difference in the weights rarely shows in
    # them. The trained weights themselves must be the uninterrupted run's, bit for bit.
    for step in (6, 7):
        tag = f"step-{step:08d}"
        resumed = consolidated_state(out / "checkpoints", tag)
        uninterrupted = consolidated_state(reference / "checkpoints", tag)
        assert resumed.keys() == uninterrupted.keys()
        differ = [k for k in resumed if not torch.equal(resumed[k], uninterrupted[k])]
        assert not differ, f"{tag}: {len(differ)} tensors differ, e.g. {differ[:3]}"
    for rank in (0, 1):
        name = f"samples-rank{rank:03d}.jsonl"

        def consumed(path: Path) -> dict[int, list[int]]:
            return {r["step"]: r["ids"] for r in map(json.loads, path.read_text().splitlines())}

        assert consumed(out / name) == consumed(reference / name)


def test_sigterm_on_one_rank_saves_and_exits_cleanly(data: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = command(
        data,
        out,
        "--stage",
        "encoder",
        "--interface",
        "cl",
        "--steps",
        "100000",
        "--save-interval",
        "100000",
    )
    proc = subprocess.Popen(
        cmd,
        env=environment(),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 240
    metrics = out / "metrics.jsonl"
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    children = psutil.Process(proc.pid).children(recursive=True)
    ranks = [p for p in children if any(a.startswith("--local_rank") for a in p.cmdline())]
    assert len(ranks) == 2
    ranks[-1].send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output[-3000:]
    steps = sorted(losses(out))
    assert (out / "checkpoints" / f"step-{steps[-1]:08d}" / "COMPLETE").is_file()
    assert steps[-1] < 100000
    assert run_status(out) == "KILLED"


@contextlib.contextmanager
def hanging_up_server() -> Iterator[str]:
    """The URI of a server that accepts every connection and closes it at once: reachable
    when the run starts (its check passes), failing every request after."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                listener.accept()[0].close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join()
        listener.close()


def tracked_command(data: dict, out: Path, uri: str) -> list[str]:
    args = ["--stage", "encoder", "--interface", "cl", "--steps", "3", "--tracking-uri", uri]
    return command(data, out, *args, deepspeed=False)


@pytest.mark.launcher
def test_a_failing_tracking_server_does_not_stop_training(data: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    # MLflow's own client would retry for minutes; launch() times out long before that.
    with hanging_up_server() as uri:
        result = launch(tracked_command(data, out, uri))
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(losses(out)) == [1, 2, 3]
    assert f"MLflow tracking at {uri} is unavailable" in result.stdout + result.stderr


@pytest.mark.launcher
def test_an_unreachable_tracking_server_stops_the_start_in_one_line(
    data: dict, tmp_path: Path
) -> None:
    out = tmp_path / "run"
    uri = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = launch(tracked_command(data, out, uri))
    assert result.returncode == 2, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if "error" in line]
    assert errors == [
        f"train: error (rank 0): the MLflow tracking server {uri} is unreachable (Connection "
        "refused): start it, correct --tracking-uri, or pass --no-tracking"
    ], result.stderr[-3000:]
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.launcher
def test_flat_codebook_split_over_two_model_parallel_ranks(data: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = ["--stage", "joint", "--interface", "vq", "--mp-size", "2", "--steps", "3"]
    result = launch(command(data, out, *args))
    check_finished(result, out, 3)
    # The codebook's health, counted over both codebook shards, in MLflow and on screen.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{out / 'mlflow.db'}")
    (run,) = client.search_runs(client.search_experiments()[0].experiment_id)
    for prefix in ("vq_", "dec_vq_"):
        figures = {
            name: [m.value for m in client.get_metric_history(run.info.run_id, prefix + name)]
            for name in ("codes_used", "dead_codes", "code_perplexity", "tokens")
        }
        assert len(figures["codes_used"]) == 3  # --log-interval 1
        for used, dead, ppl, tokens in zip(*figures.values(), strict=True):
            assert used + dead == 512 and 1 <= used <= min(512, tokens)
            assert 1 <= ppl <= used + 1e-6
    assert "| enc codes " in result.stdout and "| dec codes " in result.stdout


@pytest.mark.launcher
def test_decoder_stage_splits_an_unsplit_encoder_codebook(
    data: dict, vq_encoder_run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "decoder-mp2"
    args = ["--stage", "decoder", "--interface", "vq", "--mp-size", "2", "--steps", "2"]
    cmd = command(data, out, *args, "--init-from", str(vq_encoder_run), deepspeed=False)
    check_finished(launch(cmd), out, 2)
    from megasemface.checkpoints import load_stage

    encoder, _ = load_stage(vq_encoder_run)
    decoder, _ = load_stage(out)  # gathered over the two model-parallel ranks
    for key, value in encoder.items():
        if key.startswith("interface.quantizer."):
            torch.testing.assert_close(decoder[key], value, rtol=0, atol=0)


@pytest.mark.launcher
def test_non_finite_losses_are_skipped_then_stop_the_run(data: dict, tmp_path: Path) -> None:
    out = tmp_path / "run"
    args = [
        "--stage",
        "encoder",
        "--interface",
        "cl",
        "--steps",
        "8",
        "--inject-nan-at",
        "2",
        "--inject-nan-at",
        "4",
        "--inject-nan-at",
        "5",
        "--inject-nan-at",
        "6",
        "--max-consecutive-skips",
        "3",
    ]
    result = launch(command(data, out, *args))
    assert result.returncode != 0
    assert "step 6: the loss was non-finite 3 steps in a row" in result.stdout + result.stderr
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("skipped")] == [2, 4, 5, 6]
    assert run_status(out) == "FAILED"
