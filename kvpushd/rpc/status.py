"""StatusService: node, workers, peers, transfers in flight, counters."""

from __future__ import annotations

import time
from typing import Any

from kvpushd_client.proto.v1 import common_pb2, status_pb2, status_pb2_grpc

from ..node import Node
from .errors import unary

Ctx = Any


def node_status(node: Node) -> status_pb2.NodeStatus:
    now = time.monotonic()
    c = node.counters
    st = status_pb2.NodeStatus(
        node_id=node.node_id, version=node.version(), instance_id=node.instance_id,
        uptime_s=now - node.started, peer_address=node.peer_address, worker_socket=node.cfg.socket_path,
        backends=list(node.cfg.transfer.backends),
        counters=status_pb2.Counters(
            transfers_finished=c.transfers_finished, transfers_failed=c.transfers_failed,
            bytes_written=c.bytes_written, writes_posted=c.writes_posted,
            notifications_received=c.notifications_received,
            stray_notifications=node.recv.stray_notifications + (node.xfer.stray_notifications if node.xfer else 0),
            descriptors_requested=c.descriptors_requested, descriptors_posted=c.descriptors_posted),
    )
    for w in node.workers.values():
        st.workers.append(status_pb2.WorkerStatus(
            worker_id=w.worker_id, engine_id=w.engine_id, role=common_pb2.Role.ValueType(int(w.role)),
            tp_rank=w.tp_rank, tp_size=w.tp_size, pp_rank=w.pp_rank, agent_name=w.agent_name,
            memory_kind=w.mem_type, num_regions=len(w.regions), registered_bytes=w.registered_bytes,
            attached_s=now - w.attached_at, description=w.description))
    for p in node.peers.values():
        st.peers.append(status_pb2.PeerStatus(address=p.address, node_id=p.remote_node_id, state=p.state,
                                              instance_id=p.remote_instance, last_error=p.last_error))
    for s in node.send.views(now):
        st.transfers.append(status_pb2.TransferStatus(
            transfer_id=s.transfer_id, side="send", state="pending" if not s.legs_posted else "writing",
            age_s=s.age_s, waiting_for=s.waiting_for, worker_id=",".join(s.workers), num_blocks=s.num_blocks))
    for r in node.recv.views(now):
        st.transfers.append(status_pb2.TransferStatus(
            transfer_id=r.transfer_id, side="recv", state=r.state, age_s=r.age_s, waiting_for=r.waiting_for,
            worker_id=r.worker_id, num_blocks=r.num_blocks))
    return st


class StatusServicer(status_pb2_grpc.StatusServiceServicer):
    def __init__(self, node: Node) -> None:
        self.node = node

    @unary
    async def GetStatus(self, request: status_pb2.GetStatusRequest, context: Ctx) -> status_pb2.NodeStatus:
        return node_status(self.node)
