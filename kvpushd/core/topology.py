"""Which producer TP ranks write to which consumer TP ranks.

vLLM's rule for heterogeneous TP: with P_tp >= D_tp each consumer rank gathers the KV heads of
P_tp/D_tp producer ranks; with P_tp < D_tp each producer rank's heads are split over D_tp/P_tp
consumer ranks. Sizes must divide each other.
"""

from __future__ import annotations

from .errors import InvalidArgument

MAX_TP = 1024  # bounds the rank ranges the core materialises from peer-supplied sizes


def check_tp_pair(producer_tp: int, consumer_tp: int) -> None:
    if producer_tp <= 0 or consumer_tp <= 0:
        raise InvalidArgument(f"TP sizes must be positive (producer {producer_tp}, consumer {consumer_tp})")
    if producer_tp > MAX_TP or consumer_tp > MAX_TP:
        raise InvalidArgument(f"TP sizes above {MAX_TP} are not supported (producer {producer_tp}, "
                              f"consumer {consumer_tp})")
    big, small = max(producer_tp, consumer_tp), min(producer_tp, consumer_tp)
    if big % small:
        raise InvalidArgument(
            f"TP sizes must divide each other (producer {producer_tp}, consumer {consumer_tp})"
        )


def consumer_targets(producer_rank: int, producer_tp: int, consumer_tp: int) -> range:
    """Consumer ranks that producer rank ``producer_rank`` writes to."""
    if producer_tp >= consumer_tp:
        k = producer_tp // consumer_tp
        return range(producer_rank // k, producer_rank // k + 1)
    k = consumer_tp // producer_tp
    return range(producer_rank * k, (producer_rank + 1) * k)


def producer_sources(consumer_rank: int, producer_tp: int, consumer_tp: int) -> range:
    """Producer ranks that write to consumer rank ``consumer_rank``: one notification each (the
    rule of consumer_targets, with the sides' roles swapped)."""
    return consumer_targets(consumer_rank, consumer_tp, producer_tp)


def block_parts(producer_rank: int, producer_tp: int, consumer_rank: int,
                consumer_tp: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Which slice of a block each side of one WRITE covers, for vLLM's HND layout.

    In HND (heads, tokens, head dim) a block holds its rank's KV heads contiguously, so a rank's
    share of a bigger block is a contiguous slice. Returns ((src_parts, src_index),
    (dst_parts, dst_index)): the WRITE moves slice src_index of src_parts from each source block
    into slice dst_index of dst_parts of the matching destination block.
    """
    if producer_tp > consumer_tp:  # decode gathers k producer ranks' heads into one block
        k = producer_tp // consumer_tp
        return (1, 0), (k, producer_rank % k)
    k = consumer_tp // producer_tp  # decode ranks each take 1/k of the producer's heads (k = 1: the whole block)
    return (k, consumer_rank % k), (1, 0)


def writer_targets(producer_rank: int, producer_tp: int, consumer_tp: int, mla: bool) -> range:
    """Consumer ranks producer rank ``producer_rank`` actually WRITEs to.

    MLA (every region replicated: one latent per token, the same on every rank): with more producer
    than consumer ranks, only the first producer rank of each consumer's group writes; the others
    write nothing (and send no notification)."""
    if mla and producer_tp > consumer_tp and producer_rank % (producer_tp // consumer_tp):
        return range(0)
    return consumer_targets(producer_rank, producer_tp, consumer_tp)


def writer_sources(consumer_rank: int, producer_tp: int, consumer_tp: int, mla: bool) -> range:
    """Producer ranks that WRITE to consumer rank ``consumer_rank``: one notification each."""
    sources = producer_sources(consumer_rank, producer_tp, consumer_tp)
    return range(sources.start, sources.start + 1) if mla else sources


def skips_replicated(producer_rank: int, producer_tp: int, consumer_tp: int) -> bool:
    """Another producer rank writes the replicated (MLA) regions of this rank's consumer."""
    return producer_tp > consumer_tp and producer_rank % (producer_tp // consumer_tp) != 0
