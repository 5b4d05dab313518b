"""Carries out what the core decides: every action, the NIXL thread's callbacks, and one timer.

The rendezvous (rendezvous.py) decides; ``run`` performs the actions that come out (deliver a
completion, post a WRITE or READ, call a peer) and what comes back (WRITEs done, notifications,
peer answers) goes into the rendezvous as a core event, then onto the observation stream. At the
end of each loop turn that ran the core, the one timer is re-armed at the core's next deadline
(aioquic's ``call_at`` pattern): no polling tick. The links to peers (inbound sessions, outbound
clients) are built here, so what they report (a peer restarted, an agent to unload) comes straight
back to this object.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog

from ..config import Config, backend_init_params
from ..core.errors import KvpushdError, PeerRejected, PeerUnreachable
from ..core.ledger import Ledger
from ..core.notif import Notified
from ..core.rendezvous import (
    Action,
    Deliver,
    Dropped,
    SendFailNotice,
    SendOffer,
    SendReadFailed,
    SendRegister,
    SendWithdraw,
    StartRead,
    StartWrite,
    StopWrite,
)
from ..core.types import Completion, CompletionKind, FailureCode, Figures
from ..tracing import Tracing
from ..transfer.records import ReadResult, WriteResult
from ..transfer.thread import TransferThread
from . import observe as o
from .identity import Identity
from .inbound import Inbound, Origin
from .outbound import Outbound, PeerClient
from .rendezvous import Rendezvous
from .workers import Workers

log = structlog.get_logger(__name__)


class Executor:
    """Carries out the rendezvous' actions: the NIXL thread, the peers, and the tasks that call them."""

    def __init__(self, cfg: Config, ident: Identity, rv: Rendezvous, workers: Workers, obs: o.Observations,
                 tracing: Tracing) -> None:
        self.cfg = cfg
        self.rv = rv
        self.workers = workers
        self.obs = obs
        self.tracing = tracing
        self.inbound = Inbound(self.forget_remote, cfg.transfer.peer_timeout_s, cfg.peer_api.max_sessions_per_peer)
        self.outbound = Outbound(ident, cfg.peer_api, self._peer_restarted)
        self.xfer: TransferThread | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self._withdrawing = 0  # Withdraw RPCs not answered yet (the decode agent keeps progressing)
        self._settle_waiters: list[asyncio.Future[None]] = []  # withdrawals waiting on WRITEs in flight
        self._loop: asyncio.AbstractEventLoop | None = None
        self._registers: dict[str, list[SendRegister]] = {}  # per prefill daemon: this loop turn's Registers
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0
        self._after_turn = False  # _turn_ended is scheduled
        # what carries out each kind of action (the core's action classes are final)
        self._do: dict[type, Callable[[Any], None]] = {
            Deliver: self._deliver, StartWrite: self._start_write, StopWrite: self._stop_write,
            StartRead: self._start_read, SendRegister: self._queue_register,
            SendFailNotice: lambda a: self.spawn(self._send_fail(a)),
            SendWithdraw: lambda a: self.spawn(self._send_withdraw(a)),
            SendOffer: lambda a: self.spawn(self._send_offer(a)),
            SendReadFailed: lambda a: self.spawn(self._send_read_failed(a)),
            Dropped: self._dropped,
        }

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> TransferThread:
        t = self.cfg.transfer
        self._loop = loop
        self.xfer = TransferThread(loop, t, TransferThread.Reports(self._on_writes, self._on_notifs, self._on_reads,
                                                                   self._on_read_notifs, self._on_sealed),
                                   params_for=lambda b, dev: backend_init_params(t, b, dev))
        self.xfer.start()
        return self.xfer

    def stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def forget_remote(self, name: str) -> None:
        if self.xfer is not None:
            self.xfer.forget_remote(name)  # deferred by the thread while a transfer uses it

    # -- carrying out core actions --------------------------------------------------------------

    def run(self, actions: Sequence[Action]) -> None:
        do = self._do
        for a in actions:
            do[type(a)](a)
        if not self._after_turn and self._loop is not None:  # once per loop turn, however many runs it has
            self._after_turn = True
            self._loop.call_soon(self._turn_ended)

    def _turn_ended(self) -> None:
        """After the runs of one loop turn: the NIXL thread hears of changed counts, withdrawals waiting
        on WRITEs look again, and the timer is armed at the core's next deadline."""
        self._after_turn = False
        self._tell_thread()
        if self._settle_waiters:
            waiters, self._settle_waiters = self._settle_waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)
        self._arm()

    def _tell_thread(self) -> None:
        """The NIXL thread polls while READs are offered or receives wait: it hears of a changed count only."""
        if (x := self.xfer) is not None:
            if (n := self.rv.send.pulling()) != x.pulling:
                x.set_pulling(n)
            if (n := len(self.rv.recv) + self._withdrawing) != x.expecting:
                x.set_expecting(n)

    def _arm(self) -> None:
        """One timer at the core's next deadline; re-armed at the end of every loop turn that ran the core."""
        if self._loop is None:
            return
        nxt = self.rv.next_deadline()
        if nxt is None:
            self.stop_timer()
            return
        if self._timer is not None and self._timer_at <= nxt:
            return  # armed for as early or earlier: it re-arms when it fires
        self.stop_timer()
        self._timer_at = nxt
        # a millisecond late rather than early: the loop's clock may round the delay down
        self._timer = self._loop.call_later(max(nxt - time.monotonic(), 0.0) + 1e-3, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        try:
            self.run(self.rv.tick(time.monotonic()))
        except Exception:  # a bug here must not stop deadlines for good
            log.exception("deadline handling failed")
            self._arm()

    def _deliver(self, a: Deliver) -> None:
        worker_id, c, led = a.worker_id, a.completion, a.ledger
        if led is None:  # refused before any record of it was made
            led = Ledger("send" if c.kind is CompletionKind.FINISHED_SENDING else "recv", worker_id, "",
                         c.transfer_id, len(c.block_ids), time.monotonic())
        ended = led.done  # its worker went first: the end was told then
        led.done = ended or time.monotonic()
        c = Completion(c.kind, c.transfer_id, c.code, c.reason, c.block_ids,
                       led.figures(c.kind is CompletionKind.FINISHED_RECEIVING))
        if not ended:
            self.obs.emit(o.Ended(c, led))
        self.workers.deliver(worker_id, c)

    def worker_gone(self, worker_id: str, why: str) -> None:
        """A worker detached: each of its transfers still pending ends now for the books (its own
        completion, if one follows when its WRITEs in flight settle, goes nowhere)."""
        now = time.monotonic()
        for led in [*self.rv.send.ledgers_of(worker_id), *self.rv.recv.ledgers_of(worker_id)]:
            led.done = now
            self.obs.emit(o.Ended(Completion(CompletionKind.FAILED, led.transfer_id, FailureCode.WORKER_GONE,
                                             f"worker detached: {why}", (), Figures()), led))
        self.run(self.rv.worker_gone(worker_id))

    def _start_write(self, a: StartWrite) -> None:
        assert self.xfer is not None
        reg = a.registration
        origin = self.inbound.origins.get(reg.origin)
        peer = origin.address if origin is not None else ""
        if (led := self.rv.send.ledger_of(a.leg)) is not None:
            led.peer = peer
        agent = self.inbound.consumers.get(reg.consumer_agent)
        if agent is None:  # evicted meanwhile (cannot happen while registered): fail loudly rather than hang
            self._on_writes([WriteResult(a.leg, False, "consumer agent unknown", 0, 0, 0, 0, 0)])
            return
        self.xfer.post(a, agent)

    def _stop_write(self, a: StopWrite) -> None:
        if self.xfer is not None:
            self.xfer.stop_write(a.leg, a.reason)

    def _dropped(self, a: Dropped) -> None:
        self.obs.emit(o.Dropped(a.event, a.transfer_id, a.why))
        log.debug("late event dropped", late_event=a.event, transfer_id=a.transfer_id, why=a.why)

    def _start_read(self, a: StartRead) -> None:
        assert self.xfer is not None
        agent = self.inbound.producers.get(a.producer_agent)
        if agent is None:
            self._on_reads([ReadResult(a.key, False, "producer agent unknown", 0, 0, 0, 0, 0)])
            return
        self.xfer.post(a, agent)

    # -- NIXL callbacks (on the loop): core event, then emit -------------------------------------

    def _on_writes(self, results: list[WriteResult]) -> None:
        actions: list[Action] = []
        now, debug = time.monotonic(), log.is_enabled_for(logging.DEBUG)
        for r in results:
            if not r.ok:  # the ledger has the rest (the completion's figures, Watch, the metrics, the spans)
                led, origin = self.rv.send.ledger_of(r.leg), self.inbound.origins.get(self.rv.send.origin_of(r.leg))
                self.obs.emit(o.WriteDone(r, r.leg.transfer_id, led.worker_id if led else "",
                                          origin.address if origin else ""))
            actions += self.rv.send.write_done(r.leg, r.ok, r.reason, r, now)
            if debug:  # its arguments are built only then (bench critical-path reads these lines)
                log.debug("write done", transfer_id=r.leg.transfer_id, engine_id=r.leg.engine_id, ok=r.ok,
                          post_us=round(r.post_s * 1e6), queue_us=round(r.queue_s * 1e6),
                          xfer_us=round(r.xfer_s * 1e6), descriptors=r.descs_posted, bytes=r.nbytes)
        self.run(actions)

    def watch_step(self, worker_id: str, step: int) -> None:
        """Progressive push: tell the core when the worker's engine step ``step`` is complete."""
        if self.xfer is not None:
            self.xfer.watch_step(worker_id, step)

    def _on_sealed(self, steps: list[tuple[str, int]]) -> None:
        actions: list[Action] = []
        for worker_id, step in steps:
            actions += self.rv.send.sealed(worker_id, step)
        self.run(actions)

    def _on_notifs(self, notifs: list[Notified]) -> None:
        actions: list[Action] = []
        now = time.monotonic()
        for n in notifs:
            actions += self.rv.recv.notified(*n, now=now)
        self.obs.emit(o.Counted("notifications_received", len(notifs)))
        self.run(actions)

    def _on_read_notifs(self, notifs: list[tuple[str, int, int]]) -> None:
        """Pull mode, prefill side: READ notifications on our producer agents (the READ completed)."""
        actions: list[Action] = []
        for agent_name, rid, rank in notifs:
            origin = self.inbound.origin_of_consumer_agent(agent_name)
            if origin is None:
                log.info("READ notification from an unknown agent", remote_agent=agent_name[:128])
                continue
            actions += self.rv.send.read_done(origin.instance_id, rid, rank, True)
        self.run(actions)

    def _on_reads(self, results: list[ReadResult]) -> None:
        """Pull mode, decode side: READs this daemon posted have completed (or failed)."""
        actions: list[Action] = []
        now, debug = time.monotonic(), log.is_enabled_for(logging.DEBUG)
        for r in results:
            actions += self.rv.recv.read_done(r.key, r.ok, r.reason, r, now)
            if debug:
                log.debug("read done", transfer_id=r.key.transfer_id, ok=r.ok, reason=r.reason,
                          post_us=round(r.post_s * 1e6), xfer_us=round(r.xfer_s * 1e6), bytes=r.nbytes)
        self.run(actions)

    # -- peer calls the core asked for ------------------------------------------------------------

    def _heard(self, address: str, node_id: str = "") -> None:
        self.obs.emit(o.PeerHeard(address, node_id))

    def _failed(self, address: str, e: KvpushdError) -> None:
        self.obs.emit(o.PeerFailed(address, str(e), isinstance(e, PeerUnreachable)))

    def _queue_register(self, a: SendRegister) -> None:
        """Registers to one prefill daemon made in one turn of the loop go out together: one PeerBatch on
        its stream, with whatever else this turn sends that peer."""
        batch = self._registers.setdefault(a.producer_address, [])
        batch.append(a)
        if len(batch) == 1:
            asyncio.get_running_loop().call_soon(self._flush_registers, a.producer_address)

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
        leds = [self.rv.recv.ledger(a.worker_id, a.transfer_id) for a, _ in items] if self.tracing.enabled else []
        contexts = [self._register_sent(led) for led in leds] if leds else None
        try:
            results = await peer.register_batch(items, contexts)
        except PeerRejected as e:
            self._failed(address, e)
            results = [e] * len(items)
        except PeerUnreachable as e:
            if leds:
                self._registered(leds, [e] * len(leds))
            self._failed(address, e)
            self.run([x for a, _ in items
                      for x in self.rv.recv.failed(a.registration_id, FailureCode.PEER_UNREACHABLE, str(e))])
            return
        if leds:
            self._registered(leds, results)
        actions: list[Action] = []
        for (a, _), err in zip(items, results, strict=True):
            if err is None:
                actions += self.rv.recv.registered(a.registration_id)
            else:
                code = FailureCode.PEER_UNREACHABLE if isinstance(err, PeerUnreachable) else FailureCode.PEER_REJECTED
                actions += self.rv.recv.failed(a.registration_id, code, str(err))
        if any(err is None for err in results):
            self._heard(address, peer.remote_node_id)
        if (first := next((err for err in results if err is not None), None)) is not None:
            self._failed(address, first)
        self.run(actions)

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

    async def _call(self, address: str, call: Coroutine[None, None, None], what: str, transfer_id: str,
                    warn: bool = False) -> bool:
        """One notice to a peer; a failure is logged (``what``: what could not be done) and booked."""
        try:
            await call
        except KvpushdError as e:
            self._failed(address, e)
            (log.warning if warn else log.info)(what, transfer_id=transfer_id[:256], peer=address, error=str(e))
            return False
        self._heard(address)
        return True

    async def _send_fail(self, a: SendFailNotice) -> None:
        origin = self.inbound.origins.get(a.origin)
        if origin is not None:
            await self._call(origin.address, self.outbound.peer(origin.address).fail(
                a.transfer_id, a.registration_id, a.code, a.reason), "could not send failure notice", a.transfer_id,
                warn=True)

    async def _send_withdraw(self, a: SendWithdraw) -> None:
        # Until the prefill daemon answers, a WRITE into these blocks may still be landing, and over
        # shared memory or TCP it completes only while this side's agent makes progress: keep polling.
        self._withdrawing += 1
        self._tell_thread()
        try:
            await self._call(a.producer_address, self.outbound.peer(a.producer_address).withdraw(
                a.transfer_id, a.registration_id, a.code, a.reason), "could not withdraw registration", a.transfer_id)
        finally:
            self._withdrawing -= 1
            # answered: no WRITE into these blocks is in flight any more (or the daemon is gone)
            self.run(self.rv.recv.withdraw_answered(a.registration_id))

    def decline(self, address: str, transfer_id: str, producer_engine_id: str, consumer_engine_id: str,
                reason: str) -> None:
        """Decode side: tell the prefill daemon at ``address`` this transfer will never be registered."""
        self.spawn(self._send_decline(address, transfer_id, producer_engine_id, consumer_engine_id, reason))

    async def _send_decline(self, address: str, transfer_id: str, producer_engine_id: str, consumer_engine_id: str,
                            reason: str) -> None:
        # on failure its publish ends at publish_timeout_s, as before
        if await self._call(address, self.outbound.peer(address).decline(
                transfer_id, producer_engine_id, consumer_engine_id, reason), "could not decline transfer",
                transfer_id, warn=True):
            self.obs.emit(o.Counted("declines_sent"))

    async def _send_offer(self, a: SendOffer) -> None:
        reg = a.registration
        w = self.workers.live(a.producer_worker)
        origin = self.inbound.origins.get(reg.origin)
        if w is None or origin is None:
            why = "prefill worker is gone" if origin is not None else "decode daemon is gone"
            self.run(self.rv.send.read_done(reg.origin, reg.registration_id, a.producer_rank, False, why))
            return
        try:
            sent = await self.outbound.peer(origin.address).offer(
                a, w, lambda: self.rv.send.pull_pending(reg.origin, reg.registration_id, a.producer_rank))
        except PeerRejected as e:  # the decode daemon answered: it did not start a READ
            self._failed(origin.address, e)
            self.run(self.rv.send.read_done(reg.origin, reg.registration_id, a.producer_rank, False,
                                            f"offer refused: {e}"))
        except PeerUnreachable as e:
            # It may have started the READ: the leg stays in flight until the READ is confirmed,
            # the decode daemon is lost, or publish_timeout_s passes.
            self._failed(origin.address, e)
            log.warning("could not send an offer", transfer_id=reg.transfer_id, engine_id=a.leg.engine_id,
                        error=str(e))
        else:
            if sent:
                self._heard(origin.address)

    async def _send_read_failed(self, a: SendReadFailed) -> None:
        address = a.key.producer_address
        await self._call(address, self.outbound.peer(address).read_failed(a.key, a.reason),
                         "could not report a failed READ", a.key.transfer_id)

    # -- peers lost, heartbeats -----------------------------------------------------------------

    def _peer_restarted(self, address: str, reason: str) -> None:
        self.producer_lost(address, reason, restarted=True)

    def producer_lost(self, address: str, reason: str, restarted: bool = False) -> None:
        """A prefill daemon is unreachable (or restarted): its pending receives fail now."""
        self.obs.emit(o.PeerLost(address, reason))
        self.run(self.rv.recv.producer_lost(address, FailureCode.PEER_UNREACHABLE, reason, registered_only=restarted))

    def origin_lost(self, origin: Origin, reason: str) -> None:
        """A daemon that called us is gone (silent, or restarted): what it had pending here fails."""
        regs, _ = self.rv.send.held_by(origin.instance_id)
        log.warning("decode daemon lost", peer_node=origin.node_id, peer_address=origin.address, reason=reason,
                    registrations=regs)
        self.obs.emit(o.PeerLost(origin.address, reason, inbound=True))
        if self.xfer is not None:  # its WRITEs (and READs) in flight end now, releasing their blocks
            self.xfer.cancel_to([*self.inbound.consumers.names_of(origin.instance_id),
                                 *self.inbound.producers.names_of(origin.instance_id)], f"peer lost: {reason}")
        self.inbound.drop(origin)
        self.run(self.rv.send.origin_lost(origin.instance_id, reason))

    def housekeeping(self, now: float) -> None:
        """Heartbeats to the prefill daemons we wait on; silence from either side fails what is pending;
        idle peers are forgotten. Called every heartbeat interval (not for deadlines: see ``_arm``)."""
        t = self.cfg.transfer
        assert self._loop is not None
        loop_now = self._loop.time()
        waited_on = self.rv.recv.producer_addresses()
        for address in waited_on:
            peer = self.outbound.peer(address)
            if peer.link.silent(loop_now, t.peer_timeout_s):
                self.producer_lost(address, f"prefill daemon {address} did not answer for {t.peer_timeout_s:g}s "
                                            f"({peer.link.last_error})")
            elif peer.link.beat_due(loop_now, t.heartbeat_interval_s):
                peer.link.beat(loop_now)
                self.spawn(self._beat(peer))
        busy = self.rv.send.origins()
        grace = min(t.peer_timeout_s, max(3 * t.heartbeat_interval_s, 1.0))
        for origin, why in self.inbound.silent(now, busy, t.peer_timeout_s, grace):
            self.origin_lost(origin, f"decode daemon {origin.node_id} at {origin.address}: {why}")
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

    async def wait_unwritten(self, key: tuple[str, str], registration_id: int, timeout_s: float) -> None:
        """Return once no WRITE into that registration is in flight (bounded by ``timeout_s``)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.rv.send.writing_into(key, registration_id) and loop.time() < deadline:
            settled: asyncio.Future[None] = loop.create_future()  # woken by run after any core change
            self._settle_waiters.append(settled)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(settled, deadline - loop.time())

    # -- tasks ----------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())
