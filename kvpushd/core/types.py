"""Plain types shared by the core and the runtime. The enums and the figures record are the client
library's (kvpushd_client.types: one definition, the wire's values); the rest are the daemon's own."""

from __future__ import annotations

from dataclasses import dataclass

from kvpushd_client.types import CompletionKind, FailureCode, Role, TransferMode
from kvpushd_client.types import TransferFigures as Figures

__all__ = ["Completion", "CompletionKind", "FailureCode", "Figures", "RegionLayout", "Role", "TransferMode"]


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
