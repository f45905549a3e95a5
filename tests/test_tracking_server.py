"""Tracking to a real ``mlflow server`` started as the docs start it (``--host`` and
``--allowed-hosts`` naming the server's host): the host name reaches it, a name it does not
list is refused in one line naming the fix, and a server that is down, then up, gets every
metric point. A second server runs MLflow's basic-auth app: the run's credentials (MLflow's
own environment variables) reach it, and missing or wrong ones stop the start in one line
that never prints them."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

pytest.importorskip("mlflow")

from conftest import skip_unless_required
from mlflow import MlflowClient

from megasemface.interfaces.registry import DEFAULT
from megasemface.tracking.mlflow_tracker import MLflowTracker
from megasemface.training.options import TrainConfig
from megasemface.training.preflight import tracking_server_problem

pytestmark = pytest.mark.launcher  # starts an MLflow server process (tens of seconds)

SERVER_START_S = 240  # a loaded 2-core machine takes a minute to import and serve


LOOPBACK = "127.0.0.1"


def _host_name() -> str:
    """This machine's host name, which must resolve to an address of this machine: the
    server listens on all of them (``--host 0.0.0.0``, as the docs start it), so the name
    reaches it."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
        with socket.socket() as sock:
            sock.bind((address, 0))
    except OSError as exc:
        skip_unless_required(
            f"this machine's host name {name!r} names no address of its own ({exc})"
        )
    if name == "localhost":
        skip_unless_required("this machine has no host name of its own, only localhost")
    return name


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        return int(sock.getsockname()[1])


class Server:
    """An ``mlflow server`` listening on ``bind`` (every address by default, as the docs
    start it), reached at ``address:port`` and by ``name``, started by :meth:`start` (once)."""

    def __init__(
        self,
        root: Path,
        name: str,
        template_db: Path,
        auth_config: Path | None = None,
        bind: str = "0.0.0.0",
    ) -> None:
        self.root, self.name, self.address, self.bind = root, name, LOOPBACK, bind
        self.port = _free_port()
        self._template_db = template_db
        self._auth_config = auth_config
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        if self._proc is not None:
            return
        shutil.copy(self._template_db, self.root / "mlflow.db")  # no schema migration to wait
        mlflow = Path(sys.executable).with_name("mlflow")
        command = [
            str(mlflow), "server", "--host", self.bind, "--port", str(self.port),
            "--workers", "1", "--backend-store-uri", f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination", str(self.root / "artifacts"),
            "--allowed-hosts", f"{self.name}:{self.port},{self.address}:{self.port}",
        ]  # fmt: skip
        env = dict(os.environ)
        if self._auth_config is not None:
            command += ["--app-name", "basic-auth"]
            env["MLFLOW_AUTH_CONFIG_PATH"] = str(self._auth_config)
            env["MLFLOW_FLASK_SERVER_SECRET_KEY"] = "csrf-key-of-the-test-server"
        self._proc = subprocess.Popen(
            command,
            stdout=open(self.root / "server.log", "ab"),  # noqa: SIM115
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=self.root,
            env=env,
        )
        deadline = time.monotonic() + SERVER_START_S
        while not self._answers():
            assert self._proc.poll() is None, (self.root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.5)

    def _answers(self) -> bool:
        """Whether the server serves: its health endpoint, which needs no credentials."""
        try:
            with urllib.request.urlopen(f"http://{self.address}:{self.port}/health", timeout=5):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            os.killpg(self._proc.pid, 15)
            self._proc.wait(30)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module, started by the first test that needs it up."""
    name = _host_name()
    root = tmp_path_factory.mktemp("mlflow-server")
    template = tmp_path_factory.mktemp("template") / "mlflow.db"
    MlflowClient(f"sqlite:///{template}").search_experiments()
    server = Server(root, name, template)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(autouse=True)
def _isolated_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "MLFLOW_TRACKING_URI",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
        "MLFLOW_TRACKING_TOKEN",
    ):
        monkeypatch.delenv(name, raising=False)
    # The tracker's defaults for HTTP stores; set here so that they do not leak out.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")


def _problem(uri: str) -> str | None:
    config = TrainConfig(
        stage="encoder",
        interface=DEFAULT,
        data=Path(),
        spm_model=Path(),
        output_dir=Path(),
        tracking_uri=uri,
    )
    return tracking_server_problem(config)


def _wait_for(predicate: Callable[[], object], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_server_down_then_up_gets_every_point(
    server: Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="megasemface.tracking")
    out = tmp_path / "run"
    uri = f"http://{server.address}:{server.port}"  # not started yet: nothing listens
    tracker = MLflowTracker(uri, out, "nmt", "outage", max_spooled_metrics=10)
    assert tracker.run_id is None
    for step in range(40):
        tracker.log_metrics({"loss": float(step)}, step=step)
    spool = out / "mlflow-spool.jsonl"
    assert _wait_for(spool.exists, 10)  # past 10 points in memory, the rest went to disk

    server.start()
    tracker.end("FINISHED", timeout=30)
    assert tracker.run_id is not None
    client = MlflowClient(uri)
    history = sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss"))
    assert history == [(s, float(s)) for s in range(40)]
    assert client.get_run(tracker.run_id).info.status == "FINISHED"
    assert not spool.exists()


def test_the_start_stops_in_one_line_on_a_refusal(
    server: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    server.start()
    assert _problem(f"http://{server.name}:{server.port}") is None  # the name it lists

    # A name the server's --allowed-hosts leaves out (MLflow's DNS rebinding protection).
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "trainer")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "s3cret-pw")
    unlisted = f"http://localhost:{server.port}"
    assert _problem(unlisted) == (
        f"the MLflow server at {unlisted} refuses the host name 'localhost' (403 Invalid Host "
        "header - possible DNS rebinding attack detected): list it in the server's allowed "
        f"hosts, `mlflow server ... --allowed-hosts localhost:{server.port}` (without the option "
        "MLflow allows only localhost and IP addresses), or pass --no-tracking"
    )
    line = _problem(f"http://trainer:s3cret-pw@localhost:{server.port}")
    assert line is not None and "s3cret-pw" not in line and "***@localhost" in line

    wrong_path = f"http://{server.name}:{server.port}/mlflow"
    line = _problem(wrong_path)
    assert line is not None and "(404)" in line and "\n" not in line


def test_a_refusal_mid_run_is_reported_in_one_line_and_kept_for_the_next_start(
    server: Server, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server.start()
    caplog.set_level(logging.INFO, logger="megasemface.tracking")
    uri = f"http://localhost:{server.port}"
    tracker = MLflowTracker(uri, tmp_path / "run", "nmt", "refused", system_metrics=False)
    for step in range(3):
        tracker.log_metrics({"loss": float(step)}, step=step)
    assert _wait_for(lambda: any(r.levelno >= logging.ERROR for r in caplog.records), 10)
    tracker.end("FINISHED", timeout=1)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and f"--allowed-hosts localhost:{server.port}" in errors[0]
    assert (tmp_path / "run" / "mlflow-spool.jsonl").exists()


ADMIN, ADMIN_PASSWORD = "admin", "admin-pw-4f7c2e91"


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """MLflow's basic-auth app on the loopback address (by address: no host name needed),
    its users in a database of their own and an admin made at its first start."""
    if importlib.util.find_spec("flask_wtf") is None:
        skip_unless_required("MLflow's basic-auth app needs Flask-WTF: pip install 'mlflow[auth]'")
    root = tmp_path_factory.mktemp("mlflow-auth-server")
    config = root / "basic_auth.ini"
    config.write_text(
        "[mlflow]\n"
        "default_permission = READ\n"
        f"database_uri = sqlite:///{root / 'users.db'}\n"
        f"admin_username = {ADMIN}\n"
        f"admin_password = {ADMIN_PASSWORD}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n",
        encoding="utf-8",
    )
    template = tmp_path_factory.mktemp("auth-template") / "mlflow.db"
    MlflowClient(f"sqlite:///{template}").search_experiments()
    server = Server(root, LOOPBACK, template, auth_config=config, bind=LOOPBACK)
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_credentials_reach_a_server_that_asks_and_wrong_ones_stop_the_start(
    auth_server: Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    uri = f"http://{auth_server.address}:{auth_server.port}"
    # None given: the start stops, naming the variables to set.
    assert _problem(uri) == (
        f"the MLflow server at {uri} asks for credentials (401): set MLFLOW_TRACKING_USERNAME "
        "and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN, in the run's environment, "
        "or pass --no-tracking"
    )
    # Wrong ones: the start stops, naming the variables and never their values.
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "not-the-password")
    assert _problem(uri) == (
        f"the MLflow server at {uri} refuses the credentials in MLFLOW_TRACKING_USERNAME, "
        "MLFLOW_TRACKING_PASSWORD (401): correct them, or pass --no-tracking"
    )
    # The right ones: the start goes on, and every point the tracker logs arrives.
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)
    assert _problem(uri) is None
    tracker = MLflowTracker(uri, tmp_path / "run", "nmt", "with-credentials", system_metrics=False)
    for step in range(5):
        tracker.log_metrics({"loss": float(step)}, step=step)
    tracker.end("FINISHED", timeout=30)
    assert tracker.run_id is not None
    client = MlflowClient(uri)  # reads the same variables
    history = sorted((m.step, m.value) for m in client.get_metric_history(tracker.run_id, "loss"))
    assert history == [(s, float(s)) for s in range(5)]
    assert not (tmp_path / "run" / "mlflow-spool.jsonl").exists()
