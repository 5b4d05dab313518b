"""Daemons that call us: handshakes and their sessions, and the remote NIXL agents they introduce.

This room owns the sessions (``Inbound.origins``) and two agent tables: decode daemons' consumer
agents (from Register, push mode's WRITE targets) and prefill daemons' producer agents (from Offer,
pull mode's READ sources). Both are admitted by one rule (``AgentTable.admit``): the agent is named
after the calling daemon, an agent already known belongs to the daemon that introduced it, its
metadata names that same agent and its region table is bounded, and each daemon has a cap, the
least recently used agents no pending transfer needs being evicted first.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from .. import PROTOCOL_VERSION
from ..config import PeerApiConfig
from ..core import notif
from ..core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted, SessionUnknown
from ..transfer.descs import RemoteAgent
from .identity import agent_prefix, metadata_agent_name

log = structlog.get_logger(__name__)

MAX_AGENTS_PER_ORIGIN = 1024   # remote agents of one kind one peer daemon may have loaded here at once
MAX_AGENT_METADATA = 1 << 20   # bytes of NIXL agent metadata a peer may send
MAX_AGENT_REGIONS = 4096       # as for Attach


@dataclass(frozen=True, slots=True)
class Hello:
    """A peer daemon's handshake as this daemon sees it: what the caller says, and what its
    connection proves (its certificate's names, the address it connects from)."""

    protocol_version: int
    compat_hash: str
    node_id: str
    peer_address: str
    instance_id: str
    token: str = ""  # the session token it presents, if any
    tls_names: tuple[str, ...] = ()  # its client certificate's CN and SANs (TLS)
    host: str = ""  # the connection's source address, without its port (gRPC's peer)

    @property
    def identity(self) -> str:
        """Who the caller is for quotas: its certificate under TLS, else the host it connects from
        (what it claims, node id, address or instance id, proves nothing)."""
        return f"tls:{self.tls_names[0]}" if self.tls_names else f"host:{self.host}"


@dataclass(slots=True)
class Origin:
    """A daemon that handshook with us (from its handshake)."""

    instance_id: str
    node_id: str
    address: str
    token: str = ""  # secret of this session (HandshakeResponse.session_token)
    identity: str = ""  # who it is for quotas (Hello.identity): its sessions share them
    tls_names: tuple[str, ...] = ()  # CN and SANs of the client certificate it handshook with (TLS)
    last_seen: float = field(default_factory=time.monotonic)
    tokens: float = -1.0  # Register rate limit: a token bucket (-1: full at the first call)
    refilled: float = field(default_factory=time.monotonic)
    refused: int = 0  # calls refused by a limit (rate, quota, replacement of another's registration)
    streams: int = 0  # its Channel streams open to us now, and the PeerBatch messages it sent on them
    stream_batches: int = 0
    stream_ended: float = 0.0  # time.monotonic() when its last open Channel stream ended (0: never)
    booked: float = 0.0  # time.monotonic() when its contact last went to the peer book

    def ended(self, now: float, quiet_s: float) -> bool:
        """No stream of it is open and it was heard from neither since its last stream ended nor
        within ``quiet_s``: the daemon behind it is gone (died, restarted, or lost its connection)."""
        return self.streams == 0 and (self.stream_ended >= self.last_seen or now - self.last_seen > quiet_s)

    def unanswered(self, now: float, answer_s: float) -> bool:
        """It never opened a Channel stream and was unheard for ``answer_s`` (a caller's Handshake
        deadline) since its handshake: its daemon never got the answer, or gave up waiting for it."""
        return self.streams == 0 and not self.stream_ended and now - self.last_seen > answer_s

    def book_contact(self) -> bool:
        """Whether its contact goes to the peer book now: at most once a second (the status shows the
        last contact to the second), not once per Register."""
        if self.last_seen - self.booked < 1.0:
            return False
        self.booked = self.last_seen
        return True

    def take(self, rate: float) -> bool:
        """One Register's token; a burst of one second's worth, refilled at ``rate`` per second."""
        now = time.monotonic()
        burst = max(1.0, rate)
        self.tokens = burst if self.tokens < 0 else min(burst, self.tokens + (now - self.refilled) * rate)
        self.refilled = now
        if self.tokens < 1.0:
            return False
        self.tokens -= 1.0
        return True


@dataclass(slots=True)
class _Held:
    owner: str  # instance id of the daemon that introduced the agent
    agent: RemoteAgent
    last_used: float


def check_agent(agent: RemoteAgent, kind: str) -> None:
    """Bounds on an agent a peer introduces, before anything of it reaches NIXL."""
    name = agent.name[:128]
    if len(agent.metadata) > MAX_AGENT_METADATA:
        raise InvalidArgument(f"{kind} agent metadata of {len(agent.metadata)} bytes; at most {MAX_AGENT_METADATA}")
    if not 1 <= len(agent.regions) <= MAX_AGENT_REGIONS:
        raise InvalidArgument(f"{kind} agent {name!r} has {len(agent.regions)} regions; need 1-{MAX_AGENT_REGIONS}")
    if agent.mem_type not in ("DRAM", "VRAM"):
        raise InvalidArgument(f"{kind} agent {name!r}: memory kind {agent.mem_type[:16]!r}")
    for i, r in enumerate(agent.regions):
        if r.num_blocks < 1 or r.block_len < 1 or r.block_stride < r.block_len or r.addr >= 1 << 64:
            raise InvalidArgument(f"{kind} agent region {i}: need num_blocks >= 1, block_len >= 1, "
                                  f"block_stride >= block_len")


class AgentTable:
    """Remote agents of one kind loaded here, each kept from the daemon that introduced it."""

    def __init__(self, kind: str, per_owner: int, forget: Callable[[str], None]) -> None:
        self.kind = kind
        self.per_owner = per_owner
        self._forget = forget  # unloads an agent from NIXL (deferred there while a transfer uses it)
        self._held: dict[str, _Held] = {}
        self._owned: dict[str, int] = {}  # agents held per owner (counted, not scanned, per Register)

    def __len__(self) -> int:
        return len(self._held)

    def get(self, name: str) -> RemoteAgent | None:
        h = self._held.get(name)
        return None if h is None else h.agent

    def owner_of(self, name: str) -> str | None:
        h = self._held.get(name)
        return None if h is None else h.owner

    def count(self, owner: str) -> int:
        return self._owned.get(owner, 0)

    def _forget_held(self, name: str) -> None:
        owner = self._held.pop(name).owner
        left = self._owned.get(owner, 0) - 1
        if left > 0:
            self._owned[owner] = left
        else:
            self._owned.pop(owner, None)
        self._forget(name)

    def admit(self, origin: Origin, agent: RemoteAgent, in_use: Callable[[], set[str]]) -> RemoteAgent | None:
        """The agent a call from ``origin`` names, as known here; None when its metadata is needed first."""
        prefix = agent_prefix(origin.node_id, origin.instance_id)
        if len(agent.name) > 512 or not agent.name.startswith(prefix):
            raise PermissionDenied(f"{self.kind} agent {agent.name[:128]!r} is not one of the calling daemon's "
                                   f"(its agents are named {prefix}*)")
        held = self._held.get(agent.name)
        if held is not None and held.owner != origin.instance_id:
            # Agents are keyed by the daemon that introduced them: another peer may not re-use
            # (and so redirect) a name it does not own.
            raise PermissionDenied(f"{self.kind} agent {agent.name[:128]!r} belongs to another peer daemon")
        now = time.monotonic()
        if held is None:
            if not agent.metadata:
                return None
            check_agent(agent, self.kind)
            md_name = metadata_agent_name(agent.metadata)
            if md_name != agent.name:
                raise PermissionDenied(f"{self.kind} agent {agent.name[:128]!r}: its NIXL metadata names agent "
                                       f"{(md_name or '<unreadable>')[:128]!r}")
            if self.count(origin.instance_id) >= self.per_owner:
                self._evict(origin, in_use())
            held = self._held[agent.name] = _Held(origin.instance_id, agent, now)
            self._owned[origin.instance_id] = self._owned.get(origin.instance_id, 0) + 1
        held.last_used = now
        return held.agent

    def names_of(self, owner: str) -> list[str]:
        """The agents ``owner`` introduced here."""
        if owner not in self._owned:
            return []
        return [n for n, h in self._held.items() if h.owner == owner]

    def drop_owner(self, owner: str) -> None:
        for name in self.names_of(owner):
            self._forget_held(name)

    def _evict(self, origin: Origin, in_use: set[str]) -> None:
        """Make room among a peer's agents: forget the least recently used half that no pending
        transfer refers to (workers that detached on that node leave theirs behind)."""
        idle = sorted((h.last_used, n) for n, h in self._held.items()
                      if h.owner == origin.instance_id and n not in in_use)
        for _, name in idle[:max(1, self.count(origin.instance_id) // 2)]:
            self._forget_held(name)
        if self.count(origin.instance_id) >= self.per_owner:
            raise ResourceExhausted(f"peer {origin.node_id} has {self.count(origin.instance_id)} {self.kind} agents "
                                    f"in use here; at most {self.per_owner}")


class Inbound:
    """Sessions of the daemons that call us, and the agents they introduced."""

    def __init__(self, forget_remote: Callable[[str], None], quiet_s: float = 10.0,
                 max_sessions: int = 16, answer_s: float = 5.0) -> None:
        self.quiet_s = quiet_s  # transfer.peer_timeout_s: a session unheard this long, streamless, has ended
        self.answer_s = answer_s  # peer_api.connect_timeout_s: a caller's Handshake deadline
        self.max_sessions = max_sessions  # peer_api.max_sessions_per_peer: sessions open of one identity
        self.origins: dict[str, Origin] = {}
        self.identities: dict[str, set[str]] = {}  # identity -> instance ids of its sessions
        self._at: dict[str, set[str]] = {}  # peer address -> instance ids of sessions from it (no scan per handshake)
        self.consumers = AgentTable("consumer", MAX_AGENTS_PER_ORIGIN, forget_remote)
        self.producers = AgentTable("producer", MAX_AGENTS_PER_ORIGIN, forget_remote)

    def handshake(self, hello: Hello, busy: Callable[[str], bool]) -> tuple[str, list[Origin]]:
        """A peer daemon introduces itself; returns the secret token of its session, and the sessions
        it replaces (a restarted daemon's old ones, whose pending transfers the caller fails).

        A session is taken over only by the daemon it belongs to, never on a claim: the same instance
        id again needs the session's token (``Hello.token``), unless that session has ended
        (``Origin.ended``) and holds nothing (``busy``: whether an instance id has transfers pending
        here), or the handshake is of the same identity and the session never opened its stream within
        a Handshake deadline (``Origin.unanswered``: its daemon lost the answer, and has no token). A
        new instance at the address of others replaces them only where the restart is proven: the
        same TLS identity (certificate names), or an old session that has ended; otherwise it
        stands beside them and they end by liveness (``silent``), so a handshake that merely claims
        another daemon's address or instance id drops nothing of it."""
        h, instance_id, peer_address = hello, hello.instance_id, hello.peer_address
        if h.protocol_version != PROTOCOL_VERSION or h.compat_hash != notif.compat_hash():
            raise FailedPrecondition(
                f"incompatible peer {h.node_id[:64]!r}: protocol {h.protocol_version}/{h.compat_hash[:64]}, "
                f"ours {PROTOCOL_VERSION}/{notif.compat_hash()}")
        if not instance_id or not peer_address:
            raise InvalidArgument("handshake needs instance_id and peer_address")
        if max(len(h.node_id), len(peer_address), len(instance_id)) > 256:
            raise InvalidArgument("handshake: node_id, peer_address and instance_id are limited to 256 characters")
        now = time.monotonic()
        known = self.origins.get(instance_id)
        if known is not None:
            if h.token and secrets.compare_digest(h.token, known.token):
                known.last_seen = now
                known.tls_names = h.tls_names
                return known.token, []  # the same session again
            if busy(instance_id):
                raise PermissionDenied(f"instance id {instance_id[:64]!r} belongs to a peer session with transfers "
                                       "pending here; a daemon that lost its session token must wait for them to end")
            if not known.ended(now, self.quiet_s) and not (
                    h.identity == known.identity and known.unanswered(now, self.answer_s)):
                raise PermissionDenied(f"instance id {instance_id[:64]!r} belongs to a live peer session; "
                                       "present its session token")
            self.drop(known)  # an ended session holding nothing: its instance starts afresh
        replaced = [o for i in self._at.get(peer_address, ()) if i != instance_id and (
            (o := self.origins[i]).ended(now, self.quiet_s) or (h.tls_names and o.tls_names == h.tls_names))]
        leaving = sum(o.identity == h.identity for o in replaced)  # its sessions this one replaces

        def open_now() -> int:
            return len(self.identities.get(h.identity, ())) - leaving

        if open_now() >= self.max_sessions:
            # at its bound: its least recently heard session with no stream open and nothing pending
            # goes (a live daemon keeps its Channel open; one forgotten handshakes again when it calls)
            spare = [o for i in self.identities[h.identity] if i != instance_id
                     and (o := self.origins[i]).streams == 0 and o not in replaced and not busy(i)]
            if spare:
                self.drop(min(spare, key=lambda o: o.last_seen))
        if open_now() >= self.max_sessions:
            raise ResourceExhausted(f"{open_now() + leaving} peer sessions open from {h.identity[:128]}; at most "
                                    f"{self.max_sessions} (peer_api.max_sessions_per_peer)")
        self._at.setdefault(peer_address, set()).add(instance_id)
        self.identities.setdefault(h.identity, set()).add(instance_id)
        origin = self.origins[instance_id] = Origin(instance_id, h.node_id, peer_address, token=secrets.token_hex(16),
                                                    identity=h.identity, tls_names=h.tls_names)
        log.info("peer handshake", peer_node=h.node_id, peer_address=peer_address, identity=h.identity[:128])
        return origin.token, replaced

    def session_ok(self, instance_id: str, token: str) -> bool:
        origin = self.origins.get(instance_id)
        return origin is not None and bool(token) and secrets.compare_digest(token, origin.token)

    def channel_counts(self, instance_id: str, streams: int = 0, batches: int = 0) -> None:
        """A peer's Channel stream opened or closed (``streams`` +1 / -1), or brought ``batches`` (for status)."""
        o = self.origins.get(instance_id)
        if o is not None:
            o.streams = max(0, o.streams + streams)
            o.stream_batches += batches
            if streams < 0 and o.streams == 0:  # its last stream ended: housekeeping gives it a short grace
                o.stream_ended = time.monotonic()

    def over_quota(self, origin: Origin, n_blocks: int | None, held_by: Callable[[str], tuple[int, int]],
                   pa: PeerApiConfig) -> str:
        """Why one decode daemon may not ask this of us now ("" when it may): Registers (and Declines)
        per second, registrations and blocks held (``held_by``: a session's, from the core) summed over
        every session of its identity; ``n_blocks`` None: a Decline, which holds nothing."""
        regs = blocks = 0
        # the caller's sessions share its quotas (its own session included)
        for instance in self.identities.get(origin.identity, ()) or (origin.instance_id,):
            r, b = held_by(instance)
            regs, blocks = regs + r, blocks + b
        if not origin.take(pa.max_registers_per_s):
            return (f"more than {pa.max_registers_per_s:g} Registers and Declines per second "
                    "(peer_api.max_registers_per_s)")
        if n_blocks is not None and regs + 1 > pa.max_registrations_per_peer:
            return (f"{regs} registrations pending from {origin.identity[:128]}; at most "
                    f"{pa.max_registrations_per_peer} (peer_api.max_registrations_per_peer)")
        if n_blocks is not None and blocks + n_blocks > pa.max_blocks_per_peer:
            return (f"{blocks} destination blocks held for {origin.identity[:128]}, {n_blocks} more asked; at most "
                    f"{pa.max_blocks_per_peer} (peer_api.max_blocks_per_peer)")
        return ""

    def caller(self, instance_id: str) -> Origin:
        """The calling daemon's session (its token was checked by the servicer); it was heard from now."""
        origin = self.origins.get(instance_id)
        if origin is None:
            raise SessionUnknown(f"unknown caller instance {instance_id[:64]!r}: handshake first")
        origin.last_seen = time.monotonic()
        return origin

    def origin_of_consumer_agent(self, name: str) -> Origin | None:
        owner = self.consumers.owner_of(name)
        return None if owner is None else self.origins.get(owner)

    def drop(self, origin: Origin) -> None:
        """Forget a session and every agent it introduced."""
        gone = self.origins.pop(origin.instance_id, None)
        if gone is not None:
            for index, key in ((self._at, gone.address), (self.identities, gone.identity)):
                same = index.get(key, set())
                same.discard(gone.instance_id)
                if not same:
                    index.pop(key, None)
        self.consumers.drop_owner(origin.instance_id)
        self.producers.drop_owner(origin.instance_id)

    def silent(self, now: float, busy: set[str], timeout_s: float, grace_s: float) -> list[tuple[Origin, str]]:
        """Sessions with transfers pending here whose daemon sent nothing for ``timeout_s``, or whose
        Channel stream ended (its daemon died, or the connection dropped) with nothing heard since
        for ``grace_s``: a live daemon with transfers pending here heartbeats on a new stream before
        that. Each with why, in words."""
        out = []
        for i in busy:
            o = self.origins.get(i)
            if o is None:
                continue
            if o.streams == 0 and o.stream_ended >= o.last_seen and now - o.stream_ended > grace_s:
                out.append((o, f"its peer stream ended and it sent nothing for {grace_s:g}s"))
            elif now - o.last_seen > timeout_s:
                out.append((o, f"it sent no heartbeat for {timeout_s:g}s"))
        return out

    def forget_idle(self, now: float, busy: set[str], idle_s: float) -> None:
        """Peers idle for a while are forgotten (their agents unloaded); one that comes back handshakes
        again and resends its agents' metadata when asked."""
        for origin in [o for o in self.origins.values() if o.instance_id not in busy and now - o.last_seen > idle_s]:
            log.info("forgetting idle peer", peer_node=origin.node_id, peer_address=origin.address,
                     agents=self.consumers.count(origin.instance_id) + self.producers.count(origin.instance_id))
            self.drop(origin)
