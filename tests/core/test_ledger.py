"""A transfer keeps its own books (core/ledger.py): stamped by the core from the now it is fed,
summed from the NIXL thread's results, handed out whole with its completion; held blocks, Watch
and the status counters read it, and a worker gone ends each of its transfers once for them."""

from __future__ import annotations

import asyncio

from support.core import WorkerRef

from kvpushd import config
from kvpushd.app import observe
from kvpushd.core.actions import Deliver, Registration, StartWrite
from kvpushd.core.types import CompletionKind, Expect, FailureCode, Publish, TransferMode
from kvpushd.events import EventKind
from kvpushd.runtime import observe as o
from kvpushd.runtime.node import Node
from kvpushd.transfer.records import WriteResult


def _reg(rid: int, tid: str, blocks: tuple[int, ...]) -> Registration:
    return Registration(rid, "origin", tid, "prefill", 1, "agent", 0, 1, blocks, TransferMode.PUSH)


def test_a_push_is_stamped_summed_and_delivered_with_its_ledger() -> None:
    n = Node(config.from_dict({}))
    send = n.send
    w = WorkerRef("w1", "prefill", 0, 1, block_bytes=100)
    assert send.publish(10.0, w, Publish("tid", [1, 2, 3])) == []
    (start,) = send.register(10.25, _reg(7, "tid", (4, 5, 6)))
    assert isinstance(start, StartWrite)
    assert n.view.held_blocks() == {"send": 3, "recv": 0}
    led = send.ledger_of(start.leg)
    assert led is not None and (led.taken, led.met, led.posted, led.waited_s) == (10.0, 10.25, 10.25, 0.25)
    (done,) = send.write_done(start.leg, True, "", WriteResult(start.leg, True, "", 300, 0.002, 0.01, 3, 1), 10.5)
    assert isinstance(done, Deliver) and done.ledger is led
    assert done.completion.kind is CompletionKind.FINISHED_SENDING
    assert (led.nixl_transfers, led.nbytes, led.descs_requested, led.descs_posted, led.written) == (1, 300, 3, 1, 10.5)
    led.done = 11.0
    f = led.figures(False)
    assert (f.nbytes, f.nixl_transfers, f.descriptors, f.post_s, f.transfer_s, f.rendezvous_wait_s, f.elapsed_s) == (
        300, 1, 1, 0.002, 0.01, 0.25, 1.0)
    assert n.view.held_blocks() == {"send": 0, "recv": 0}


def test_a_retried_expect_is_one_transfer_and_a_finished_receive_counts_its_blocks() -> None:
    n = Node(config.from_dict({}))
    recv = n.recv
    w = WorkerRef("d1", "decode", 0, 1, block_bytes=64)
    cmd = Expect("tid", [4, 5], "10.0.0.1:50061", "prefill")
    (reg,) = recv.expect(5.0, w, cmd)
    assert recv.expect(6.0, w, cmd) == []  # a retry: the same books, taken at 5.0
    led = recv.ledger("d1", "tid")
    assert led is not None and (led.taken, led.expected_bytes, led.peer) == (5.0, 128, "10.0.0.1:50061")
    assert n.view.held_blocks() == {"send": 0, "recv": 2}
    recv.registered(reg.registration_id)
    (done,) = recv.notified(reg.registration_id, 0, now=7.0)
    assert isinstance(done, Deliver) and done.ledger is led and led.written == 7.0
    assert led.figures(True).nbytes == 128 and led.figures(False).nbytes == 0


def test_a_worker_gone_ends_each_of_its_transfers_once_for_the_books() -> None:
    n = Node(config.from_dict({}))
    observe(n)
    ended: list[o.Ended] = []
    n.obs.on(o.Ended, ended.append)
    watched = n.events.subscribe([EventKind.TRANSFER_FAILED])
    w = WorkerRef("d1", "decode", 0, 1, block_bytes=64)

    async def go() -> None:
        for tid in ("a", "b"):
            n.run(n.recv.expect(1.0, w, Expect(tid, [1, 2, 3], "10.0.0.1:50061", "prefill")))
        n.worker_gone("d1", "stream ended")
        await asyncio.gather(*n.peers.tasks)

    asyncio.run(go())
    assert sorted((e.ledger.transfer_id, e.completion.code) for e in ended) == [
        ("a", FailureCode.WORKER_GONE), ("b", FailureCode.WORKER_GONE)]
    assert n.tally.counters.transfers_failed == 2 and n.view.held_blocks() == {"send": 0, "recv": 0}
    assert watched._q.qsize() == 2
