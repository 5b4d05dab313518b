"""A batch message of legal size holding millions of empty items (a CommandBatch from a worker, a
PeerBatch from an admitted peer) costs the daemon a bounded amount: it is refused RESOURCE_EXHAUSTED
without being parsed, GetStatus keeps answering within 100 ms, RSS stays within +150 MiB, and a
transfer beside it moves exact bytes. Real daemons, real NIXL."""

from __future__ import annotations

import threading
import time
import uuid

import grpc
import pytest
from kvpushd_client import Attach, Role, _convert
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc, status_pb2, worker_pb2
from kvpushd_client.shm import hand_over
from support import make_kv, rss

from kvpushd import PROTOCOL_VERSION
from kvpushd.core.notif import compat_hash
from kvpushd.rpc.pump import packed
from kvpushd.rpc.services import MAX_BATCH, Oversized, bounded, count_items

EMPTY_ITEMS = 4_190_000  # 2 bytes each: just under the 8 MiB message limit
RSS_SLACK = 150 << 20


class StatusProbe:
    """GetStatus every 20 ms in a thread while it runs; the slowest answer."""

    def __init__(self, client) -> None:  # type: ignore[no-untyped-def]
        self.client, self.worst, self._stop = client, 0.0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            self.client.status_stub.GetStatus(status_pb2.GetStatusRequest(), timeout=10)
            self.worst = max(self.worst, time.perf_counter() - t0)
            time.sleep(0.02)

    def __enter__(self) -> StatusProbe:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(15)


def _transfer(p, d, pw, dw, src, dst, tid: str, a: int, b: int) -> None:  # type: ignore[no-untyped-def]
    dw.expect(tid, [a], p.peer_address, "prefill", 1)
    pw.publish(tid, [b])
    assert dw.next_completion(30).kind.name == "FINISHED_RECEIVING"
    assert pw.next_completion(30).kind.name == "FINISHED_SENDING"
    assert (dst.arr[:, a] == src.arr[:, b]).all()


@pytest.mark.parametrize("stream", ["worker", "peer"])
def test_a_batch_of_millions_of_empty_items_costs_little(daemon_pair, kv_pair, stream: str) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    _transfer(p, d, pw, dw, src, dst, "warm", 1, 2)
    base = rss(p.pid)
    if stream == "worker":
        kv = make_kv("kvp-cost", regions=2, num_blocks=8)
        tokens = hand_over(p.sock, [kv.buf.memory], 10)
        ans = p.client.stub.Attach(_convert.attach_request(
            Attach("junk", Role.PRODUCER, 0, 1, [kv.buf.memory], kv.region_list), tokens), timeout=10)
        head = worker_pb2.CommandBatch(worker_id=ans.worker_id, worker_token=ans.worker_token).SerializeToString()
        junk = head + b"\x12\x00" * EMPTY_ITEMS  # field 2 (commands), empty

        raw_worker = p.client.channel.stream_stream("/kvpushd.v1.WorkerService/Stream")

        def call() -> list:  # type: ignore[type-arg]
            return list(raw_worker(iter([junk]), timeout=30))
    else:
        channel = grpc.insecure_channel(p.peer_address)
        stub = peer_pb2_grpc.PeerServiceStub(channel)
        instance = uuid.uuid4().hex
        token = stub.Handshake(peer_pb2.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION, compat_hash=compat_hash(), node_id="junk",
            peer_address="127.0.0.1:1", instance_id=instance), timeout=10).session_token
        junk = b"\x0a\x00" * EMPTY_ITEMS  # field 1 (items), empty
        raw = channel.stream_stream("/kvpushd.v1.PeerService/Channel")

        def call() -> list:  # type: ignore[type-arg]
            return list(raw(iter([junk]), timeout=30, metadata=(("kvpushd-session", token),
                                                                  ("kvpushd-instance", instance))))
    assert len(junk) < 8 << 20
    peak = base
    with StatusProbe(p.client) as probe:
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as ei:
            call()
        took = time.perf_counter() - t0
        peak = max(peak, rss(p.pid))
        _transfer(p, d, pw, dw, src, dst, "beside", 3, 4)
    after = rss(p.pid)
    print(f"{stream}: refused in {took * 1e3:.0f} ms; GetStatus worst {probe.worst * 1e3:.1f} ms; "
          f"RSS base {base >> 20} MiB, peak +{(peak - base) >> 20}, after +{(after - base) >> 20}")
    assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    assert f"more than {MAX_BATCH} items" in (ei.value.details() or "")
    assert probe.worst < 0.1 + 0.4, probe.worst  # 100 ms, with room for a loaded test machine
    assert peak - base < RSS_SLACK and after - base < RSS_SLACK


def test_counting_stops_past_the_cap() -> None:
    """The walk counts top-level items and stops at cap + 1; short or legal batches are parsed."""
    legal = worker_pb2.CommandBatch(worker_id="w", commands=[
        worker_pb2.Command(seq=i, publish=worker_pb2.PublishRequest(transfer_id=f"t{i}", block_ids=[i]))
        for i in range(MAX_BATCH)]).SerializeToString()
    assert count_items(legal, 2, MAX_BATCH) == MAX_BATCH
    parse = bounded(worker_pb2.CommandBatch)
    assert len(parse(legal).commands) == MAX_BATCH  # type: ignore[union-attr]
    over = legal + worker_pb2.CommandBatch(commands=[worker_pb2.Command(seq=1)]).SerializeToString()
    assert isinstance(parse(over), Oversized)
    assert count_items(b"\x12\x00" * 10_000_000, 2, 7) == 8
    assert bounded(worker_pb2.DetachRequest) == worker_pb2.DetachRequest.FromString


def test_answers_go_out_in_messages_the_other_side_accepts() -> None:
    results = [worker_pb2.CommandResult(seq=i, code="INVALID_ARGUMENT", message="x" * 1000) for i in range(10_000)]
    out = packed(worker_pb2.EventBatch, [("results", results)])
    assert len(out) > 2 and all(b.ByteSize() <= 4 << 20 for b in out)
    assert [r.seq for b in out for r in b.results] == list(range(10_000))
