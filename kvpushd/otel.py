"""OpenTelemetry spans per transfer, exported over OTLP/gRPC: the only module importing opentelemetry.

Loaded by ``telemetry.make_tracing`` when ``[tracing] otlp_endpoint`` is set (``pip install
kvpushd[tracing]``). The span tree is described in ``kvpushd.tracing``. Top-level spans are open
while their transfer is; the short child spans are recorded when their step ends, with the start
time it had (NIXL reports post and transfer seconds), so nothing here runs on the NIXL thread.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .config import TracingConfig
from .core.types import Completion, CompletionKind
from .tracing import Tracing

if TYPE_CHECKING:
    from .transfer.records import ReadResult, WriteResult

Key = tuple[str, str]  # (worker id, transfer id)
_CAP = 100_000  # open spans and remembered contexts at most (a transfer that never ends is dropped)


@dataclass(slots=True)
class _Open:
    span: Span
    registered_ns: int = 0
    register_sent_ns: int = 0  # the Register went out (its answer may come after the WRITE's notification)


@dataclass(slots=True)
class _Pub:
    traceparent: str
    engine_id: str
    started_ns: int
    span: Span | None = None


def _ns_ago(seconds: float, now_ns: int | None = None) -> int:
    return (now_ns if now_ns is not None else time.time_ns()) - int(seconds * 1e9)


def _evict(d: dict[Key, _Open] | dict[Key, _Pub]) -> None:
    """Bounded: the oldest entry goes (its span ends) before a new one is added."""
    if len(d) >= _CAP:
        old = d.pop(next(iter(d)))
        if old.span is not None:
            old.span.end()


class OtelTracing(Tracing):
    enabled = True

    def __init__(self, cfg: TracingConfig, node_id: str) -> None:
        self._provider = TracerProvider(
            resource=Resource.create({"service.name": cfg.service_name, "service.instance.id": node_id,
                                      "kvpushd.node_id": node_id}),
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
        exporter = OTLPSpanExporter(endpoint=cfg.otlp_endpoint, insecure=cfg.otlp_endpoint.startswith("http://"))
        self._provider.add_span_processor(BatchSpanProcessor(exporter))
        self._tracer = self._provider.get_tracer("kvpushd")
        self._prop = TraceContextTextMapPropagator()
        self._node_id = node_id
        self._recv: dict[Key, _Open] = {}
        self._send: dict[Key, _Pub] = {}
        self._reg_ctx: collections.OrderedDict[str, str] = collections.OrderedDict()  # transfer id -> traceparent
        self._down = False

    def _extract(self, traceparent: str) -> Context | None:
        return self._prop.extract({"traceparent": traceparent}) if traceparent else None

    def _child(self, parent: Span, name: str, start_ns: int, end_ns: int, attrs: dict[str, str | int | float],
               error: str = "") -> None:
        s = self._tracer.start_span(name, context=trace.set_span_in_context(parent), start_time=start_ns,
                                    attributes=attrs)
        if error:
            s.set_status(Status(StatusCode.ERROR, error))
        s.end(end_time=max(end_ns, start_ns))

    # decode side ------------------------------------------------------------------------------
    def expect(self, worker_id: str, transfer_id: str, traceparent: str, engine_id: str, peer: str) -> None:
        span = self._tracer.start_span("kvpushd.recv", context=self._extract(traceparent), kind=SpanKind.CONSUMER,
                                       attributes={"kvpushd.transfer_id": transfer_id, "kvpushd.engine_id": engine_id,
                                                   "kvpushd.node_id": self._node_id, "kvpushd.side": "recv",
                                                   "kvpushd.peer": peer})
        old = self._recv.pop((worker_id, transfer_id), None)
        if old is not None:  # a repeated Expect: the newer one is the transfer
            old.span.end()
        _evict(self._recv)
        self._recv[(worker_id, transfer_id)] = _Open(span)

    def register_context(self, worker_id: str, transfer_id: str) -> str:
        o = self._recv.get((worker_id, transfer_id))
        if o is None:
            return ""
        o.register_sent_ns = time.time_ns()
        carrier: dict[str, str] = {}
        self._prop.inject(carrier, context=trace.set_span_in_context(o.span))
        return carrier.get("traceparent", "")

    def registered(self, worker_id: str, transfer_id: str, started_ns: int, error: str = "") -> None:
        o = self._recv.get((worker_id, transfer_id))
        if o is None:
            return
        now = time.time_ns()
        o.registered_ns = now
        self._child(o.span, "kvpushd.register", started_ns, now, {"kvpushd.transfer_id": transfer_id}, error)

    # prefill side -----------------------------------------------------------------------------
    def publish(self, worker_id: str, transfer_id: str, traceparent: str, engine_id: str) -> None:
        old = self._send.pop((worker_id, transfer_id), None)
        if old is not None and old.span is not None:
            old.span.end()
        _evict(self._send)
        self._send[(worker_id, transfer_id)] = _Pub(traceparent, engine_id, time.time_ns())

    def registration(self, transfer_id: str, traceparent: str) -> None:
        if not traceparent:
            return
        self._reg_ctx[transfer_id] = traceparent
        self._reg_ctx.move_to_end(transfer_id)
        if len(self._reg_ctx) > _CAP:
            self._reg_ctx.popitem(last=False)

    def _send_span(self, worker_id: str, transfer_id: str, since_ns: int = 0) -> Span | None:
        """The prefill span, started (at the publish, or at ``since_ns`` when the registration came
        first) once both contexts are known."""
        p = self._send.get((worker_id, transfer_id))
        if p is None:
            return None
        if p.span is None:
            # The decode daemon's span is the parent (one trace across the daemons); the prefill
            # engine's own context, when it is another one, is a link.
            reg_tp = self._reg_ctx.get(transfer_id, "")
            parent_tp = reg_tp or p.traceparent
            links = []
            if p.traceparent and p.traceparent != parent_tp:
                ctx = trace.get_current_span(self._extract(p.traceparent)).get_span_context()
                if ctx.is_valid:
                    links.append(Link(ctx, {"kvpushd.link": "prefill engine request"}))
            p.span = self._tracer.start_span(
                "kvpushd.send", context=self._extract(parent_tp), kind=SpanKind.PRODUCER, links=links,
                start_time=min(p.started_ns, since_ns) if since_ns else p.started_ns,
                attributes={"kvpushd.transfer_id": transfer_id, "kvpushd.engine_id": p.engine_id,
                            "kvpushd.node_id": self._node_id, "kvpushd.side": "send"})
        return p.span

    def rendezvous(self, worker_id: str, transfer_id: str, waited_s: float, peer: str) -> None:
        now = time.time_ns()
        first = _ns_ago(waited_s, now)
        span = self._send_span(worker_id, transfer_id, first)
        if span is None:
            return
        self._child(span, "kvpushd.rendezvous_wait", first, now,
                    {"kvpushd.transfer_id": transfer_id, "kvpushd.peer": peer})

    # both -------------------------------------------------------------------------------------
    def nixl_done(self, worker_id: str, transfer_id: str, read: bool, x: WriteResult | ReadResult) -> None:
        if read:
            o = self._recv.get((worker_id, transfer_id))
            parent = o.span if o is not None else None
        else:
            parent = self._send_span(worker_id, transfer_id)
        if parent is None:
            return
        now = time.time_ns()
        start = _ns_ago(x.post_s + x.xfer_s, now)
        s = self._tracer.start_span("kvpushd.nixl_read" if read else "kvpushd.nixl_write",
                                    context=trace.set_span_in_context(parent), start_time=start,
                                    attributes={"kvpushd.transfer_id": transfer_id, "kvpushd.bytes": x.nbytes,
                                                "kvpushd.descriptors": x.descs_posted, "kvpushd.post_s": x.post_s,
                                                "kvpushd.transfer_s": x.xfer_s})
        s.add_event("posted", timestamp=_ns_ago(x.xfer_s, now))
        if not x.ok:
            s.set_status(Status(StatusCode.ERROR, x.reason))
        s.end(end_time=now)

    def delivered(self, worker_id: str, side: str, c: Completion) -> None:
        key = (worker_id, c.transfer_id)
        now = time.time_ns()
        if side == "recv" or key in self._recv:
            o = self._recv.pop(key, None)
            if o is None:
                return
            span = o.span
            if not o.registered_ns and o.register_sent_ns and c.kind is CompletionKind.FINISHED_RECEIVING:
                # the data came before the Register's answer (the prefill daemon WRITEs as soon as it
                # takes the registration): the register span ends here, its answer is no longer awaited
                o.registered_ns = now
                self._child(span, "kvpushd.register", o.register_sent_ns, now, {"kvpushd.transfer_id": c.transfer_id})
            if o.registered_ns and c.kind is CompletionKind.FINISHED_RECEIVING:
                f = c.figures
                if f is None or f.nixl_transfers == 0:  # push: the WRITEs were the prefill daemon's
                    self._child(span, "kvpushd.wait_notifications", o.registered_ns, now,
                                {"kvpushd.transfer_id": c.transfer_id})
        else:
            p = self._send.get(key)
            if p is None:
                return
            sent = self._send_span(worker_id, c.transfer_id)  # a transfer that failed before its WRITE too
            self._send.pop(key, None)
            if sent is None:
                return
            span = sent
        f = c.figures
        if f is not None:
            span.set_attributes({"kvpushd.bytes": f.nbytes, "kvpushd.nixl_transfers": f.nixl_transfers,
                                 "kvpushd.descriptors": f.descriptors, "kvpushd.elapsed_s": f.elapsed_s})
        span.set_attribute("kvpushd.outcome", c.kind.name)
        if c.kind is CompletionKind.FAILED:
            span.set_attribute("kvpushd.code", c.code.name)
            span.set_status(Status(StatusCode.ERROR, f"{c.code.name}: {c.reason}"[:500]))
        span.end(end_time=now)

    def forget_worker(self, worker_id: str) -> None:
        for k in [k for k in self._recv if k[0] == worker_id]:
            self._recv.pop(k).span.end()
        for k in [k for k in self._send if k[0] == worker_id]:
            p = self._send.pop(k)
            if p.span is not None:
                p.span.end()

    def shutdown(self) -> None:
        if self._down:
            return
        self._down = True
        self._provider.shutdown()  # flushes what the batch processor holds
