"""The decode daemon's spans when the WRITE's notification beats the Register's answer (the prefill
daemon WRITEs as soon as it takes the registration, so the data can land before the answer comes
back): the trace still has kvpushd.register and kvpushd.wait_notifications under kvpushd.recv, and
the recv span has the context its Register carried."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra: pip install kvpushd[tracing]")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvpushd.config import TracingConfig
from kvpushd.core.ledger import Ledger
from kvpushd.core.types import Completion, CompletionKind, Figures
from kvpushd.otel import OtelTracing

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _tracing() -> tuple[OtelTracing, InMemorySpanExporter]:
    mem = InMemorySpanExporter()  # the daemon's own spans, kept in memory instead of exported
    return OtelTracing(TracingConfig(otlp_endpoint="http://127.0.0.1:1"), "dnode", SimpleSpanProcessor(mem)), mem


@pytest.mark.parametrize("answer_first", [True, False])
def test_register_and_wait_spans_whichever_comes_first(answer_first: bool) -> None:
    t, mem = _tracing()
    now = time.monotonic()
    led = Ledger("recv", "w", "decode", "tid", 1, now, 4096, "127.0.0.1:9", traceparent=TP)
    context = t.register_context(led)
    assert context.startswith("00-0af7651916cd43dd8448eb211c80319c-") and context != TP
    assert t.register_context(led) == context  # chosen once: every Register of the transfer carries it
    led.register_sent = now + 0.001
    if answer_first:
        led.registered = now + 0.002
    led.written = led.done = now + 0.003  # the answer, if after the data: nothing left to do for it
    t.ended(Completion(CompletionKind.FINISHED_RECEIVING, "tid", figures=Figures(nbytes=4096)), led)
    spans = {s.name: s for s in mem.get_finished_spans()}
    assert set(spans) == {"kvpushd.recv", "kvpushd.register", "kvpushd.wait_notifications"}, sorted(spans)
    recv = spans["kvpushd.recv"].context
    assert f"00-{recv.trace_id:032x}-{recv.span_id:016x}-01" == context  # the span the prefill daemon joined
    assert spans["kvpushd.register"].parent.span_id == recv.span_id
    assert spans["kvpushd.wait_notifications"].parent.span_id == recv.span_id
    assert spans["kvpushd.register"].end_time <= spans["kvpushd.wait_notifications"].end_time
    assert spans["kvpushd.recv"].start_time <= spans["kvpushd.register"].start_time


def test_a_decode_span_without_an_engine_context_starts_its_own_trace() -> None:
    t, mem = _tracing()
    led = Ledger("recv", "w", "decode", "tid", 1, time.monotonic())
    context = t.register_context(led)
    led.done = time.monotonic()
    t.ended(Completion(CompletionKind.FAILED, "tid"), led)
    (span,) = mem.get_finished_spans()
    assert f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-01" == context and span.parent is None
