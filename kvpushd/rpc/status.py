"""StatusService: node, workers, peers, transfers in flight, counters, and the Watch stream."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvpushd_client.proto.v1 import common_pb2, status_pb2, status_pb2_grpc

from ..config import Config
from ..core.errors import InvalidArgument
from ..events import Event, EventKind
from ..node import Node
from ..transfer.descs import RegionSpec
from .errors import stream, unary

Ctx = Any


def node_status(node: Node) -> status_pb2.NodeStatus:
    now = time.monotonic()
    wall = time.time()
    c = node.counters
    ev = node.events
    st = status_pb2.NodeStatus(
        node_id=node.node_id, version=node.version(), instance_id=node.instance_id,
        uptime_s=now - node.started, peer_address=node.peer_address, worker_socket=node.cfg.socket_path,
        backends=list(node.cfg.transfer.backends), metrics_address=node.metrics.address,
        config=config_summary(node.cfg), draining=node.draining, started_unix=wall - (now - node.started),
        watchers=ev.subscribers,
        counters=status_pb2.Counters(
            transfers_finished=c.transfers_finished, transfers_failed=c.transfers_failed,
            bytes_written=c.bytes_written, writes_posted=c.writes_posted,
            notifications_received=c.notifications_received,
            stray_notifications=node.recv.stray_notifications + (node.xfer.stray_notifications if node.xfer else 0),
            descriptors_requested=c.descriptors_requested, descriptors_posted=c.descriptors_posted,
            events_emitted=ev.emitted, events_dropped=ev.dropped,
            reads_posted=c.reads_posted, bytes_read=c.bytes_read),
    )
    pending = collections.Counter(worker_id for worker_id, _ in ev.open)
    for w in node.workers.values():
        st.workers.append(status_pb2.WorkerStatus(
            worker_id=w.worker_id, engine_id=w.engine_id, role=common_pb2.Role.ValueType(int(w.role)),
            tp_rank=w.tp_rank, tp_size=w.tp_size, pp_rank=w.pp_rank, agent_name=w.agent_name,
            memory_kind=w.mem_type, num_regions=len(w.regions), registered_bytes=w.registered_bytes,
            attached_s=now - w.attached_at, description=w.description, regions=region_summary(w.regions),
            pending_transfers=pending[w.worker_id], backends=agent_backends(node, w.worker_id)))
    st.peers.extend(peer_status(node, wall))
    for s in node.send.views(now):
        peer = next((t.peer for wid in s.workers if (t := ev.open.get((wid, s.transfer_id))) and t.peer), "")
        st.transfers.append(status_pb2.TransferStatus(
            transfer_id=s.transfer_id, side="send", state="pending" if not s.legs_posted else "writing",
            age_s=s.age_s, waiting_for=s.waiting_for, worker_id=",".join(s.workers), num_blocks=s.num_blocks,
            engine_id=s.engine_id, peer=peer))
    for r in node.recv.views(now):
        rw = node.workers.get(r.worker_id)
        st.transfers.append(status_pb2.TransferStatus(
            transfer_id=r.transfer_id, side="recv", state=r.state, age_s=r.age_s, waiting_for=r.waiting_for,
            worker_id=r.worker_id, num_blocks=r.num_blocks, engine_id=rw.engine_id if rw else "",
            peer=r.producer_address, registration_id=r.registration_id, mode=r.mode))
    for t_unix, tid, text in list(node.recent_failures):
        st.recent_failures.append(status_pb2.FailureRecord(time_unix=t_unix, age_s=max(wall - t_unix, 0.0),
                                                           transfer_id=tid, reason=text))
    return st


def agent_backends(node: Node, worker_id: str) -> list[status_pb2.AgentBackend]:
    """The NIXL backends of a worker's agent: name, init parameters, network devices (its rails)."""
    got = node.xfer.agent_backends.get(worker_id, ()) if node.xfer is not None else ()
    return [status_pb2.AgentBackend(name=b.name, params=b.params, devices=b.devices, devices_from=b.devices_from,
                                    device=b.device) for b in got]


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


def peer_status(node: Node, wall: float) -> list[status_pb2.PeerStatus]:
    """Every other daemon we call (outbound) or that calls us (inbound), by its peer address."""
    inbound = {o.address: o for o in node.origins.values()}
    loop_now = asyncio.get_running_loop().time()
    mono_now = time.monotonic()
    out = []
    for addr in sorted(set(node.peers) | set(inbound) | set(node.metrics.peers)):
        client = node.peers.get(addr)
        origin = inbound.get(addr)
        stats = node.metrics.peers.get(addr)
        direction = "both" if client and origin else "outbound" if client else "inbound" if origin else ""
        p = status_pb2.PeerStatus(address=addr, direction=direction)
        # Last contact either way: calls, and heartbeats (answered by it, or received from it).
        contact = stats.last_contact if stats is not None else 0.0
        if client is not None and client.last_ok:
            contact = max(contact, wall - (loop_now - client.last_ok))
        if origin is not None:
            contact = max(contact, wall - (mono_now - origin.last_seen))
        if contact:
            p.last_contact_unix, p.last_contact_age_s = contact, max(wall - contact, 0.0)
        if stats is not None:
            p.node_id = stats.node_id
            p.bytes_sent, p.bytes_received = stats.bytes_sent, stats.bytes_received
            p.transfers_finished, p.transfers_failed = stats.transfers_finished, stats.transfers_failed
            p.errors, p.last_error = stats.errors, stats.last_error
        if origin is not None:
            p.node_id = p.node_id or origin.node_id
            p.instance_id = origin.instance_id
            p.state = "connected"
        if client is not None:
            p.node_id = client.remote_node_id or p.node_id
            p.instance_id = client.remote_instance or p.instance_id
            p.state = client.state
            p.since_s = loop_now - client.since if client.since else 0.0
            p.last_error = client.last_error or p.last_error
            p.channel_state = client.channel.get_state(try_to_connect=False).name
        elif origin is None:
            p.state = "lost"
        out.append(p)
    return out


def config_summary(cfg: Config) -> dict[str, str]:
    """Every effective setting as "section.key" -> value (JSON-ish, as in the TOML file)."""
    out: dict[str, str] = {}
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        for f in dataclasses.fields(sub):
            v = getattr(sub, f.name)
            out[f"{section.name}.{f.name}"] = v if isinstance(v, str) else json.dumps(list(v) if isinstance(
                v, tuple) else v)
    out["worker_api.socket"] = cfg.socket_path
    out["node.node_id"] = cfg.node_id
    return out


def event(ev: Event, dropped: int) -> status_pb2.Event:
    return status_pb2.Event(
        seq=ev.seq, time_unix=ev.time, kind=status_pb2.EventKind.ValueType(int(ev.kind)), transfer_id=ev.transfer_id,
        engine_id=ev.engine_id, worker_id=ev.worker_id, side=ev.side, peer=ev.peer,
        code=common_pb2.FailureCode.ValueType(int(ev.code)), detail=ev.detail, num_blocks=ev.num_blocks,
        bytes=ev.nbytes, duration_s=ev.duration_s, dropped=dropped)


class StatusServicer(status_pb2_grpc.StatusServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @unary
    async def GetStatus(self, request: status_pb2.GetStatusRequest, context: Ctx) -> status_pb2.NodeStatus:
        return node_status(self.node)

    @stream
    async def Watch(self, request: status_pb2.WatchRequest, context: Ctx) -> AsyncIterator[status_pb2.Event]:
        unknown = [k for k in request.kinds if k not in EventKind._value2member_map_ or k == 0]
        if unknown:
            raise InvalidArgument(f"unknown event kind(s) {unknown}")
        kinds = [EventKind(k) for k in request.kinds]
        sub = self.node.events.subscribe(kinds, request.queue_size)
        try:
            while (ev := await sub.get()) is not None:
                yield event(ev, sub.dropped)
        finally:
            sub.close()
