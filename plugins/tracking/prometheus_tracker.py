"""The ``prometheus`` tracker (kind ``tracker``): a ``/metrics`` endpoint with the latest metrics as gauges.

Turned on by ``trainer.prometheus.port=9400`` (null, the default: off), which adds ``prometheus`` to the
trackers (:func:`rlplug.run.metrics.tracker_names`); ``trainer.prometheus.host`` is the address, ``127.0.0.1`` by
default (loopback only; ``0.0.0.0`` lets other machines scrape). Needs ``prometheus_client``
(``pip install prometheus_client``, or ``pip install 'rlplug[watch]'``).

Why a tracker: the tracker contract already hands every step's metrics to ``log_metrics`` on the main
process, and ``close`` ends with the run, which is all an exporter needs; as a plugin it is loaded,
disabled (``RLPLUG_DISABLE_PLUGINS=prometheus``) and replaced like any tracker, and the trainer stays
unaware of it.

``GET http://<host>:<port>/metrics`` serves, in Prometheus' text format:

* one gauge per metric the run has logged, holding its latest value (a validation metric keeps the value
  of the last validation), named by :func:`prometheus_name`: ``rlplug_`` + the verl name mapped with
  :func:`rlplug.plugin.tracker_name` to Prometheus' characters ``[a-zA-Z0-9_:]`` (``actor/pg_loss`` ->
  ``rlplug_actor_pg_loss``, ``val-core/gsm8k/acc/mean@8`` -> ``rlplug_val_core_gsm8k_acc_mean_at_8``);
  its help text is the verl name. Among them, when the run logs them: ``rlplug_perf_gen_tokens_per_s``
  (rollout tokens/s), ``rlplug_actor_ppo_kl`` / ``rlplug_actor_kl_loss`` (KL), ``rlplug_actor_grad_norm``,
  ``rlplug_critic_score_mean`` / ``rlplug_critic_rewards_mean`` (reward), ``rlplug_timing_s_step``
  (step time, seconds) and ``rlplug_training_phase`` (``training/phase``, the schedule's phase);
* ``rlplug_step``: the global step of the latest values, and ``rlplug_run_info{project, experiment}`` = 1.

Two verl names that map to one Prometheus name keep the first one's value (a warning names both). The
Grafana dashboard ``contrib/grafana/rlplug.json`` plots these gauges (``docs/trackers.md``).
"""

from __future__ import annotations

import importlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any

from rlplug.plugin import ConfigError, TrainerConfig, hookimpl, tracker_name, typed_section
from rlplug.plugin import (
    metric_value as _number,
)

__all__ = ["PrometheusTracker", "prometheus_name", "PROMETHEUS_NAME_CHARS", "PREFIX"]

log = logging.getLogger("rlplug.trackers")

#: The characters Prometheus accepts in metric names (a regex character-class body for ``tracker_name``).
PROMETHEUS_NAME_CHARS = "A-Za-z0-9_:"
#: What every gauge name starts with (also makes a name valid when the verl name starts with a digit).
PREFIX = "rlplug_"


def prometheus_name(name: str) -> str:
    """The Prometheus gauge name of the metric ``name``: :data:`PREFIX` + :func:`rlplug.plugin.tracker_name`
    with :data:`PROMETHEUS_NAME_CHARS` and no length limit, so ``@`` becomes ``_at_`` and every other
    character outside ``[A-Za-z0-9_:]`` ``_``. Example: ``val-core/gsm8k/acc/mean@8`` ->
    ``rlplug_val_core_gsm8k_acc_mean_at_8``; the result always matches ``[a-zA-Z_:][a-zA-Z0-9_:]*``."""
    return PREFIX + tracker_name(name, allowed=PROMETHEUS_NAME_CHARS, max_length=None)


def _import_client() -> Any:
    try:
        return importlib.import_module("prometheus_client")
    except ImportError as exc:
        raise ImportError(
            "trainer.prometheus.port needs the Python package 'prometheus_client', which is not installed "
            f"({exc}). Install it with `pip install prometheus_client` (or `pip install 'rlplug[watch]'`), "
            "or set trainer.prometheus.port=null."
        ) from exc


class _LatestValues:
    """A ``prometheus_client`` collector: the latest value of every metric as a gauge (thread-safe)."""

    def __init__(self, project: str, experiment: str) -> None:
        self._lock = threading.Lock()
        self.values: dict[str, tuple[str, float]] = {}  # prometheus name -> (verl name, value)
        self.step: int | None = None
        self.labels = (project, experiment)
        self._warned: set[str] = set()

    def update(self, metrics: Mapping[str, Any], step: int) -> None:
        with self._lock:
            for key, value in metrics.items():
                v = _number(value)
                if v is None:
                    continue
                name = prometheus_name(key)
                old = self.values.get(name)
                if old is not None and old[0] != key:
                    if name not in self._warned:
                        self._warned.add(name)
                        log.warning(
                            "Metrics '%s' and '%s' are both %s in Prometheus; keeping '%s'.", old[0], key, name, old[0]
                        )
                    continue
                self.values[name] = (str(key), v)
            self.step = int(step)

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily  # deferred: prometheus_client

        with self._lock:
            values, step = dict(self.values), self.step
        info = GaugeMetricFamily(
            "rlplug_run_info", "The rlplug run this endpoint serves", labels=["project", "experiment"]
        )
        info.add_metric(list(self.labels), 1.0)
        yield info
        if step is not None:
            yield GaugeMetricFamily("rlplug_step", "The global step of the latest metrics", value=float(step))
        for name, (key, v) in sorted(values.items()):
            yield GaugeMetricFamily(name, key, value=v)


def _trainer(config: Any) -> TrainerConfig:
    """``config``'s ``trainer`` section as the schema's :class:`TrainerConfig` (a key missing or None takes the
    schema's default); ``config`` is the run config, a plain mapping or None."""
    return typed_section(TrainerConfig, config, "trainer")


class PrometheusTracker:
    """Serves ``/metrics`` on ``trainer.prometheus.host:port`` from construction to :meth:`close`.

    ``factory(config)``: ``config`` is the resolved run config. Attributes: ``host``, ``port`` (the bound
    port: port 0 picks a free one), ``url`` (``http://host:port/metrics``), ``registry`` (its own
    ``prometheus_client.CollectorRegistry``: nothing of the process-wide default registry is served).

    Raises :class:`rlplug.config.schema.ConfigError` when ``trainer.prometheus.port`` is null, ``ImportError``
    naming the pip package when ``prometheus_client`` is missing, and ``OSError`` saying which address is
    taken when the port cannot be bound.
    """

    def __init__(self, config: Any) -> None:
        client = _import_client()
        trainer = _trainer(config)
        port = trainer.prometheus.port
        self.host = str(trainer.prometheus.host or "127.0.0.1")
        if port is None:
            raise ConfigError(
                "The 'prometheus' tracker needs trainer.prometheus.port (null: no endpoint); set e.g. "
                "trainer.prometheus.port=9400."
            )
        self.closed = False
        project = str(trainer.project_name)
        experiment = str(trainer.experiment_name if trainer.experiment_name is not None else "default")
        self.registry = client.CollectorRegistry(auto_describe=False)
        self._collector = _LatestValues(project, experiment)
        self.registry.register(self._collector)
        try:
            self._server, self._thread = client.start_http_server(int(port), addr=self.host, registry=self.registry)
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"trainer.prometheus.port={port}: cannot serve /metrics on {self.host}:{port} ({exc.strerror or exc}). "
                "Pick a free port (another run may use this one), or set trainer.prometheus.port=null.",
            ) from exc
        self.port = int(self._server.server_port)
        self.url = f"http://{self.host}:{self.port}/metrics"
        log.info("Prometheus metrics at %s", self.url)

    def log_params(self, params: Mapping[str, Any]) -> None:
        """Nothing: settings are not gauges."""
        return None

    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> None:
        """Set the gauges to this step's numeric values (NaN and infinities as Prometheus spells them)."""
        if not self.closed:
            self._collector.update(metrics, step)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        """Nothing: tables are not gauges."""
        return None

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        """Nothing: Prometheus keeps numbers only."""
        return None

    def close(self, status: str = "FINISHED") -> None:
        """Stop serving and free the port; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


@hookimpl
def register_trackers(register):
    register("prometheus", PrometheusTracker)
