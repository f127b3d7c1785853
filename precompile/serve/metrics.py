"""The service's Prometheus metrics.

    precompile_requests_total{code}                  /predict and /v2 infer responses by HTTP status; 499:
                                                     the client hung up first (nothing was sent)
    precompile_grpc_requests_total{code}             gRPC ModelInfer answers by status code (OK,
                                                     INVALID_ARGUMENT, UNAVAILABLE, ...)
    precompile_predict_seconds{variant,precision}    latency of successful predictions (histogram; _count
                                                     is the number of requests each variant served;
                                                     precision: fp32, bf16 or int8)
    precompile_rejections_total{reason}              refused predictions: a guard's reason (out_of_range,
                                                     dtype, ...), invalid_body, non_finite_output,
                                                     unknown_model, too_large, queue_full (a full
                                                     batch or instance queue) or disconnected
    precompile_shape_calls_total{shape}              predictions per shape bucket (each dim rounded up
                                                     to a power of two: batch=3-4,seq=65-128)
    precompile_batch_size                            batches run by --batch, by size (histogram)
    precompile_batch_queue_wait_seconds              how long each call waited for its batch (histogram)
    precompile_reloads_total{result}                 swaps to a new version: ok | failed
    precompile_artifact_info{name,version,digest}    what is serving (read at scrape time; one per
                                                     version a repository serves)

Serving a repository (``precompile serve REPO``), every metric but the artifact info has a ``model``
label first: the model's name. Each app has its own registry. With several uvicorn workers the counters live in
``PROMETHEUS_MULTIPROC_DIR`` and every scrape sums them over the workers; the artifact info is then
the answering worker's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import InfoMetricFamily
from prometheus_client.registry import Collector

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def guard_reason(error: Exception) -> str:
    """The label of a refused call: the GuardError's own ``reason``."""
    return getattr(error, "reason", None) or "other"


def size_bucket(size: int) -> str:
    """The power-of-two bucket holding ``size``: 0, 1, 2, 3-4, 5-8, ..., 65-128, ..."""
    if size <= 2:
        return str(size)
    upper = 1 << (size - 1).bit_length()
    return f"{upper // 2 + 1}-{upper}"


def shape_bucket(dims: dict[str, int]) -> str:
    return ",".join(f"{name}={size_bucket(size)}" for name, size in dims.items())


class ArtifactInfo(Collector):
    """Reports what is serving when scraped, so a swap needs no bookkeeping here."""

    def __init__(self, serving: Callable[[], list[dict]]):
        self._serving = serving  # not "describe": the registry calls a collector's describe()

    def collect(self) -> Iterator[InfoMetricFamily]:
        metric = InfoMetricFamily("precompile_artifact", "The artifact being served")
        for serving in self._serving():
            metric.add_metric(
                [], {"name": serving["name"], "version": str(serving["version"]), "digest": serving["digest"]}
            )
        yield metric


class Metrics:
    """The registry and its metrics. ``describe_artifacts``: what is serving, read at scrape time;
    ``labels``: label names every metric but the info has first (``("model",)`` for a repository),
    whose values each caller passes first."""

    def __init__(self, describe_artifacts: Callable[[], list[dict]], *, labels: tuple[str, ...] = ()):
        self.labels = labels
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        if self.multiprocess:
            from prometheus_client import multiprocess

            multiprocess.MultiProcessCollector(self.registry)
            owner = None  # values live in files; the collector above reads every worker's
        else:
            owner = self.registry
        self.requests = Counter(
            "precompile_requests", "/predict and /v2 infer responses by HTTP status", [*labels, "code"], registry=owner
        )
        self.grpc_requests = Counter(
            "precompile_grpc_requests", "gRPC ModelInfer answers by status code", [*labels, "code"], registry=owner
        )
        self.latency = Histogram(
            "precompile_predict_seconds",
            "Latency of successful /predict and /v2 infer requests, by variant and its precision",
            [*labels, "variant", "precision"],
            buckets=LATENCY_BUCKETS,
            registry=owner,
        )
        self.rejections = Counter(
            "precompile_rejections",
            "Refused /predict and /v2 infer requests by reason",
            [*labels, "reason"],
            registry=owner,
        )
        self.shapes = Counter(
            "precompile_shape_calls",
            "Predictions per shape bucket (dims rounded up to powers of two)",
            [*labels, "shape"],
            registry=owner,
        )
        self.batch_size = Histogram(
            "precompile_batch_size",
            "Batches run by --batch, by size",
            labels,
            buckets=BATCH_BUCKETS,
            registry=owner,
        )
        self.queue_wait = Histogram(
            "precompile_batch_queue_wait_seconds",
            "How long each call waited for its batch",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=owner,
        )
        self.reloads = Counter(
            "precompile_reloads", "Swaps to a new artifact version, by result", [*labels, "result"], registry=owner
        )
        self.registry.register(ArtifactInfo(describe_artifacts))

    def count_batch(self, size: int, waits: list[float], values: tuple[str, ...] = ()) -> None:
        """``loader.Batcher``'s ``on_batch``: one batch of ``size`` and its calls' queue waits
        (``values``: those of ``labels``)."""
        sizes, queue_wait = (
            (self.batch_size, self.queue_wait)
            if not values
            else (
                self.batch_size.labels(*values),
                self.queue_wait.labels(*values),
            )
        )
        sizes.observe(size)
        for seconds in waits:
            queue_wait.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
