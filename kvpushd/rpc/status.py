"""StatusService: node, workers, peers, transfers in flight, counters, and the Watch stream."""

from __future__ import annotations

import collections
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
from kvpushd_client.proto.v1 import common_pb2, status_pb2, status_pb2_grpc

from ..config import Config
from ..core.errors import InvalidArgument
from ..events import Event, EventKind
from ..runtime.tally import Counters
from ..runtime.view import PeerView, View
from ..transfer.descs import RegionSpec
from .errors import stream, unary

Ctx = Any
MAX_TRANSFERS = 1000  # entries of a GetStatus answer: it stays well below gRPC's default 4 MiB
MAX_PEERS = 256
_COUNTERS = [f for f in Counters.__slots__ if f in status_pb2.Counters.DESCRIPTOR.fields_by_name]


def node_status(v: View) -> status_pb2.NodeStatus:
    wall = time.time()
    c = v.counters
    ev = v.events
    uptime = v.uptime_s
    st = status_pb2.NodeStatus(
        node_id=v.ident.node_id, version=v.ident.version, instance_id=v.ident.instance_id,
        uptime_s=uptime, peer_address=v.ident.peer_address, worker_socket=v.cfg.socket_path,
        backends=list(v.cfg.transfer.backends), metrics_address=v.ident.metrics_address,
        config=config_summary(v.cfg), draining=v.draining, started_unix=wall - uptime,
        watchers=ev.subscribers,
        counters=status_pb2.Counters(  # the tally's counters, by name, and three kept elsewhere
            **{f: getattr(c, f) for f in _COUNTERS}, stray_notifications=v.stray_notifications,
            events_emitted=ev.emitted, events_dropped=ev.dropped),
    )
    now = time.monotonic()
    sends, recvs = v.send_transfers(), v.recv_transfers()
    pending = collections.Counter([*(wid for s in sends for wid in s.workers), *(r.worker_id for r in recvs)])
    for w in v.workers():
        st.workers.append(status_pb2.WorkerStatus(
            worker_id=w.worker_id, engine_id=w.engine_id, role=common_pb2.Role.ValueType(int(w.role)),
            tp_rank=w.tp_rank, tp_size=w.tp_size, pp_rank=w.pp_rank, agent_name=w.agent_name,
            memory_kind=w.mem_type, num_regions=len(w.regions), registered_bytes=w.registered_bytes,
            attached_s=now - w.attached_at, description=w.description, regions=region_summary(w.regions),
            pending_transfers=pending[w.worker_id], backends=agent_backends(v, w.worker_id),
            command_batches=w.command_batches, stream_commands=w.stream_commands))
    peers = peer_status(v, wall)
    if len(peers) > MAX_PEERS:  # the ones heard from most recently
        peers = sorted(peers, key=lambda p: -p.last_contact_unix)
    st.peers.extend(peers[:MAX_PEERS])
    st.peers_omitted = max(0, len(peers) - MAX_PEERS)
    idents = sorted(v.peer_identities(), key=lambda i: (-i.blocks, -i.sessions, i.identity))
    st.peer_identities.extend(status_pb2.PeerIdentityStatus(
        identity=i.identity, sessions=i.sessions, registrations=i.registrations, blocks=i.blocks, refused=i.refused)
        for i in idents[:MAX_PEERS])
    st.peer_identities_omitted = max(0, len(idents) - MAX_PEERS)
    for s in sends:
        st.transfers.append(status_pb2.TransferStatus(
            transfer_id=s.transfer_id, side="send", state="pending" if not s.legs_posted else "writing",
            age_s=s.age_s, waiting_for=s.waiting_for, worker_id=",".join(s.workers), num_blocks=s.num_blocks,
            engine_id=s.engine_id, peer=s.peer))
    for r in recvs:
        rw = v.worker(r.worker_id)
        st.transfers.append(status_pb2.TransferStatus(
            transfer_id=r.transfer_id, side="recv", state=r.state, age_s=r.age_s, waiting_for=r.waiting_for,
            worker_id=r.worker_id, num_blocks=r.num_blocks, engine_id=rw.engine_id if rw else "",
            peer=r.producer_address, registration_id=r.registration_id, mode=r.mode))
    if len(st.transfers) > MAX_TRANSFERS:  # the oldest first: those are the ones to look at
        keep = sorted(st.transfers, key=lambda t: -t.age_s)[:MAX_TRANSFERS]
        st.transfers_omitted = len(st.transfers) - MAX_TRANSFERS
        del st.transfers[:]
        st.transfers.extend(keep)
    for t_unix, tid, text in v.recent_failures():
        st.recent_failures.append(status_pb2.FailureRecord(time_unix=t_unix, age_s=max(wall - t_unix, 0.0),
                                                           transfer_id=tid, reason=text))
    return st


def agent_backends(v: View, worker_id: str) -> list[status_pb2.AgentBackend]:
    """The NIXL backends of a worker's agent: name, init parameters, network devices (its rails)."""
    return [status_pb2.AgentBackend(name=b.name, params=b.params, devices=b.devices, devices_from=b.devices_from,
                                    device=b.device) for b in v.agent_backends(worker_id)]


def region_summary(regions: Sequence[RegionSpec]) -> list[status_pb2.RegionSummary]:
    """Runs of consecutive regions with one layout: a 64-layer model shows one line, not 128."""
    out: list[status_pb2.RegionSummary] = []
    for i, r in enumerate(regions):
        last = out[-1] if out else None
        if last is not None and (last.num_blocks, last.block_len, last.block_stride, last.device_id) == (
                r.num_blocks, r.block_len, r.block_stride, r.device_id):
            last.count += 1
            last.bytes += r.num_blocks * r.block_len
            continue
        out.append(status_pb2.RegionSummary(first_index=i, count=1, num_blocks=r.num_blocks, block_len=r.block_len,
                                            block_stride=r.block_stride, device_id=r.device_id,
                                            bytes=r.num_blocks * r.block_len))
    return out


def peer_status(v: View, wall: float) -> list[status_pb2.PeerStatus]:
    """Every other daemon we call (outbound) or that calls us (inbound), by its peer address."""
    out = []
    for pv in v.peers():
        p = status_pb2.PeerStatus(**{f: getattr(pv, f) for f in PeerView.__slots__})  # its fields, by name
        if pv.last_contact_unix:
            p.last_contact_age_s = max(wall - pv.last_contact_unix, 0.0)
        out.append(p)
    return out


_summary: tuple[Config, dict[str, str]] | None = None  # the last one made: a Config is frozen


def config_summary(cfg: Config) -> dict[str, str]:
    """Every effective setting as "section.key" -> value (JSON-ish, as in the TOML file). Made once per
    Config: walking the structs' fields costs ~1.2 ms of the loop (msgspec resolves the annotations)."""
    global _summary
    if _summary is not None and _summary[0] is cfg:
        return _summary[1]
    out: dict[str, str] = {}
    for section in msgspec.structs.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in msgspec.structs.fields(sub):
            v = getattr(sub, f.name)
            out[f"{section.name}.{f.name}"] = v if isinstance(v, str) else json.dumps(list(v) if isinstance(
                v, tuple) else v)
    out["worker_api.socket"] = cfg.socket_path
    out["node.node_id"] = cfg.node_id
    _summary = (cfg, out)
    return out


def event(ev: Event, dropped: int) -> status_pb2.Event:
    return status_pb2.Event(
        seq=ev.seq, time_unix=ev.time, kind=status_pb2.EventKind.ValueType(int(ev.kind)), transfer_id=ev.transfer_id,
        engine_id=ev.engine_id, worker_id=ev.worker_id, side=ev.side, peer=ev.peer,
        code=common_pb2.FailureCode.ValueType(int(ev.code)), detail=ev.detail, num_blocks=ev.num_blocks,
        bytes=ev.nbytes, duration_s=ev.duration_s, dropped=dropped)


class StatusServicer(status_pb2_grpc.StatusServiceServicer):
    def __init__(self, view: View) -> None:
        self.view = view

    @unary
    async def GetStatus(self, request: status_pb2.GetStatusRequest, context: Ctx) -> status_pb2.NodeStatus:
        return node_status(self.view)

    @stream
    async def Watch(self, request: status_pb2.WatchRequest, context: Ctx) -> AsyncIterator[status_pb2.Event]:
        unknown = [k for k in request.kinds if k not in EventKind._value2member_map_ or k == 0]
        if unknown:
            raise InvalidArgument(f"unknown event kind(s) {unknown}")
        kinds = [EventKind(k) for k in request.kinds]
        sub = self.view.events.subscribe(kinds, request.queue_size)
        try:
            while (ev := await sub.get()) is not None:
                yield event(ev, sub.dropped)
        finally:
            sub.close()
