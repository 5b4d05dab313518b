"""Synchronous client of a kvpushd daemon (worker API on its unix socket).

    client = KVPushClient("/run/kvpushd/worker.sock")
    w = client.attach("prefill-0", Role.PRODUCER, tp_rank=0, tp_size=1, memory=[...], regions=[...])
    w.publish("req-1", [3, 4, 5])          # one unary call, never waits on a transfer
    for c in w.completions():             # non-blocking: what the session stream has delivered
        ...

The session stream is read by a background thread into a local queue, so ``completions()`` costs
no RPC at all; the stream's end is how the daemon learns that this worker is gone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Sequence

import grpc

from . import _convert, errors
from .calls import Call, CallQueue, DirectTarget
from .inbox import Inbox
from .proto.v1 import status_pb2, status_pb2_grpc, worker_pb2, worker_pb2_grpc
from .stream import StreamWorker
from .types import Completion, DaemonUnavailable, KVPushError, Memory, Region, Role


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
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.status()
                return
            except DaemonUnavailable:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def status(self) -> status_pb2.NodeStatus:
        try:
            return self.status_stub.GetStatus(status_pb2.GetStatusRequest(), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def attach(self, engine_id: str, role: Role, tp_rank: int, tp_size: int, memory: Sequence[Memory],
               regions: Sequence[Region], pp_rank: int = 0, description: str = "") -> Worker:
        """Hand the daemon this worker's KV memory, once; returns the worker handle."""
        req = _convert.attach_request(engine_id, role, tp_rank, tp_size, memory, regions, pp_rank, description)
        try:
            resp = self.stub.Attach(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        return Worker(self, resp.worker_id, resp.node_id, resp.peer_address)

    def attach_stream(self, engine_id: str, role: Role, tp_rank: int, tp_size: int, memory: Sequence[Memory],
                      regions: Sequence[Region], pp_rank: int = 0, description: str = "") -> StreamWorker:
        """As ``attach``, with the session on one stream both ways: commands batched per engine step
        (``*_nowait`` then ``step()``), results and completions on the same stream."""
        req = _convert.attach_request(engine_id, role, tp_rank, tp_size, memory, regions, pp_rank, description)
        try:
            resp = self.stub.Attach(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None
        return StreamWorker(self, resp.worker_id, resp.node_id, resp.peer_address)

    def decline(self, worker_id: str, transfer_id: str, producer_address: str, producer_engine_id: str,
                reason: str = "") -> None:
        """Decode side, for worker ``worker_id``: this transfer will never be expected there (one
        unary call, usable beside either kind of worker; see ``Worker.decline``)."""
        try:
            self.stub.Decline(worker_pb2.DeclineRequest(
                worker_id=worker_id, transfer_id=transfer_id, producer_address=producer_address,
                producer_engine_id=producer_engine_id, reason=reason), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> KVPushClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Worker(Inbox):
    """An attached worker: per-request calls and its completions."""

    def __init__(self, client: KVPushClient, worker_id: str, node_id: str, peer_address: str) -> None:
        self.client = client
        self.worker_id = worker_id
        self.node_id = node_id
        self.peer_address = peer_address  # what decode engines use as remote_host:remote_port
        super().__init__()
        self._closed = False
        self._stream = client.stub.Session(worker_pb2.SessionRequest(worker_id=worker_id))
        self._reader = threading.Thread(target=self._read, name=f"kvpushd-session-{worker_id}", daemon=True)
        self._reader.start()
        self._calls = CallQueue(DirectTarget(self, self._deliver), name=f"kvpushd-calls-{worker_id}")

    @property
    def alive(self) -> bool:
        """False once the session stream ended (daemon gone or restarted): re-attach then."""
        return self.session_error is None and not self._closed

    def _read(self) -> None:
        try:
            for msg in self._stream:
                c = _convert.completion(msg)
                with self._cond:
                    self._queue.append(c)
                    self._cond.notify_all()
            err: KVPushError = DaemonUnavailable("UNAVAILABLE", "session ended by the daemon")
        except grpc.RpcError as e:
            err = errors.from_rpc_error(e)
        with self._cond:
            if not self._closed:
                self.session_error = err
            self._cond.notify_all()

    def _unary(self, method: str, req: object) -> object:
        try:
            return getattr(self.client.stub, method)(req, timeout=self.client.timeout_s)
        except grpc.RpcError as e:
            raise errors.from_rpc_error(e) from None

    def expect(self, transfer_id: str, block_ids: Iterable[int], producer_address: str,
               producer_engine_id: str, producer_tp_size: int, skip_tokens: int = 0,
               transfer_mode: str = "push", traceparent: str = "") -> None:
        """Decode side: destination blocks, as soon as they are allocated.

        ``skip_tokens``: the prompt's first tokens this worker already holds (a prefix-cache hit,
        a whole number of its blocks); ``block_ids`` then hold the prompt from that token on.
        ``transfer_mode``: "push" (the prefill node's daemon WRITEs) or "pull" (this node's daemon
        READs once the prefill side has published), vLLM's kv_transfer_params["transfer_mode"].
        ``traceparent``: the engine request's W3C trace context; a daemon with tracing on continues it."""
        self._unary("Expect", worker_pb2.ExpectRequest(
            worker_id=self.worker_id, transfer_id=transfer_id, block_ids=list(block_ids),
            producer_address=producer_address, producer_engine_id=producer_engine_id,
            producer_tp_size=producer_tp_size, skip_tokens=skip_tokens,
            transfer_mode=_convert.transfer_mode(transfer_mode), traceparent=traceparent))

    def publish(self, transfer_id: str, block_ids: Iterable[int], traceparent: str = "") -> None:
        """Prefill side: the source blocks are complete."""
        self._unary("Publish", worker_pb2.PublishRequest(worker_id=self.worker_id, transfer_id=transfer_id,
                                                         block_ids=list(block_ids), traceparent=traceparent))

    def decline(self, transfer_id: str, producer_address: str, producer_engine_id: str, reason: str = "") -> None:
        """Decode side: this transfer will never be expected here (its Expect failed before it
        reached the daemon); the prefill daemon frees the transfer's source blocks at once."""
        self.client.decline(self.worker_id, transfer_id, producer_address, producer_engine_id, reason)

    def abort(self, transfer_id: str) -> bool:
        resp = self._unary("Abort", worker_pb2.AbortRequest(worker_id=self.worker_id, transfer_id=transfer_id))
        assert isinstance(resp, worker_pb2.AbortResponse)
        return resp.found

    # -- off the engine thread -------------------------------------------------------------
    # The calls above block the caller for one gRPC round trip (about 0.5 ms of CPU here). The
    # *_nowait variants only queue the call (a few microseconds): one sender thread per worker
    # makes the calls in order (kvpushd_client.calls, the same queue ReconnectingWorker uses). A
    # call the daemon refuses comes back as a FAILED completion with code "REFUSED", the daemon's
    # status and message in ``reason`` and the request's block ids, so an engine frees the blocks
    # on the same path as any other failed transfer.

    def publish_nowait(self, transfer_id: str, block_ids: Iterable[int], traceparent: str = "") -> None:
        self._calls.submit(Call("Publish", transfer_id, tuple(block_ids), traceparent=traceparent))

    def expect_nowait(self, transfer_id: str, block_ids: Iterable[int], producer_address: str,
                      producer_engine_id: str, producer_tp_size: int, skip_tokens: int = 0,
                      transfer_mode: str = "push", traceparent: str = "") -> None:
        self._calls.submit(Call("Expect", transfer_id, tuple(block_ids), expect_args=dict(
            producer_address=producer_address, producer_engine_id=producer_engine_id,
            producer_tp_size=producer_tp_size, skip_tokens=skip_tokens, transfer_mode=transfer_mode),
            traceparent=traceparent))

    def abort_nowait(self, transfer_id: str) -> None:
        """Queued after any earlier *_nowait call of this worker; an unknown transfer is no error."""
        self._calls.submit(Call("Abort", transfer_id))

    def decline_nowait(self, transfer_id: str, producer_address: str, producer_engine_id: str,
                       reason: str = "") -> None:
        """Queued like ``abort_nowait``; best effort (a refusal is dropped, logged by the daemon)."""
        self._calls.submit(Call("Decline", transfer_id, expect_args=dict(
            producer_address=producer_address, producer_engine_id=producer_engine_id, reason=reason)))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued call has been made; False on timeout."""
        return self._calls.flush(timeout_s)

    def _deliver(self, c: Completion) -> None:
        with self._cond:
            self._queue.append(c)
            self._cond.notify_all()

    def detach(self) -> None:
        """Fail what is pending for this worker, release its memory in the daemon. Idempotent."""
        if self._closed:
            return
        self.flush(timeout_s=self.client.timeout_s)
        self._closed = True
        self._calls.close()
        try:
            self._unary("Detach", worker_pb2.DetachRequest(worker_id=self.worker_id))
        except KVPushError as e:
            if e.code not in ("NOT_FOUND", "UNAVAILABLE"):
                raise
        finally:
            self._stream.cancel()
            self._reader.join(timeout=5)
