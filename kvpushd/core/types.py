"""Plain types shared by the core and the runtime."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class FailureCode(enum.IntEnum):
    """Mirrors kvpushd.v1.FailureCode; the rpc layer converts by value."""

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
    """Mirrors kvpushd.v1.TransferMode: who moves the bytes (UNSPECIFIED means PUSH)."""

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
                raise ValueError(f"transfer mode {v!r}: 'push' or 'pull'") from None
        m = cls(v)
        return cls.PUSH if m is cls.UNSPECIFIED else m


class Role(enum.IntEnum):
    """Mirrors kvpushd.v1.Role."""

    UNSPECIFIED = 0
    PRODUCER = 1
    CONSUMER = 2
    BOTH = 3

    @property
    def can_send(self) -> bool:
        return self in (Role.PRODUCER, Role.BOTH)

    @property
    def can_receive(self) -> bool:
        return self in (Role.CONSUMER, Role.BOTH)


@dataclass(frozen=True, slots=True)
class RegionLayout:
    """Where the blocks of one region live, relative to the region's block 0."""

    num_blocks: int
    block_len: int
    block_stride: int
    block_tokens: int = 0    # tokens per block; 0: not said (blocks map one to one with the peer's)
    num_heads: int = 0       # KV heads in one block of this rank; 0: not said
    kv_layout: int = 0       # core.layout.HND (or 0) or NHD
    replicated: bool = False  # MLA: one latent per token, the same on every TP rank

    def span(self) -> int:
        """Bytes from block 0's start to the last block's end."""
        if self.num_blocks == 0:
            return 0
        return (self.num_blocks - 1) * self.block_stride + self.block_len


class CompletionKind(enum.IntEnum):
    """Mirrors kvpushd.v1.Completion.Kind."""

    FINISHED_SENDING = 1
    FINISHED_RECEIVING = 2
    FAILED = 3


@dataclass(frozen=True, slots=True)
class Figures:
    """What the daemon measured of one worker's transfer (0: not known on this side)."""

    nbytes: int = 0
    nixl_transfers: int = 0   # WRITEs or READs this daemon posted for it
    descriptors: int = 0      # posted, after merging
    post_s: float = 0.0       # summed over its NIXL transfers
    transfer_s: float = 0.0   # the longest of its NIXL transfers, posted -> done
    rendezvous_wait_s: float = 0.0  # prefill side: first of publish/registration -> the second
    elapsed_s: float = 0.0    # Publish/Expect -> completion


@dataclass(frozen=True, slots=True)
class Completion:
    """What a worker learns about one of its transfers: exactly one per Expect or Publish."""

    kind: CompletionKind
    transfer_id: str
    code: FailureCode = FailureCode.UNSPECIFIED
    reason: str = ""
    block_ids: tuple[int, ...] = ()
    figures: Figures | None = None  # filled in by the runtime when it delivers (the core leaves it None)
