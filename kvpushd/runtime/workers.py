"""Attached workers: their memory (opened once), sessions and completion queues, and the checks
of what a worker may ask for. This room owns ``Workers.by_id``; it knows nothing of peers or of
the rendezvous.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import structlog
from kvpushd_client.types import Decline, Expect, Publish

from ..config import Config
from ..core.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from ..core.notif import MAX_LAYERS
from ..core.types import Completion, RegionLayout, Role
from ..events import EventHub, EventKind
from ..memory import Mapping, MemorySpec, open_all, take_fds
from ..memory.doorbell import Doorbell, fd_label
from ..memory.fdpass import MAX_MEMORY_HANDLES, FdInbox, fd_socket_path
from ..memory.shm import ShmMapping
from ..memory.vmm import VmmMapping, check_described, check_growth, check_regions_mapped, registrations
from ..transfer.backends import vmm_transport_note
from ..transfer.descs import RegionSpec
from ..transfer.thread import TransferThread
from .checks import check_block_ids, check_geometry, check_transfer_id
from .identity import Identity, agent_prefix

log = structlog.get_logger(__name__)

MAX_DESCRIPTION = 1024         # characters of a worker's free-text description


@dataclass(frozen=True, slots=True)
class RegionArg:
    memory_index: int
    offset: int
    layout: RegionLayout


class Attach(msgspec.Struct, frozen=True):
    """One Attach, as rpc/convert.py makes it from the request: checked and carried out whole (a frozen
    msgspec Struct, like the client's Attach and the stream's commands)."""

    engine_id: str
    role: Role
    tp_rank: int
    tp_size: int
    pp_rank: int
    memory: tuple[MemorySpec, ...]
    regions: tuple[RegionArg, ...]
    description: str = ""
    doorbell: str = ""           # the doorbell page's label, if one is handed over
    doorbell_token: bytes = b""  # the token it was handed over under (fdpass)
    extends_worker_id: str = ""  # a growth: the live worker whose VMM memory gains chunks (``extend``)
    extends_worker_token: bytes = b""


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
    bell: Doorbell | None = None  # its engine steps' progress (read-only)
    token: bytes = field(default_factory=lambda: secrets.token_bytes(16), repr=False)  # AttachResponse.worker_token
    command_batches: int = 0  # Stream batches it sent, and the commands in them
    stream_commands: int = 0

    @property
    def registered_bytes(self) -> int:
        return sum(getattr(m, "mapped_bytes", m.size) for m in self.mappings)  # VMM: its chunks, not the range

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id across all regions (what one block of a transfer moves)."""
        return sum(r.block_len for r in self.regions)


class Workers:
    """The attached workers, by worker id. Every method runs on the event loop."""

    def __init__(self, cfg: Config, ident: Identity, events: EventHub) -> None:
        self.cfg = cfg
        self.ident = ident
        self.events = events
        self.by_id: dict[str, Worker] = {}
        self.xfer: TransferThread | None = None  # set at start
        self.fds = FdInbox(fd_socket_path(cfg.socket_path), cfg.worker_api.socket_mode)  # memfds by token
        self._seq = itertools.count(1)
        # what attaches in progress claim (their engine rank, their doorbell page) while they map and
        # register memory: an overlapping Attach of the same rank or page is refused like an attached one
        self._claims: set[tuple[object, ...]] = set()
        self._releasing: dict[str, asyncio.Future[None]] = {}  # worker id -> its release under way
        # one thread populates host KV (one core at most; attaches never wait behind it); none starts until used
        self._populator = ThreadPoolExecutor(1, thread_name_prefix="kvpushd-populate")

    async def attach(self, a: Attach) -> Worker:
        """An Attach whose caller goes (its deadline passed, its call cancelled) runs to its end anyway,
        holding its claims: cut short, it left what a thread had mapped for it mapped for good, or
        unmapped memory the NIXL thread was registering. Finished, its worker is detached like any that
        never opens its session (``worker_api.session_grace_s``)."""
        task = asyncio.ensure_future(self._claim_and_attach(a))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_abandoned)
            raise

    async def _claim_and_attach(self, a: Attach) -> Worker:
        check_attach(a, self.cfg)
        check_geometry([r.layout for r in a.regions])
        check_described(a.memory, [(r.memory_index, r.offset, r.layout.span()) for r in a.regions])  # VMM handles
        engine_id, tp_rank, pp_rank = a.engine_id, a.tp_rank, a.pp_rank
        rank = ("rank", engine_id, tp_rank, pp_rank)
        for w in self.by_id.values():
            # A worker that is gone (its detach waits for WRITEs from its memory to settle) does
            # not hold its place: its engine may attach again at once.
            if not w.gone and (w.engine_id, w.tp_rank, w.pp_rank) == rank[1:]:
                raise AlreadyExists(
                    f"engine {engine_id!r} TP rank {tp_rank} PP rank {pp_rank} is already attached "
                    f"as worker {w.worker_id}; detach it (or end its session) first")
        if rank in self._claims:
            raise AlreadyExists(f"engine {engine_id!r} TP rank {tp_rank} PP rank {pp_rank} is attaching now "
                                f"(another Attach of it is in progress)")
        attaching = sum(1 for c in self._claims if c[0] == "rank")
        if len(self.by_id) + attaching >= self.cfg.worker_api.max_workers:
            raise ResourceExhausted(f"at most {self.cfg.worker_api.max_workers} workers may attach")
        claims: set[tuple[object, ...]] = {rank}
        self._claims.add(rank)
        try:
            return await self._attach(a, claims)
        finally:
            self._claims -= claims

    async def _attach(self, a: Attach, claims: set[tuple[object, ...]]) -> Worker:
        engine_id, role, tp_rank, tp_size, pp_rank = a.engine_id, a.role, a.tp_rank, a.tp_size, a.pp_rank
        loop = asyncio.get_running_loop()
        mappings = await loop.run_in_executor(None, open_all, a.memory, take_fds(self.fds, a.memory))
        bell: Doorbell | None = None
        try:
            bell = self._open_bell(a.doorbell, a.doorbell_token)
            if bell is not None:
                self._claim_bell(bell, claims)
            kinds = {m.mem_type for m in mappings}
            if len(kinds) != 1:
                raise InvalidArgument("a worker's memory must be all host (shm) or all GPU (CUDA IPC)")
            mem_type = kinds.pop()
            specs = []
            for i, r in enumerate(a.regions):
                m = mappings[r.memory_index]
                if r.offset + r.layout.span() > m.size:
                    raise InvalidArgument(
                        f"region {i} does not fit its memory: offset {r.offset} + span "
                        f"{r.layout.span()} > size {m.size}")
                if isinstance(m, VmmMapping):
                    check_regions_mapped({0: m.mapped}, [(0, r.offset, r.layout.span())], i)
                specs.append(RegionSpec(m.addr + r.offset, r.layout.num_blocks, r.layout.block_len,
                                        r.layout.block_stride, m.device_id, r.layout.block_tokens,
                                        r.layout.num_heads, r.layout.kv_layout, r.layout.replicated))
            wid = f"w{next(self._seq)}-{uuid.uuid4().hex[:8]}"
            prefix = agent_prefix(self.ident.node_id, self.ident.instance_id)
            agent = f"{prefix}{engine_id}.tp{tp_rank}.pp{pp_rank}.{wid}"
            w = Worker(wid, engine_id, role, tp_rank, tp_size, pp_rank, agent, mem_type, mappings,
                       tuple(specs), a.description, time.monotonic(),
                       min(r.layout.num_blocks for r in a.regions), bell=bell)
            assert self.xfer is not None
            w.metadata = await self.xfer.attach(wid, agent, mem_type,
                                                [p for m in mappings for p in registrations(m)],
                                                specs, role.can_receive, bell)
        except BaseException:
            for m in mappings:
                m.close()
            if bell is not None:
                bell.close()
            raise
        self.by_id[wid] = w
        log.info("worker attached", worker_id=wid, engine_id=engine_id, role=role.name,
                 tp_rank=tp_rank, tp_size=tp_size, regions=len(specs), bytes=w.registered_bytes)
        if any(isinstance(m, VmmMapping) for m in mappings):  # which path GPU virtual memory takes
            level, note = vmm_transport_note(wid, self.xfer.agent_backends(wid))
            getattr(log, level)("transport for VMM memory", worker_id=wid, note=note)
        if self.cfg.worker_api.populate_host_kv:
            for m in mappings:
                if isinstance(m, ShmMapping):
                    self._populate(loop, wid, m)
        self.events.emit(EventKind.WORKER_ATTACHED, worker_id=wid, engine_id=engine_id,
                         detail=f"{role.name} tp {tp_rank}/{tp_size} pp {pp_rank}")
        return w

    async def extend(self, a: Attach) -> Worker:
        """Growth of a live worker's VMM memory (``a.extends_worker_id``): checked whole, then refused
        for now (memory/vmm.py check_growth: the NIXL side of growth is not built)."""
        w = self.owned(a.extends_worker_id, a.extends_worker_token)
        check_growth(w.worker_id, w.engine_id, a.engine_id, w.mappings, w.regions, a.memory,
                     [(r.memory_index, r.offset, r.layout.block_len, r.layout.block_stride, r.layout.num_blocks,
                       r.layout.span()) for r in a.regions])
        return w

    def _open_bell(self, name: str, token: bytes) -> Doorbell | None:
        """The worker's doorbell page, by descriptor from the fd socket; by /dev/shm name it is refused."""
        if token:
            if name:
                raise InvalidArgument("a doorbell by name or by memfd token, not both")
            fd = self.fds.take(token)
            return Doorbell(fd, fd_label(fd))
        if not name:
            return None
        raise PermissionDenied(f"doorbell {name[:256]!r}: a page by /dev/shm name is refused; hand it over as a "
                               "memfd (doorbell_token)")

    def _claim_bell(self, bell: Doorbell, claims: set[tuple[object, ...]]) -> None:
        """One page rings for one worker: two on one page would read each other's progress (a WRITE of
        layers not computed yet)."""
        key = ("bell", *bell.ident)
        owner = next((w.worker_id for w in self.by_id.values()
                      if not w.gone and w.bell is not None and w.bell.ident == bell.ident), None)
        if owner is not None or key in self._claims:
            raise FailedPrecondition(
                f"doorbell {bell.name!r} is already worker {owner or '(attaching now)'}'s: each worker rings "
                f"a page of its own")
        claims.add(key)
        self._claims.add(key)

    def _populate(self, loop: asyncio.AbstractEventLoop, wid: str, m: ShmMapping) -> None:
        """Map the worker's host KV into the daemon's page tables in the background (ShmMapping.populate)."""
        t0 = time.monotonic()

        def done(f: asyncio.Future[int]) -> None:
            if not f.cancelled() and f.exception() is None:
                log.info("host KV populated", worker_id=wid, shm=m.name, bytes=f.result(),
                         seconds=round(time.monotonic() - t0, 3))
            elif not f.cancelled():
                log.warning("host KV populate failed", worker_id=wid, shm=m.name, error=str(f.exception()))

        loop.run_in_executor(self._populator, m.populate).add_done_callback(done)

    def get(self, worker_id: str) -> Worker:
        w = self.live(worker_id)
        if w is None:
            raise NotFound(f"unknown worker {worker_id!r} (not attached, or its session ended)")
        return w

    def owned(self, worker_id: str, token: bytes) -> Worker:
        """The worker, for a caller that presents its token (the Attach's answer): its session and its
        Detach are its own, not any process's on the worker socket that read its id in the status."""
        w = self.get(worker_id)
        if not secrets.compare_digest(bytes(token), w.token):
            raise PermissionDenied(f"worker {worker_id[:128]!r}: its Stream and Detach need the worker_token its "
                                   "Attach answered")
        return w

    def live(self, worker_id: str) -> Worker | None:
        w = self.by_id.get(worker_id)
        return None if w is None or w.gone else w

    def called(self, worker_id: str, commands: int) -> None:
        """Count a worker's Stream batch of ``commands`` commands, for status."""
        w = self.live(worker_id)
        if w is not None:
            w.command_batches += 1
            w.stream_commands += commands

    def wake(self, worker_id: str) -> None:
        """Wake the worker's session (the Stream RPC has answers of its own to send)."""
        w = self.live(worker_id)
        if w is not None:
            w.wakeup.set()

    def producer(self, engine_id: str) -> Worker | None:
        """A prefill worker of that engine (any rank: they share a layout), or None."""
        return next((w for w in self.by_id.values() if w.engine_id == engine_id and w.role.can_send and not w.gone),
                    None)

    def deliver(self, worker_id: str, c: Completion) -> None:
        """Queue a completion for the worker's session (dropped if the worker is gone)."""
        w = self.live(worker_id)
        if w is None:
            return
        w.completions.append(c)
        w.wakeup.set()

    async def session_batches(self, worker_id: str, on_end: Callable[[str, str], Awaitable[None]]
                              ) -> AsyncGenerator[list[Completion], None]:
        """The worker's completions in batches, every one queued when it wakes, until the worker goes
        away; the caller's end means detach (``on_end``). Woken with none (the Stream RPC set
        ``wakeup`` for answers of its own to send) it yields an empty batch."""
        w = self.get(worker_id)
        if w.session_open:
            raise AlreadyExists(f"worker {worker_id} already has a session")
        w.session_open = True
        try:
            while not w.gone:
                batch = list(w.completions)
                w.completions.clear()
                w.wakeup.clear()
                yield batch
                if not w.completions and not w.gone:
                    await w.wakeup.wait()
        finally:
            if not w.gone:
                log.info("worker session ended; detaching", worker_id=worker_id)
                await on_end(worker_id, "session ended")

    def mark_gone(self, worker_id: str) -> Worker | None:
        """First step of a detach: no completions are queued for it from now on."""
        w = self.live(worker_id)
        if w is None:
            return None
        w.gone = True
        w.wakeup.set()
        return w

    async def release(self, w: Worker, why: str) -> None:
        """Last step of a detach: NIXL lets go of its memory (after its WRITEs in flight), then we unmap.
        It runs to its end whoever waits for it: a caller that goes (a worker's stream cancelled as its
        process dies, a Detach past its deadline) does not cut it short, which unmapped memory that a
        WRITE in flight still read and left the NIXL thread's release waiting on an abandoned future."""
        task = self._releasing.get(w.worker_id)
        if task is None:
            task = asyncio.ensure_future(self._release(w, why))
            self._releasing[w.worker_id] = task
            task.add_done_callback(lambda t: self._released(w.worker_id, t))
        await asyncio.shield(task)

    async def releasing(self, worker_id: str) -> None:
        """Wait for the worker's release under way, if any (a second Detach returns when it is detached)."""
        task = self._releasing.get(worker_id)
        if task is not None:
            await asyncio.shield(task)

    def _released(self, worker_id: str, task: asyncio.Future[None]) -> None:
        self._releasing.pop(worker_id, None)
        if not task.cancelled() and (e := task.exception()) is not None:
            log.warning("releasing a worker failed", worker_id=worker_id, error=str(e))

    async def _release(self, w: Worker, why: str) -> None:
        assert self.xfer is not None
        try:
            await self.xfer.detach(w.worker_id)
        finally:
            for m in w.mappings:
                m.close()
            if w.bell is not None:
                w.bell.close()
            self.by_id.pop(w.worker_id, None)
            log.info("worker detached", worker_id=w.worker_id, reason=why)
            self.events.emit(EventKind.WORKER_DETACHED, worker_id=w.worker_id, engine_id=w.engine_id, detail=why)

    def without_session(self, now: float) -> list[str]:
        """Workers that attached but never opened their session within the grace period."""
        grace = self.cfg.worker_api.session_grace_s
        return [w.worker_id for w in self.by_id.values()
                if not w.session_open and not w.gone and now - w.attached_at > grace]


def _abandoned(task: asyncio.Future[Worker]) -> None:
    if task.cancelled():
        return
    if (e := task.exception()) is not None:
        log.info("an Attach whose caller left failed", error=str(e))
    else:
        log.info("an Attach whose caller left finished; its worker goes unless it opens a session",
                 worker_id=task.result().worker_id)


def check_command(w: Worker, cmd: Expect | Publish | Decline, cfg: Config) -> None:
    """What a worker's Expect, Publish or Decline must be before the core sees it."""
    if isinstance(cmd, Publish):
        if not w.role.can_send:
            raise FailedPrecondition(f"worker {w.worker_id} attached as {w.role.name}: it cannot publish")
        check_blocks(w, cmd.block_ids, cfg)
        check_transfer_id(cmd.transfer_id)
        if max(len(cmd.consumer_node_id), len(cmd.consumer_tls_name)) > 256:
            raise InvalidArgument("consumer_node_id and consumer_tls_name are limited to 256 characters")
        check_progressive(w, cmd.step, cmd.layers)
        return
    if not w.role.can_receive:
        verb = "expect" if isinstance(cmd, Expect) else "decline"
        raise FailedPrecondition(f"worker {w.worker_id} attached as {w.role.name}: it cannot {verb}")
    if isinstance(cmd, Decline):
        check_transfer_id(cmd.transfer_id)
        if not cmd.producer_engine_id or not cmd.producer_address:
            raise InvalidArgument("producer_address and producer_engine_id must not be empty")
        return
    check_blocks(w, cmd.block_ids, cfg)
    check_skip(w, cmd.skip_tokens)
    check_transfer_id(cmd.transfer_id)
    if not cmd.producer_engine_id:
        raise InvalidArgument("producer_engine_id must not be empty")


def check_blocks(w: Worker, block_ids: Sequence[int], cfg: Config) -> None:
    check_block_ids(block_ids, w.min_blocks, cfg.worker_api.max_blocks_per_request, f"worker {w.worker_id}'s regions")


def check_attach(a: Attach, cfg: Config) -> None:
    engine_id, tp_rank, tp_size, memory, regions, description = (a.engine_id, a.tp_rank, a.tp_size, a.memory,
                                                                  a.regions, a.description)
    if not engine_id or len(engine_id) > 128 or not engine_id.isprintable() or "." in engine_id:
        raise InvalidArgument(f"engine_id {engine_id!r}: 1-128 printable characters, no '.'")
    if a.role is Role.UNSPECIFIED:
        raise InvalidArgument("role must be PRODUCER, CONSUMER or BOTH")
    if tp_size < 1 or tp_rank >= tp_size:
        raise InvalidArgument(f"tp_rank {tp_rank} must be below tp_size {tp_size} (>= 1)")
    if not memory:
        raise InvalidArgument("no memory handles")
    if len(memory) > MAX_MEMORY_HANDLES or not regions or len(regions) > 4096:
        raise InvalidArgument(f"{len(memory)} memory handles and {len(regions)} regions: "
                              f"need 1-{MAX_MEMORY_HANDLES} and 1-4096")
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


def check_progressive(w: Worker, step: int, layers: int) -> None:
    """A progressive publish needs the worker's doorbell and layer groups that split its regions evenly."""
    if not layers and not step:
        return
    if w.bell is None:
        raise FailedPrecondition(f"worker {w.worker_id} attached without a doorbell: it cannot publish progressively "
                                 "(step/layers); attach with one, or publish once the blocks are complete")
    if step < 1 or layers < 1 or layers > MAX_LAYERS or len(w.regions) % layers:
        raise InvalidArgument(f"progressive publish: step {step} and layers {layers} must be positive, with layers "
                              f"at most {MAX_LAYERS} and dividing the worker's {len(w.regions)} regions")


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
