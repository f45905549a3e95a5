"""MLflow tracking against real MLflow stores: delivery, run status, reattach and outages."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from mlflow import MlflowClient

from megasemface.tracking.mlflow_tracker import MLflowTracker
from megasemface.tracking.tracker import NullTracker, RunKilled, flatten_params, tracked_run

LOGGER = "megasemface.tracking"
"""The parent logger of the tracker's modules."""
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def template_db(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty, fully migrated MLflow SQLite database, made once: creating the schema takes
    seconds, copying the file takes milliseconds."""
    db = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No user MLflow settings leak in; the tracker's HTTP defaults do not leak out."""
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
        "MLFLOW_HTTP_REQUEST_TIMEOUT",
        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL",
        "MLFLOW_SYSTEM_METRICS_NODE_ID",
    ):
        monkeypatch.delenv(name, raising=False)
    yield


def _output_dir(tmp_path: Path, template_db: Path) -> Path:
    """A training output directory whose default store (mlflow.db) already has the schema."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copy(template_db, out / "mlflow.db")
    return out


def _ours(record: logging.LogRecord) -> bool:
    """Whether ``record`` comes from the tracker (not from MLflow itself)."""
    return record.name.startswith(f"{LOGGER}.")


def _history(client: MlflowClient, run_id: str, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def _free_port() -> int:
    """A 127.0.0.1 port nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return bool(predicate())


def test_run_receives_params_metrics_tags_and_artifacts(tmp_path: Path, template_db: Path) -> None:
    out = _output_dir(tmp_path, template_db)
    tracker = MLflowTracker(None, out, "nmt", "base-run", tags={"team": "mt"}, system_metrics=False)
    assert tracker.tracking_uri == f"sqlite:///{out}/mlflow.db"
    # The constructor waits for the run; on a loaded machine it may come a moment later.
    run_id = tracker.wait_for_run()
    assert run_id is not None
    assert tracker.reachable

    many = {f"p{i:03d}": i for i in range(250)}  # more than one 100-param batch
    tracker.log_params(
        {"model": {"d_model": 512, "enc": {"layers": 6}}, "lr": 3e-4, "many": many, "x": "v" * 7000}
    )
    for step in range(5):
        tracker.log_metrics({"train/loss": 10.0 - step, "train/lr": step * 1e-4}, step=step)
    tracker.write_events([("Train/Samples/train_loss", 1.5, 320), ("bad:name", 2.0, 320)])
    tracker.set_tags({"stage": "pretrain", "long": "t" * 9000})
    (out / "notes.txt").write_text("hello")
    tracker.log_artifact(out / "notes.txt", artifact_path="extra")
    tracker.log_dict({"model": {"d_model": 512}, "path": out}, "config.json")
    tracker.end("FINISHED")

    client = MlflowClient(tracker.tracking_uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.info.artifact_uri.startswith((out / "mlartifacts").as_uri())
    params = run.data.params
    assert params["model.d_model"] == "512"
    assert params["model.enc.layers"] == "6"
    assert params["lr"] == "0.0003"
    assert sum(key.startswith("many.") for key in params) == 250
    assert len(params["x"]) == 6000 and params["x"].endswith("...")
    assert _history(client, run_id, "train/loss") == [(s, 10.0 - s) for s in range(5)]
    assert [s for s, _ in _history(client, run_id, "train/lr")] == list(range(5))
    assert _history(client, run_id, "Train/Samples/train_loss") == [(320, 1.5)]
    assert _history(client, run_id, "bad_name") == [(320, 2.0)]  # ':' is not portable
    tags = run.data.tags
    assert tags["team"] == "mt" and tags["stage"] == "pretrain"
    assert tags["mlflow.runName"] == "base-run"
    assert len(tags["long"]) == 8000
    assert {a.path for a in client.list_artifacts(run_id)} == {"extra", "config.json"}
    assert [a.path for a in client.list_artifacts(run_id, "extra")] == ["extra/notes.txt"]
    # Artifacts land in the output directory, not in the current working directory.
    assert list((out / "mlartifacts").rglob("notes.txt"))
    config = client.download_artifacts(run_id, "config.json", str(tmp_path))
    assert '"d_model": 512' in Path(config).read_text()


def test_dataset_lineage_and_experiment_kind(tmp_path: Path, template_db: Path) -> None:
    out = _output_dir(tmp_path, template_db)
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    # An experiment made without the kind tag (older versions) gets it at the next run.
    old = client.create_experiment("nmt", artifact_location=(out / "mlartifacts").as_uri())
    parent = MLflowTracker(None, out, "nmt", "pretrain-vq", system_metrics=False)
    parent.end("FINISHED")
    assert client.get_experiment(old).tags["mlflow.experimentKind"] == "custom_model_development"

    tags = {"parent_encoder_run": parent.run_id, "parent_decoder_run": parent.run_id}
    child = MLflowTracker(None, out, "nmt", "supervised-vq", tags=tags, system_metrics=False)
    profile = {"sentences": 3, "languages": {"en": {"sentences": 3}}}
    child.log_dataset("shards/mono", "ab" * 40, "/data/shards/mono", profile, "training")
    child.end("FINISHED")

    run = client.get_run(child.run_id)
    assert run.data.tags["parent_encoder_run_name"] == "pretrain-vq"
    link = f"[pretrain-vq](#/experiments/{old}/runs/{parent.run_id})"
    assert run.data.tags["mlflow.note.content"] == f"Made from: {link} (decoder, encoder)."
    (dataset_input,) = run.inputs.dataset_inputs
    dataset = dataset_input.dataset
    assert (dataset.name, dataset.digest) == ("shards/mono", ("ab" * 40)[:36])
    assert json.loads(dataset.source) == {"uri": "/data/shards/mono"}
    assert json.loads(dataset.profile) == profile
    assert [(t.key, t.value) for t in dataset_input.tags] == [("mlflow.data.context", "training")]
    # A parent in another store is kept as its id, without a name or a link.
    lone = MLflowTracker(
        None, out, "nmt", "x", tags={"parent_init_run": "f" * 32}, system_metrics=False
    )
    lone.end("FINISHED")
    tags = client.get_run(lone.run_id).data.tags
    assert tags["parent_init_run"] == "f" * 32
    assert "parent_init_run_name" not in tags and "mlflow.note.content" not in tags


@pytest.mark.parametrize(
    ("exc", "status"),
    [
        (None, "FINISHED"),
        (ValueError, "FAILED"),
        (RunKilled, "KILLED"),
        (KeyboardInterrupt, "KILLED"),
    ],
)
def test_tracked_run_sets_final_status(
    tmp_path: Path, template_db: Path, exc: type[BaseException] | None, status: str
) -> None:
    out = _output_dir(tmp_path, template_db)
    tracker = MLflowTracker(None, out, "nmt", None, system_metrics=False)
    raised = pytest.raises(exc) if exc is not None else contextlib.nullcontext()
    with raised, tracked_run(tracker):
        tracker.log_metrics({"loss": 1.0}, step=1)
        if exc is not None:
            raise exc("stop")
    run_id = tracker.run_id
    assert run_id is not None
    client = MlflowClient(tracker.tracking_uri)
    assert client.get_run(run_id).info.status == status
    assert _history(client, run_id, "loss") == [(1, 1.0)]


def test_reattach_by_run_id_continues_the_same_run(
    tmp_path: Path, template_db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = _output_dir(tmp_path, template_db)
    first = MLflowTracker(None, out, "nmt", "resumable", system_metrics=False)
    run_id = first.run_id
    assert run_id is not None
    first.log_params({"lr": 1e-3, "seed": 1})
    for step in range(3):
        first.log_metrics({"loss": float(step)}, step=step)
    first.end("KILLED")
    client = MlflowClient(first.tracking_uri)
    assert client.get_run(run_id).info.status == "KILLED"

    second = MLflowTracker(None, out, "nmt", None, run_id=run_id, system_metrics=False)
    assert second.run_id == run_id
    assert client.get_run(run_id).info.status == "RUNNING"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        # A changed param cannot be changed in MLflow: it keeps its value, the rest is logged.
        second.log_params({"lr": 5e-4, "seed": 1, "resumed_at": 3})
        for step in range(3, 6):
            second.log_metrics({"loss": float(step)}, step=step)
        second.end("FINISHED")

    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert _history(client, run_id, "loss") == [(s, float(s)) for s in range(6)]
    assert run.data.params == {"lr": "0.001", "seed": "1", "resumed_at": "3"}
    assert any("lr" in r.getMessage() and "0.0005" in r.getMessage() for r in caplog.records)
    experiment = client.get_experiment_by_name("nmt")
    assert experiment is not None
    assert len(client.search_runs([experiment.experiment_id])) == 1


def test_unknown_run_id_starts_a_new_run(tmp_path: Path, template_db: Path) -> None:
    out = _output_dir(tmp_path, template_db)
    tracker = MLflowTracker(None, out, "nmt", None, run_id="0" * 32, system_metrics=False)
    assert tracker.run_id is not None and tracker.run_id != "0" * 32
    tracker.end()
    assert MlflowClient(tracker.tracking_uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_a_record_naming_the_run_waits_for_a_store_slow_to_create_it(
    tmp_path: Path, template_db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A store that creates the run only after the constructor stopped waiting (a fresh
    # SQLite database on a busy machine): a checkpoint or best model written then would name
    # no run. wait_for_run is what they ask, and it answers once the run exists.
    from megasemface.tracking.mlflow_run import MLflowRun

    gate = threading.Event()
    establish = MLflowRun.establish

    def slow_establish(run: MLflowRun) -> None:
        gate.wait(60)
        establish(run)

    monkeypatch.setattr(MLflowRun, "establish", slow_establish)
    out = _output_dir(tmp_path, template_db)
    tracker = MLflowTracker(None, out, "nmt", "slow", system_metrics=False, start_timeout=0.05)
    assert tracker.run_id is None and tracker.wait_for_run(timeout=0.05) is None
    threading.Timer(0.2, gate.set).start()
    run_id = tracker.wait_for_run()
    assert run_id is not None and run_id == tracker.run_id
    tracker.end()
    assert MlflowClient(tracker.tracking_uri).get_run(run_id).info.run_name == "slow"
    assert NullTracker().wait_for_run() is None


def test_system_metrics_follow_the_training_step(tmp_path: Path, template_db: Path) -> None:
    pytest.importorskip("psutil")
    out = _output_dir(tmp_path, template_db)
    tracker = MLflowTracker(None, out, "nmt", None, system_metrics_interval=0.1)
    run_id = tracker.wait_for_run()
    assert run_id is not None
    tracker.log_metrics({"loss": 1.0}, step=7)
    client = MlflowClient(tracker.tracking_uri)
    key = "system/cpu_utilization_percentage"

    def sampled_steps() -> set[int]:
        return {m.step for m in client.get_metric_history(run_id, key)}

    # Waits for a sample taken after step 7 was logged (the first ones may come earlier:
    # the run's start-up can outlast the interval on a busy machine).
    assert _wait_for(lambda: tracker.flush(5) and 7 in sampled_steps(), 20)
    tracker.end()
    # Samples carry the latest logged step: 7 once it is logged, 0 before.
    assert sampled_steps() <= {0, 7}


def test_unreachable_server_never_blocks_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # "Never blocks" is checked by where the network is touched, not with a stopwatch (a
    # loaded machine can stall any thread for a while): every connection attempt must come
    # from the tracker's worker thread, none from the thread that logs.
    connecting_threads: list[int] = []
    connect = socket.socket.connect

    def recording_connect(sock: socket.socket, address: object) -> None:
        connecting_threads.append(threading.get_ident())
        connect(sock, address)

    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    uri = f"http://127.0.0.1:{_free_port()}"
    caplog.set_level(logging.INFO, logger=LOGGER)
    caller = threading.get_ident()

    tracker = MLflowTracker(uri, tmp_path, "nmt", "offline", max_spooled_metrics=500)
    assert tracker.run_id is None  # the run could not be created; it would be, later
    # The constructor returned when the first attempt failed, not when its wait ran out.
    assert not [r for r in caplog.records if "is not ready after" in r.getMessage()]

    for step in range(1000):
        tracker.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    tracker.log_params({"model": {"layers": 6}})
    tracker.set_tags({"k": "v"})
    tracker.log_dict({"a": 1}, "config.json")
    tracker.log_artifact(tmp_path)

    def warnings() -> list[logging.LogRecord]:
        return [r for r in caplog.records if _ours(r) and r.levelno >= logging.WARNING]

    assert _wait_for(lambda: warnings(), 5)
    time.sleep(1.5)  # at least one backoff retry has failed again by now: still one warning
    outage = warnings()
    assert len(outage) == 1
    assert not tracker.reachable  # so the trainer does not wait for it at checkpoints
    start = time.monotonic()
    assert tracker.wait_for_run(timeout=30) is None  # the first attempt failed: no wait
    assert time.monotonic() - start < 10
    assert uri in outage[0].getMessage() and "500 metric points" in outage[0].getMessage()

    start = time.monotonic()
    tracker.end("FINISHED", timeout=1.0)
    # Within its timeout, with a margin for a loaded machine; waiting on the store instead
    # would take HTTP retries with backoff.
    assert time.monotonic() - start < 10
    summary = warnings()[1:]
    assert len(summary) == 1  # what was lost, reported once more at the end
    assert "about 1000 metric points" in summary[0].getMessage()
    tracker.end()  # idempotent
    tracker.log_metrics({"late": 1.0}, step=1)  # ignored after end, never raises

    assert connecting_threads, "the worker never tried the server: the check above saw nothing"
    assert caller not in connecting_threads


def _missing_mount(tmp_path: Path) -> tuple[str, Callable[[Path], None]]:
    """A store that is really unavailable: its directory is a symlink to nothing (a missing
    mount). The URI, and what makes it come back: the target directory appearing (atomically,
    by rename) with the template database in it."""
    target, link = tmp_path / "mount", tmp_path / "store"
    link.symlink_to(target, target_is_directory=True)

    def mount(template_db: Path) -> None:
        staging = tmp_path / "staging"
        staging.mkdir()
        shutil.copy(template_db, staging / "mlflow.db")
        staging.rename(target)

    return f"sqlite:///{link}/mlflow.db", mount


def test_spool_is_replayed_in_order_when_the_store_comes_back(
    tmp_path: Path, template_db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri, mount = _missing_mount(tmp_path)
    caplog.set_level(logging.INFO, logger=LOGGER)
    out = tmp_path / "out"
    tracker = MLflowTracker(uri, out, "nmt", "flaky", max_spooled_metrics=50)
    assert tracker.run_id is None
    tracker.log_params({"lr": 1e-3})
    for step in range(100):
        tracker.log_metrics({"loss": float(step)}, step=step)
    tracker.set_tags({"phase": "offline"})
    assert _wait_for(
        lambda: any(_ours(r) and r.levelno == logging.WARNING for r in caplog.records), 5
    )
    # Past the bound, the oldest points went to the run directory, as JSON lines.
    spool = out / "mlflow-spool.jsonl"
    assert _wait_for(spool.exists, 5)
    first = json.loads(spool.read_text().splitlines()[0])
    assert first["kind"] == "metrics" and first["payload"][0][:2] == ["loss", 0.0]

    mount(template_db)
    tracker.end("FINISHED", timeout=15.0)

    run_id = tracker.run_id
    assert run_id is not None  # created once the store came back
    client = MlflowClient(uri)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.001"} and run.data.tags["phase"] == "offline"
    assert _history(client, run_id, "loss") == [(s, float(s)) for s in range(100)]  # none lost
    assert not spool.exists()  # delivered, then removed
    assert any("available again" in r.getMessage() for r in caplog.records)
    assert run.info.artifact_uri.startswith((tmp_path / "store" / "mlartifacts").as_uri())


def test_what_an_ended_run_could_not_deliver_is_delivered_at_its_next_start(
    tmp_path: Path, template_db: Path, caplog: pytest.LogCaptureFixture
) -> None:
    uri, mount = _missing_mount(tmp_path)
    out = tmp_path / "out"
    first = MLflowTracker(uri, out, "nmt", "resumed", max_spooled_metrics=10)
    first.log_params({"lr": 1e-3})
    for step in range(30):
        first.log_metrics({"loss": float(step)}, step=step)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        first.end("KILLED", timeout=1.0)
    spool = out / "mlflow-spool.jsonl"
    assert spool.exists()
    (summary,) = [r.getMessage() for r in caplog.records if "could not be ended" in r.getMessage()]
    assert "about 30 metric points" in summary and str(spool) in summary

    # The next start of the run (its resume, in the same directory), with the store back.
    mount(template_db)
    second = MLflowTracker(uri, out, "nmt", "resumed", system_metrics=False)
    for step in range(30, 32):
        second.log_metrics({"loss": float(step)}, step=step)
    second.end("FINISHED", timeout=15.0)
    assert second.run_id is not None
    client = MlflowClient(uri)
    assert _history(client, second.run_id, "loss") == [(s, float(s)) for s in range(32)]
    assert client.get_run(second.run_id).data.params == {"lr": "0.001"}
    assert not spool.exists()


def test_crash_without_end_leaves_the_run_failed_not_running(
    tmp_path: Path, template_db: Path
) -> None:
    out = _output_dir(tmp_path, template_db)
    script = textwrap.dedent(
        f"""
        from megasemface.tracking.mlflow_tracker import MLflowTracker
        tracker = MLflowTracker(None, {str(out)!r}, "nmt", None, system_metrics=False)
        print(tracker.wait_for_run(), flush=True)
        tracker.log_metrics({{"loss": 2.0}}, step=3)
        raise RuntimeError("training crashed")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=180
    )
    assert proc.returncode == 1 and "training crashed" in proc.stderr
    run_id = proc.stdout.strip().splitlines()[-1]
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    assert client.get_run(run_id).info.status == "FAILED"
    assert _history(client, run_id, "loss") == [(3, 2.0)]


def test_null_tracker_does_nothing(tmp_path: Path) -> None:
    tracker = NullTracker()
    with tracked_run(tracker):
        tracker.log_params({"a": {"b": 1}})
        tracker.log_metrics({"loss": 1.0}, step=0)
        tracker.write_events([("x", 1.0, 0)])
        tracker.set_tags({"t": 1})
        tracker.log_artifact(tmp_path)
        tracker.log_dict({}, "c.json")
        assert tracker.flush()
    assert tracker.run_id is None


def test_flatten_params() -> None:
    assert flatten_params({"a": {"b": {"c": 1}, "d": None}, "e": [1, 2], "f": {}}) == {
        "a.b.c": "1",
        "a.d": "None",
        "e": "[1, 2]",
        "f": "{}",
    }
