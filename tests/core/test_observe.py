"""The observation stream: a record reaches the sinks registered for its type, in their order, once;
the node's NIXL callback is the core event, then one record that every book reads."""

from __future__ import annotations

import asyncio

from support.core import WorkerRef

from kvpushd import config
from kvpushd.app import observe
from kvpushd.core.actions import Dropped, Registration
from kvpushd.core.types import CompletionKind, Publish, TransferMode
from kvpushd.runtime import observe as o
from kvpushd.runtime.node import Node


def test_records_reach_their_sinks_in_order() -> None:
    obs = o.Observations()
    seen: list[tuple[str, object]] = []
    obs.on(o.PeerHeard, lambda r: seen.append(("a", r)))
    obs.on(o.PeerHeard, lambda r: seen.append(("b", r)))
    obs.on(o.PeerLost, lambda r: seen.append(("lost", r)))
    heard = o.PeerHeard("10.0.0.1:50061")
    obs.emit(heard)
    obs.emit(o.Counted("declines_sent"))  # nobody reads it
    assert seen == [("a", heard), ("b", heard)]


class _NoThread:
    pulling = expecting = 0

    def set_pulling(self, n: int) -> None:
        pass

    def set_expecting(self, n: int) -> None:
        pass


def test_a_rendezvous_whose_write_fails_is_told_once_to_every_book() -> None:
    n = Node(config.from_dict({}))
    observe(n)
    records: list[object] = []
    for kind in (o.WriteDone, o.Ended, Dropped):
        n.obs.on(kind, records.append)
    n.xfer = _NoThread()  # type: ignore[assignment]  # posts nothing: the consumer agent is unknown
    rv = ex = n

    async def rendezvous() -> None:  # the failure notice to the (unknown) decode daemon is a task
        ex.run(rv.send.publish(100.0, WorkerRef("w1", "prefill", 0, 1), Publish("tid", [1, 2])))
        reg = Registration(7, "origin", "tid", "prefill", 1, "agent", 0, 1, (3, 4), TransferMode.PUSH)
        ex.run(rv.send.register(100.5, reg))
        await asyncio.gather(*n.peers.tasks)

    asyncio.run(rendezvous())
    # The rendezvous met is the ledger's, the failed WRITE the stream's.
    done, delivered = records[:2]
    assert isinstance(done, o.WriteDone) and not done.result.ok and done.worker_id == "w1"
    assert isinstance(delivered, o.Ended) and delivered.completion.kind is CompletionKind.FAILED
    assert (delivered.ledger.worker_id, delivered.ledger.transfer_id, delivered.ledger.met) == ("w1", "tid", 100.5)
    assert delivered.completion.figures is not None and delivered.completion.figures.rendezvous_wait_s > 0
    c = n.tally.counters
    assert (c.transfers_failed, c.writes_posted) == (1, 0)
    assert n.tally.recent_failures[-1][1] == "tid"


def test_every_kind_of_core_action_has_its_handler() -> None:
    """The node carries out an action by its type: a kind of action added to the core without a
    handler would fail at its first use, on the transfer path."""
    import typing

    from kvpushd.core.actions import Action

    n = Node(config.from_dict({}))
    assert set(typing.get_args(Action)) == set(n._do)


def test_a_failed_write_is_booked_against_the_decode_daemon_it_was_for() -> None:
    """The peer book hears of a failed WRITE with the address of the daemon whose registration it
    wrote into (found from the leg's registration, not from a book of WRITEs in flight)."""
    from kvpushd.runtime.inbound import Origin

    n = Node(config.from_dict({}))
    observe(n)
    n.xfer = _NoThread()  # type: ignore[assignment]  # posts nothing: the consumer agent is unknown
    n.inbound.origins["origin"] = Origin("origin", "dnode", "10.0.0.9:50061")
    failed: list[o.WriteDone] = []
    n.obs.on(o.WriteDone, failed.append)
    rv = ex = n

    async def rendezvous() -> None:
        ex.run(rv.send.publish(100.0, WorkerRef("w1", "prefill", 0, 1), Publish("tid", [1, 2])))
        reg = Registration(7, "origin", "tid", "prefill", 1, "agent", 0, 1, (3, 4), TransferMode.PUSH)
        ex.run(rv.send.register(100.5, reg))
        await asyncio.gather(*n.peers.tasks, return_exceptions=True)

    asyncio.run(rendezvous())
    (w,) = failed
    assert (w.peer, w.worker_id, w.result.reason) == ("10.0.0.9:50061", "w1", "consumer agent unknown")
    assert n.peerbook.peers["10.0.0.9:50061"].errors >= 1  # (the failure notice to it, unreachable, too)
