"""One transfer, one trace: the engine's span (this test acts as the engine), then both daemons' spans,
received by a real OTLP/gRPC receiver in this process, with every parent link intact."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvpushd_client import CompletionKind, Expect, Publish, TransferMode
from support import attach_pair, start_daemon, wait_for

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra: pip install kvpushd[tracing]")
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from otlp_receiver import Got, Receiver


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.stop()


def _pair(workdir: Path, receiver: Receiver, monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
          tracing: str = ""):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the daemons' batch processor: export soon
    cfg = (f'[transfer]\npublish_timeout_s = 20.0\nexpect_timeout_s = 20.0\n'
           f'[tracing]\notlp_endpoint = "{receiver.endpoint}"\n' + tracing)
    p = start_daemon(workdir, "pnode", cfg)
    try:
        d = start_daemon(workdir, "dnode", cfg)
    except BaseException:
        p.stop()
        raise
    return p, d


def _engine_tracer(receiver: Receiver) -> tuple[TracerProvider, trace.Tracer]:
    provider = TracerProvider(resource=Resource.create({"service.name": "test-engine"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=receiver.endpoint, insecure=True)))
    return provider, provider.get_tracer("test-engine")


def _traceparent(span: trace.Span) -> str:
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return carrier["traceparent"]


def _by_name(spans: list[Got], name: str) -> list[Got]:
    return [s for s in spans if s.name == name]


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_one_transfer_one_trace(workdir, kv_pair, receiver, monkeypatch, mode) -> None:  # type: ignore[no-untyped-def]
    provider, tracer = _engine_tracer(receiver)
    p, d = _pair(workdir, receiver, monkeypatch)
    try:
        src, dst = kv_pair
        pw, dw = attach_pair(p, d, src, dst)
        root = tracer.start_span("engine.request")  # the engine request's span (vLLM's llm_request)
        tp = _traceparent(root)
        tid = f"traced-{mode}"
        if mode == "push":
            dw.send(Expect(tid, (10, 11), p.peer_address, "prefill", 1, traceparent=tp))
            assert wait_for(lambda: any(t.transfer_id == tid for t in p.client.status().transfers))
            pw.send(Publish(tid, (1, 2), traceparent=tp))
        else:
            pw.send(Publish(tid, (1, 2), traceparent=tp))
            dw.send(Expect(tid, (10, 11), p.peer_address, "prefill", 1, transfer_mode=TransferMode.PULL,
                           traceparent=tp))
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        root.end()
        pw.detach()
        dw.detach()
    finally:
        for x in (p, d):
            x.client.close()
            assert x.stop() == 0, x.logs()[-3000:]  # a clean stop flushes the daemon's exporter
        provider.shutdown()

    spans = receiver.snapshot()
    trace_id = format(root.get_span_context().trace_id, "032x")
    assert {s.trace_id for s in spans} == {trace_id}, "every span is in the engine request's trace"
    ids = {s.span_id: s for s in spans}
    assert len(ids) == len(spans)
    for s in spans:
        if s.name != "engine.request":
            assert s.parent_span_id in ids, f"{s.name}: parent {s.parent_span_id} was not received"
    (eng,) = _by_name(spans, "engine.request")
    assert eng.parent_span_id == ""
    (recv,) = _by_name(spans, "kvpushd.recv")
    (send,) = _by_name(spans, "kvpushd.send")
    assert recv.resource["kvpushd.node_id"] == "dnode" and send.resource["kvpushd.node_id"] == "pnode"
    assert recv.parent_span_id == eng.span_id  # the decode daemon continued the engine's context
    assert send.parent_span_id == recv.span_id  # the prefill daemon joined through Register
    assert send.attributes["kvpushd.transfer_id"] == tid and recv.attributes["kvpushd.outcome"] == "FINISHED_RECEIVING"
    (reg,) = _by_name(spans, "kvpushd.register")
    assert reg.parent_span_id == recv.span_id
    moved = 2 * src.regions * src.block_len
    if mode == "push":
        (rv,) = _by_name(spans, "kvpushd.rendezvous_wait")
        (wr,) = _by_name(spans, "kvpushd.nixl_write")
        (wn,) = _by_name(spans, "kvpushd.wait_notifications")
        assert rv.parent_span_id == send.span_id and wr.parent_span_id == send.span_id
        assert wn.parent_span_id == recv.span_id
        assert wr.attributes["kvpushd.bytes"] == moved and wr.attributes["kvpushd.descriptors"] == src.regions
        assert send.start_ns <= rv.start_ns <= rv.end_ns <= wr.end_ns <= send.end_ns
        assert recv.start_ns <= wn.start_ns <= wn.end_ns <= recv.end_ns
        assert not _by_name(spans, "kvpushd.nixl_read")
    else:
        (rd,) = _by_name(spans, "kvpushd.nixl_read")
        assert rd.parent_span_id == recv.span_id and rd.attributes["kvpushd.bytes"] == moved
        assert not _by_name(spans, "kvpushd.nixl_write")
    assert all(s.status_code != 2 for s in spans)  # no STATUS_CODE_ERROR


def test_stream_commands_carry_the_context(workdir, kv_pair, receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Workers on WorkerService.Stream (commands batched per step) pass the traceparent the same way."""
    import secrets

    from kvpushd_client import Role

    p, d = _pair(workdir, receiver, monkeypatch)
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    tp = f"00-{trace_id}-{parent}-01"
    try:
        src, dst = kv_pair
        pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        dw.send_nowait(Expect("st", (3, 4), p.peer_address, "prefill", 1, traceparent=tp))
        dw.step()
        pw.send_nowait(Publish("st", (5, 6), traceparent=tp))
        pw.step()
        assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        pw.detach()
        dw.detach()
    finally:
        for x in (p, d):
            x.client.close()
            assert x.stop() == 0, x.logs()[-3000:]
    got = {s.name: s for s in receiver.snapshot()}
    assert {s.trace_id for s in got.values()} == {trace_id}
    assert got["kvpushd.recv"].parent_span_id == parent
    assert got["kvpushd.send"].parent_span_id == got["kvpushd.recv"].span_id
    assert got["kvpushd.send"].links == ((trace_id, parent),)  # the prefill engine's own context


def test_sampling_follows_the_context(workdir, kv_pair, receiver, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """sample_ratio 0: a transfer without context is not traced, nor one whose traceparent says
    "not sampled"; one whose traceparent is sampled is traced on both daemons."""
    import secrets

    p, d = _pair(workdir, receiver, monkeypatch, "sample_ratio = 0.0\n")
    traced = secrets.token_hex(16)
    try:
        src, dst = kv_pair
        pw, dw = attach_pair(p, d, src, dst)
        for i, tp in enumerate(["", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-00",
                                f"00-{traced}-{secrets.token_hex(8)}-01"]):
            dw.send(Expect(f"s{i}", (10 + i,), p.peer_address, "prefill", 1, traceparent=tp))
            pw.send(Publish(f"s{i}", (1 + i,), traceparent=tp))
            assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
            assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
        pw.detach()
        dw.detach()
    finally:
        for x in (p, d):
            x.client.close()
            assert x.stop() == 0, x.logs()[-3000:]
    spans = receiver.snapshot()
    assert {s.trace_id for s in spans} == {traced}
    assert {s.resource["kvpushd.node_id"] for s in spans} == {"pnode", "dnode"}
    assert {s.attributes["kvpushd.transfer_id"] for s in spans} == {"s2"}


def test_tracing_off_imports_no_opentelemetry() -> None:
    """Without [tracing] the daemon's whole composition root loads and opentelemetry is never imported."""
    code = ("import sys, kvpushd.app, kvpushd.config as c; from kvpushd.telemetry import make_tracing; "
            "t = make_tracing(c.load(None).tracing, 'n'); "
            "print(t.enabled, sorted(m for m in sys.modules if m.startswith('opentelemetry')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "[]"], out.stdout
