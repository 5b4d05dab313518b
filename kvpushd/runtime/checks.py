"""What a worker's or a peer's request must satisfy before the core sees it: plain values only
(transfer ids, block lists, region geometry); the checks that need a live worker are in workers.py."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..core.errors import InvalidArgument
from ..core.types import RegionLayout


def check_transfer_id(transfer_id: str) -> None:
    if not transfer_id:
        raise InvalidArgument("transfer_id must not be empty")
    if len(transfer_id) > 256:
        raise InvalidArgument(f"transfer_id is {len(transfer_id)} characters long; at most 256")


SMALL_BLOCK_LIST = 128  # ids up to which check_block_ids walks the list in Python


def check_block_ids(block_ids: Sequence[int], num_blocks: int, max_blocks: int, whose: str) -> None:
    """One block list, from a worker or a peer: non-empty, bounded, in range, no duplicates."""
    n = len(block_ids)
    if not n:
        raise InvalidArgument("block_ids must not be empty")
    if n > max_blocks:
        raise InvalidArgument(f"{n} block ids; at most {max_blocks}")
    a: np.ndarray | None = None
    if n <= SMALL_BLOCK_LIST:  # plain Python: numpy's fixed cost (~30 us a list) is most of the check here
        lo, hi = min(block_ids), max(block_ids)
    else:
        # numpy: a protobuf repeated field becomes an array in ~1 ms per million ids, where each pass of
        # Python over it costs ~80 ms (a Register of 1 Mi ids held the loop 250 ms); 6x cheaper at 1,000 too
        a = np.asarray(block_ids, dtype=np.int64)
        lo, hi = int(a.min()), int(a.max())
    if hi >= num_blocks or lo < 0:
        raise InvalidArgument(f"block id {hi if hi >= num_blocks else lo} out of range: {whose} have "
                              f"{num_blocks} blocks")
    if a is None:
        unique = len(set(block_ids))
    elif hi - lo < 8 * n + 4096:  # a bitmap of the span (bounded by the list's own length)
        seen = np.zeros(hi - lo + 1, dtype=np.bool_)
        seen[a - lo] = True
        unique = int(np.count_nonzero(seen))
    else:
        s = np.sort(a)
        unique = n - int(np.count_nonzero(s[1:] == s[:-1]))
    if unique != n:
        raise InvalidArgument("block_ids contain duplicates")


def check_geometry(layouts: Sequence[RegionLayout]) -> None:
    """Block size in tokens, head count and layout of each region: bounded and consistent."""
    for i, lay in enumerate(layouts):
        if lay.block_tokens > 1 << 20 or lay.num_heads > 1 << 16:
            raise InvalidArgument(f"region {i}: block_size_tokens {lay.block_tokens} / num_heads {lay.num_heads} "
                                  "out of range")
        if lay.kv_layout not in (0, 1, 2):
            raise InvalidArgument(f"region {i}: unknown layout {lay.kv_layout}")
        units = (lay.block_tokens or 1) * (lay.num_heads or 1)
        if lay.block_len % units:
            raise InvalidArgument(f"region {i}: block_len {lay.block_len} is not a whole number of bytes per "
                                  f"head and token ({lay.num_heads or 1} heads x {lay.block_tokens or 1} tokens)")
