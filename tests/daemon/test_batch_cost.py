"""A batch message of legal size holding millions of empty items (a CommandBatch from a worker, a
PeerBatch from an admitted peer) costs the daemon a bounded amount: it is refused RESOURCE_EXHAUSTED
without being parsed, GetStatus keeps answering within 100 ms, RSS stays within +150 MiB, and a
transfer beside it moves exact bytes. Real daemons, real NIXL."""

from __future__ import annotations

import time
import uuid

import grpc
import pytest
from kvpushd_client import Attach, Role, _convert
from kvpushd_client.handover import hand_over
from kvpushd_client.proto.v1 import peer_pb2, peer_pb2_grpc, worker_pb2
from support import make_kv, rss
from support.bystander import RSS_BOUND, StatusProbe, transfer

from kvpushd import PROTOCOL_VERSION
from kvpushd.core.notif import compat_hash
from kvpushd.rpc.pump import packed
from kvpushd.rpc.services import MAX_BATCH, Oversized, bounded, count_items

EMPTY_ITEMS = 4_190_000  # 2 bytes each: just under the 8 MiB message limit


@pytest.mark.parametrize("stream", ["worker", "peer"])
def test_a_batch_of_millions_of_empty_items_costs_little(daemon_pair, kv_pair, stream: str) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
    transfer(p, pw, dw, src, dst, "warm", 1, 2)
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
    with StatusProbe(p) as probe:
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as ei:
            call()
        took = time.perf_counter() - t0
        peak = max(probe.peak, rss(p.pid))
        transfer(p, pw, dw, src, dst, "beside", 3, 4)
    after = rss(p.pid)
    print(f"{stream}: refused in {took * 1e3:.0f} ms; GetStatus worst {probe.worst * 1e3:.1f} ms; "
          f"RSS base {base >> 20} MiB, peak +{(peak - base) >> 20}, after +{(after - base) >> 20}")
    assert ei.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, ei.value
    assert f"more than {MAX_BATCH} items" in (ei.value.details() or "")
    assert probe.worst < 0.1 + 0.4, probe.worst  # 100 ms, with room for a loaded test machine
    assert peak - base < RSS_BOUND and after - base < RSS_BOUND


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
