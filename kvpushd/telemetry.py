"""Which tracer a daemon gets: the no-op one unless ``[tracing] otlp_endpoint`` is set.

Kept apart from ``tracing`` (the hooks) and ``otel`` (the only module importing opentelemetry,
loaded here only when tracing is on), so neither imports the other's room.
"""

from __future__ import annotations

from .config import TracingConfig
from .tracing import Tracing


def make_tracing(cfg: TracingConfig, node_id: str) -> Tracing:
    """No-op unless an OTLP endpoint is configured (opentelemetry is imported only then)."""
    if not cfg.otlp_endpoint:
        return Tracing()
    from .otel import OtelTracing  # deferred: tracing off costs no import

    return OtelTracing(cfg, node_id)
