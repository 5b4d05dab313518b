"""KV cache groups (vLLM's hybrid KV cache manager) -> the one block list a transfer moves.

With the hybrid manager on, a model with sliding-window and full-attention layers has one KV cache
group per attention kind, each with its own block table, and all groups draw their blocks from ONE
block pool: a block id names one page of every KV allocation, and the layer that page belongs to
is the one whose group holds that id. Each allocation is shared by one layer of every group (the
same view shape), so the daemon's regions (one per allocation, not per layer) with the
concatenation of every group's block ids move each group's pages into the decode side's pages of
the same group: prefill and decode concatenate the same groups, in the same order, over the same
positions (``transfer_positions``).

A sliding-window group keeps (and needs) only the blocks of its last window: vLLM puts the null
block (id 0) in the positions before it. Both sides derive the same positions from the prompt
length alone: those vLLM's decode side allocates for a prompt received whole
(``SlidingWindowManager.get_num_skipped_tokens``), so no null block is ever written or read.

No vLLM import at module level: ``plan_groups`` inspects the specs by class name.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

NULL_BLOCK_ID = 0  # vLLM's BlockPool.null_block: a placeholder, never holds a token's KV

_FULL = ("FullAttentionSpec", "MLAAttentionSpec", "SinkFullAttentionSpec")
_WINDOW = ("SlidingWindowSpec", "SlidingWindowMLASpec")


@dataclass(frozen=True)
class GroupPlan:
    """What a transfer moves of one KV cache group."""

    block_size: int           # tokens per block of this group
    sliding_window: int = 0   # tokens; 0: full attention (every block of the prompt)
    retained: int = 0         # vLLM's extra_retained_tokens below the window
    moves: bool = True        # False: vLLM keeps this group out of KV transfer (enable_kv_transfer)

    def positions(self, num_prompt_tokens: int) -> range:
        """Block positions (indexes into the request's block table of this group) that move."""
        if not self.moves:
            return range(0)
        end = -(-num_prompt_tokens // self.block_size)
        if not self.sliding_window:
            return range(0, end)
        skipped = max(0, num_prompt_tokens - self.sliding_window + 1 - self.retained)
        return range(min(skipped // self.block_size, end), end)


def describe_groups(kv_cache_config: Any) -> str:
    """"group 0: FullAttentionSpec (2 layers: model.layers.0..., ...)", for messages."""
    parts = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        names = list(g.layer_names)
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        parts.append(f"group {i}: {type(g.kv_cache_spec).__name__} ({len(names)} layers: {shown})")
    return "; ".join(parts)


def plan_groups(kv_cache_config: Any) -> tuple[GroupPlan, ...]:
    """Each KV cache group's plan, or NotImplementedError naming the groups kvpushd cannot move.

    Full attention (and MLA) moves every block of the prompt, sliding window the blocks of its last
    window. Anything else (Mamba / linear-attention state, chunked local attention, cross
    attention) is refused: its blocks hold no per-token KV that these rules would place right, and
    vLLM 0.33's connector API hands connectors no separate state to move.
    """
    groups = list(kv_cache_config.kv_cache_groups)
    plans: list[GroupPlan] = []
    bad: list[int] = []
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        kinds = [c.__name__ for c in type(spec).__mro__]
        name = type(spec).__name__
        if not getattr(g, "enable_kv_transfer", True):
            plans.append(GroupPlan(int(getattr(spec, "block_size", 1) or 1), moves=False))
        elif name in _WINDOW or (name not in _FULL and "SlidingWindowSpec" in kinds):
            plans.append(GroupPlan(int(spec.block_size), int(spec.sliding_window),
                                   int(getattr(spec, "extra_retained_tokens", 0) or 0)))
        elif name in _FULL or (name not in _WINDOW and "FullAttentionSpec" in kinds and "RSWASpec" not in kinds):
            plans.append(GroupPlan(int(spec.block_size)))
        else:
            bad.append(i)
    if bad:
        raise NotImplementedError(
            "KVPushdConnector moves full-attention and sliding-window KV only; KV cache group(s) "
            f"{', '.join(map(str, bad))} of this model hold state it cannot move "
            f"({describe_groups(kv_cache_config)}). Serve this model with another connector, or without "
            "disaggregated prefill.")
    if len(plans) > 1:
        sizes = {p.block_size for p in plans}
        pages = {int(g.kv_cache_spec.page_size_bytes) for g, p in zip(groups, plans, strict=True) if p.moves}
        if len(pages) > 1:
            raise NotImplementedError(
                f"KVPushdConnector needs one page size across KV cache groups; this model's groups page "
                f"{sorted(pages)} bytes with block sizes {sorted(sizes)} ({describe_groups(kv_cache_config)})")
    return tuple(plans)


def transfer_block_ids(plans: Sequence[GroupPlan], block_ids: Sequence[Sequence[int]], num_prompt_tokens: int,
                       ) -> tuple[int, ...] | str:
    """The blocks one side moves (every group's positions, concatenated in group order), or why not.

    Refused (a string) when a group's table is shorter than the prompt or holds the null block
    where a block is needed: moving it would write a placeholder, or leave decode blocks unwritten.
    """
    if len(block_ids) != len(plans):
        return f"{len(block_ids)} block lists for {len(plans)} KV cache groups"
    out: list[int] = []
    for i, (plan, blocks) in enumerate(zip(plans, block_ids, strict=True)):
        pos = plan.positions(num_prompt_tokens)
        if len(blocks) < pos.stop:
            return (f"group {i} holds {len(blocks)} blocks, the prompt of {num_prompt_tokens} tokens needs "
                    f"{pos.stop} of {plan.block_size} tokens")
        chosen = [int(blocks[p]) for p in pos]
        if NULL_BLOCK_ID in chosen:
            return f"group {i} has no block (the null block) at a position inside its window"
        out += chosen
    return tuple(out)
