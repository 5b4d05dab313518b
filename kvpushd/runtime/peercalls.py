"""The calls to other daemons that the core's actions ask for, and the heartbeats: I/O only.

The node (node.py) is the one driver of the core: it hands each peer action here, and what a peer
answers comes back to it through ``Answers`` (as the NIXL thread's results come back through that
thread's ``Reports``), to be fed to the core there. Nothing here changes the core; it reads it
(a transfer's ledger, whether an offer is still pending, whom we wait on) and keeps the links to
peers: the daemons that call us (``inbound``) and those we call (``outbound``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Protocol

import structlog

from ..config import Config
from ..core.actions import SendFailNotice, SendOffer, SendReadFailed, SendRegister, SendWithdraw
from ..core.errors import KvpushdError, PeerRejected, PeerUnreachable
from ..core.ledger import Ledger
from ..core.recv import RecvSide
from ..core.send import SendSide
from ..rpc import outbound as pb
from ..tracing import Tracing
from . import observe as o
from .identity import Identity
from .inbound import Inbound, Origin
from .outbound import Outbound, PeerClient
from .workers import Workers

log = structlog.get_logger(__name__)


class Answers(Protocol):
    """What the node hears back from the calls made here (it feeds each to the core)."""

    def registered(self, batch: Sequence[SendRegister], results: Sequence[KvpushdError | None]) -> None: ...

    def withdraw_answered(self, registration_id: int) -> None: ...

    def offer_failed(self, a: SendOffer, why: str) -> None: ...

    def producer_lost(self, address: str, reason: str, restarted: bool = False) -> None: ...

    def origin_lost(self, origin: Origin, reason: str) -> None: ...

    def forget_remote(self, name: str) -> None: ...


class PeerCalls:
    """The peer calls the core asked for, the tasks that make them, heartbeats and idle peers."""

    def __init__(self, cfg: Config, ident: Identity, send: SendSide, recv: RecvSide, workers: Workers,
                 obs: o.Observations, tracing: Tracing, answers: Answers) -> None:
        self.cfg = cfg
        self.send, self.recv = send, recv  # read only
        self.workers = workers
        self.obs = obs
        self.tracing = tracing
        self.answers = answers
        self.inbound = Inbound(answers.forget_remote, cfg.transfer.peer_timeout_s,
                               cfg.peer_api.max_sessions_per_peer, cfg.peer_api.connect_timeout_s)
        self.outbound = Outbound(ident, cfg.peer_api,
                                 lambda address, why: answers.producer_lost(address, why, restarted=True))
        self.tasks: set[asyncio.Task[None]] = set()
        self.withdrawing = 0  # Withdraw RPCs not answered yet (the decode agent keeps progressing)
        self._registers: dict[str, list[SendRegister]] = {}  # per prefill daemon: this loop turn's Registers

    # -- what the node hands over (one per action kind) -------------------------------------------

    def register(self, a: SendRegister) -> None:
        """Registers to one prefill daemon made in one turn of the loop go out together: one PeerBatch on
        its stream, with whatever else this turn sends that peer."""
        batch = self._registers.setdefault(a.producer_address, [])
        batch.append(a)
        if len(batch) == 1:
            asyncio.get_running_loop().call_soon(self._flush_registers, a.producer_address)

    def fail(self, a: SendFailNotice) -> None:
        self.spawn(self._send_fail(a))

    def withdraw(self, a: SendWithdraw) -> None:
        self.withdrawing += 1  # counted now: the node tells the NIXL thread at the end of this turn
        self.spawn(self._send_withdraw(a))

    def offer(self, a: SendOffer) -> None:
        self.spawn(self._send_offer(a))

    def read_failed(self, a: SendReadFailed) -> None:
        k = a.key
        self.spawn(self._call(k.producer_address, lambda p: p.send("read_failed", pb.read_failed(k, a.reason)),
                              "could not report a failed READ", k.transfer_id))

    def decline(self, address: str, transfer_id: str, producer_engine_id: str, consumer_engine_id: str,
                reason: str) -> None:
        """Decode side: tell the prefill daemon at ``address`` this transfer will never be registered
        (on failure its publish ends at publish_timeout_s, as before)."""
        self.spawn(self._call(address, lambda p: p.send("decline", pb.decline(transfer_id, producer_engine_id,
                                                                         consumer_engine_id, reason)),
                              "could not decline transfer", transfer_id, warn=True, counted="declines_sent"))

    # -- the calls --------------------------------------------------------------------------------

    def _heard(self, address: str, node_id: str = "") -> None:
        self.obs.emit(o.PeerHeard(address, node_id))

    def _failed(self, address: str, e: KvpushdError) -> None:
        self.obs.emit(o.PeerFailed(address, str(e), isinstance(e, PeerUnreachable)))

    def _flush_registers(self, address: str) -> None:
        batch = self._registers.pop(address, [])
        if batch:
            self.spawn(self._send_registers(address, batch))

    async def _send_registers(self, address: str, batch: list[SendRegister]) -> None:
        items = [(a, w) for a in batch if (w := self.workers.by_id.get(a.worker_id)) is not None]
        if not items:
            return
        peer = self.outbound.peer(address)
        # tracing: the Registers' ledgers stamp the call, and each carries its transfer's span context
        leds = [self.recv.ledger(a.worker_id, a.transfer_id) for a, _ in items] if self.tracing.enabled else []
        contexts = [self._register_sent(led) for led in leds] if leds else None
        results: Sequence[KvpushdError | None]
        try:
            results = await peer.register_batch(items, contexts)
        except (PeerRejected, PeerUnreachable) as e:
            results = [e] * len(items)
        if leds:
            self._registered(leds, results)
        if any(err is None for err in results):
            self._heard(address, peer.remote_node_id)
        if (first := next((err for err in results if err is not None), None)) is not None:
            self._failed(address, first)
        self.answers.registered([a for a, _ in items], results)

    def _register_sent(self, led: Ledger | None) -> str:
        if led is None:
            return ""
        led.register_sent = led.register_sent or time.monotonic()
        return self.tracing.register_context(led)

    @staticmethod
    def _registered(leds: list[Ledger | None], results: Sequence[KvpushdError | None]) -> None:
        now = time.monotonic()
        for led, err in zip(leds, results, strict=True):
            if led is not None and not led.registered:
                led.registered, led.register_error = now, "" if err is None else str(err)

    async def _call(self, address: str, send: Callable[[PeerClient], Coroutine[None, None, None]], what: str,
                    transfer_id: str, warn: bool = False, counted: str = "") -> None:
        """One notice to a peer (``send``, to its client, taken when the call starts); a failure is
        logged (``what``: what could not be done) and booked, a success counted as ``counted`` if set."""
        try:
            await send(self.outbound.peer(address))
        except KvpushdError as e:
            self._failed(address, e)
            (log.warning if warn else log.info)(what, transfer_id=transfer_id[:256], peer=address, error=str(e))
            return
        self._heard(address)
        if counted:
            self.obs.emit(o.Counted(counted))

    async def _send_fail(self, a: SendFailNotice) -> None:
        origin = self.inbound.origins.get(a.origin)
        if origin is not None:
            await self._call(origin.address,
                             lambda p: p.send("fail", pb.notice(a.transfer_id, a.registration_id, a.code, a.reason)),
                             "could not send failure notice", a.transfer_id, warn=True)

    async def _send_withdraw(self, a: SendWithdraw) -> None:
        # Until the prefill daemon answers, a WRITE into these blocks may still be landing, and over
        # shared memory or TCP it completes only while this side's agent makes progress: the NIXL
        # thread keeps polling while ``withdrawing``.
        try:
            await self._call(a.producer_address, lambda p: p.send("withdraw", pb.notice(
                a.transfer_id, a.registration_id, a.code, a.reason)), "could not withdraw registration", a.transfer_id)
        finally:
            self.withdrawing -= 1
            # answered: no WRITE into these blocks is in flight any more (or the daemon is gone)
            self.answers.withdraw_answered(a.registration_id)

    async def _send_offer(self, a: SendOffer) -> None:
        reg = a.registration
        w = self.workers.live(a.producer_worker)
        origin = self.inbound.origins.get(reg.origin)
        if w is None or origin is None:
            self.answers.offer_failed(a, "prefill worker is gone" if origin is not None else "decode daemon is gone")
            return
        try:
            sent = await self.outbound.peer(origin.address).offer(
                a, w, lambda: self.send.pull_pending(reg.origin, reg.registration_id, a.producer_rank))
        except PeerRejected as e:  # the decode daemon answered: it did not start a READ
            self._failed(origin.address, e)
            self.answers.offer_failed(a, f"offer refused: {e}")
        except PeerUnreachable as e:
            # It may have started the READ: the leg stays in flight until the READ is confirmed,
            # the decode daemon is lost, or publish_timeout_s passes.
            self._failed(origin.address, e)
            log.warning("could not send an offer", transfer_id=reg.transfer_id, engine_id=a.leg.engine_id,
                        error=str(e))
        else:
            if sent:
                self._heard(origin.address)

    # -- heartbeats, silence, idle peers ----------------------------------------------------------

    def housekeeping(self, now: float) -> None:
        """Heartbeats to the prefill daemons we wait on; silence from either side is told to the node
        (which fails what is pending); idle peers are forgotten. Called every heartbeat interval."""
        t = self.cfg.transfer
        loop_now = asyncio.get_running_loop().time()
        waited_on = self.recv.producer_addresses()
        for address in waited_on:
            peer = self.outbound.peer(address)
            if peer.link.silent(loop_now, t.peer_timeout_s):
                self.answers.producer_lost(address, f"prefill daemon {address} did not answer for "
                                                    f"{t.peer_timeout_s:g}s ({peer.link.last_error})")
            elif peer.link.beat_due(loop_now, t.heartbeat_interval_s):
                peer.link.beat(loop_now)
                self.spawn(self._beat(peer))
        busy = self.send.origins()
        grace = min(t.peer_timeout_s, max(3 * t.heartbeat_interval_s, 1.0))
        for origin, why in self.inbound.silent(now, busy, t.peer_timeout_s, grace):
            self.answers.origin_lost(origin, f"decode daemon {origin.node_id} at {origin.address}: {why}")
        self.inbound.forget_idle(now, busy, self.idle_s)
        for p in self.outbound.idle(loop_now, waited_on, self.idle_s):
            self.spawn(p.close())

    @property
    def idle_s(self) -> float:
        """A peer nothing is pending with, unheard for this long, is closed or forgotten (peer_api.idle_close_s)."""
        return self.cfg.peer_api.idle_close_s

    def live_addresses(self) -> set[str]:
        """Addresses of the peers we have a channel to or a session with."""
        return set(self.outbound.peers) | {o.address for o in self.inbound.origins.values()}

    async def _beat(self, peer: PeerClient) -> None:
        try:
            await peer.heartbeat(min(self.cfg.transfer.peer_timeout_s, 2.0))
        except KvpushdError:
            pass  # counted by the link's failing_since; housekeeping decides
        finally:
            peer.link.beat_over()

    # -- tasks ----------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

