"""What one leg carries: the StartWrite (or, in pull mode, SendOffer) of a publish into a registration.

The whole plan is decided here, once: which source blocks (a partial prefix-cache hit on decode
needs only the tail), which slice of each block on either side (TP sizes), the notification,
whether replicated regions are left to another rank, and whether the prepared lists serve.
"""

from __future__ import annotations

from . import notif
from .actions import LegKey, Registration, SendOffer, StartWrite
from .layout import needs_plan, sizes_differ
from .sendstate import Publish, SendTransfer
from .topology import block_parts, skips_replicated
from .types import TransferMode


def by_tokens(pub: Publish, reg: Registration) -> bool:
    """Blocks do not map one to one (block sizes differ, or a prefix is skipped): map by tokens."""
    return reg.skip_tokens > 0 or sizes_differ(pub.layouts, reg.layouts)


def mismatch(pub: Publish, reg: Registration, tokens: bool) -> str:
    """Why this publish cannot feed this registration ("" if it can)."""
    if reg.producer_tp_size != pub.tp_size:
        return (f"decode side expects producer TP size {reg.producer_tp_size}, "
                f"prefill engine runs TP {pub.tp_size}")
    if len(reg.block_ids) > len(pub.block_ids) and not tokens:  # by tokens: checked when posting
        return (f"block lists of unequal length: decode expects {len(reg.block_ids)} blocks, "
                f"prefill published {len(pub.block_ids)}")
    return ""


def leg_action(t: SendTransfer, pub: Publish, reg: Registration, now: float, tokens: bool) -> StartWrite | SendOffer:
    leg = LegKey(t.engine_id, t.transfer_id, pub.rank, reg.registration_id)
    src = pub.block_ids if tokens else pub.block_ids[len(pub.block_ids) - len(reg.block_ids):]
    if reg.mode is TransferMode.PULL:
        return SendOffer(leg, pub.worker_id, pub.rank, pub.tp_size, src, reg)
    src_part, dst_part = block_parts(pub.rank, pub.tp_size, reg.consumer_rank, reg.consumer_tp_size)
    skip_rep = skips_replicated(pub.rank, pub.tp_size, reg.consumer_tp_size)
    return StartWrite(
        leg=leg,
        producer_worker=pub.worker_id,
        producer_rank=pub.rank,
        producer_tp_size=pub.tp_size,
        src_blocks=src,
        registration=reg,
        notif=notif.encode(reg.registration_id, pub.rank),
        src_part=src_part,
        dst_part=dst_part,
        skip_replicated=skip_rep,
        planned=tokens or needs_plan(pub.layouts, reg.layouts, reg.skip_tokens, skip_rep, src_part, dst_part),
        waited_s=max(now - t.created, 0.0),
        step=0 if pub.ready else pub.step,
        layers=0 if pub.ready else pub.layers,
        # the source is the tail of the published blocks: its ready ones are those past what it leaves out
        ready_blocks=0 if pub.ready or tokens else max(0, pub.ready_blocks - (len(pub.block_ids) - len(src))),
    )
