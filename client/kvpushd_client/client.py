"""Synchronous client of a kvpushd daemon (worker API on its unix socket).

    client = KVPushClient("/run/kvpushd/worker.sock")
    w = client.attach("prefill-0", Role.PRODUCER, tp_rank=0, tp_size=1, memory=[...], regions=[...])
    w.send_nowait(Publish("req-1", (3, 4, 5)))   # appends to this step's batch
    w.step()                              # the step's commands as one message, never waits on a transfer
    for c in w.completions():             # non-blocking: what the stream has delivered
        ...

The stream is read by a background thread into a local queue, so ``completions()`` costs no RPC at
all; the stream's end is how the daemon learns that this worker is gone (``kvpushd_client.stream``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import grpc

from . import _convert, errors
from .doorbell import SIZE as BELL_SIZE
from .doorbell import Doorbell
from .gpu_doorbell import make_doorbell
from .handover import hand_over, hand_over_chunks
from .proto.v1 import status_pb2, status_pb2_grpc, worker_pb2_grpc
from .stream import StreamWorker
from .types import Attach, CudaMemory, DaemonUnavailable, MemfdMemory, Memory, Region, Role
from .vmm import VmmMemory

T = TypeVar("T")


class KVPushClient:
    """A connection to one daemon. Thread-safe; one per process is enough."""

    def __init__(self, socket_path: str, timeout_s: float = 10.0) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s
        self.channel = grpc.insecure_channel(f"unix:{socket_path}", options=_convert.CHANNEL_OPTIONS)
        self.stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        self.status_stub = status_pb2_grpc.StatusServiceStub(self.channel)

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Block until the daemon answers (it may still be starting)."""
        retry_unavailable(self.status, timeout_s, 0.05)

    def status(self) -> status_pb2.NodeStatus:
        try:
            return self.status_stub.GetStatus(status_pb2.GetStatusRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def attach(self, engine_id: str, role: Role, tp_rank: int, tp_size: int, memory: Sequence[Memory | VmmMemory],
               regions: Sequence[Region], *, description: str = "", doorbell: Doorbell | bool = False) -> StreamWorker:
        """Hand the daemon this worker's KV memory, once; returns the worker, its session on one stream
        both ways (commands batched per engine step: ``send_nowait`` then ``step()``; results and
        completions on the same stream). The common form of ``attach_record``: an Attach of pipeline
        stage 0 (a pipeline-parallel worker says its ``pp_rank`` in the record)."""
        return self.attach_record(Attach(engine_id, role, tp_rank, tp_size, tuple(memory), tuple(regions),
                                         description=description), doorbell)

    def attach_record(self, a: Attach, doorbell: Doorbell | bool = False,
                      doorbell_fd: int | None = None) -> StreamWorker:
        """``attach`` with the whole Attach record. ``doorbell``: a page in shared memory, handed over by
        descriptor as host KV is (True: a new one, closed at detach; or one the caller keeps across
        attachments, e.g. after a daemon restart), which a sender rings for progressive push (by the
        CUDA stream when the memory is GPU memory: gpu_doorbell.make_doorbell). ``doorbell_fd``: a
        descriptor of that page to hand over instead of ``doorbell.fd`` (ReconnectingStreamWorker's own
        copy)."""
        memory, role = a.memory, a.role
        gpu = any(isinstance(m, CudaMemory | VmmMemory) for m in memory)
        bell = make_doorbell(kv_on_cuda=gpu and role.can_send) if doorbell is True else doorbell or None
        try:
            # the page goes by descriptor, after the memory: the last token is its
            pages = ([MemfdMemory(bell.fd if doorbell_fd is None else doorbell_fd, BELL_SIZE)]
                     if bell is not None else [])
            tokens = hand_over(self.socket_path, [*memory, *pages], self.timeout_s)  # type: ignore[list-item]
            chunk_tokens = hand_over_chunks(self.socket_path, memory, self.timeout_s)
            req = _convert.attach_request(a, tokens, chunk_tokens)
            if bell is not None:
                req.doorbell_token = tokens[len(memory)]
            resp = self.stub.Attach(req, timeout=self.timeout_s)
        except BaseException as e:
            if doorbell is True and bell is not None:
                bell.close()
            if isinstance(e, grpc.RpcError):
                raise errors.from_rpc_error(e) from None
            raise
        return StreamWorker(self, resp.worker_id, resp.node_id, resp.peer_address, bell, doorbell is True,
                            resp.worker_token)

    def extend(self, worker: StreamWorker, engine_id: str, role: Role, tp_rank: int, tp_size: int,
               memory: Sequence[VmmMemory], regions: Sequence[Region], pp_rank: int = 0) -> None:
        """Growth: hand a live worker's new VMM chunks to the daemon (an Attach naming the worker by
        ``extends_worker_id`` and its token): ``memory`` holds, per memory of the worker, only the chunks
        that are new (none where it did not grow); ``regions`` are the worker's regions with their new
        ``num_blocks``. Today's daemon checks the growth and refuses it (FAILED_PRECONDITION: the NIXL
        side of growth is not built); detach and attach with every chunk instead."""
        memory = [dataclasses.replace(m, arm_sentinel=None) for m in memory]  # no sentinel: live KV, not checked
        try:
            chunk_tokens = hand_over_chunks(self.socket_path, memory, self.timeout_s)
            req = _convert.attach_request(Attach(engine_id, role, tp_rank, tp_size, tuple(memory), tuple(regions),
                                                 pp_rank, extends_worker_id=worker.worker_id,
                                                 extends_worker_token=worker.token), {}, chunk_tokens)
            self.stub.Attach(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> KVPushClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def retry_unavailable(fn: Callable[[], T], timeout_s: float, pause_s: float) -> T:
    """``fn()``, again every ``pause_s`` while no daemon answers (DaemonUnavailable); past ``timeout_s``
    that error goes to the caller, as does any other at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return fn()
        except DaemonUnavailable:
            if time.monotonic() > deadline:
                raise
            time.sleep(pause_s)
