"""Progressive push of a publish whose first blocks are complete when it is declared (``ready_blocks``).

Real daemons, real NIXL. A chunked prefill's earlier chunks (or prefix-cache hits) are in the source
blocks before the last chunk's step declares the publish; the rest is computed layer by layer as the
doorbell rings. The ready blocks must be in the decode worker's memory before any layer is rung,
while the decode worker is not told finished; every other block stays poison until its layer was
rung, so a group posted early would show. At the end every byte is checked.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from kvpushd_client import Abort, CompletionKind, Expect, KVPushError, Publish
from support import POISON, attach_pair, layered_kv, make_kv, wait_for

REGIONS, LAYERS, BLOCKS = 8, 4, 64
PER = REGIONS // LAYERS


@pytest.fixture
def kv():  # type: ignore[no-untyped-def]
    src, dst, want = layered_kv("ready", REGIONS, BLOCKS, 5)
    yield src, dst, want
    src.close()
    dst.close()


def _landed(dst, want, dblocks, sblocks, regions=range(REGIONS)) -> bool:  # type: ignore[no-untyped-def]
    r = list(regions)
    return bool((dst.arr[r][:, dblocks] == want[r][:, sblocks]).all())


def _poison(dst, dblocks, regions=range(REGIONS)) -> bool:  # type: ignore[no-untyped-def]
    return bool((dst.arr[list(regions)][:, dblocks] == POISON).all())


def _group(g: int) -> range:
    return range(g * PER, (g + 1) * PER)


def _notifs(dm) -> int:  # type: ignore[no-untyped-def]
    return int(dm.client.status().counters.notifications_received)


def _quiet(dw) -> None:  # type: ignore[no-untyped-def]
    """The decode worker was told nothing (a FINISHED sent by now would have arrived)."""
    time.sleep(0.2)
    assert dw.completions() == []


@pytest.mark.parametrize("registration", ["before", "between", "after"])
def test_ready_blocks_land_before_any_layer_is_rung_then_the_rest_layer_by_layer(  # type: ignore[no-untyped-def]
        group_pair, kv, registration: str) -> None:
    p, d = group_pair
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    sblocks, dblocks = [3, 4, 5, 9, 17, 18], [10, 11, 12, 30, 31, 40]
    ready = 3  # earlier chunks: computed in earlier steps, every layer of them
    src.arr[:, sblocks[:ready]] = want[:, sblocks[:ready]]
    n0 = _notifs(d)

    def expect() -> None:
        dw.send(Expect("r1", tuple(dblocks), p.peer_address, "prefill", 1))

    if registration == "before":
        expect()
    seq = bell.step()
    pw.send(Publish("r1", tuple(sblocks), step=seq, layers=LAYERS, ready_blocks=ready))  # the last chunk's step
    if registration == "before":
        assert wait_for(lambda: _landed(dst, want, dblocks[:ready], sblocks[:ready]))  # no layer rung yet
        assert wait_for(lambda: _notifs(d) == n0 + 1)  # its notification was counted: one unit of 5
        _quiet(dw)  # ... and decode is not told finished
        assert _poison(dst, dblocks[ready:])
    for g in range(LAYERS):
        if registration == "between" and g == 2:
            expect()  # catches up at once: ready blocks and groups 0, 1
            assert wait_for(lambda: _landed(dst, want, dblocks[:ready], sblocks[:ready])
                            and _landed(dst, want, dblocks[ready:], sblocks[ready:], range(2 * PER)))
            assert _poison(dst, dblocks[ready:], range(2 * PER, REGIONS))
            _quiet(dw)
        for r in _group(g):
            src.arr[r, sblocks[ready:]] = want[r, sblocks[ready:]]
        bell.layer_done(g + 1)
        if registration == "before" and g < LAYERS - 1:
            assert wait_for(lambda: _landed(dst, want, dblocks[ready:], sblocks[ready:], _group(g)))  # noqa: B023
            assert _poison(dst, dblocks[ready:], range((g + 1) * PER, REGIONS))  # no later group early
            _quiet(dw)
    bell.seal()
    if registration == "after":
        expect()
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
    c = pw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_SENDING, c
    assert _landed(dst, want, dblocks, sblocks)
    assert _poison(dst, [0, 1, 2, 13, 32, 41])  # nothing else written
    got = _notifs(d) - n0
    if registration == "before":
        assert got == 1 + LAYERS  # the ready blocks, then one per layer group
    elif registration == "after":
        assert got == 1  # the step was complete: one WRITE of everything
    else:
        assert 2 <= got <= LAYERS  # ready blocks and groups 0, 1 as one, groups 2 and 3 one by one or merged
    pw.detach()
    dw.detach()
    assert wait_for(lambda: not p.client.status().workers and not d.client.status().workers)


def test_abort_after_the_ready_blocks_fails_both_sides_and_writes_nothing_more(group_pair, kv) -> None:  # type: ignore[no-untyped-def]
    p, d = group_pair
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    sblocks, dblocks = [40, 41, 42], [20, 21, 22]
    src.arr[:, sblocks[:2]] = want[:, sblocks[:2]]
    dw.send(Expect("r2", tuple(dblocks), p.peer_address, "prefill", 1))
    seq = bell.step()
    pw.send(Publish("r2", tuple(sblocks), step=seq, layers=LAYERS, ready_blocks=2))
    assert wait_for(lambda: _landed(dst, want, dblocks[:2], sblocks[:2]))
    for r in _group(0):
        src.arr[r, sblocks[2:]] = want[r, sblocks[2:]]
    bell.layer_done(1)
    assert wait_for(lambda: _landed(dst, want, dblocks[2:], sblocks[2:], _group(0)))
    assert pw.send(Abort("r2"))
    c = pw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FAILED and c.code == "ABORTED", c
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FAILED, c
    for g in range(1, LAYERS):  # the engine goes on; nothing more is written
        for r in _group(g):
            src.arr[r, sblocks[2:]] = want[r, sblocks[2:]]
        bell.layer_done(g + 1)
    bell.seal()
    time.sleep(0.3)
    assert _poison(dst, dblocks[2:], range(PER, REGIONS))
    assert wait_for(lambda: not p.client.status().transfers and not d.client.status().transfers)
    pw.detach()
    dw.detach()


def test_bad_ready_blocks_are_refused_and_the_daemon_goes_on(group_pair, kv) -> None:  # type: ignore[no-untyped-def]
    p, d = group_pair
    src, dst, want = kv
    pw, dw = attach_pair(p, d, src, dst, doorbell=True)
    bell = pw.doorbell
    assert bell is not None
    seq = bell.step()
    for ready in (4, 1 << 31, (1 << 32) - 1):
        with pytest.raises(KVPushError, match="ready_blocks") as e:
            pw.send(Publish("bad", (1, 2, 3), step=seq, layers=LAYERS, ready_blocks=ready))
        assert e.value.code == "INVALID_ARGUMENT" and "3 block ids" in e.value.message
    with pytest.raises(KVPushError, match="ready_blocks"):
        pw.send(Publish("bad", (1, 2, 3), ready_blocks=4))  # not progressive: still not more than the blocks
    assert not p.client.status().transfers
    # the same worker, the same transfer id, well formed: goes through
    sblocks, dblocks = [1, 2, 3], [4, 5, 6]
    src.arr[:, sblocks] = want[:, sblocks]
    dw.send(Expect("bad", tuple(dblocks), p.peer_address, "prefill", 1))
    pw.send(Publish("bad", tuple(sblocks), step=seq, layers=LAYERS, ready_blocks=3))  # all complete: one WRITE at once
    c = dw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_RECEIVING, c
    c = pw.next_completion(30)
    assert c is not None and c.kind is CompletionKind.FINISHED_SENDING, c
    assert _landed(dst, want, dblocks, sblocks)
    bell.seal()
    pw.detach()
    dw.detach()


MANY_REGIONS, MANY_LAYERS = 32, 16


def test_many_legs_and_groups_in_flight(group_pair) -> None:  # type: ignore[no-untyped-def]
    """Several declared publishes with different ready counts in one step, the layers rung back to back."""
    p, d = group_pair
    src = make_kv("ready-many-src", regions=MANY_REGIONS, num_blocks=BLOCKS, block_len=2048, fill="poison")
    dst = make_kv("ready-many-dst", regions=MANY_REGIONS, num_blocks=BLOCKS, block_len=2048, fill="poison")
    try:
        want = np.random.default_rng(9).integers(0, 256, src.arr.shape, dtype=np.uint8)
        pw, dw = attach_pair(p, d, src, dst, doorbell=True)
        bell = pw.doorbell
        assert bell is not None
        per = MANY_REGIONS // MANY_LAYERS
        legs = {f"m{i}": ([i * 8 + j for j in range(7)], [60 - i * 8 - j for j in range(7)], ready)
                for i, ready in enumerate((0, 1, 4, 6, 7))}
        n0 = _notifs(d)
        for tid, (sb, db, ready) in legs.items():
            src.arr[:, sb[:ready]] = want[:, sb[:ready]]
            dw.send(Expect(tid, tuple(db), p.peer_address, "prefill", 1))
        seq = bell.step()
        for tid, (sb, _, ready) in legs.items():
            pw.send_nowait(Publish(tid, tuple(sb), step=seq, layers=MANY_LAYERS, ready_blocks=ready))
        pw.step()
        assert wait_for(lambda: all(_landed(dst, want, db[:r], sb[:r]) for sb, db, r in legs.values()))
        for _, db, r in legs.values():
            assert _poison(dst, db[r:])
        for g in range(MANY_LAYERS):
            for sb, _, ready in legs.values():
                src.arr[g * per:(g + 1) * per, sb[ready:]] = want[g * per:(g + 1) * per, sb[ready:]]
            bell.layer_done(g + 1)
        bell.seal()
        kinds = {c.transfer_id: c.kind for c in (dw.next_completion(30) for _ in legs) if c is not None}
        assert kinds == dict.fromkeys(legs, CompletionKind.FINISHED_RECEIVING)
        kinds = {c.transfer_id: c.kind for c in (pw.next_completion(30) for _ in legs) if c is not None}
        assert kinds == dict.fromkeys(legs, CompletionKind.FINISHED_SENDING)
        for sb, db, _ in legs.values():
            assert _landed(dst, want, db, sb, range(MANY_REGIONS))
        used = {b for _, db, _ in legs.values() for b in db}
        assert (dst.arr[:, sorted(set(range(BLOCKS)) - used)] == POISON).all()
        assert _notifs(d) - n0 >= 8  # m4: one WRITE of all; m1-m3: their ready blocks, then 1+ for the rest; m0: 1+
        pw.detach()
        dw.detach()
    finally:
        src.close()
        dst.close()
