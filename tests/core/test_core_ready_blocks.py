"""Progressive push of a publish whose first blocks are complete when it is declared (``ready_blocks``:
earlier chunks of a chunked prefill, prefix-cache hits).

The core: the count is checked, carried into the leg (the tail the decode side registered), and
dropped where the leg is not staged. The NIXL thread's staging (transfer/staged.py, driven here
with a stand-in agent that records what it is asked to post): the ready blocks of every layer go
out at once as one WRITE, the other blocks layer group by layer group, each WRITE covering exactly
its descriptors. The decode side: the leg's notifications count ``layers + 1`` units, and a rank
is complete only once all of them landed, in whatever order and merged however.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from support.core import WorkerRef
from test_core_rendezvous import ENGINE, SRC, T0, TID, expect, new_recv, new_send, of, one, pw, reg

from kvpushd.core import notif
from kvpushd.core.actions import Deliver, LegKey, StartWrite
from kvpushd.core.errors import AlreadyExists, InvalidArgument
from kvpushd.core.types import CompletionKind, Publish
from kvpushd.transfer.agents import Prepped
from kvpushd.transfer.descs import Units, ready_first, units
from kvpushd.transfer.records import Inflight, Local, WriteResult
from kvpushd.transfer.staged import Stages

LAYERS, REGIONS, NUM_BLOCKS = 4, 8, 100


# -- the core: the count, checked and carried into the leg ---------------------------------------

def declare(s, ready: int, blocks=SRC, layers: int = LAYERS):  # type: ignore[no-untyped-def]
    return s.publish(T0, WorkerRef(pw(0), ENGINE, 0, 1),
                     Publish(TID, blocks, step=5, layers=layers, ready_blocks=ready))


def test_more_ready_blocks_than_blocks_is_refused() -> None:
    s = new_send()
    with pytest.raises(InvalidArgument, match="ready_blocks 4 is more than the 3 block ids"):
        declare(s, 4)
    with pytest.raises(InvalidArgument, match="ready_blocks"):
        declare(s, 4, layers=0)
    assert len(s) == 0
    declare(s, 3)  # all of them is fine


def test_the_leg_carries_the_ready_blocks_of_its_tail() -> None:
    s = new_send()
    declare(s, 2, blocks=(1, 2, 3, 4, 5))
    # the decode side holds the first two blocks already: the leg writes the last three, one of them ready
    w = one(s.register(T0, reg(7, blocks=(20, 21, 22))), StartWrite)
    assert w.src_blocks == (3, 4, 5) and (w.layers, w.ready_blocks) == (LAYERS, 0)  # its ready blocks are not in it
    s2 = new_send()
    declare(s2, 4, blocks=(1, 2, 3, 4, 5))
    w = one(s2.register(T0, reg(7, blocks=(20, 21, 22))), StartWrite)
    assert w.src_blocks == (3, 4, 5) and w.ready_blocks == 2


def test_ready_blocks_go_with_the_step_only() -> None:
    s = new_send()
    w = one(declare(s, 2) + s.register(T0, reg(7)), StartWrite)
    assert (w.step, w.layers, w.ready_blocks) == (5, LAYERS, 2)
    s = new_send()
    s.publish(T0, WorkerRef(pw(0), ENGINE, 0, 1), Publish(TID, SRC, ready_blocks=2))  # no step: every block is complete
    w = one(s.register(T0, reg(7)), StartWrite)
    assert (w.layers, w.ready_blocks) == (0, 0)
    s = new_send()
    declare(s, 2)
    assert s.sealed(pw(0), 5) == []
    w = one(s.register(T0, reg(7)), StartWrite)  # the step is complete: one WRITE of everything
    assert (w.layers, w.ready_blocks) == (0, 0)


def test_a_retried_publish_must_say_the_same_ready_blocks() -> None:
    s = new_send()
    declare(s, 2)
    assert declare(s, 2) == []  # idempotent
    with pytest.raises(AlreadyExists):
        declare(s, 1)


# -- the decode side's count ----------------------------------------------------------------

def test_notifications_of_layers_plus_one_units_parse_up_to_the_limit() -> None:
    top = notif.MAX_LAYERS + 1
    assert notif.decode(notif.encode(9, 1, 0, 1, top)) == (9, 1, 0, 1, top)
    assert notif.decode(notif.encode(9, 1, top - 1, 1, top)) == (9, 1, top - 1, 1, top)
    assert notif.decode(notif.encode(9, 1, 0, 1, top + 1)) is None


def orders(units_: int):  # type: ignore[no-untyped-def]
    """Every way the WRITEs of one rank may be cut (runs of units) and every order they may land in."""
    for cuts in itertools.product((False, True), repeat=units_ - 1):
        runs, start = [], 0
        for i, cut in enumerate(cuts, 1):
            if cut:
                runs.append((start, i - start))
                start = i
        runs.append((start, units_ - start))
        yield from itertools.permutations(runs) if len(runs) <= 5 else [tuple(runs), tuple(reversed(runs))]


def test_a_rank_with_ready_blocks_is_complete_only_once_every_unit_landed_in_any_order() -> None:
    total = LAYERS + 1  # unit 0: the ready blocks of every layer; 1..LAYERS: the layer groups
    n = 0
    for order in orders(total):
        r = new_recv(first_id=50)
        expect(r)
        r.registered(50)
        for i, (first, count) in enumerate(order):
            actions = r.notified(50, 0, first, count, total)
            if i < len(order) - 1:
                assert actions == [], (order, i)  # never complete early
            else:
                d = one(actions, Deliver)
                assert d.completion.kind is CompletionKind.FINISHED_RECEIVING
        assert len(r) == 0
        n += 1
    assert n > 100


def test_the_ready_unit_alone_or_the_layer_groups_alone_do_not_complete_a_rank() -> None:
    r = new_recv(first_id=50)
    expect(r)
    r.registered(50)
    assert r.notified(50, 0, 1, LAYERS, LAYERS + 1) == []  # every layer group, not the ready blocks
    assert of(r.notified(50, 0, 1, 1, LAYERS + 1), Deliver) == []  # a group again: dropped, not counted
    assert r.stray_notifications == 1
    one(r.notified(50, 0, 0, 1, LAYERS + 1), Deliver)


# -- the NIXL thread's staging ---------------------------------------------------------------

class Bell:
    def __init__(self) -> None:
        self.done = 0

    def ready(self, step: int, layers: int) -> int:
        return min(self.done, layers)


class Agent:
    """Stands in for a NIXL agent: a transfer handle is what was asked to be posted."""

    def make_prepped_xfer(self, op: str, ldl: Any, li: Any, rdl: Any, ri: Any, msg: bytes) -> Any:
        return list(np.asarray(li)), list(np.asarray(ri)), msg

    def transfer(self, handle: Any) -> str:
        return "PROC"


def leg(ready: int, blocks: list[int], bell: Bell, planned: bool = False):  # type: ignore[no-untyped-def]
    """A staged leg from source ``blocks`` (regions x NUM_BLOCKS, region-major) into destination
    blocks ``b + 1000``; -> (stages, what was posted)."""
    bases = np.arange(REGIONS, dtype=np.int64) * NUM_BLOCKS
    src = np.asarray(blocks, dtype=np.int64)
    lidx = (bases[:, None] + src[None, :]).reshape(-1).astype(np.int32)
    ridx = lidx + 1000
    agent = Agent()
    loc = Local("pw0", agent, "DRAM", (), None, None, bases, False, bell=bell)
    key = LegKey(ENGINE, TID, 0, 7)
    result = WriteResult(key, True, "", 1, 0.0, 0.0, 0, 0)
    make: Any = (lambda m, lo=0, hi=0: (list(lidx), list(ridx), m)) if planned else \
        Prepped(agent, "WRITE", None, lidx, None, ridx)
    write = StartWrite(key, "pw0", 0, 1, tuple(blocks), reg(7), step=5, layers=LAYERS, ready_blocks=ready)
    stages = Stages(None, stall_s=1e9)
    stages.add(write, loc, "decode", make, result, 0.0)
    posted: list[Inflight] = []
    stages.advance(posted.append)
    return stages, posted


def cells(f: Inflight) -> set[tuple[int, int]]:
    """(region, block) pairs a posted WRITE covers; its destination indices match its source ones."""
    li, ri, _ = f.handle
    assert [x + 1000 for x in li] == ri
    return {(int(x) // NUM_BLOCKS, int(x) % NUM_BLOCKS) for x in li}


def group(g: int, blocks: list[int]) -> set[tuple[int, int]]:
    per = REGIONS // LAYERS
    return {(r, b) for r in range(g * per, (g + 1) * per) for b in blocks}


def test_ready_blocks_go_at_once_and_each_layer_group_after_them_covers_exactly_its_descriptors() -> None:
    bell = Bell()
    blocks = [40, 41, 7, 9, 10, 3]  # not sorted, not contiguous: a chunked prompt's blocks
    ready, rest = blocks[:2], blocks[2:]
    stages, posted = leg(2, blocks, bell)
    assert len(posted) == 1  # before any layer was rung
    assert cells(posted[0]) == {(r, b) for r in range(REGIONS) for b in ready}  # every layer of them
    assert notif.decode(posted[0].handle[2]) == (7, 0, 0, 1, LAYERS + 1)
    stages.advance(posted.append)
    assert len(posted) == 1  # nothing more until the doorbell rings
    bell.done = 1
    stages.advance(posted.append)
    assert cells(posted[1]) == group(0, rest)
    assert notif.decode(posted[1].handle[2]) == (7, 0, 1, 1, LAYERS + 1)
    bell.done = LAYERS  # the thread was behind: the rest merge into one WRITE
    stages.advance(posted.append)
    assert len(posted) == 3
    assert cells(posted[2]) == set().union(*(group(g, rest) for g in range(1, LAYERS)))
    assert notif.decode(posted[2].handle[2]) == (7, 0, 2, LAYERS - 1, LAYERS + 1)
    all_cells = [c for f in posted for c in cells(f)]
    assert len(all_cells) == len(set(all_cells)) == REGIONS * len(blocks)  # each descriptor once
    for f in posted:
        stages.settled(f)
    _, done = stages.advance(posted.append)
    assert [r.ok for r in done] == [True] and not stages.legs


def test_a_leg_registered_after_the_step_completed_is_one_write_of_every_unit() -> None:
    bell = Bell()
    bell.done = LAYERS
    _, posted = leg(2, [5, 6, 7], bell)
    assert len(posted) == 1 and len(cells(posted[0])) == REGIONS * 3
    assert notif.decode(posted[0].handle[2]) == (7, 0, 0, LAYERS + 1, LAYERS + 1)


def test_a_leg_whose_blocks_are_all_ready_goes_at_once_as_the_whole_rank() -> None:
    _, posted = leg(3, [5, 6, 7], Bell())
    assert len(posted) == 1 and len(cells(posted[0])) == REGIONS * 3
    assert notif.decode(posted[0].handle[2]) == (7, 0, 0, 1, 1)


def test_without_ready_blocks_the_layer_groups_are_as_before() -> None:
    bell = Bell()
    stages, posted = leg(0, [5, 6], bell)
    assert posted == []
    bell.done = 2
    stages.advance(posted.append)
    assert cells(posted[0]) == group(0, [5, 6]) | group(1, [5, 6])
    assert notif.decode(posted[0].handle[2]) == (7, 0, 0, 2, LAYERS)


def test_a_leg_planned_per_request_waits_for_the_whole_step() -> None:
    bell = Bell()
    stages, posted = leg(1, [5, 6], bell, planned=True)
    bell.done = LAYERS - 1
    stages.advance(posted.append)
    assert posted == []  # ready blocks or not: one WRITE once the step is complete
    bell.done = LAYERS
    stages.advance(posted.append)
    assert len(posted) == 1 and notif.decode(posted[0].handle[2]) == (7, 0, 0, LAYERS, LAYERS)


def test_a_stopped_leg_posts_no_more_units() -> None:
    bell = Bell()
    stages, posted = leg(1, [5, 6], bell)
    stages.stop("aborted")
    bell.done = LAYERS
    stages.advance(posted.append)
    assert len(posted) == 1  # the ready blocks only
    stages.settled(posted[0])
    _, done = stages.advance(posted.append)
    assert [(r.ok, r.reason) for r in done] == [(False, "aborted")]


@pytest.mark.parametrize("blocks,ready", [(1, 0), (5, 2), (5, 5), (130, 17)])
def test_units_cover_the_reordered_indices_in_order(blocks: int, ready: int) -> None:
    idx = np.arange(REGIONS * blocks, dtype=np.int32)
    moved = ready_first(idx, blocks, ready)
    assert sorted(moved.tolist()) == idx.tolist()
    u = units(len(idx), blocks, LAYERS, ready)
    spans = [(u.end(i), u.end(i + 1)) for i in range(u.units)]
    assert spans[0][0] == 0 and spans[-1][1] == len(idx)
    assert all(a < b for a, b in spans) and all(spans[i][1] == spans[i + 1][0] for i in range(len(spans) - 1))
    if 0 < ready < blocks:
        a, b = spans[0]
        assert {int(x) % blocks for x in moved[a:b]} == set(range(ready))  # unit 0: the ready blocks
    assert units(len(idx), blocks, 3, ready) == Units(3, sliced=False)  # 3 groups do not split 8 regions


def test_the_client_sends_ready_blocks_under_that_name() -> None:
    from kvpushd_client import stream

    assert Publish("t", (1,)).ready_blocks == 0
    cmd = stream._command(1, Publish("t", (1, 2, 3), step=5, layers=LAYERS, ready_blocks=2))
    assert (cmd.publish.step, cmd.publish.layers, cmd.publish.ready_blocks) == (5, LAYERS, 2)
    assert stream._command(1, Publish("t", (1,))).publish.ready_blocks == 0
