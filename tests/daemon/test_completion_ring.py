"""The completion ring: a receiving worker's finished receives, written by its daemon into the
worker's doorbell page, read by the engine with a load in its own step before the stream's copy.

The page format is checked between the daemon's writer and the client's reader; then real daemons
and real NIXL WRITEs: each transfer is reported exactly once (the ring's report first, the stream's
copy held back with its figures), failures come by the stream, a page re-used by a new attachment
starts empty, and a worker that truncates or scribbles over its page loses only its own hints.
"""

from __future__ import annotations

import contextlib
import os
import time

import pytest
from kvpushd_client import CompletionKind, Role
from kvpushd_client.doorbell import (
    RING_BASE,
    RING_HEAD,
    RING_SLOTS,
    SIZE,
    Doorbell,
    RingReader,
    reset_ring,
    ring_key,
)
from support import make_kv, wait_for

from kvpushd.memory.doorbell import Doorbell as DaemonDoorbell


def daemon_side(bell: Doorbell, ring: bool = False, mode: int = os.O_RDWR) -> DaemonDoorbell:
    """The daemon's view of the page, as if handed over (a descriptor of its own)."""
    return DaemonDoorbell(os.open(bell.proc_path, mode | os.O_CLOEXEC), bell.name, ring)


@pytest.fixture
def page():  # type: ignore[no-untyped-def]
    bell = Doorbell()
    reset_ring(bell.fd)
    reader = RingReader(bell.fd)
    writer = daemon_side(bell, ring=True)
    yield bell, reader, writer
    writer.close()
    reader.close()
    bell.close()


def test_records_are_read_in_order_once(page) -> None:  # type: ignore[no-untyped-def]
    _, reader, writer = page
    assert writer.has_ring and not reader.ready() and reader.take() == []
    for t in ("a", "b", "c"):
        writer.post(t)
    assert reader.ready()
    assert reader.take() == [ring_key("a"), ring_key("b"), ring_key("c")]
    assert not reader.ready() and reader.take() == []
    writer.post("d")
    assert reader.take() == [ring_key("d")]


def test_a_slot_not_visible_yet_waits_for_the_next_read(page) -> None:  # type: ignore[no-untyped-def]
    """The count may be seen before its slot (no fences on either side): the slot's tag says so."""
    bell, reader, writer = page
    writer.post("a")
    fd = os.open(bell.proc_path, os.O_WRONLY)
    try:
        os.pwrite(fd, (2).to_bytes(8, "little"), RING_HEAD)  # record 2 counted, its slot still empty
        assert reader.take() == [ring_key("a")]
        assert reader.take() == [] and reader.last == 1
        os.pwrite(fd, ((2 << 48) | ring_key("b")).to_bytes(8, "little"), RING_BASE + 8)  # now it is there
        assert reader.take() == [ring_key("b")]
    finally:
        os.close(fd)


def test_a_reader_a_ring_behind_skips_to_the_newest(page) -> None:  # type: ignore[no-untyped-def]
    _, reader, writer = page
    for i in range(RING_SLOTS + 20):
        writer.post(f"t{i}")
    got = reader.take()
    assert got == [ring_key(f"t{i}") for i in range(20, RING_SLOTS + 20)]  # the oldest 20: by the stream


def test_an_emptied_ring_is_read_from_its_start_and_a_lower_count_changes_nothing(page) -> None:  # type: ignore[no-untyped-def]
    bell, reader, writer = page
    for t in ("a", "b", "c"):
        writer.post(t)
    assert len(reader.take()) == 3
    reset_ring(bell.fd)  # a new attachment of the same page: a new writer, a new reader
    fresh, again = daemon_side(bell, ring=True), RingReader(bell.fd)
    try:
        fresh.post("x")
        assert again.take() == [ring_key("x")]
        assert not reader.ready() and reader.take() == [] and reader.last == 3  # 1 < 3: ignored, kept
        for t in ("y", "z", "w"):
            fresh.post(t)
        assert reader.take() == [ring_key("w")]  # record 4 is new to it
    finally:
        again.close()
        fresh.close()


def test_a_truncated_page_costs_the_daemon_nothing(page) -> None:  # type: ignore[no-untyped-def]
    """pwrite, not a store through a mapping: a page the worker shrank cannot fault the daemon."""
    bell, _, writer = page
    os.ftruncate(bell.fd, 0)
    writer.post("a")  # no SIGBUS; the file grows back to the slot it needed, never past the page
    assert os.fstat(bell.fd).st_size <= SIZE


def test_no_ring_without_write_access_or_for_a_sender() -> None:
    bell = Doorbell()
    try:
        assert not daemon_side(bell).has_ring  # a sender's page is read-only to the daemon
        ro = daemon_side(bell, ring=True, mode=os.O_RDONLY)  # a descriptor not open for writing
        assert not ro.has_ring
        ro.post("a")  # nothing, no error
        ro.close()
    finally:
        bell.close()


# -- real daemons ------------------------------------------------------------------------------


@contextlib.contextmanager
def _pair(p, d, name: str, ring: bool):  # type: ignore[no-untyped-def]
    """Source and destination KV, a prefill worker and a decode worker (with a page: ``ring``)."""
    src = make_kv(f"{name}-src", fill="random", seed=3)
    dst = make_kv(f"{name}-dst", fill="poison")
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list, doorbell=ring)
    try:
        yield src, dst, pw, dw
    finally:
        pw.detach()
        dw.detach()
        src.close()
        dst.close()


def _push(p, pw, dw, tid: str, src, dst, blocks: list[int]):  # type: ignore[no-untyped-def]
    dw.expect(tid, blocks, p.peer_address, "prefill", 1)
    pw.publish(tid, blocks)
    c = dw.next_completion(30)
    assert c is not None and c.transfer_id == tid and c.kind is CompletionKind.FINISHED_RECEIVING, c
    assert (dst.arr[:, blocks] == src.arr[:, blocks]).all()  # told only once every byte is there
    s = pw.next_completion(30)
    assert s is not None and s.kind is CompletionKind.FINISHED_SENDING, s
    return c


def test_each_receive_is_reported_once_ring_first_figures_later(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    with _pair(p, d, "ring1", ring=True) as (src, dst, pw, dw):
        for i in range(6):
            c = _push(p, pw, dw, f"r{i}", src, dst, [2 * i, 2 * i + 1])
            assert c.figures is None  # the ring's report: no figures, no stream message waited for
        late: list = []

        def drained() -> bool:
            assert dw.completions() == []  # the stream's copies are held back...
            late.extend(dw.take_late())  # ...their figures kept
            return len(late) == 6

        assert wait_for(drained)
        assert [c.transfer_id for c in late] == [f"r{i}" for i in range(6)]
        assert all(c.kind is CompletionKind.FINISHED_RECEIVING and c.figures is not None for c in late)
        time.sleep(0.2)
        assert dw.completions() == [] and dw.take_late() == []
        assert not dw._keys and not dw._rung  # nothing left watched


def test_without_a_page_the_stream_reports_as_before(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    with _pair(p, d, "ring2", ring=False) as (src, dst, pw, dw):
        c = _push(p, pw, dw, "s1", src, dst, [1, 2])
        assert c.figures is not None and dw.take_late() == []


def test_a_failed_receive_comes_by_the_stream_and_is_not_watched_any_more(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    with _pair(p, d, "ring3", ring=True) as (src, dst, pw, dw):
        dw.expect("f1", [1, 2], p.peer_address, "prefill", 1)
        assert dw.abort("f1")
        c = dw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FAILED and c.transfer_id == "f1", c
        assert not dw._keys
        _push(p, pw, dw, "f2", src, dst, [3, 4])  # the worker goes on


def test_a_page_kept_across_attachments_starts_empty(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    """As the vLLM connector re-attaches after a daemon restart, with the page it keeps."""
    p, d = daemon_pair
    src = make_kv("ring4-src", fill="random", seed=5)
    dst = make_kv("ring4-dst", fill="poison")
    bell = Doorbell()
    pw = p.client.attach("prefill", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
    try:
        for n in range(2):
            dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list, doorbell=bell)
            try:
                for i in range(3):
                    c = _push(p, pw, dw, f"a{n}-{i}", src, dst, [i + 10 * n])
                    assert c.figures is None
            finally:
                dw.detach()
        assert bell.fd >= 0 and os.fstat(bell.fd).st_size == SIZE  # the caller's page: not closed at detach
    finally:
        pw.detach()
        bell.close()
        src.close()
        dst.close()


def test_a_worker_that_scribbles_over_its_ring_loses_only_its_hints(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    with _pair(p, d, "ring5", ring=True) as (src, dst, pw, dw):
        with open(dw.doorbell.proc_path, "r+b") as f:
            f.write(os.urandom(SIZE))  # garbage count and slots
        c = _push(p, pw, dw, "g1", src, dst, [1])
        assert c.transfer_id == "g1"  # by the stream if the ring cannot say it
        c = _push(p, pw, dw, "g2", src, dst, [2])
        assert c.transfer_id == "g2"
        assert d.client.status().node_id  # the daemon goes on


def test_two_expected_transfers_with_one_key_are_left_to_the_stream(page, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """48-bit keys can collide: then the ring cannot say which one finished, so it says neither."""
    from kvpushd_client import stream

    bell, reader, _writer = page
    monkeypatch.setattr(stream, "ring_key", lambda tid: 7)
    w = stream.StreamWorker.__new__(stream.StreamWorker)  # only the ring's bookkeeping, no daemon
    w._ring, w._ring_lock = reader, __import__("threading").Lock()
    w._keys, w._key_of, w._rung = {}, {}, set()
    w._watch("a")
    w._watch("b")
    fd = os.open(bell.proc_path, os.O_WRONLY)
    try:
        os.pwrite(fd, ((1 << 48) | 7).to_bytes(8, "little"), RING_BASE)
        os.pwrite(fd, (1).to_bytes(8, "little"), RING_HEAD)
    finally:
        os.close(fd)
    assert w._from_ring() == [] and not w._rung


def test_what_next_completion_did_not_return_comes_with_completions(daemon_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    with _pair(p, d, "ring6", ring=True) as (_src, _dst, pw, dw):
        for t, b in (("m1", 1), ("m2", 2)):
            dw.expect(t, [b], p.peer_address, "prefill", 1)
            pw.publish(t, [b])
        assert wait_for(lambda: dw._ring.ready() and dw._ring._words[dw._ring._head] >= 2)  # both in the ring
        first = dw.next_completion(30)
        assert first is not None
        rest: list = []
        assert wait_for(lambda: rest.extend(dw.completions()) or len(rest) == 1)  # type: ignore[func-returns-value]
        assert {first.transfer_id, rest[0].transfer_id} == {"m1", "m2"}
