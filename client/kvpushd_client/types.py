"""Plain types of the client API (no protobuf in the caller's hands)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import DaemonUnavailable, KVPushError

__all__ = ["DaemonUnavailable", "KVPushError"]  # kept here for older imports


class Role(enum.IntEnum):
    PRODUCER = 1  # prefill
    CONSUMER = 2  # decode
    BOTH = 3


class KVLayout(enum.IntEnum):
    """Order of a block's dimensions: HND [heads, tokens, head dim] (vLLM's) or NHD [tokens, heads, head dim]."""

    HND = 1
    NHD = 2


class CompletionKind(enum.IntEnum):
    FINISHED_SENDING = 1
    FINISHED_RECEIVING = 2
    FAILED = 3


@dataclass(frozen=True, slots=True)
class ShmMemory:
    """A POSIX shared memory object (/dev/shm/<name>) holding KV blocks."""

    name: str
    size: int


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


Memory = ShmMemory | CudaMemory


@dataclass(frozen=True, slots=True)
class Region:
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
