"""Which producer TP ranks write to which consumer TP ranks.

vLLM's rule for heterogeneous TP: with P_tp >= D_tp each consumer rank gathers the KV heads of
P_tp/D_tp producer ranks; with P_tp < D_tp each producer rank's heads are split over D_tp/P_tp
consumer ranks. Sizes must divide each other.
"""

from __future__ import annotations

from .errors import InvalidArgument


def check_tp_pair(producer_tp: int, consumer_tp: int) -> None:
    if producer_tp <= 0 or consumer_tp <= 0:
        raise InvalidArgument(f"TP sizes must be positive (producer {producer_tp}, consumer {consumer_tp})")
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
    """Producer ranks that write to consumer rank ``consumer_rank``: one notification each."""
    if producer_tp >= consumer_tp:
        k = producer_tp // consumer_tp
        return range(consumer_rank * k, (consumer_rank + 1) * k)
    k = consumer_tp // producer_tp
    return range(consumer_rank // k, consumer_rank // k + 1)
