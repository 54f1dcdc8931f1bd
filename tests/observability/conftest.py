"""Fixtures for the observability tests: metrics readers, an in-memory span exporter."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry


def metric_value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """The sum of every sample called ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in registry.collect():
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def metric_names(registry: CollectorRegistry) -> set[str]:
    return {sample.name for family in registry.collect() for sample in family.samples}


class Spans:
    def __init__(self) -> None:
        self.exporter = InMemorySpanExporter()
        self.provider = TracerProvider()
        self.provider.add_span_processor(SimpleSpanProcessor(self.exporter))

    def finished(self) -> list[Any]:
        return list(self.exporter.get_finished_spans())

    def named(self, name: str) -> list[Any]:
        return [s for s in self.finished() if s.name == name]


@pytest.fixture
def spans() -> Iterator[Spans]:
    collected = Spans()
    yield collected
    collected.provider.shutdown()
