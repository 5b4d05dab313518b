"""Plain types shared by the core and the runtime. The enums, the figures record and the worker's
command records are the client library's (kvpushd_client.types: one definition, the wire's values);
the rest are the daemon's own."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpushd_client.types import CompletionKind, Expect, FailureCode, Publish, Role, TransferMode
from kvpushd_client.types import TransferFigures as Figures

if TYPE_CHECKING:
    from .layout import Shape

__all__ = ["Completion", "CompletionKind", "Expect", "FailureCode", "Figures", "Publish", "RegionLayout", "Role",
           "TransferMode", "WorkerInfo"]


class WorkerInfo(Protocol):
    """The worker a command came from, as the rendezvous needs it (the runtime's attached Worker is one)."""

    @property
    def worker_id(self) -> str: ...
    @property
    def engine_id(self) -> str: ...
    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def regions(self) -> tuple[Shape, ...]: ...  # its KV regions, if known (block sizes, layout, replication)
    @property
    def block_bytes(self) -> int: ...  # bytes of one block over all its regions (0: not known)


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


@dataclass(frozen=True, slots=True)
class Completion:
    """What a worker learns about one of its transfers: exactly one per Expect or Publish."""

    kind: CompletionKind
    transfer_id: str
    code: FailureCode = FailureCode.UNSPECIFIED
    reason: str = ""
    block_ids: tuple[int, ...] = ()
    figures: Figures | None = None  # filled in by the runtime when it delivers (the core leaves it None)
