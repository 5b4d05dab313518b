"""protobuf <-> core values."""

from __future__ import annotations

from kvpushd_client.proto.v1 import common_pb2, peer_pb2, worker_pb2
from kvpushd_client.types import Abort, CudaMemory, Decline, Expect, Publish

from ..core.errors import InvalidArgument, PermissionDenied
from ..core.types import Completion, FailureCode, RegionLayout, Role, TransferMode
from ..memory import MemfdSpec, MemorySpec
from ..memory.fdpass import TOKEN_BYTES
from ..memory.vmm import ChunkSpec, VmmSpec
from ..runtime.peerops import Declined, Notice, Offer, ReadFailed, Register
from ..runtime.workers import Attach, RegionArg
from ..transfer.descs import RegionSpec, RemoteAgent


def role(v: int) -> Role:
    try:
        return Role(v)
    except ValueError:
        raise InvalidArgument(f"unknown role {v}") from None


def transfer_mode(v: int) -> TransferMode:
    try:
        return TransferMode.parse(v)
    except ValueError:
        raise InvalidArgument(f"unknown transfer mode {v}") from None


def failure_code(v: int) -> FailureCode:
    try:
        return FailureCode(v)
    except ValueError:
        return FailureCode.UNSPECIFIED


def expect(r: worker_pb2.ExpectRequest) -> Expect:
    return Expect(r.transfer_id, tuple(r.block_ids), r.producer_address, r.producer_engine_id, r.producer_tp_size,
                  r.skip_tokens, transfer_mode(r.transfer_mode), r.traceparent[:128])


def publish(r: worker_pb2.PublishRequest) -> Publish:
    return Publish(r.transfer_id, tuple(r.block_ids), r.traceparent[:128], r.consumer_node_id, r.consumer_tls_name,
                   r.step, r.layers, r.ready_blocks)


def abort(r: worker_pb2.AbortRequest) -> Abort:
    return Abort(r.transfer_id)


def decline(r: worker_pb2.DeclineRequest) -> Decline:
    return Decline(r.transfer_id, r.producer_address, r.producer_engine_id, r.reason)


def notice(n: peer_pb2.FailNotice) -> Notice:
    """A Fail or Withdraw item."""
    return Notice(n.transfer_id, n.registration_id, failure_code(n.code), n.reason[:2000])


def register(r: peer_pb2.RegisterRequest) -> Register:
    return Register(r.transfer_id, r.registration_id, r.producer_engine_id, r.producer_tp_size, r.consumer_engine_id,
                    r.consumer_tp_rank, r.consumer_tp_size, remote_agent(r.consumer_agent), tuple(r.block_ids),
                    transfer_mode(r.transfer_mode), r.skip_tokens, r.traceparent)


def offer(r: peer_pb2.OfferRequest) -> Offer:
    return Offer(r.transfer_id, r.registration_id, r.producer_rank, remote_agent(r.producer_agent),
                 tuple(r.block_ids))


def read_failed(r: peer_pb2.ReadFailedNotice) -> ReadFailed:
    return ReadFailed(r.registration_id, r.producer_rank, r.reason)


def declined(r: peer_pb2.DeclineNotice) -> Declined:
    return Declined(r.transfer_id, r.producer_engine_id, r.consumer_engine_id, r.reason)


def token(t: bytes, optional: bool = True) -> bytes:
    """A memfd token (``optional``: empty means none)."""
    if (t or not optional) and len(t) != TOKEN_BYTES:
        raise InvalidArgument(f"a memfd token is {TOKEN_BYTES} bytes, got {len(t)}")
    return t


def memory(h: common_pb2.MemoryHandle) -> MemorySpec:
    kind = h.WhichOneof("kind")
    if kind == "shm":
        raise PermissionDenied("host KV by /dev/shm name is refused: a worker could truncate it under a WRITE; "
                               "hand a sealed memfd (kvpushd_client.SealedBuffer)")
    if kind == "cuda_ipc":
        c = h.cuda_ipc
        return CudaMemory(c.gpu_uuid, c.ipc_handle, c.size, c.storage_offset, c.ref_counter_handle,
                          c.ref_counter_offset, c.event_handle, c.event_sync_required, c.sentinel,
                          c.sentinel_offset, c.sentinel_restore)
    if kind == "memfd":
        return MemfdSpec(token(h.memfd.token, optional=False), h.memfd.size)
    if kind == "vmm":
        v = h.vmm
        return VmmSpec(v.gpu_uuid, v.reserved, v.granularity, tuple(ChunkSpec(c.offset, c.size) for c in v.chunks),
                       tuple(token(c.token, optional=False) for c in v.chunks), v.sentinel, v.sentinel_offset,
                       v.sentinel_restore)
    raise InvalidArgument("memory handle has none of shm, cuda_ipc, memfd and vmm set")


def region(r: common_pb2.Region) -> RegionArg:
    return RegionArg(r.memory_index, r.offset, RegionLayout(r.num_blocks, r.block_len, r.block_stride,
                                                            r.block_size_tokens, r.num_heads, r.layout, r.replicated))


def attach(r: worker_pb2.AttachRequest) -> Attach:
    return Attach(r.engine_id, role(r.role), r.tp_rank, r.tp_size, r.pp_rank, tuple(memory(m) for m in r.memory),
                  tuple(region(x) for x in r.regions), r.description, r.doorbell[:256], token(r.doorbell_token),
                  r.extends_worker_id[:256], r.extends_worker_token)


def completion(c: Completion) -> worker_pb2.Completion:
    m = worker_pb2.Completion(kind=worker_pb2.Completion.Kind.ValueType(int(c.kind)), transfer_id=c.transfer_id,
                              code=common_pb2.FailureCode.ValueType(int(c.code)), reason=c.reason,
                              block_ids=c.block_ids)
    f = c.figures
    if f is not None:
        m.bytes, m.nixl_transfers, m.descriptors = f.nbytes, f.nixl_transfers, f.descriptors
        m.post_seconds, m.transfer_seconds = f.post_s, f.transfer_s
        m.rendezvous_wait_seconds, m.elapsed_seconds = f.rendezvous_wait_s, f.elapsed_s
    return m


def remote_agent(a: peer_pb2.AgentInfo) -> RemoteAgent:
    if not a.agent_name:
        raise InvalidArgument("consumer_agent.agent_name must not be empty")
    return RemoteAgent(a.agent_name, a.agent_metadata, a.memory_kind,
                       tuple(RegionSpec(r.base_addr, r.num_blocks, r.block_len, r.block_stride, r.device_id,
                                        r.block_size_tokens, r.num_heads, r.layout, r.replicated)
                             for r in a.regions))
