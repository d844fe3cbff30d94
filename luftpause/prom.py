"""Prometheus pieces every service's ``/metrics`` uses: labelled series looked up once
per label set (:class:`Children`), gauges computed from a service's state at scrape time
(:class:`ScrapeCollector`), and the text exposition (:func:`exposition`, as an aiohttp
response :func:`metrics_response`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric


class Children:
    """Labelled series looked up once per label set: ``metric.labels()`` locks and
    validates on every call, and the services call it several times per turn.

    ``children(metric, *labels)`` is ``metric.labels(*labels)``, cached. Only for
    labels from a bounded set (classes, replicas, outcomes): every set is kept."""

    def __init__(self) -> None:
        self._cache: dict[tuple, object] = {}

    def __call__(self, metric, *labels: str):  # noqa: ANN001, ANN204 - a prometheus_client metric and its child
        key = (id(metric), labels)
        child = self._cache.get(key)
        if child is None:
            child = self._cache[key] = metric.labels(*labels)
        return child


class ScrapeCollector:
    """Metric families computed at each scrape by ``families`` (a custom collector: read
    from the service's own state, so ``/metrics`` always agrees with its status)."""

    def __init__(self, families: Callable[[], Iterable[Metric]]) -> None:
        self._families = families

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the families are only known at a scrape

    def collect(self) -> Iterable[Metric]:
        return self._families()


def exposition(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The registry in Prometheus text format, and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


def metrics_response(registry: CollectorRegistry) -> web.Response:
    """``GET /metrics``'s answer: the registry's exposition."""
    body, content_type = exposition(registry)
    return web.Response(body=body, headers={"Content-Type": content_type})
