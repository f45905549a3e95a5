"""System metrics (CPU, memory, disk, network; GPU with ``nvidia-ml-py``) for the MLflow tracker.

Samples are taken with MLflow's own monitor classes, on the tracker's worker thread, and logged
by the tracker like any other metric. MLflow's ``log_system_metrics=True`` is not used: its
monitor thread makes its own MLflow calls, bypasses the tracker's spool and stops for good at the
first failed request.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import time
from typing import Any

__all__ = ["SystemMetricsSampler"]

logger = logging.getLogger(__name__)


class SystemMetricsSampler:
    """Takes a sample of every monitor once :attr:`next_sample` (``time.monotonic``) is reached.

    A sampler without monitors (``SystemMetricsSampler()``) never samples: its
    :attr:`next_sample` is infinite.
    """

    def __init__(
        self, monitors: list[Any] | None = None, interval: float = math.inf, prefix: str = ""
    ) -> None:
        self._monitors = list(monitors or [])
        self._interval = interval if self._monitors else math.inf
        self._prefix = prefix
        self.next_sample = time.monotonic() + self._interval

    @classmethod
    def create(cls, interval: float | None) -> SystemMetricsSampler:
        """Create MLflow's metric monitors (psutil; GPU via nvidia-ml-py or ROCm if present).

        ``interval``: seconds between samples; None: ``MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL``
        or 10. Metrics are named ``system/<name>``, or ``system/<node_id>/<name>`` with
        ``MLFLOW_SYSTEM_METRICS_NODE_ID``. Without psutil the sampler never samples.
        """
        if importlib.util.find_spec("psutil") is None:
            logger.info("MLflow system metrics disabled: psutil is not installed")
            return cls()
        try:
            from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
            from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
            from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

            monitors: list[Any] = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
        except Exception:
            logger.info("MLflow system metrics unavailable", exc_info=True)
            return cls()
        try:
            from mlflow.system_metrics.metrics.gpu_monitor import GPUMonitor

            monitors.append(GPUMonitor())
        except Exception:
            try:
                from mlflow.system_metrics.metrics.rocm_monitor import ROCMMonitor

                monitors.append(ROCMMonitor())
            except Exception:
                logger.debug("no GPU metrics (nvidia-ml-py / pyrsmi missing or no GPU)")
        if interval is None:
            interval = float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL") or 10.0)
        node_id = os.environ.get("MLFLOW_SYSTEM_METRICS_NODE_ID")
        # The first sample after one interval: psutil's CPU percentage needs a previous call.
        for monitor in monitors:
            with contextlib.suppress(Exception):
                monitor.collect_metrics()
                monitor.clear_metrics()
        prefix = f"system/{node_id}/" if node_id else "system/"
        return cls(monitors, max(0.1, interval), prefix)

    def sample(self, now: float) -> dict[str, float]:
        """One sample of every monitor, by metric name; schedules the next one."""
        self.next_sample = now + self._interval
        values: dict[str, float] = {}
        for monitor in self._monitors:
            try:
                monitor.collect_metrics()
                values.update(monitor.aggregate_metrics())
            except Exception:
                logger.debug("system metric sampling failed", exc_info=True)
            finally:
                monitor.clear_metrics()
        return {self._prefix + key: value for key, value in values.items()}
