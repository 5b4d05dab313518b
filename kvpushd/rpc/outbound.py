"""The protobuf side of the daemon's outbound peer client: what it sends, and what a peer's errors say.

runtime/outbound.py (the client's glue) and runtime/channel.py (its Channel stream) build every
message here, so protobuf stays at the rpc/ boundary whichever way the calls go.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import grpc
from google.protobuf.message import Message
from kvpushd_client.proto.v1 import common_pb2, peer_pb2, peer_pb2_grpc

from .. import PROTOCOL_VERSION
from ..core import notif
from ..core.actions import ReadKey, SendOffer, SendRegister
from ..core.types import FailureCode
from ..runtime.identity import Identity
from ..runtime.workers import Worker

PeerResult = peer_pb2.PeerResult
PeerItem = peer_pb2.PeerItem
Stub = peer_pb2_grpc.PeerServiceStub
heartbeat = peer_pb2.HeartbeatRequest  # a Heartbeat item carries nothing


def error_kind(e: grpc.aio.AioRpcError) -> str:
    """The error class a kvpushd daemon named in its trailing metadata (``kvpushd-error``), or ""."""
    for key, value in e.trailing_metadata() or ():
        if key == "kvpushd-error":
            try:
                return str(json.loads(value).get("kind", ""))
            except (ValueError, AttributeError):
                return ""
    return ""


def handshake(n: Identity) -> peer_pb2.HandshakeRequest:
    return peer_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, compat_hash=notif.compat_hash(),
                                     node_id=n.node_id, peer_address=n.peer_address, instance_id=n.instance_id)


def agent_info(w: Worker, with_metadata: bool) -> peer_pb2.AgentInfo:
    """A worker's NIXL agent as a peer sees it; metadata and region table only the first time."""
    if not with_metadata:
        return peer_pb2.AgentInfo(agent_name=w.agent_name, memory_kind=w.mem_type)
    return peer_pb2.AgentInfo(
        agent_name=w.agent_name, memory_kind=w.mem_type, agent_metadata=w.metadata,
        regions=[peer_pb2.RemoteRegion(base_addr=r.addr, num_blocks=r.num_blocks, block_len=r.block_len,
                                       block_stride=r.block_stride, device_id=r.device_id,
                                       block_size_tokens=r.block_tokens, num_heads=r.num_heads,
                                       layout=common_pb2.KVLayout.ValueType(r.layout), replicated=r.replicated)
                 for r in w.regions])


def register(a: SendRegister, w: Worker, with_metadata: bool, traceparent: str = "") -> peer_pb2.RegisterRequest:
    return peer_pb2.RegisterRequest(
        transfer_id=a.transfer_id, registration_id=a.registration_id,
        producer_engine_id=a.producer_engine_id, producer_tp_size=a.producer_tp_size,
        consumer_engine_id=w.engine_id, consumer_tp_rank=a.consumer_rank, consumer_tp_size=a.consumer_tp_size,
        consumer_agent=agent_info(w, with_metadata=with_metadata), block_ids=a.block_ids,
        transfer_mode=common_pb2.TransferMode.ValueType(int(a.mode)), skip_tokens=a.skip_tokens,
        traceparent=traceparent)


def offer(a: SendOffer, w: Worker, with_metadata: bool) -> peer_pb2.OfferRequest:
    return peer_pb2.OfferRequest(
        transfer_id=a.leg.transfer_id, registration_id=a.registration.registration_id,
        producer_rank=a.producer_rank, producer_tp_size=a.producer_tp_size,
        producer_agent=agent_info(w, with_metadata=with_metadata), block_ids=a.src_blocks)


def read_failed(key: ReadKey, reason: str) -> peer_pb2.ReadFailedNotice:
    return peer_pb2.ReadFailedNotice(transfer_id=key.transfer_id, registration_id=key.registration_id,
                                     producer_rank=key.producer_rank, reason=reason[:2000])


def notice(transfer_id: str, registration_id: int, code: FailureCode, reason: str) -> peer_pb2.FailNotice:
    """A Fail or Withdraw notice."""
    return peer_pb2.FailNotice(transfer_id=transfer_id, registration_id=registration_id,
                               code=common_pb2.FailureCode.ValueType(int(code)), reason=reason[:2000])


def decline(transfer_id: str, producer_engine_id: str, consumer_engine_id: str, reason: str) -> peer_pb2.DeclineNotice:
    return peer_pb2.DeclineNotice(transfer_id=transfer_id, producer_engine_id=producer_engine_id,
                                  consumer_engine_id=consumer_engine_id, reason=reason[:2000])


def item(seq: int, kind: str, msg: Message) -> peer_pb2.PeerItem:
    """One item of a PeerBatch (``kind``: its PeerItem field)."""
    it = peer_pb2.PeerItem(seq=seq)
    getattr(it, kind).CopyFrom(msg)
    return it


def batch(items: Sequence[peer_pb2.PeerItem]) -> peer_pb2.PeerBatch:
    return peer_pb2.PeerBatch(items=items)
