"""Tests for the small pure helpers of the core: TP topology and the WRITE notification format."""

from __future__ import annotations

import itertools

import pytest
from support.core import WorkerRef, receive_of

from kvpushd.core import notif
from kvpushd.core.actions import Registration
from kvpushd.core.errors import InvalidArgument
from kvpushd.core.recv import RecvSide
from kvpushd.core.send import SendSide
from kvpushd.core.topology import block_parts, check_tp_pair, consumer_targets, producer_sources
from kvpushd.core.types import Expect, Publish

# --------------------------------------------------------------------------------------------
# topology

SIZES = range(1, 9)
DIVISIBLE = [(p, d) for p, d in itertools.product(SIZES, SIZES) if max(p, d) % min(p, d) == 0]
NOT_DIVISIBLE = [(p, d) for p, d in itertools.product(SIZES, SIZES) if max(p, d) % min(p, d) != 0]


def test_pair_lists_are_not_empty() -> None:
    assert (8, 2) in DIVISIBLE and (2, 8) in DIVISIBLE and (1, 1) in DIVISIBLE
    assert (3, 2) in NOT_DIVISIBLE and (6, 4) in NOT_DIVISIBLE


@pytest.mark.parametrize(("ptp", "dtp"), DIVISIBLE)
def test_targets_and_sources_are_inverse(ptp: int, dtp: int) -> None:
    check_tp_pair(ptp, dtp)
    edges_from_producers = {(p, c) for p in range(ptp) for c in consumer_targets(p, ptp, dtp)}
    edges_from_consumers = {(p, c) for c in range(dtp) for p in producer_sources(c, ptp, dtp)}
    assert edges_from_producers == edges_from_consumers
    # every rank on each side takes part, and all ranks named are in range
    assert {p for p, _ in edges_from_producers} == set(range(ptp))
    assert {c for _, c in edges_from_producers} == set(range(dtp))
    # the fan-in/fan-out is the TP ratio: one WRITE (leg) per (producer, consumer) edge
    assert len(edges_from_producers) == max(ptp, dtp)
    for p in range(ptp):
        assert len(consumer_targets(p, ptp, dtp)) == max(1, dtp // ptp)
    for c in range(dtp):
        assert len(producer_sources(c, ptp, dtp)) == max(1, ptp // dtp)


@pytest.mark.parametrize(
    ("ptp", "dtp", "rank", "targets"),
    [
        (1, 1, 0, [0]),
        (2, 1, 0, [0]),
        (2, 1, 1, [0]),
        (4, 2, 3, [1]),
        (1, 2, 0, [0, 1]),
        (2, 8, 1, [4, 5, 6, 7]),
    ],
)
def test_consumer_targets_examples(ptp: int, dtp: int, rank: int, targets: list[int]) -> None:
    assert list(consumer_targets(rank, ptp, dtp)) == targets


@pytest.mark.parametrize(
    ("ptp", "dtp", "rank", "sources"),
    [
        (1, 1, 0, [0]),
        (2, 1, 0, [0, 1]),
        (8, 2, 1, [4, 5, 6, 7]),
        (1, 2, 1, [0]),
        (2, 4, 3, [1]),
    ],
)
def test_producer_sources_examples(ptp: int, dtp: int, rank: int, sources: list[int]) -> None:
    assert list(producer_sources(rank, ptp, dtp)) == sources


@pytest.mark.parametrize(("ptp", "dtp"), [*NOT_DIVISIBLE, (0, 1), (1, 0), (0, 0), (-1, 1), (2, -2), (-2, -2)])
def test_check_tp_pair_rejects(ptp: int, dtp: int) -> None:
    with pytest.raises(InvalidArgument):
        check_tp_pair(ptp, dtp)


@pytest.mark.parametrize(("ptp", "dtp"), DIVISIBLE)
def test_block_parts_tile_every_block_exactly_once(ptp: int, dtp: int) -> None:
    """Over all WRITEs (producer -> consumer edges), each destination block is covered once by
    equal slices, and each source block is read once in total by its WRITEs."""
    dst_cover: dict[int, list[tuple[int, int]]] = {c: [] for c in range(dtp)}
    src_cover: dict[int, list[tuple[int, int]]] = {p: [] for p in range(ptp)}
    for p in range(ptp):
        for c in consumer_targets(p, ptp, dtp):
            (sp, si), (dp, di) = block_parts(p, ptp, c, dtp)
            assert sp >= 1 and dp >= 1 and 0 <= si < sp and 0 <= di < dp
            assert sp == 1 or dp == 1  # only one side of a WRITE is ever sliced
            src_cover[p].append((sp, si))
            dst_cover[c].append((dp, di))
    for slices in [*dst_cover.values(), *src_cover.values()]:
        parts = {n for n, _ in slices}
        assert len(parts) == 1
        (n,) = parts
        assert sorted(i for _, i in slices) == list(range(n))


@pytest.mark.parametrize(
    ("ptp", "prank", "dtp", "crank", "expected"),
    [
        (1, 0, 1, 0, ((1, 0), (1, 0))),
        (2, 1, 1, 0, ((1, 0), (2, 1))),  # P tp2 -> D tp1: rank 1 fills the second half of the block
        (4, 3, 2, 1, ((1, 0), (2, 1))),
        (1, 0, 2, 1, ((2, 1), (1, 0))),  # P tp1 -> D tp2: consumer rank 1 takes the second half
        (2, 1, 4, 2, ((2, 0), (1, 0))),
    ],
)
def test_block_parts_examples(ptp: int, prank: int, dtp: int, crank: int,
                              expected: tuple[tuple[int, int], tuple[int, int]]) -> None:
    assert block_parts(prank, ptp, crank, dtp) == expected


# --------------------------------------------------------------------------------------------
# notifications


@pytest.mark.parametrize(
    ("rid", "rank"),
    [(0, 0), (1, 0), (7, 3), (1 << 40, 63), (2**63 - 1, 0), (10**19, 10**19), (123456789, 8)],
)
def test_notif_round_trip(rid: int, rank: int) -> None:
    msg = notif.encode(rid, rank)
    assert isinstance(msg, bytes)
    assert msg.startswith(notif.PREFIX)
    assert msg.isascii()
    assert notif.decode(msg) == (rid, rank, 0, 1, 1)


def test_notif_encoding_is_stable() -> None:
    assert notif.encode(42, 3) == b"kvp1:42:3"
    assert notif.encode(42, 3, 4, 2, 64) == b"kvp1:42:3:4:2:64"


@pytest.mark.parametrize(("first", "count", "total"), [(0, 1, 2), (1, 1, 2), (0, 64, 64), (63, 1, 64), (5, 7, 4096)])
def test_layered_notif_round_trip(first: int, count: int, total: int) -> None:
    assert notif.decode(notif.encode(9, 2, first, count, total)) == (9, 2, first, count, total)


@pytest.mark.parametrize("msg", [b"kvp1:1:2:0:0:4", b"kvp1:1:2:3:2:4", b"kvp1:1:2:0:1:4098", b"kvp1:1:2:0:1",
                                 b"kvp1:1:2:0:1:2:3"])
def test_layered_notif_malformed(msg: bytes) -> None:
    assert notif.decode(msg) is None


@pytest.mark.parametrize(
    "msg",
    [
        b"",
        b"kvp1:",
        b"kvp1:1",
        b"kvp1:1:",
        b"kvp1::1",
        b"kvp1:1:2:3",
        b"kvp1:a:1",
        b"kvp1:1:b",
        b"kvp1:-1:0",
        b"kvp1:1:-2",
        b"kvp1:+1:2",
        b"kvp1: 1:2",
        b"kvp1:1:2 ",
        b"kvp1:1:2\n",
        b"kvp1:1.0:2",
        b"kvp1:0x1:2",
        b"kvp2:1:2",
        b"KVP1:1:2",
        b"xkvp1:1:2",
        b"1:2",
        b"kvp1:" + b"1" * 21 + b":0",
        b"kvp1:0:" + b"9" * 21,
        "kvp1:\u0661:2".encode(),  # a non-ASCII digit
        b"\xff\xfe",
        b"some other engine's notification",
    ],
)
def test_notif_decode_rejects_malformed(msg: bytes) -> None:
    assert notif.decode(msg) is None


def test_notif_decode_accepts_max_width_fields() -> None:
    assert notif.decode(b"kvp1:" + b"9" * 20 + b":" + b"0" * 20) == (10**20 - 1, 0, 0, 1, 1)


def test_compat_hash_is_stable_hex() -> None:
    h = notif.compat_hash()
    assert h == notif.compat_hash()
    assert len(h) == 16
    int(h, 16)


# --------------------------------------------------------------------------------------------
# status views (smoke tests: what the status API shows while a transfer waits)


def test_send_views_describe_what_is_missing() -> None:
    s = SendSide(30.0, 30.0)
    s.publish(10.0, WorkerRef("pw0", "E", 0, 1), Publish("a", [1, 2]))
    reg = Registration(5, "dec", "b", "E", 1, "agent", 0, 1, (3,))
    s.register(11.0, reg)
    views = {v.transfer_id: v for v in s.views(15.0)}
    assert views["a"].waiting_for == "decode registration"
    assert views["a"].published_ranks == (0,)
    assert views["a"].age_s == pytest.approx(5.0)
    assert views["a"].num_blocks == 2
    assert views["a"].workers == ("pw0",)
    assert views["b"].waiting_for == "prefill publish"
    assert views["b"].registered_ranks == (0,)
    (w,) = s.publish(12.0, WorkerRef("pw0", "E", 0, 1), Publish("b", [7]))
    vb = next(v for v in s.views(15.0) if v.transfer_id == "b")
    assert vb.legs_posted == 1 and "in flight" in vb.waiting_for
    s.write_done(w.leg, True)  # type: ignore[union-attr]
    assert [v.transfer_id for v in s.views(15.0)] == ["a"]


def test_recv_views_describe_what_is_missing() -> None:
    r = RecvSide(30.0)
    (sr,) = r.expect(1.0, WorkerRef("dw0", "", 0, 1), Expect("a", [4, 5], "prefill:1", "E", 2))
    (v,) = r.views(3.0)
    assert v.state == "registering" and "prefill:1" in v.waiting_for and v.num_blocks == 2
    r.registered(sr.registration_id)  # type: ignore[union-attr]
    r.notified(sr.registration_id, 1)  # type: ignore[union-attr]
    (v,) = r.views(3.0)
    assert v.state == "registered" and "[0]" in v.waiting_for
    assert receive_of(r, sr.registration_id) == ("dw0", "a")  # type: ignore[union-attr]
