"""The decode daemon's spans when the WRITE's notification beats the Register's answer (the prefill
daemon WRITEs as soon as it takes the registration, so the data can land before the answer comes
back): the trace still has kvpushd.register and kvpushd.wait_notifications under kvpushd.recv."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra: pip install kvpushd[tracing]")
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpushd.config import TracingConfig
from kvpushd.core.types import Completion, CompletionKind, Figures
from kvpushd.otel import OtelTracing

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _tracing() -> tuple[OtelTracing, InMemorySpanExporter]:
    t = OtelTracing(TracingConfig(otlp_endpoint="http://127.0.0.1:1"), "dnode")
    mem = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(mem))
    t._tracer = provider.get_tracer("test")  # the daemon's own spans, kept in memory instead of exported
    return t, mem


@pytest.mark.parametrize("answer_first", [True, False])
def test_register_and_wait_spans_whichever_comes_first(answer_first: bool) -> None:
    t, mem = _tracing()
    t.expect("w", "tid", TP, "decode", "127.0.0.1:9")
    assert t.register_context("w", "tid").startswith("00-0af7651916cd43dd8448eb211c80319c-")
    sent = time.time_ns()
    done = Completion(CompletionKind.FINISHED_RECEIVING, "tid", figures=Figures(nbytes=4096))
    if answer_first:
        t.registered("w", "tid", sent)
        t.delivered("w", "recv", done)
    else:
        t.delivered("w", "recv", done)
        t.registered("w", "tid", sent)  # the answer, after the data: nothing left to do
    spans = {s.name: s for s in mem.get_finished_spans()}
    assert set(spans) == {"kvpushd.recv", "kvpushd.register", "kvpushd.wait_notifications"}, sorted(spans)
    recv = spans["kvpushd.recv"].context.span_id
    assert spans["kvpushd.register"].parent.span_id == recv
    assert spans["kvpushd.wait_notifications"].parent.span_id == recv
    assert spans["kvpushd.register"].end_time <= spans["kvpushd.wait_notifications"].end_time
