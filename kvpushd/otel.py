"""OpenTelemetry spans per transfer, exported over OTLP/gRPC: the only module importing opentelemetry.

Loaded by ``telemetry.make_tracing`` when ``[tracing] otlp_endpoint`` is set (``pip install
kvpushd[tracing]``). The span tree is described in ``kvpushd.tracing``. Nothing is kept here per
transfer: when a transfer ends, its spans are made from its ledger (core/ledger.py) with the times it
stamped (monotonic, turned into wall-clock time once per transfer), so nothing here runs on the NIXL
thread or while the transfer is under way. The one span whose context is needed before it ends, the
decode daemon's (its Register carries it), gets that context chosen then, kept in the ledger, and
the span is made with it at the end.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .config import TracingConfig
from .core.ledger import Ledger
from .core.types import Completion, CompletionKind
from .tracing import Tracing


class _Ids(RandomIdGenerator):
    """Random ids, but the next span made takes ``preset`` (trace id, span id) when one is set: the
    context a decode span was given before it was made."""

    def __init__(self) -> None:
        self.preset: tuple[int, int] | None = None

    def generate_trace_id(self) -> int:  # asked only for a span without a parent
        return self.preset[0] if self.preset else super().generate_trace_id()

    def generate_span_id(self) -> int:
        if self.preset:
            span_id, self.preset = self.preset[1], None
            return span_id
        return super().generate_span_id()


class OtelTracing(Tracing):
    enabled = True

    def __init__(self, cfg: TracingConfig, node_id: str, processor: SpanProcessor | None = None) -> None:
        self._ids = _Ids()
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name, "service.instance.id": node_id,
                                      "kvpushd.node_id": node_id}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)), id_generator=self._ids)
        if processor is None:
            exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=cfg.otlp_endpoint.startswith("http://"))
            processor = BatchSpanProcessor(exporter)
        self._provider.add_span_processor(processor)
        self._tracer = self._provider.get_tracer("kvpushd")
        self._prop = TraceContextTextMapPropagator()
        self._node_id = node_id
        self._down = False

    def _extract(self, traceparent: str) -> Context | None:
        return self._prop.extract({"traceparent": traceparent}) if traceparent else None

    def _context_of(self, traceparent: str) -> SpanContext | None:
        """The span context a W3C traceparent names (None: none, or not a valid one)."""
        parent = self._extract(traceparent)
        ctx = trace.get_current_span(parent).get_span_context() if parent is not None else None
        return ctx if ctx is not None and ctx.is_valid else None

    def register_context(self, led: Ledger) -> str:
        if not led.span_context:
            parent = self._extract(led.traceparent)
            pctx = self._context_of(led.traceparent)
            trace_id = pctx.trace_id if pctx is not None else self._ids.generate_trace_id()
            span_id = self._ids.generate_span_id()
            decision = self._provider.sampler.should_sample(parent, trace_id, "kvpushd.recv").decision
            sampled = decision is Decision.RECORD_AND_SAMPLE
            led.span_context = f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"
        return led.span_context

    def ended(self, c: Completion, led: Ledger) -> None:
        now_m, now_w = time.monotonic(), time.time_ns()

        def ns(t: float) -> int:
            return now_w - int(max(now_m - t, 0.0) * 1e9)

        end = ns(led.done or now_m)
        attrs: dict[str, Any] = {"kvpushd.transfer_id": c.transfer_id, "kvpushd.engine_id": led.engine_id,
                                 "kvpushd.node_id": self._node_id, "kvpushd.side": led.side}
        tid = {"kvpushd.transfer_id": c.transfer_id}
        if led.side == "recv":
            own = self._context_of(led.span_context)  # chosen when its Register went (register_context)
            self._ids.preset = (own.trace_id, own.span_id) if own is not None else None
            try:
                span = self._tracer.start_span("kvpushd.recv", context=self._extract(led.traceparent),
                                               kind=SpanKind.CONSUMER, start_time=ns(led.taken),
                                               attributes={**attrs, "kvpushd.peer": led.peer})
            finally:
                self._ids.preset = None
            finished = c.kind is CompletionKind.FINISHED_RECEIVING
            # the data can come before the Register's answer (the prefill daemon WRITEs as soon as it
            # takes the registration): the register span then ends with the transfer
            answered = ns(led.registered) if led.registered else end if finished else 0
            if led.register_sent and answered:
                self._child(span, "kvpushd.register", ns(led.register_sent), answered, tid, led.register_error)
            if finished and answered and not (led.nixl_transfers or led.failed_writes):  # push: prefill WRITEs
                self._child(span, "kvpushd.wait_notifications", answered, end, tid)
        else:
            first = led.met - led.waited_s if led.met else led.taken
            parent_tp = led.span_context or led.traceparent  # the decode daemon's span, else the engine's
            engine = self._context_of(led.traceparent) if led.traceparent != parent_tp else None
            links = [Link(engine, {"kvpushd.link": "prefill engine request"})] if engine is not None else []
            span = self._tracer.start_span("kvpushd.send", context=self._extract(parent_tp), kind=SpanKind.PRODUCER,
                                           links=links, start_time=ns(min(led.taken, first)), attributes=attrs)
            if led.met:
                self._child(span, "kvpushd.rendezvous_wait", ns(first), ns(led.met), {**tid, "kvpushd.peer": led.peer})
        if led.nixl_transfers or led.failed_writes:  # the READs (pull) or WRITEs this daemon posted
            self._nixl(span, "kvpushd.nixl_read" if led.side == "recv" else "kvpushd.nixl_write", led, ns, end)
        f = c.figures
        if f is not None:
            span.set_attributes({"kvpushd.bytes": f.nbytes, "kvpushd.nixl_transfers": f.nixl_transfers,
                                 "kvpushd.descriptors": f.descriptors, "kvpushd.elapsed_s": f.elapsed_s})
        span.set_attribute("kvpushd.outcome", c.kind.name)
        if c.kind is CompletionKind.FAILED:
            span.set_attribute("kvpushd.code", c.code.name)
            span.set_status(Status(StatusCode.ERROR, f"{c.code.name}: {c.reason}"[:500]))
        span.end(end_time=end)

    def _child(self, parent: Span, name: str, start_ns: int, end_ns: int, attrs: dict[str, Any],
               error: str = "") -> None:
        s = self._tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns,
                                    attributes=attrs)
        if error:
            s.set_status(Status(StatusCode.ERROR, error[:500]))
        s.end(end_time=max(end_ns, start_ns))

    def _nixl(self, parent: Span, name: str, led: Ledger, ns: Callable[[float], int], end: int) -> None:
        """The transfer's NIXL WRITEs (or READs) as one span: the first posted -> the last one's bytes landed."""
        done = ns(led.written) if led.written else end
        start = ns(led.posted) if led.posted else done - int((led.post_s + led.transfer_s) * 1e9)
        self._child(parent, name, start, done,
                    {"kvpushd.transfer_id": led.transfer_id, "kvpushd.bytes": led.nbytes,
                     "kvpushd.descriptors": led.descs_posted, "kvpushd.nixl_transfers": led.nixl_transfers,
                     "kvpushd.post_s": led.post_s, "kvpushd.transfer_s": led.transfer_s},
                    f"{led.failed_writes} of them failed" if led.failed_writes else "")

    def shutdown(self) -> None:
        if self._down:
            return
        self._down = True
        self._provider.shutdown()  # flushes what the batch processor holds
