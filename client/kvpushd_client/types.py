"""Plain types of the client API (no protobuf in the caller's hands), and the records and enums the
daemon shares (kvpushd/core/types.py imports them from here): each enum has the values of its
kvpushd.v1 namesake (tests/core/test_enums.py). Imports neither grpc nor protobuf."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from .errors import DaemonUnavailable, KVPushError

if TYPE_CHECKING:
    from .vmm import VmmMemory

__all__ = ["DaemonUnavailable", "KVPushError"]  # kept here for older imports


class Role(enum.IntEnum):
    UNSPECIFIED = 0  # on the wire only: a worker that attaches says which it is
    PRODUCER = 1  # prefill
    CONSUMER = 2  # decode
    BOTH = 3

    @property
    def can_send(self) -> bool:
        return self in (Role.PRODUCER, Role.BOTH)

    @property
    def can_receive(self) -> bool:
        return self in (Role.CONSUMER, Role.BOTH)


class FailureCode(enum.IntEnum):
    """Why a transfer failed; a FAILED completion's ``code`` is the name ("TIMEOUT")."""

    UNSPECIFIED = 0
    TIMEOUT = 1
    ABORTED = 2
    PEER_UNREACHABLE = 3
    PEER_REJECTED = 4
    TRANSFER_ERROR = 5
    LAYOUT_MISMATCH = 6
    WORKER_GONE = 7
    SUPERSEDED = 8
    SHUTDOWN = 9
    REFUSED = 10  # client side only: a queued call the daemon refused


class TransferMode(enum.IntEnum):
    """Who moves the bytes (UNSPECIFIED means PUSH)."""

    UNSPECIFIED = 0
    PUSH = 1  # the prefill node's daemon WRITEs into the decode worker's blocks
    PULL = 2  # the decode node's daemon READs from the prefill worker's blocks

    @classmethod
    def parse(cls, v: int | str) -> TransferMode:
        """From the wire (0 -> PUSH) or from vLLM's kv_transfer_params ("push"/"pull")."""
        if isinstance(v, str):
            try:
                return {"push": cls.PUSH, "pull": cls.PULL}[v.lower()]
            except KeyError:
                raise ValueError(f"transfer_mode {v!r}: 'push' or 'pull'") from None
        m = cls(v)
        return cls.PUSH if m is cls.UNSPECIFIED else m


class KVLayout(enum.IntEnum):
    """Order of a block's dimensions: HND [heads, tokens, head dim] (vLLM's) or NHD [tokens, heads, head dim]."""

    HND = 1
    NHD = 2


class CompletionKind(enum.IntEnum):
    FINISHED_SENDING = 1
    FINISHED_RECEIVING = 2
    FAILED = 3


# -- the commands a worker sends on its stream: one record each, from the caller that makes it to the
# daemon's core (the client builds it, its stream queues it as it is, the daemon's rpc/convert.py
# makes the same record from the wire). Frozen msgspec Structs (one is built per command: a tenth of a
# frozen dataclass's cost); gc=False: they hold strings, numbers, enums and tuples of them, no cycle.


class Expect(msgspec.Struct, frozen=True, gc=False):
    """Decode side: destination blocks, as soon as they are allocated. ``transfer_mode``: PUSH (the
    prefill node's daemon WRITEs) or PULL (this node's daemon READs once the prefill side published);
    vLLM's kv_transfer_params["transfer_mode"] is a string: ``TransferMode.parse`` it."""

    transfer_id: str
    block_ids: tuple[int, ...]
    producer_address: str
    producer_engine_id: str
    producer_tp_size: int = 1
    skip_tokens: int = 0  # the prompt's first tokens the worker holds already (whole blocks); block_ids start there
    transfer_mode: TransferMode = TransferMode.PUSH
    traceparent: str = ""  # the engine request's W3C trace context


class Publish(msgspec.Struct, frozen=True, gc=False):
    """Prefill side: the source blocks are complete, or (``step``, ``layers``: progressive push) will
    be as the doorbell's step ``step`` goes; ``ready_blocks``: the first that many are complete now.
    ``consumer_*``: the only decode daemon whose registration is accepted (both "": the first)."""

    transfer_id: str
    block_ids: tuple[int, ...]
    traceparent: str = ""
    consumer_node_id: str = ""
    consumer_tls_name: str = ""
    step: int = 0
    layers: int = 0
    ready_blocks: int = 0


class Abort(msgspec.Struct, frozen=True, gc=False):
    """Withdraw a transfer of this worker; best effort (its answer says whether it was pending)."""

    transfer_id: str


class Decline(msgspec.Struct, frozen=True, gc=False):
    """Decode side: this transfer will never be expected here (its Expect failed before it reached the
    daemon); the prefill daemon frees the transfer's source blocks at once. Best effort, like Abort."""

    transfer_id: str
    producer_address: str
    producer_engine_id: str
    reason: str = ""


Command = Expect | Publish | Abort | Decline


# -- what a worker attaches with. Region and Attach are Structs like the commands; the memory records
# stay dataclasses: CudaMemory's ``arm_sentinel`` is left out of equality (``compare=False``, which a
# Struct field cannot say), and they are copied with dataclasses.replace like vmm.py's VmmMemory.


@dataclass(frozen=True, slots=True)
class CudaMemory:
    """A CUDA allocation shared by IPC handle; see kvpushd_client.memory.cuda_memory()."""

    gpu_uuid: str
    ipc_handle: bytes
    size: int
    storage_offset: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False
    # What the daemon reads through its mapping before it registers the memory: ``sentinel`` at
    # ``sentinel_offset``, then it writes ``sentinel_restore`` (the bytes that were there) back.
    sentinel: bytes = b""
    sentinel_offset: int = 0
    sentinel_restore: bytes = b""
    # Called for every attach request (reconnects too): writes a fresh sentinel, returns the three above.
    arm_sentinel: Callable[[], tuple[bytes, int, bytes]] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, slots=True)
class MemfdMemory:
    """Host memory in a memfd sealed against shrinking (``kvpushd_client.shm.SealedBuffer``): the client
    hands the descriptor itself to the daemon at every attach, so no name, and no process can truncate
    it under a WRITE. The caller keeps ``fd`` open for as long as it may attach."""

    fd: int
    size: int


Memory = CudaMemory | MemfdMemory


class Region(msgspec.Struct, frozen=True, gc=False):
    """One KV region (e.g. layer 3's K cache): block b at offset + b * block_stride."""

    memory_index: int
    offset: int
    num_blocks: int
    block_len: int
    block_stride: int = 0  # 0: same as block_len (blocks packed back to back)
    # Tokens per block (0: not said; then the peer's blocks must map one to one). Prefill and
    # decode may use different block sizes once both say theirs.
    block_size_tokens: int = 0
    layout: KVLayout = KVLayout.HND
    num_heads: int = 0     # KV heads of this rank in one block (0: not said; needed for HND across block sizes)
    replicated: bool = False  # MLA: one latent per token, the same on every TP rank


class Attach(msgspec.Struct, frozen=True):
    """What a worker hands its daemon once: KVPushClient.attach makes it, _convert.attach_request
    turns it into the AttachRequest. A growth Attach (KVPushClient.extend) names the live worker
    whose VMM memory it adds chunks to by ``extends_worker_id`` and its token; its ``memory`` holds
    only the new chunks."""

    engine_id: str
    role: Role
    tp_rank: int
    tp_size: int
    memory: tuple[Memory | VmmMemory, ...]
    regions: tuple[Region, ...]
    pp_rank: int = 0
    description: str = ""
    extends_worker_id: str = ""
    extends_worker_token: bytes = b""


# -- what the daemon answers: dataclasses, filled field by field through their slots on the client's
# stream thread (_convert.py) and completed with dataclasses.replace in the daemon (runtime/figures.py).


@dataclass(frozen=True, slots=True)
class TransferFigures:
    """What the daemon measured of the transfer (0: not known on this side). The daemon that posted
    the NIXL transfers (prefill in push mode, decode in pull mode) knows ``nixl_transfers``,
    ``descriptors``, ``post_s`` and ``transfer_s``; the prefill daemon ``rendezvous_wait_s``."""

    nbytes: int = 0
    nixl_transfers: int = 0   # WRITEs or READs that daemon posted for this worker (one per TP pair)
    descriptors: int = 0      # posted (after merging adjacent blocks), summed
    post_s: float = 0.0       # queued -> posted, summed over its NIXL transfers
    transfer_s: float = 0.0   # posted -> done, the longest of them
    rendezvous_wait_s: float = 0.0  # prefill: first of publish/registration -> the second
    elapsed_s: float = 0.0    # this worker's Publish/Expect -> this completion, in the daemon


@dataclass(frozen=True, slots=True)
class Completion:
    kind: CompletionKind
    transfer_id: str
    code: str = ""        # FailureCode name without prefix, e.g. "TIMEOUT", for FAILED
    reason: str = ""
    block_ids: tuple[int, ...] = ()
    figures: TransferFigures | None = None  # from the daemon (None: a completion the client made up)
    # REFUSED by the client, not the daemon: the session ended before the daemon answered the
    # command (it may never have arrived), so the daemon was unreachable for it
    unanswered: bool = False

    @property
    def ok(self) -> bool:
        return self.kind is not CompletionKind.FAILED
