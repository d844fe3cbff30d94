"""Labelled Prometheus series looked up once per label set: ``metric.labels()`` locks
and validates on every call, and the services call it several times per turn."""

from __future__ import annotations


class Children:
    """``children(metric, *labels)`` is ``metric.labels(*labels)``, cached. Only for
    labels from a bounded set (classes, replicas, outcomes): every set is kept."""

    def __init__(self) -> None:
        self._cache: dict[tuple, object] = {}

    def __call__(self, metric, *labels: str):  # noqa: ANN001, ANN204 - a prometheus_client metric and its child
        key = (id(metric), labels)
        child = self._cache.get(key)
        if child is None:
            child = self._cache[key] = metric.labels(*labels)
        return child
