"""Client types <-> protobuf messages."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .proto.v1 import common_pb2, worker_pb2
from .types import (
    Attach,
    Completion,
    CompletionKind,
    CudaMemory,
    FailureCode,
    MemfdMemory,
    TransferFigures,
)
from .vmm import VmmMemory

# A local daemon that restarts is back within a second: reconnect quickly instead of gRPC's
# default exponential backoff (which reaches tens of seconds).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def attach_request(a: Attach, tokens: Mapping[int, bytes] | None = None,
                   chunk_tokens: Mapping[int, Sequence[bytes]] | None = None) -> worker_pb2.AttachRequest:
    """``tokens``: what each MemfdMemory's descriptor was sent under (handover.hand_over), by index;
    ``chunk_tokens``: each VmmMemory's chunks' (handover.hand_over_chunks)."""
    mem = []
    for i, m in enumerate(a.memory):
        if isinstance(m, VmmMemory):
            got = (chunk_tokens or {}).get(i)
            if got is None or len(got) != len(m.chunks):
                raise ValueError(f"memory {i} is VMM memory whose chunks were not handed over "
                                 "(handover.hand_over_chunks)")
            sentinel, sentinel_offset, restore = m.arm_sentinel() if m.arm_sentinel is not None else (b"", 0, b"")
            mem.append(common_pb2.MemoryHandle(vmm=common_pb2.VmmHandle(
                gpu_uuid=m.gpu_uuid, reserved=m.reserved, granularity=m.granularity,
                chunks=[common_pb2.VmmChunk(token=t, offset=c.offset, size=c.size) for t, c in zip(got, m.chunks,
                                                                                                strict=True)],
                sentinel=sentinel, sentinel_offset=sentinel_offset, sentinel_restore=restore)))
        elif isinstance(m, MemfdMemory):
            if tokens is None or i not in tokens:
                raise ValueError(f"memory {i} is a memfd that was not handed over (handover.hand_over)")
            mem.append(common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=tokens[i], size=m.size)))
        elif isinstance(m, CudaMemory):
            sentinel, sentinel_offset, restore = (m.arm_sentinel() if m.arm_sentinel is not None
                                                  else (m.sentinel, m.sentinel_offset, m.sentinel_restore))
            mem.append(common_pb2.MemoryHandle(cuda_ipc=common_pb2.CudaIpcHandle(
                gpu_uuid=m.gpu_uuid, ipc_handle=m.ipc_handle, size=m.size, storage_offset=m.storage_offset,
                ref_counter_handle=m.ref_counter_handle, ref_counter_offset=m.ref_counter_offset,
                event_handle=m.event_handle, event_sync_required=m.event_sync_required,
                sentinel=sentinel, sentinel_offset=sentinel_offset, sentinel_restore=restore)))
        else:
            raise TypeError(f"memory must be MemfdMemory, CudaMemory or VmmMemory, got {type(m).__name__}")
    regs = [common_pb2.Region(memory_index=r.memory_index, offset=r.offset, num_blocks=r.num_blocks,
                              block_len=r.block_len, block_stride=r.block_stride or r.block_len,
                              block_size_tokens=r.block_size_tokens,
                              layout=common_pb2.KVLayout.ValueType(int(r.layout)), num_heads=r.num_heads,
                              replicated=r.replicated)
            for r in a.regions]
    return worker_pb2.AttachRequest(engine_id=a.engine_id, role=common_pb2.Role.ValueType(int(a.role)),
                                    tp_rank=a.tp_rank, tp_size=a.tp_size, pp_rank=a.pp_rank, memory=mem,
                                    regions=regs, description=a.description,
                                    extends_worker_id=a.extends_worker_id,
                                    extends_worker_token=a.extends_worker_token)


# A queued command the daemon refused (client side only, see StreamWorker.send_nowait).
REFUSED = FailureCode.REFUSED.name


_KINDS = {int(k): k for k in CompletionKind}
_CODES: dict[int, str] = {}
# The stream's reader thread converts every completion while it holds the GIL, which the engine
# thread may be waiting for (64 of them took 180 us here): the frozen dataclasses are filled through
# their slots, not their __init__ (one object.__setattr__ call per field). Same objects, equal to
# the ones __init__ makes (tests/core/test_client_convert.py).
_C_SET = tuple(getattr(Completion, f).__set__ for f in Completion.__slots__)
_F_SET = tuple(getattr(TransferFigures, f).__set__ for f in TransferFigures.__slots__)
_new = object.__new__


def _code_name(v: int) -> str:
    """A non-zero FailureCode value -> the name completions carry ("TIMEOUT", "REFUSED"; a code this client
    does not know, from a newer daemon, is "UNKNOWN_<value>": its reason says more)."""
    name = _CODES.get(v)
    if name is None:
        try:
            name = FailureCode(v).name
        except ValueError:
            name = f"UNKNOWN_{int(v)}"
        _CODES[v] = name
        if len(_CODES) > 256:  # a daemon sending ever new values cannot grow it without bound
            _CODES.clear()
    return name


def completion(c: worker_pb2.Completion) -> Completion:
    kind = _KINDS.get(c.kind)
    if kind is None:
        kind = CompletionKind(c.kind)  # raises ValueError, as before
    f0, f1, f2, f3, f4, f5, f6 = _F_SET
    f = _new(TransferFigures)
    f0(f, c.bytes)
    f1(f, c.nixl_transfers)
    f2(f, c.descriptors)
    f3(f, c.post_seconds)
    f4(f, c.transfer_seconds)
    f5(f, c.rendezvous_wait_seconds)
    f6(f, c.elapsed_seconds)
    s0, s1, s2, s3, s4, s5, s6 = _C_SET
    out = _new(Completion)
    s0(out, kind)
    s1(out, c.transfer_id)
    s2(out, _code_name(c.code) if c.code else "")
    s3(out, c.reason)
    s4(out, tuple(c.block_ids))
    s5(out, f)
    s6(out, False)
    return out
