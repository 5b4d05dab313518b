"""The one check of a block list (from a worker's Expect or Publish, or a peer's Register): non-empty,
bounded, in range, no duplicates; the same verdict as plain Python's, for lists and protobuf fields."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpushd_client.proto.v1 import peer_pb2

from kvpushd.core.errors import InvalidArgument
from kvpushd.runtime import checks as workers
from kvpushd.runtime.checks import check_block_ids


def _reference(ids: list[int], num_blocks: int, max_blocks: int) -> str:
    if not ids:
        return "empty"
    if len(ids) > max_blocks:
        return "at most"
    if max(ids) >= num_blocks or min(ids) < 0:
        return "out of range"
    return "duplicates" if len(set(ids)) != len(ids) else ""


def _verdict(ids: object, num_blocks: int, max_blocks: int) -> str:
    try:
        check_block_ids(ids, num_blocks, max_blocks, "the regions")  # type: ignore[arg-type]
    except InvalidArgument as e:
        return next(k for k in ("empty", "at most", "out of range", "duplicates") if k in str(e))
    return ""


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(st.integers(-3, 1 << 20), max_size=200), num_blocks=st.integers(1, 1 << 21),
       spread=st.booleans(), small=st.sampled_from([0, workers.SMALL_BLOCK_LIST]))
def test_same_verdict_as_plain_python(ids: list[int], num_blocks: int, spread: bool, small: int) -> None:
    if spread:  # far apart: the sorted path, not the bitmap of the span
        ids = [i * 100_003 for i in ids]
        num_blocks *= 100_003
    want = _reference(ids, num_blocks, 150)
    saved, workers.SMALL_BLOCK_LIST = workers.SMALL_BLOCK_LIST, small  # 0: numpy for every list
    try:
        assert _verdict(ids, num_blocks, 150) == want
        if all(0 <= i < 1 << 32 for i in ids):  # a repeated uint32 field, as a Register carries them
            field = peer_pb2.RegisterRequest(block_ids=ids).block_ids
            assert _verdict(field, num_blocks, 150) == want
    finally:
        workers.SMALL_BLOCK_LIST = saved


@pytest.mark.parametrize("ids,why", [([0, 1 << 31, 5], "out of range"), ([7, 3, 7], "duplicates"),
                                     ([4_000_000_000, 1], "out of range")])
def test_the_message_names_what(ids: list[int], why: str) -> None:
    assert _verdict(ids, 100, 10) == why
