"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's TraceService on a grpc server."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(frozen=True)
class Got:
    """One received span, with the attributes of the resource that sent it."""

    resource: dict[str, str]
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    attributes: dict[str, object]
    links: tuple[tuple[str, str], ...]
    status_code: int


def _value(v) -> object:  # type: ignore[no-untyped-def]
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[Got] = []
        self.exports = 0
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):  # type: ignore[no-untyped-def]
        got = []
        for rs in request.resource_spans:
            res = {a.key: str(_value(a.value)) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(Got(res, s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                   s.start_time_unix_nano, s.end_time_unix_nano,
                                   {a.key: _value(a.value) for a in s.attributes},
                                   tuple((lk.trace_id.hex(), lk.span_id.hex()) for lk in s.links),
                                   s.status.code))
        with self._lock:
            self.spans.extend(got)
            self.exports += 1
        return trace_service_pb2.ExportTraceServiceResponse()

    def snapshot(self) -> list[Got]:
        with self._lock:
            return list(self.spans)

    def stop(self) -> None:
        self._server.stop(None)
