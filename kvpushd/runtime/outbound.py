"""Daemons we call: one channel and one handshake per remote daemon (the client side of the peer API).

This room owns the outbound peers (``Outbound.peers``); it gets an identity and the peer API
settings, never the node. A restart it notices is reported through ``on_restart``. It is glue:
each peer's state is a pure state machine (core/peerlink.py) fed the loop's time, and every
message it sends is built in rpc/outbound.py.

A handshake is repeated whenever a call says the remote does not know us (it restarted), and a
changed remote instance id means every agent we had sent it must be sent again.

Connection discipline: one PeerClient (one gRPC channel, one Channel stream) per remote daemon,
shared by every worker on this node; at most ``max_concurrent_handshakes`` handshakes at once
(``HandshakeGate``: a fleet restarting together does not storm one daemon); an unreachable peer
backs off exponentially with jitter (core/peerlink.backoff_s); the ``preconnect`` peers are
handshaken at start, retried until they answer and never closed as idle; other peers are closed
after ``idle_close_s`` with nothing pending (housekeeping in peercalls.py).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable

import grpc
import structlog
from google.protobuf.message import Message

from ..config import PeerApiConfig
from ..core.actions import SendOffer, SendRegister
from ..core.errors import KvpushdError, PeerRejected, PeerUnreachable, SessionUnknown
from ..core.peerlink import LinkState, PeerLink
from ..peer_security import channel_credentials, channel_options, tls_enabled
from ..rpc import outbound as pb
from .channel import PeerChannel
from .identity import Identity
from .workers import Worker

log = structlog.get_logger(__name__)

KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # A restarted peer is back in seconds: do not sit in gRPC's exponential reconnect backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
]


# A call or stream that ended with one of these was not answered by the peer's logic (it went away,
# restarted, or its server cancelled the call): the items fail as PeerUnreachable, which lets the
# decode side decline them later, not as PeerRejected (the peer refused them).
UNREACHABLE_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def _why(e: grpc.aio.AioRpcError) -> str:
    return f"{e.code().name}: {e.details()}"


class HandshakeGate:
    """At most ``limit`` handshakes in flight from this daemon; the others wait their turn (each
    holder is bounded by connect_timeout_s, so every wait is bounded too)."""

    def __init__(self, limit: int) -> None:
        self._sem = asyncio.Semaphore(limit)
        self.in_flight = 0  # holding the gate: a Handshake call under way
        self.waiting = 0

    async def __aenter__(self) -> None:
        self.waiting += 1
        try:
            await self._sem.acquire()
        finally:
            self.waiting -= 1
        self.in_flight += 1

    async def __aexit__(self, *exc: object) -> None:
        self.in_flight -= 1
        self._sem.release()


class PeerClient:
    def __init__(self, address: str, ident: Identity, cfg: PeerApiConfig,
                 on_restart: Callable[[str, str], None], gate: HandshakeGate | None = None) -> None:
        self.address = address
        self._gate = gate or HandshakeGate(cfg.max_concurrent_handshakes)
        self.ident = ident
        self.cfg = cfg
        self._on_restart = on_restart
        size = cfg.max_message_bytes
        # the answers a peer sends are bounded as its calls are here (app.py): the derived message size,
        # metadata, and no BDP probing, so a peer cannot widen the window this side buffers for it
        opts = [*KEEPALIVE, ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
                ("grpc.max_metadata_size", 16 << 10), ("grpc.http2.bdp_probe", 0)]
        if tls_enabled(cfg):
            self.channel = grpc.aio.secure_channel(address, channel_credentials(cfg),
                                                   options=[*opts, *channel_options(cfg)])
        else:
            self.channel = grpc.aio.insecure_channel(address, options=opts)
        self.stub = pb.Stub(self.channel)
        self.remote_node_id = ""
        self.remote_instance = ""
        self.session: tuple[tuple[str, str], ...] = ()  # (("kvpushd-session", token),) from the handshake
        self.sent_agents: set[str] = set()
        self._md_on_way: set[str] = set()  # agents whose metadata a Register not yet answered carries
        self._hs_lock = asyncio.Lock()
        self._loop = asyncio.get_running_loop()
        self.link = PeerLink(created=self._loop.time())  # the link's state, fed the loop's time
        self.stream: PeerChannel | None = None  # the Channel stream of this session (opened on first use)
        self.streams_opened = 0
        self.batches_before = 0  # PeerBatch messages written on the streams before the current one

    async def close(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()
        await self.channel.close(grace=None)

    # -- the Channel stream ---------------------------------------------------------------------

    def _channel(self) -> PeerChannel:
        """The open stream of the current session, opened now if there is none."""
        ch = self.stream
        if ch is None or ch.closed is not None:
            if ch is not None:
                self.batches_before += ch.batches
            md = (*self.session, ("kvpushd-instance", self.ident.instance_id))
            ch = self.stream = PeerChannel(self.address, self.stub.Channel(metadata=md), self.cfg.max_stream_items,
                                           self.cfg.rpc_timeout_s, self._stream_broken, self.cfg.max_message_bytes)
            self.streams_opened += 1
        return ch

    def stream_counts(self) -> tuple[int, int, int]:
        """(streams opened, PeerBatch messages written on them, items queued or unanswered now)."""
        ch = self.stream
        if ch is None:
            return self.streams_opened, self.batches_before, 0
        return self.streams_opened, self.batches_before + ch.batches, len(ch) if ch.closed is None else 0

    def _stream_broken(self, why: BaseException | str) -> KvpushdError:
        """What the items of a stream that ended fail with; a broken stream counts as a failing peer
        (heartbeats decide, as for a failed heartbeat) and the next call handshakes first."""
        if isinstance(why, grpc.aio.AioRpcError) and pb.error_kind(why) == "SessionUnknown":
            return SessionUnknown(f"prefill daemon {self.address}: {why.details()}", peer=self.address)
        if why == "closed":
            return PeerUnreachable(f"prefill daemon {self.address}: stream closed", peer=self.address)
        self.link.stream_broken(self._loop.time())
        if isinstance(why, grpc.aio.AioRpcError):
            self.link.failed(_why(why), why.code() in UNREACHABLE_CODES)
            return self._error(why)
        self.link.last_error = str(why)
        return PeerUnreachable(f"prefill daemon {self.address}: {why}", peer=self.address)

    async def _items(self, kind: str, msgs: list[Message],
                     timeout_s: float | None = None) -> list[pb.PeerResult | KvpushdError]:
        """Items of one kind on the stream (in the batch of this loop turn); per item its result
        (code "OK") or why it failed. Bounded: no result within ``timeout_s`` (rpc_timeout_s) is
        PeerUnreachable. A session the peer forgot is handshaken again and those items sent once more."""
        self.link.calls += 1
        try:
            out: list[pb.PeerResult | KvpushdError] = [
                PeerUnreachable(f"prefill daemon {self.address}: not sent", peer=self.address)] * len(msgs)
            todo = list(range(len(msgs)))
            for attempt in (0, 1):
                await self._handshake(force=attempt > 0)
                ch = self._channel()
                futs = [ch.submit(kind, msgs[i]) for i in todo]
                timeout = self.cfg.rpc_timeout_s if timeout_s is None else timeout_s
                _, late = await asyncio.wait(futs, timeout=timeout)
                for f in late:
                    f.cancel()
                again = []
                if late:  # as a unary call's DEADLINE_EXCEEDED: the next call handshakes first
                    self.link.failed(f"DEADLINE_EXCEEDED: no answer on the stream within {timeout:g}s", True)
                for i, f in zip(todo, futs, strict=True):
                    if f.cancelled():
                        out[i] = PeerUnreachable(f"prefill daemon {self.address}: no answer within {timeout:g}s",
                                                 peer=self.address)
                        continue
                    exc = f.exception()
                    if isinstance(exc, KvpushdError):
                        out[i] = exc
                    elif exc is not None:
                        raise exc
                    else:
                        out[i] = f.result()
                    if isinstance(exc, SessionUnknown) or (exc is None and f.result().kind == "SessionUnknown"):
                        again.append(i)
                if not again or attempt:
                    break
                todo = again
            if any(isinstance(r, pb.PeerResult) and r.code == "OK" for r in out):
                self.link.answered(self._loop.time())
            return out
        finally:
            self.link.calls -= 1

    def _rejected(self, r: pb.PeerResult) -> PeerRejected:
        return PeerRejected(f"prefill daemon {self.address}: {r.code}: {r.message}", peer=self.address)

    async def _one(self, kind: str, msg: Message, timeout_s: float | None = None) -> pb.PeerResult:
        """One item on the stream; raises what it failed with (PeerRejected when the peer refused it)."""
        (r,) = await self._items(kind, [msg], timeout_s)
        if isinstance(r, KvpushdError):
            raise r
        if r.code != "OK":
            raise self._rejected(r)
        return r

    # -- the handshake and the items on the stream ----------------------------------------------

    async def _handshake(self, force: bool = False) -> None:
        async with self._hs_lock:
            link = self.link
            if not link.handshake_due(force):
                return
            if link.backing_off(self._loop.time()) and not force:
                raise PeerUnreachable(f"prefill daemon {self.address}: {link.last_error}")
            link.handshaking()
            req = pb.handshake(self.ident)
            async with self._gate:
                try:
                    # wait_for_ready: connect (or reconnect after a restart) within the deadline
                    # instead of failing at once on a channel that last saw the peer down.
                    resp = await self.stub.Handshake(req, timeout=self.cfg.connect_timeout_s,
                                                     wait_for_ready=True, metadata=self.session)
                except grpc.aio.AioRpcError as e:
                    err: grpc.aio.AioRpcError | None = e
                    if e.code() is grpc.StatusCode.DEADLINE_EXCEEDED:
                        # wait_for_ready hides why the channel cannot connect (refused, TLS handshake
                        # failed): one call without it reports the channel's last connection error.
                        try:
                            resp = await self.stub.Handshake(req, timeout=1.0, metadata=self.session)
                            err = None
                        except grpc.aio.AioRpcError as e2:
                            err = e2 if e2.code() is grpc.StatusCode.UNAVAILABLE else e
                    if err is not None:
                        link.handshake_failed(self._loop.time(), _why(err), err.code() in UNREACHABLE_CODES,
                                              random.random(), self.cfg.handshake_retry_s,
                                              self.cfg.handshake_retry_max_s)
                        raise self._error(err) from None
            session = (("kvpushd-session", resp.session_token),)
            if self.stream is not None and (session != self.session or resp.instance_id != self.remote_instance):
                self.stream.close("closed")  # a stream of the old session: the next item opens one anew
            if resp.instance_id != self.remote_instance:
                if self.remote_instance:
                    log.warning("peer restarted", peer=self.address, node=resp.node_id)
                    self._on_restart(self.address, f"prefill daemon at {self.address} restarted")
                self.sent_agents.clear()
            elif self.session and session != self.session:
                # the same instance gave us a new session: it dropped ours (it found this daemon silent
                # past its peer_timeout_s, e.g. stalled), and with it every registration we held there
                log.warning("peer dropped our session", peer=self.address, node=resp.node_id)
                self._on_restart(self.address, f"prefill daemon at {self.address} dropped this daemon's session "
                                               "(it heard nothing from us within its peer_timeout_s)")
                self.sent_agents.clear()
            self.remote_instance = resp.instance_id
            self.remote_node_id = resp.node_id
            self.session = session
            link.connected(self._loop.time())

    async def connect(self) -> None:
        """Handshake (unless connected) and open the Channel stream, without sending anything."""
        await self._handshake()
        self._channel()

    def _error(self, e: grpc.aio.AioRpcError) -> KvpushdError:
        msg = f"prefill daemon {self.address}: {e.code().name}: {e.details()}"
        if "Socket closed" in (e.details() or "") and not tls_enabled(self.cfg):
            msg += " (if that daemon's peer API uses TLS, set peer_api.tls_cert, tls_key and tls_ca here too)"
        if e.code() in UNREACHABLE_CODES:
            return PeerUnreachable(msg, peer=self.address)
        return PeerRejected(msg, peer=self.address)

    async def register_batch(self, items: list[tuple[SendRegister, Worker]],
                             traceparents: list[str] | None = None) -> list[KvpushdError | None]:
        """Many registrations, on the stream in this loop turn's batch: per item None (accepted) or why
        not (PeerUnreachable: not sent or not answered in time; PeerRejected: the peer refused it).
        ``traceparents``: per item, the decode span's W3C context (tracing on), else None."""
        out: list[KvpushdError | None] = [None] * len(items)
        todo = list(range(len(items)))
        for _ in range(2):
            with_md: set[str] = set()
            regs: list[Message] = []
            for i in todo:
                a, w = items[i]
                # once per agent: not again while a Register carrying it is on its way (a worker's batch
                # may reach here in more than one loop turn); one that misses it is asked for it
                name = w.agent_name
                md = name not in self.sent_agents and name not in self._md_on_way and name not in with_md
                if md:
                    with_md.add(w.agent_name)
                regs.append(pb.register(a, w, md, traceparents[i] if traceparents else ""))
            self._md_on_way |= with_md
            try:
                answers = await self._items("register", regs)
            finally:
                self._md_on_way -= with_md
            again = []
            for i, r in zip(todo, answers, strict=True):
                w = items[i][1]
                if isinstance(r, KvpushdError):
                    out[i] = r
                elif r.code == "OK" and r.need_metadata:
                    self.sent_agents.discard(w.agent_name)
                    again.append(i)
                elif r.code == "OK":
                    self.sent_agents.add(w.agent_name)
                else:
                    out[i] = self._rejected(r)
            todo = again
            if not todo:
                return out
        for i in todo:
            out[i] = PeerRejected(f"prefill daemon {self.address} keeps asking for agent metadata", peer=self.address)
        return out

    async def offer(self, a: SendOffer, w: Worker, still_wanted: Callable[[], bool]) -> bool:
        """Pull mode (we are the prefill side): offer a leg's source blocks to the decode daemon.

        Returns False, sending nothing, when the leg was settled meanwhile (e.g. the decode daemon
        was declared lost while we waited for the handshake): a late offer would READ blocks the
        prefill worker was already told are free."""
        await self._handshake()
        for _ in range(2):
            if not still_wanted():
                return False
            resp = await self._one("offer", pb.offer(a, w, with_metadata=w.agent_name not in self.sent_agents))
            if not resp.need_metadata:
                self.sent_agents.add(w.agent_name)
                return True
            self.sent_agents.discard(w.agent_name)
        raise PeerRejected(f"decode daemon {self.address} keeps asking for agent metadata", peer=self.address)

    async def heartbeat(self, timeout_s: float) -> None:
        """One liveness probe on the stream. Raises PeerUnreachable; a restart is handled like in the
        handshake."""
        try:
            resp = (await self._one("heartbeat", pb.heartbeat(), timeout_s)).heartbeat
        except KvpushdError:
            self.link.beat_failed(self._loop.time())
            raise
        self.link.beat_answered(self._loop.time())
        if resp.instance_id != self.remote_instance or not resp.knows_caller:
            await self._handshake(force=True)  # a restarted peer: fails what was pending with it

    async def send(self, kind: str, msg: Message) -> None:
        """One item that is answered with nothing but OK (``kind``: a PeerItem field; ``msg`` built by
        rpc/outbound.py): a Fail or Withdraw of one registration (pb.notice), a Decline of a transfer that
        will never be registered from here (pb.decline), or, pull mode, a failed READ (pb.read_failed)."""
        await self._one(kind, msg)


class Outbound:
    """The daemons we call, by peer address."""

    def __init__(self, ident: Identity, cfg: PeerApiConfig, on_restart: Callable[[str, str], None]) -> None:
        self.ident = ident
        self.cfg = cfg
        self._on_restart = on_restart
        self.peers: dict[str, PeerClient] = {}
        self.gate = HandshakeGate(cfg.max_concurrent_handshakes)
        self._preconnecting: set[asyncio.Task[None]] = set()

    def peer(self, address: str) -> PeerClient:
        """The one client of the daemon at ``address``: every worker's calls to it share its channel."""
        p = self.peers.get(address)
        if p is None:
            p = self.peers[address] = PeerClient(address, self.ident, self.cfg, self._on_restart, self.gate)
        return p

    def connected(self) -> int:
        return sum(1 for p in self.peers.values() if p.link.state is LinkState.CONNECTED)

    def preconnect(self, addresses: Iterable[str]) -> None:
        """Handshake with each configured peer now (through the gate), retried with the back-off until
        it answers; its link is pinned: never closed as idle."""
        loop = asyncio.get_running_loop()
        for address in dict.fromkeys(addresses):
            if address == self.ident.peer_address:
                continue
            self.peer(address).link.pinned = True
            task = loop.create_task(self._preconnect(address))
            self._preconnecting.add(task)
            task.add_done_callback(self._preconnecting.discard)

    async def _preconnect(self, address: str) -> None:
        while True:
            p = self.peer(address)  # the same client unless it was closed meanwhile
            p.link.pinned = True
            try:
                await p.connect()
                log.info("peer pre-connected", peer=address, node=p.remote_node_id)
                return
            except KvpushdError as e:
                wait = max(p.link.retry_in(asyncio.get_running_loop().time()), self.cfg.handshake_retry_s)
                log.info("pre-connect failed; retrying", peer=address, error=str(e), retry_in_s=round(wait, 2))
                await asyncio.sleep(wait)

    def is_instance(self, address: str, instance_id: str) -> bool:
        """Whether ``instance_id`` is the daemon we know at ``address`` (where our registrations went)."""
        p = self.peers.get(address)
        return p is not None and bool(instance_id) and p.remote_instance == instance_id

    def idle(self, loop_now: float, waited_on: set[str], idle_s: float) -> list[PeerClient]:
        """Peers nothing waits on, unheard for ``idle_s``: removed here, for the caller to close."""
        out = []
        for address, p in list(self.peers.items()):
            if address not in waited_on and p.link.idle(loop_now, idle_s):
                del self.peers[address]
                out.append(p)
        return out

    async def close(self) -> None:
        for t in list(self._preconnecting):
            t.cancel()
        await asyncio.gather(*self._preconnecting, return_exceptions=True)
        for p in self.peers.values():
            await p.close()
