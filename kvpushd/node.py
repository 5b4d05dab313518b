"""The node runtime: asyncio glue between the gRPC servicers, the pure core and the NIXL thread.

Servicers call the ``Node`` methods with plain values; the node validates against what workers
attached, feeds the core, and carries out the actions the core returns. The core never sees a
protobuf message, and the event loop never calls NIXL.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import secrets
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog

from . import __version__
from .config import Config, backend_init_params
from .core import notif
from .core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    KvpushdError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from .core.rendezvous import (
    Action,
    Deliver,
    RecvSide,
    Registration,
    SendFailNotice,
    SendOffer,
    SendReadFailed,
    SendRegister,
    SendSide,
    SendWithdraw,
    StartRead,
    StartWrite,
)
from .core.topology import block_parts, skips_replicated
from .core.types import Completion, CompletionKind, FailureCode, RegionLayout, Role, TransferMode
from .events import EventHub, EventKind
from .memory import Mapping
from .metrics import Metrics
from .peers import PeerClient, PeerRejected, PeerUnreachable
from .transfer.descs import RegionSpec, RemoteAgent
from .transfer.thread import ReadResult, TransferThread, WriteResult

log = structlog.get_logger(__name__)

MAX_AGENTS_PER_ORIGIN = 1024   # consumer agents one decode daemon may have loaded here at once
MAX_DESCRIPTION = 1024         # characters of a worker's free-text description
IDLE_PEER_S = 60.0             # a peer with nothing pending is forgotten after this long unheard
_MD_PREFIX = b"nixlSerDes|Agent"


def agent_prefix(node_id: str, instance_id: str) -> str:
    """How the NIXL agents of the daemon (node_id, instance_id) are named: a peer may only register its own."""
    return f"kvpushd.{node_id}.{instance_id[:8]}."


def metadata_agent_name(md: bytes) -> str | None:
    """The agent name inside NIXL agent metadata (``nixlSerDes|Agent`` + u64 length + name).

    Checked before the metadata is loaded, so a peer cannot load metadata under a name it did
    not register (which would replace another agent's). None when the bytes are not in that form.
    """
    if not md.startswith(_MD_PREFIX) or len(md) < len(_MD_PREFIX) + 8:
        return None
    n = int.from_bytes(md[len(_MD_PREFIX):len(_MD_PREFIX) + 8], "little")
    start = len(_MD_PREFIX) + 8
    if n > 4096 or start + n > len(md):
        return None
    try:
        return md[start:start + n].decode()
    except UnicodeDecodeError:
        return None


@dataclass(frozen=True, slots=True)
class ShmSpec:
    name: str
    size: int


@dataclass(frozen=True, slots=True)
class CudaSpec:
    gpu_uuid: str
    ipc_handle: bytes
    size: int
    storage_offset: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""
    event_sync_required: bool = False


MemorySpec = ShmSpec | CudaSpec


@dataclass(frozen=True, slots=True)
class RegionArg:
    memory_index: int
    offset: int
    layout: RegionLayout


@dataclass(slots=True)
class Worker:
    worker_id: str
    engine_id: str
    role: Role
    tp_rank: int
    tp_size: int
    pp_rank: int
    agent_name: str
    mem_type: str
    mappings: list[Mapping]
    regions: tuple[RegionSpec, ...]
    description: str
    attached_at: float
    min_blocks: int
    metadata: bytes = b""
    completions: collections.deque[Completion] = field(default_factory=collections.deque)
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    session_open: bool = False
    gone: bool = False

    @property
    def registered_bytes(self) -> int:
        return sum(m.size for m in self.mappings)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id across all regions (what one block of a transfer moves)."""
        return sum(r.block_len for r in self.regions)


@dataclass(slots=True)
class Counters:
    transfers_finished: int = 0
    transfers_failed: int = 0
    bytes_written: int = 0
    writes_posted: int = 0
    notifications_received: int = 0
    descriptors_requested: int = 0
    descriptors_posted: int = 0
    reads_posted: int = 0  # pull mode: READs this (decode) daemon posted that completed
    bytes_read: int = 0


MAX_PULL_AGENTS = 1024         # prefill agents (from Offers) kept loaded here at once
MAX_AGENT_METADATA = 1 << 20   # bytes of NIXL agent metadata a peer may send
MAX_AGENT_REGIONS = 4096       # as for Attach


@dataclass(slots=True)
class Origin:
    """A decode daemon that registered with us (from its handshake)."""

    instance_id: str
    node_id: str
    address: str
    token: str = ""  # secret of this session (HandshakeResponse.session_token)
    agents: dict[str, float] = field(default_factory=dict)  # consumer agent name -> last registration
    last_seen: float = field(default_factory=time.monotonic)


class Node:
    """All of one daemon's state; every method runs on the event loop."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.node_id = cfg.node_id
        self.instance_id = uuid.uuid4().hex
        self.started = time.monotonic()
        self.peer_address = f"{cfg.advertise_host}:{cfg.listen_host_port[1]}"
        self.workers: dict[str, Worker] = {}
        self.send = SendSide(cfg.transfer.publish_timeout_s, cfg.transfer.expect_timeout_s)
        # Registration ids are random (63 bits): they do not collide with stale notifications addressed
        # to a previous instance, and only the prefill daemon a registration went to knows its id.
        self.recv = RecvSide(cfg.transfer.expect_timeout_s, random_ids=True)
        self.counters = Counters()
        self.recent_failures: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=100)
        self.remote_agents: dict[str, RemoteAgent] = {}
        self.origins: dict[str, Origin] = {}
        # Pull mode (decode side): prefill agents offers came from: name -> (owner instance, agent, last use)
        self.pull_agents: dict[str, tuple[str, RemoteAgent, float]] = {}
        self.peers: dict[str, PeerClient] = {}
        self.draining = False
        self._withdrawing = 0  # Withdraw RPCs not answered yet (see _send_withdraw)
        self._settle_waiters: list[asyncio.Future[None]] = []  # withdrawals waiting on WRITEs in flight
        self._seq = itertools.count(1)
        self._tasks: set[asyncio.Task[None]] = set()
        self.xfer: TransferThread | None = None
        self.events = EventHub()
        self.metrics = Metrics(self)

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        t = self.cfg.transfer
        self.xfer = TransferThread(loop, t.backends, self._on_writes, self._on_notifs,
                                   poll_interval_s=t.poll_interval_s, nixl_threads=t.nixl_threads,
                                   params_for=lambda b, dev: backend_init_params(t, b, dev),
                                   param_devices=tuple(t.device_params),
                                   on_read_done=self._on_reads, on_read_notifications=self._on_read_notifs)
        self.xfer.start()

    async def tick_forever(self, interval_s: float = 0.05) -> None:
        """Deadlines and reaping; deadlines are resolved to ``interval_s``."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self._tick(time.monotonic())
            except Exception:  # a bug here must not stop deadlines for good
                log.exception("tick failed")

    async def _tick(self, now: float) -> None:
        self._run(self.send.tick(now) + self.recv.tick(now))
        self._check_peers(now)
        grace = self.cfg.worker_api.session_grace_s
        for w in list(self.workers.values()):
            if not w.session_open and now - w.attached_at > grace:
                log.warning("worker never opened its session; detaching", worker_id=w.worker_id)
                await self.detach(w.worker_id, "no session opened")

    async def drain(self, timeout_s: float) -> None:
        """Stop taking new transfers; wait (bounded) for what is in flight; release all memory."""
        self.draining = True
        why = f"daemon {self.node_id} is shutting down"
        self._run(self.send.shutdown(why) + self.recv.shutdown(why))
        self._update_expecting()
        deadline = time.monotonic() + timeout_s
        # What is left are WRITEs in flight (and notices to peers): let them finish, bounded.
        while (len(self.send) or self._tasks) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for wid in list(self.workers):
            await self.detach(wid, "daemon shutting down")
        for p in self.peers.values():
            await p.close()
        if self.xfer is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.xfer.stop)

    # -- worker API -----------------------------------------------------------------------------

    async def attach(self, engine_id: str, role: Role, tp_rank: int, tp_size: int, pp_rank: int,
                     memory: Sequence[MemorySpec], regions: Sequence[RegionArg],
                     description: str) -> Worker:
        self._not_draining()
        check_attach(engine_id, role, tp_rank, tp_size, memory, regions, self.cfg, description)
        check_geometry([r.layout for r in regions])
        for w in self.workers.values():
            if (w.engine_id, w.tp_rank, w.pp_rank) == (engine_id, tp_rank, pp_rank):
                raise AlreadyExists(
                    f"engine {engine_id!r} TP rank {tp_rank} PP rank {pp_rank} is already attached "
                    f"as worker {w.worker_id}; detach it (or end its session) first")
        if len(self.workers) >= self.cfg.worker_api.max_workers:
            raise ResourceExhausted(f"at most {self.cfg.worker_api.max_workers} workers may attach")
        loop = asyncio.get_running_loop()
        mappings = await loop.run_in_executor(None, open_all, memory)
        try:
            kinds = {m.mem_type for m in mappings}
            if len(kinds) != 1:
                raise InvalidArgument("a worker's memory must be all host (shm) or all GPU (CUDA IPC)")
            mem_type = kinds.pop()
            specs = []
            for i, r in enumerate(regions):
                m = mappings[r.memory_index]
                if r.offset + r.layout.span() > m.size:
                    raise InvalidArgument(
                        f"region {i} does not fit its memory: offset {r.offset} + span "
                        f"{r.layout.span()} > size {m.size}")
                specs.append(RegionSpec(m.addr + r.offset, r.layout.num_blocks, r.layout.block_len,
                                        r.layout.block_stride, m.device_id, r.layout.block_tokens,
                                        r.layout.num_heads, r.layout.kv_layout, r.layout.replicated))
            wid = f"w{next(self._seq)}-{uuid.uuid4().hex[:8]}"
            agent = f"{agent_prefix(self.node_id, self.instance_id)}{engine_id}.tp{tp_rank}.pp{pp_rank}.{wid}"
            w = Worker(wid, engine_id, role, tp_rank, tp_size, pp_rank, agent, mem_type, mappings,
                       tuple(specs), description, time.monotonic(),
                       min(r.layout.num_blocks for r in regions))
            assert self.xfer is not None
            w.metadata = await self.xfer.attach(wid, agent, mem_type,
                                                [(m.addr, m.size, m.device_id) for m in mappings],
                                                specs, role.can_receive)
        except BaseException:
            for m in mappings:
                m.close()
            raise
        self.workers[wid] = w
        log.info("worker attached", worker_id=wid, engine_id=engine_id, role=role.name,
                 tp_rank=tp_rank, tp_size=tp_size, regions=len(specs), bytes=w.registered_bytes)
        self.events.emit(EventKind.WORKER_ATTACHED, worker_id=wid, engine_id=engine_id,
                         detail=f"{role.name} tp {tp_rank}/{tp_size} pp {pp_rank}")
        return w

    def worker(self, worker_id: str) -> Worker:
        w = self.workers.get(worker_id)
        if w is None or w.gone:
            raise NotFound(f"unknown worker {worker_id!r} (not attached, or its session ended)")
        return w

    def expect(self, worker_id: str, transfer_id: str, block_ids: Sequence[int],
               producer_address: str, producer_engine_id: str, producer_tp_size: int,
               transfer_mode: TransferMode = TransferMode.PUSH, skip_tokens: int = 0) -> None:
        self._not_draining()
        w = self.worker(worker_id)
        if not w.role.can_receive:
            raise FailedPrecondition(f"worker {worker_id} attached as {w.role.name}: it cannot expect")
        check_blocks(w, block_ids, self.cfg)
        check_skip(w, skip_tokens)
        check_transfer_id(transfer_id)
        if not producer_engine_id:
            raise InvalidArgument("producer_engine_id must not be empty")
        self._bounded()
        actions = self.recv.expect(time.monotonic(), w.worker_id, w.tp_rank, w.tp_size, transfer_id,
                                   block_ids, producer_address, producer_engine_id, producer_tp_size,
                                   TransferMode.parse(transfer_mode), skip_tokens=skip_tokens,
                                   mla=all(r.replicated for r in w.regions))
        self.events.emit(EventKind.TRANSFER_STARTED, transfer_id=transfer_id, engine_id=w.engine_id,
                         worker_id=w.worker_id, side="recv", peer=producer_address, num_blocks=len(block_ids),
                         nbytes=len(block_ids) * w.block_bytes)
        self._run(actions)
        self._update_expecting()

    def publish(self, worker_id: str, transfer_id: str, block_ids: Sequence[int]) -> None:
        self._not_draining()
        w = self.worker(worker_id)
        if not w.role.can_send:
            raise FailedPrecondition(f"worker {worker_id} attached as {w.role.name}: it cannot publish")
        check_blocks(w, block_ids, self.cfg)
        check_transfer_id(transfer_id)
        self._bounded()
        actions = self.send.publish(time.monotonic(), w.worker_id, w.engine_id, w.tp_rank, w.tp_size,
                                    transfer_id, block_ids)
        self.events.emit(EventKind.TRANSFER_STARTED, transfer_id=transfer_id, engine_id=w.engine_id,
                         worker_id=w.worker_id, side="send", num_blocks=len(block_ids))
        self._run(actions)

    def abort(self, worker_id: str, transfer_id: str) -> bool:
        w = self.worker(worker_id)
        found_r, acts_r = self.recv.abort(w.worker_id, transfer_id)
        found_s, acts_s = self.send.abort(w.worker_id, w.engine_id, transfer_id)
        self._run(acts_r + acts_s)
        self._update_expecting()
        return found_r or found_s

    def poll(self, worker_id: str, max_n: int) -> list[Completion]:
        w = self.worker(worker_id)
        n = len(w.completions) if max_n <= 0 else min(max_n, len(w.completions))
        return [w.completions.popleft() for _ in range(n)]

    async def session(self, worker_id: str) -> collections.abc.AsyncIterator[Completion]:
        """Yield the worker's completions until it goes away; the caller's end means detach."""
        w = self.worker(worker_id)
        if w.session_open:
            raise AlreadyExists(f"worker {worker_id} already has a session")
        w.session_open = True
        try:
            while not w.gone:
                while w.completions:
                    yield w.completions.popleft()
                w.wakeup.clear()
                if w.completions:
                    continue
                await w.wakeup.wait()
        finally:
            if not w.gone:
                log.info("worker session ended; detaching", worker_id=worker_id)
                await self.detach(worker_id, "session ended")

    async def detach(self, worker_id: str, why: str) -> None:
        w = self.workers.get(worker_id)
        if w is None or w.gone:
            return
        w.gone = True
        w.wakeup.set()
        self._run(self.send.worker_gone(worker_id) + self.recv.worker_gone(worker_id))
        self._update_expecting()
        assert self.xfer is not None
        try:
            await self.xfer.detach(worker_id)  # waits for this worker's in-flight WRITEs
        finally:
            for m in w.mappings:
                m.close()
            del self.workers[worker_id]
            log.info("worker detached", worker_id=worker_id, reason=why)
            self.events.emit(EventKind.WORKER_DETACHED, worker_id=worker_id, engine_id=w.engine_id, detail=why)

    # -- peer API (we are the prefill side) -----------------------------------------------------

    def handshake(self, protocol_version: int, compat_hash: str, node_id: str, peer_address: str,
                  instance_id: str, presented_token: str = "") -> str:
        """A peer daemon introduces itself; returns the secret token of its session."""
        from . import PROTOCOL_VERSION

        if protocol_version != PROTOCOL_VERSION or compat_hash != notif.compat_hash():
            raise FailedPrecondition(
                f"incompatible peer {node_id[:64]!r}: protocol {protocol_version}/{compat_hash}, "
                f"ours {PROTOCOL_VERSION}/{notif.compat_hash()}")
        if not instance_id or not peer_address:
            raise InvalidArgument("handshake needs instance_id and peer_address")
        if max(len(node_id), len(peer_address), len(instance_id)) > 256:
            raise InvalidArgument("handshake: node_id, peer_address and instance_id are limited to 256 characters")
        known = self.origins.get(instance_id)
        if known is not None:
            if presented_token and secrets.compare_digest(presented_token, known.token):
                known.last_seen = time.monotonic()
                return known.token  # the same session again
            if instance_id in self.send.origins():
                raise PermissionDenied(f"instance id {instance_id[:64]!r} belongs to a peer session with transfers "
                                       "pending here; a daemon that lost its session token must wait for them to end")
            # An idle session whose holder lost its token (or a new claimant): it starts afresh,
            # without the agents the old session introduced.
            self.origins.pop(instance_id, None)
            self._forget_agents(known)
        for old in [o for o in self.origins.values() if o.address == peer_address and o.instance_id != instance_id]:
            self._origin_lost(old, f"peer {old.node_id} at {old.address} restarted")
        origin = self.origins[instance_id] = Origin(instance_id, node_id, peer_address, token=secrets.token_hex(16))
        log.info("peer handshake", peer_node=node_id, peer_address=peer_address)
        self.metrics.contact(peer_address, node_id=node_id, inbound=True)
        return origin.token

    def session_ok(self, instance_id: str, token: str) -> bool:
        origin = self.origins.get(instance_id)
        return origin is not None and bool(token) and secrets.compare_digest(token, origin.token)

    def register(self, origin_id: str, transfer_id: str, registration_id: int, producer_engine_id: str,
                 producer_tp_size: int, consumer_engine_id: str, consumer_rank: int,
                 consumer_tp_size: int, agent: RemoteAgent, block_ids: Sequence[int],
                 transfer_mode: TransferMode = TransferMode.PUSH, skip_tokens: int = 0) -> bool:
        """A decode daemon's registration. Returns False when we need the agent's metadata."""
        self._not_draining()
        origin = self.origins.get(origin_id)
        if origin is None:
            raise FailedPrecondition(f"unknown caller instance {origin_id!r}: handshake first")
        origin.last_seen = time.monotonic()
        check_transfer_id(transfer_id)
        self.metrics.contact(origin.address, inbound=True)
        self.events.remember(transfer_id, producer_engine_id)
        if not any(w.engine_id == producer_engine_id and w.role.can_send for w in self.workers.values()):
            raise NotFound(f"no prefill engine {producer_engine_id!r} is attached to node {self.node_id}")
        prefix = agent_prefix(origin.node_id, origin.instance_id)
        if not agent.name.startswith(prefix):
            raise PermissionDenied(f"consumer agent {agent.name[:128]!r} is not one of the calling daemon's "
                                   f"(its agents are named {prefix}*)")
        known = self.remote_agents.get(agent.name)
        if known is not None and agent.name not in origin.agents:
            # Agents are keyed by the daemon that introduced them: another peer may not re-use
            # (and so redirect) a name it does not own.
            raise PermissionDenied(f"consumer agent {agent.name[:128]!r} belongs to another peer daemon")
        if known is None:
            if not agent.metadata:
                return False
            if not agent.regions:
                raise InvalidArgument(f"consumer agent {agent.name!r} has no regions")
            if agent.mem_type not in ("DRAM", "VRAM"):
                raise InvalidArgument(f"consumer agent {agent.name!r}: memory kind {agent.mem_type!r}")
            md_name = metadata_agent_name(agent.metadata)
            if md_name != agent.name:
                raise PermissionDenied(f"consumer agent {agent.name[:128]!r}: its NIXL metadata names agent "
                                       f"{(md_name or '<unreadable>')[:128]!r}")
            if len(origin.agents) >= MAX_AGENTS_PER_ORIGIN:
                self._evict_agents(origin)
            self.remote_agents[agent.name] = known = agent
        origin.agents[agent.name] = time.monotonic()
        nb = min(r.num_blocks for r in known.regions)
        if not block_ids:
            raise InvalidArgument(f"transfer {transfer_id!r}: block_ids must not be empty")
        if max(block_ids) >= nb:
            raise InvalidArgument(
                f"transfer {transfer_id!r}: destination block id {max(block_ids)} out of range "
                f"(consumer regions have {nb} blocks)")
        if not 0 <= skip_tokens < 1 << 31:
            raise InvalidArgument(f"transfer {transfer_id!r}: skip_tokens {skip_tokens} out of range")
        self._bounded()
        producer = next(w for w in self.workers.values() if w.engine_id == producer_engine_id and w.role.can_send)
        by_tokens = skip_tokens > 0 or any(
            lr.block_tokens and rr.block_tokens and lr.block_tokens != rr.block_tokens
            for lr, rr in zip(producer.regions, known.regions, strict=False))
        reg = Registration(registration_id, origin_id, transfer_id, producer_engine_id, producer_tp_size,
                           agent.name, consumer_rank, consumer_tp_size, tuple(block_ids),
                           TransferMode.parse(transfer_mode), skip_tokens=skip_tokens, by_tokens=by_tokens,
                           mla=all(r.replicated for r in known.regions))
        self._run(self.send.register(time.monotonic(), reg))
        return True

    def heard_from(self, origin_id: str, token: str) -> bool:
        """A decode daemon's heartbeat: False when we do not know it (we restarted) or its session."""
        origin = self.origins.get(origin_id)
        if origin is None or not self.session_ok(origin_id, token):
            return False
        origin.last_seen = time.monotonic()
        return True

    def _check_peers(self, now: float) -> None:
        """Heartbeats to the prefill daemons we wait on; silence from either side fails what is pending."""
        t = self.cfg.transfer
        loop_now = asyncio.get_running_loop().time()
        for address in self.recv.producer_addresses():
            peer = self.peer(address)
            if peer.failing_since and loop_now - peer.failing_since > t.peer_timeout_s:
                self.peer_lost(address, f"prefill daemon {address} did not answer for {t.peer_timeout_s:g}s "
                                        f"({peer.last_error})")
                peer.failing_since = 0.0
            elif loop_now - peer.last_beat >= t.heartbeat_interval_s and not peer.beating:
                peer.last_beat = loop_now
                self._spawn(self._beat(peer))
        busy = self.send.origins()
        for origin_id in busy:
            origin = self.origins.get(origin_id)
            if origin is not None and now - origin.last_seen > t.peer_timeout_s:
                self._origin_lost(origin, f"decode daemon {origin.node_id} at {origin.address} sent no "
                                          f"heartbeat for {t.peer_timeout_s:g}s")
        # Peers idle for a while are forgotten (their agents unloaded, channels closed); a peer
        # that comes back handshakes again and resends its agents' metadata when asked.
        idle_s = max(IDLE_PEER_S, 6 * t.peer_timeout_s)
        for origin in [o for o in self.origins.values() if o.instance_id not in busy and now - o.last_seen > idle_s]:
            log.info("forgetting idle peer", peer_node=origin.node_id, peer_address=origin.address,
                     agents=len(origin.agents))
            self.origins.pop(origin.instance_id, None)
            self._forget_agents(origin)
        waited_on = self.recv.producer_addresses()
        for address, peer in list(self.peers.items()):
            if (address not in waited_on and not peer.beating and peer.state != "handshaking"
                    and loop_now - max(peer.last_ok, peer.since, peer.failed_at) > idle_s):
                del self.peers[address]
                self._spawn(peer.close())

    async def _beat(self, peer: PeerClient) -> None:
        peer.beating = True
        try:
            await peer.heartbeat(min(self.cfg.transfer.peer_timeout_s, 2.0))
        except KvpushdError:
            pass  # counted by failing_since; _check_peers decides
        finally:
            peer.beating = False

    async def withdraw(self, origin_id: str, transfer_id: str, registration_id: int, code: FailureCode,
                       reason: str) -> None:
        """A decode daemon withdraws a registration; returns once no WRITE into it is in flight
        (bounded), so the decode side may then let its engine free the blocks."""
        key = self.send.transfer_of(origin_id, registration_id)
        self._run(self.send.withdraw(origin_id, transfer_id, registration_id, code, reason))
        if key is None:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(0.5, self.cfg.peer_api.rpc_timeout_s - 1.0)
        while self.send.writing_into(key, registration_id) and loop.time() < deadline:
            settled: asyncio.Future[None] = loop.create_future()  # woken by _run after any core change
            self._settle_waiters.append(settled)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(settled, deadline - loop.time())

    def peer_failed(self, caller_instance_id: str, transfer_id: str, registration_id: int, code: FailureCode,
                    reason: str) -> None:
        """The prefill daemon says a registration of ours will not be written.

        Only the daemon the registration was sent to may fail it, and only under its transfer id."""
        sent = self.recv.sent_to(registration_id)
        if sent is None:
            return  # already ended (finished, failed or withdrawn): nothing to do
        tid, address = sent
        peer = self.peers.get(address)
        if tid != transfer_id or peer is None or not caller_instance_id or peer.remote_instance != caller_instance_id:
            raise PermissionDenied(f"failure notice for registration {registration_id} (transfer "
                                   f"{transfer_id[:256]!r}) from a daemon it was not sent to")
        self._run(self.recv.failed(registration_id, code, reason))
        self._update_expecting()

    # -- pull mode ------------------------------------------------------------------------------

    def offer(self, caller_instance_id: str, transfer_id: str, registration_id: int, producer_rank: int,
              agent: RemoteAgent, block_ids: Sequence[int]) -> bool:
        """Pull mode, decode side: the prefill daemon offers a producer rank's source blocks.

        We READ only into the blocks our own worker registered for this very registration, and only
        when the caller is the prefill daemon the registration was sent to. Returns False when we
        need the producer agent's metadata.
        """
        address = self.recv.producer_address_of(registration_id)
        if address is None:
            raise NotFound(f"registration {registration_id} is not pending on node {self.node_id}")
        peer = self.peers.get(address)
        origin = self.origins.get(caller_instance_id)
        if peer is None or origin is None or not caller_instance_id or peer.remote_instance != caller_instance_id:
            raise PermissionDenied(f"offer for registration {registration_id} (transfer {transfer_id[:256]!r}) "
                                   "from a daemon it was not sent to")
        origin.last_seen = time.monotonic()
        if len(block_ids) > self.cfg.worker_api.max_blocks_per_request:
            raise InvalidArgument(f"offer of {len(block_ids)} blocks; at most "
                                  f"{self.cfg.worker_api.max_blocks_per_request}")
        prefix = agent_prefix(origin.node_id, origin.instance_id)
        if len(agent.name) > 512 or not agent.name.startswith(prefix):
            raise PermissionDenied(f"producer agent {agent.name[:128]!r} is not one of the calling daemon's "
                                   f"(its agents are named {prefix}*)")
        now = time.monotonic()
        held = self.pull_agents.get(agent.name)
        if held is not None and held[0] != caller_instance_id:
            raise PermissionDenied(f"producer agent {agent.name[:128]!r} belongs to another peer daemon")
        if held is None:
            if not agent.metadata:
                return False
            check_pull_agent(agent)
            md_name = metadata_agent_name(agent.metadata)
            if md_name != agent.name:
                raise PermissionDenied(f"producer agent {agent.name[:128]!r}: its NIXL metadata names agent "
                                       f"{(md_name or '<unreadable>')[:128]!r}")
        known = held[1] if held is not None else agent
        if block_ids and max(block_ids) >= min(r.num_blocks for r in known.regions):
            raise InvalidArgument(f"transfer {transfer_id[:256]!r}: source block id {max(block_ids)} out of range "
                                  f"(producer regions have {min(r.num_blocks for r in known.regions)} blocks)")
        actions = self.recv.offer(registration_id, transfer_id, producer_rank, block_ids)
        if held is None and len(self.pull_agents) >= MAX_PULL_AGENTS:
            self._evict_pull_agents()
        self.pull_agents[agent.name] = (caller_instance_id, known, now)
        assert self.xfer is not None
        for a in actions:
            if isinstance(a, StartRead):
                src_part, dst_part = block_parts(a.key.producer_rank, a.producer_tp_size, a.consumer_rank,
                                                 a.consumer_tp_size)
                self.xfer.post_read(a.key, a.worker_id, a.dst_blocks, known, a.src_blocks,
                                    notif.encode_read(a.key.registration_id, a.key.producer_rank),
                                    src_part, dst_part)
        self._run([a for a in actions if not isinstance(a, StartRead)])
        return True

    def _evict_pull_agents(self) -> None:
        """Forget the least recently used half of the prefill agents offers came from."""
        assert self.xfer is not None
        for _, name in sorted((t, n) for n, (_, _, t) in self.pull_agents.items())[:len(self.pull_agents) // 2]:
            del self.pull_agents[name]
            self.xfer.forget_remote(name)  # deferred by the thread while a READ from it is in flight

    def read_failed(self, caller_instance_id: str, registration_id: int, producer_rank: int, reason: str) -> None:
        """Pull mode, prefill side: the decode daemon says the READ of our offer failed."""
        origin = self.origins.get(caller_instance_id)
        if origin is None:
            raise FailedPrecondition(f"unknown caller instance {caller_instance_id[:64]!r}: handshake first")
        origin.last_seen = time.monotonic()
        self._run(self.send.read_done(caller_instance_id, registration_id, producer_rank, False,
                                      f"decode daemon {origin.node_id}: {reason[:2000]}"))

    def _on_read_notifs(self, notifs: list[tuple[str, int, int]]) -> None:
        """Pull mode, prefill side: READ notifications on our producer agents (the READ completed)."""
        actions: list[Action] = []
        for agent_name, rid, rank in notifs:
            origin = next((o for o in self.origins.values() if agent_name in o.agents), None)
            if origin is None:
                log.info("READ notification from an unknown agent", remote_agent=agent_name[:128])
                continue
            actions += self.send.read_done(origin.instance_id, rid, rank, True)
        self._run(actions)

    def _on_reads(self, results: list[ReadResult]) -> None:
        """Pull mode, decode side: READs this daemon posted have completed (or failed)."""
        actions: list[Action] = []
        for r in results:
            if r.ok:
                self.counters.reads_posted += 1
                self.counters.bytes_read += r.nbytes
                self.counters.descriptors_requested += r.descs_requested
                self.counters.descriptors_posted += r.descs_posted
            log.debug("read done", transfer_id=r.key.transfer_id, ok=r.ok, reason=r.reason,
                      post_us=round(r.post_s * 1e6), xfer_us=round(r.xfer_s * 1e6), bytes=r.nbytes)
            actions += self.recv.read_done(r.key, r.ok, r.reason)
        self._run(actions)
        self._update_expecting()

    async def _send_offer(self, a: SendOffer) -> None:
        reg = a.registration
        w = self.workers.get(a.producer_worker)
        origin = self.origins.get(reg.origin)
        if w is None or w.gone or origin is None:
            why = "prefill worker is gone" if origin is not None else "decode daemon is gone"
            self._run(self.send.read_done(reg.origin, reg.registration_id, a.producer_rank, False, why))
            return
        try:
            sent = await self.peer(origin.address).offer(
                a, w, lambda: self.send.pull_pending(reg.origin, reg.registration_id, a.producer_rank))
        except PeerRejected as e:  # the decode daemon answered: it did not start a READ
            self.metrics.failed(origin.address, str(e))
            self._run(self.send.read_done(reg.origin, reg.registration_id, a.producer_rank, False,
                                          f"offer refused: {e}"))
        except PeerUnreachable as e:
            # It may have started the READ: the leg stays in flight until the READ is confirmed,
            # the decode daemon is lost, or publish_timeout_s passes.
            self.metrics.failed(origin.address, str(e), unreachable=True)
            log.warning("could not send an offer", transfer_id=reg.transfer_id, engine_id=a.leg.engine_id,
                        error=str(e))
        else:
            if sent:
                self.metrics.contact(origin.address)

    async def _send_read_failed(self, a: SendReadFailed) -> None:
        try:
            await self.peer(a.key.producer_address).read_failed(a.key, a.reason)
        except KvpushdError as e:
            self.metrics.failed(a.key.producer_address, str(e), unreachable=isinstance(e, PeerUnreachable))
            log.info("could not report a failed READ", transfer_id=a.key.transfer_id, error=str(e))
        else:
            self.metrics.contact(a.key.producer_address)

    # -- carrying out core actions --------------------------------------------------------------

    def _run(self, actions: Sequence[Action]) -> None:
        for a in actions:
            if isinstance(a, Deliver):
                self._deliver(a.worker_id, a.completion)
            elif isinstance(a, StartWrite):
                self._start_write(a)
            elif isinstance(a, SendRegister):
                self._spawn(self._send_register(a))
            elif isinstance(a, SendFailNotice):
                self._spawn(self._send_fail(a))
            elif isinstance(a, SendWithdraw):
                self._spawn(self._send_withdraw(a))
            elif isinstance(a, SendOffer):
                self._spawn(self._send_offer(a))
            elif isinstance(a, SendReadFailed):
                self._spawn(self._send_read_failed(a))
            elif isinstance(a, StartRead):  # only offer() starts READs (it holds the agent)
                log.error("StartRead outside offer()", transfer_id=a.key.transfer_id)
        if self.xfer is not None:
            self.xfer.set_pulling(self.send.pulling())
        if self._settle_waiters:
            waiters, self._settle_waiters = self._settle_waiters, []
            for f in waiters:
                if not f.done():
                    f.set_result(None)

    def _deliver(self, worker_id: str, c: Completion) -> None:
        ev = self.events.emit(EventKind.TRANSFER_FAILED if c.kind is CompletionKind.FAILED
                              else EventKind.TRANSFER_FINISHED, worker_id=worker_id, transfer_id=c.transfer_id,
                              code=c.code, detail=c.reason)
        if c.kind is CompletionKind.FAILED:
            self.counters.transfers_failed += 1
            self.recent_failures.append((time.time(), c.transfer_id, f"{c.code.name}: {c.reason}"))
            log.warning("transfer failed", transfer_id=c.transfer_id, engine_id=ev.engine_id, worker_id=worker_id,
                        code=c.code.name, reason=c.reason)
        else:
            self.counters.transfers_finished += 1
        w = self.workers.get(worker_id)
        if w is None or w.gone:
            return
        w.completions.append(c)
        w.wakeup.set()

    def _start_write(self, a: StartWrite) -> None:
        self.metrics.write_started(a)
        assert self.xfer is not None
        agent = self.remote_agents.get(a.registration.consumer_agent)
        if agent is None:  # cannot happen: register() stored it; fail loudly rather than hang
            self._on_writes([WriteResult(a.leg, False, "consumer agent unknown", 0, 0, 0, 0, 0)])
            return
        reg = a.registration
        src_part, dst_part = block_parts(a.producer_rank, a.producer_tp_size, reg.consumer_rank,
                                         reg.consumer_tp_size)
        self.xfer.post_write(a.leg, a.producer_worker, a.src_blocks, agent, reg.block_ids,
                             notif.encode(reg.registration_id, a.producer_rank), src_part, dst_part,
                             skip_tokens=reg.skip_tokens,
                             skip_replicated=skips_replicated(a.producer_rank, a.producer_tp_size,
                                                              reg.consumer_tp_size))

    def _on_writes(self, results: list[WriteResult]) -> None:
        actions: list[Action] = []
        for r in results:
            if r.ok:
                self.counters.writes_posted += 1
                self.counters.bytes_written += r.nbytes
                self.counters.descriptors_requested += r.descs_requested
                self.counters.descriptors_posted += r.descs_posted
            self.metrics.write_done(r)
            log.debug("write done", transfer_id=r.leg.transfer_id, engine_id=r.leg.engine_id, ok=r.ok,
                      post_us=round(r.post_s * 1e6),
                      xfer_us=round(r.xfer_s * 1e6), descriptors=r.descs_posted, bytes=r.nbytes)
            actions += self.send.write_done(r.leg, r.ok, r.reason)
        self._run(actions)

    def _on_notifs(self, notifs: list[tuple[int, int]]) -> None:
        actions: list[Action] = []
        for rid, rank in notifs:
            self.counters.notifications_received += 1
            actions += self.recv.notified(rid, rank)
        self._run(actions)
        self._update_expecting()

    def _update_expecting(self) -> None:
        if self.xfer is not None:
            self.xfer.set_expecting(len(self.recv) + self._withdrawing)

    def peer(self, address: str) -> PeerClient:
        p = self.peers.get(address)
        if p is None:
            p = self.peers[address] = PeerClient(address, self)
        return p

    async def _send_register(self, a: SendRegister) -> None:
        w = self.workers.get(a.worker_id)
        if w is None:
            return
        try:
            await self.peer(a.producer_address).register(a, w)
        except PeerRejected as e:
            self.metrics.failed(a.producer_address, str(e))
            self._run(self.recv.failed(a.registration_id, FailureCode.PEER_REJECTED, str(e)))
        except PeerUnreachable as e:
            self.metrics.failed(a.producer_address, str(e), unreachable=True)
            self._run(self.recv.failed(a.registration_id, FailureCode.PEER_UNREACHABLE, str(e)))
        else:
            self.metrics.contact(a.producer_address, node_id=self.peer(a.producer_address).remote_node_id)
            self.recv.registered(a.registration_id)
        self._update_expecting()

    async def _send_fail(self, a: SendFailNotice) -> None:
        origin = self.origins.get(a.origin)
        if origin is None:
            return
        try:
            await self.peer(origin.address).fail(a.transfer_id, a.registration_id, a.code, a.reason)
        except KvpushdError as e:
            self.metrics.failed(origin.address, str(e), unreachable=isinstance(e, PeerUnreachable))
            log.warning("could not send failure notice", transfer_id=a.transfer_id,
                        engine_id=self.events.engine_of(a.transfer_id), error=str(e))
        else:
            self.metrics.contact(origin.address)

    async def _send_withdraw(self, a: SendWithdraw) -> None:
        # Until the prefill daemon answers, a WRITE into these blocks may still be landing, and over
        # shared memory or TCP it completes only while this side's agent makes progress: keep polling.
        self._withdrawing += 1
        self._update_expecting()
        try:
            await self.peer(a.producer_address).withdraw(a.transfer_id, a.registration_id, a.code, a.reason)
        except KvpushdError as e:
            self.metrics.failed(a.producer_address, str(e), unreachable=isinstance(e, PeerUnreachable))
            log.info("could not withdraw registration", transfer_id=a.transfer_id,
                     engine_id=self.events.engine_of(a.transfer_id), error=str(e))
        else:
            self.metrics.contact(a.producer_address)
        finally:
            self._withdrawing -= 1
            self._update_expecting()
            if a.then is not None:  # the prefill daemon has no WRITE into these blocks in flight any more
                self.recv.ended(a.then)
                self._deliver(a.then.worker_id, a.then.completion)

    def peer_lost(self, address: str, reason: str, restarted: bool = False) -> None:
        """A prefill daemon is unreachable (or restarted): its pending receives fail now."""
        self.metrics.lost(address, reason)
        self._run(self.recv.producer_lost(address, FailureCode.PEER_UNREACHABLE, reason, registered_only=restarted))
        self._update_expecting()

    def _origin_lost(self, origin: Origin, reason: str) -> None:
        self.metrics.lost(origin.address, reason, inbound=True)
        self.origins.pop(origin.instance_id, None)
        self._run(self.send.origin_lost(origin.instance_id, reason))
        self._forget_agents(origin)

    def _forget_agents(self, origin: Origin) -> None:
        assert self.xfer is not None
        for name in origin.agents:
            self.remote_agents.pop(name, None)
            self.xfer.forget_remote(name)
        origin.agents.clear()

    def _evict_agents(self, origin: Origin) -> None:
        """Make room among a peer's agents: forget the least recently used half that no pending
        registration refers to (workers that detached on the decode node leave theirs behind)."""
        assert self.xfer is not None
        in_use = self.send.agents_in_use(origin.instance_id)
        idle = sorted((t, n) for n, t in origin.agents.items() if n not in in_use)
        for _, name in idle[:max(1, len(origin.agents) // 2)]:
            del origin.agents[name]
            self.remote_agents.pop(name, None)
            self.xfer.forget_remote(name)
        if len(origin.agents) >= MAX_AGENTS_PER_ORIGIN:
            raise ResourceExhausted(f"peer {origin.node_id} has {len(origin.agents)} agents in use here; "
                                    f"at most {MAX_AGENTS_PER_ORIGIN}")

    def _spawn(self, coro: collections.abc.Coroutine[None, None, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("background task failed", exc_info=task.exception())

    def _not_draining(self) -> None:
        if self.draining:
            raise Unavailable(f"daemon {self.node_id} is shutting down")

    def _bounded(self) -> None:
        if len(self.send) + len(self.recv) >= self.cfg.transfer.max_pending:
            raise ResourceExhausted(f"more than {self.cfg.transfer.max_pending} transfers pending")

    def version(self) -> str:
        return __version__


def open_all(memory: Sequence[MemorySpec]) -> list[Mapping]:
    """Open every handle, or none (closing what was opened when one fails)."""
    from .memory.shm import ShmMapping

    out: list[Mapping] = []
    try:
        for spec in memory:
            if isinstance(spec, ShmSpec):
                out.append(ShmMapping(spec.name, spec.size))
            else:
                from .memory.cuda import CudaIpcMapping

                out.append(CudaIpcMapping(spec.gpu_uuid, spec.ipc_handle, spec.size, spec.storage_offset,
                                          spec.ref_counter_handle, spec.ref_counter_offset,
                                          spec.event_handle, spec.event_sync_required))
    except BaseException:
        for m in out:
            m.close()
        raise
    return out


def check_pull_agent(agent: RemoteAgent) -> None:
    """Bounds on a producer agent a peer offers (pull mode) before anything is loaded into NIXL."""
    if len(agent.metadata) > MAX_AGENT_METADATA:
        raise InvalidArgument(f"producer agent metadata of {len(agent.metadata)} bytes; at most {MAX_AGENT_METADATA}")
    if not 1 <= len(agent.regions) <= MAX_AGENT_REGIONS:
        raise InvalidArgument(f"producer agent {agent.name[:128]!r} has {len(agent.regions)} regions; need 1-"
                              f"{MAX_AGENT_REGIONS}")
    if agent.mem_type not in ("DRAM", "VRAM"):
        raise InvalidArgument(f"producer agent {agent.name[:128]!r}: memory kind {agent.mem_type[:16]!r}")
    for i, r in enumerate(agent.regions):
        if r.num_blocks < 1 or r.block_len < 1 or r.block_stride < r.block_len or r.addr >= 1 << 64:
            raise InvalidArgument(f"producer agent region {i}: need num_blocks >= 1, block_len >= 1, "
                                  f"block_stride >= block_len")


def check_transfer_id(transfer_id: str) -> None:
    if not transfer_id:
        raise InvalidArgument("transfer_id must not be empty")
    if len(transfer_id) > 256:
        raise InvalidArgument(f"transfer_id is {len(transfer_id)} characters long; at most 256")


def check_blocks(w: Worker, block_ids: Sequence[int], cfg: Config) -> None:
    if not block_ids:
        raise InvalidArgument("block_ids must not be empty")
    if len(block_ids) > cfg.worker_api.max_blocks_per_request:
        raise InvalidArgument(f"{len(block_ids)} block ids; at most {cfg.worker_api.max_blocks_per_request}")
    arr = np.asarray(block_ids, dtype=np.int64)
    hi = int(arr.max())
    if hi >= w.min_blocks:
        raise InvalidArgument(
            f"block id {hi} out of range: worker {w.worker_id}'s regions have {w.min_blocks} blocks")
    if len(np.unique(arr)) != len(arr):
        raise InvalidArgument("block_ids contain duplicates")


def check_attach(engine_id: str, role: Role, tp_rank: int, tp_size: int, memory: Sequence[MemorySpec],
                 regions: Sequence[RegionArg], cfg: Config, description: str = "") -> None:
    if not engine_id or len(engine_id) > 128 or not engine_id.isprintable() or "." in engine_id:
        raise InvalidArgument(f"engine_id {engine_id!r}: 1-128 printable characters, no '.'")
    if role is Role.UNSPECIFIED:
        raise InvalidArgument("role must be PRODUCER, CONSUMER or BOTH")
    if tp_size < 1 or tp_rank >= tp_size:
        raise InvalidArgument(f"tp_rank {tp_rank} must be below tp_size {tp_size} (>= 1)")
    if not memory:
        raise InvalidArgument("no memory handles")
    if len(memory) > 256 or not regions or len(regions) > 4096:
        raise InvalidArgument(f"{len(memory)} memory handles and {len(regions)} regions: need 1-256 and 1-4096")
    if len(description) > MAX_DESCRIPTION:
        raise InvalidArgument(f"description is {len(description)} characters long; at most {MAX_DESCRIPTION}")
    descs = sum(r.layout.num_blocks for r in regions)
    if descs > cfg.worker_api.max_attach_descriptors:
        raise InvalidArgument(
            f"{len(regions)} regions with {descs} blocks in all: at most {cfg.worker_api.max_attach_descriptors} "
            f"(worker_api.max_attach_descriptors); NIXL needs one descriptor per block per region")
    for i, r in enumerate(regions):
        lay = r.layout
        if not 0 <= r.memory_index < len(memory):
            raise InvalidArgument(f"region {i}: memory_index {r.memory_index} names no memory handle")
        if lay.num_blocks < 1 or lay.block_len < 1 or lay.block_stride < lay.block_len:
            raise InvalidArgument(
                f"region {i}: need num_blocks >= 1, block_len >= 1, block_stride >= block_len "
                f"(got {lay.num_blocks}, {lay.block_len}, {lay.block_stride})")


def check_geometry(layouts: Sequence[RegionLayout]) -> None:
    """Block size in tokens, head count and layout of each region: bounded and consistent."""
    for i, lay in enumerate(layouts):
        if lay.block_tokens > 1 << 20 or lay.num_heads > 1 << 16:
            raise InvalidArgument(f"region {i}: block_size_tokens {lay.block_tokens} / num_heads {lay.num_heads} "
                                  "out of range")
        if lay.kv_layout not in (0, 1, 2):
            raise InvalidArgument(f"region {i}: unknown layout {lay.kv_layout}")
        units = (lay.block_tokens or 1) * (lay.num_heads or 1)
        if lay.block_len % units:
            raise InvalidArgument(f"region {i}: block_len {lay.block_len} is not a whole number of bytes per "
                                  f"head and token ({lay.num_heads or 1} heads x {lay.block_tokens or 1} tokens)")


def check_skip(w: Worker, skip_tokens: int) -> None:
    """A skipped prefix is a whole number of the worker's blocks (it holds them already)."""
    if skip_tokens < 0 or skip_tokens >= 1 << 31:
        raise InvalidArgument(f"skip_tokens {skip_tokens} out of range")
    if not skip_tokens:
        return
    sizes = {r.block_tokens for r in w.regions}
    if 0 in sizes:
        raise InvalidArgument("skip_tokens needs the block size in tokens (Region.block_size_tokens) at attach")
    bad = [b for b in sizes if skip_tokens % b]
    if bad:
        raise InvalidArgument(f"skip_tokens {skip_tokens} is not a whole number of blocks of {bad[0]} tokens")
