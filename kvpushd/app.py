"""Composition root and lifecycle: start, READY, signals, drain, stop.

Order matters: NIXL is probed and both sockets listen before READY=1 is sent. The first
SIGTERM/SIGINT drains (no new transfers, in-flight WRITEs finish, memory deregistered and
unmapped); a second one exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import stat
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvpushd_client.proto.v1 import peer_pb2, status_pb2, worker_pb2

from .config import Config, PeerApiConfig
from .core.errors import FailedPrecondition
from .events import EventKind
from .metrics import Metrics
from .peer_security import peer_interceptors, server_credentials, tls_enabled
from .rpc.peer import PeerServicer
from .rpc.services import add_service
from .rpc.status import StatusServicer
from .rpc.worker import WorkerServicer
from .runtime.node import Node
from .runtime.observe import Ended
from .systemd import SdNotifier
from .telemetry import make_tracing

log = structlog.get_logger(__name__)


def freeze_startup_objects() -> None:
    """Collect once, then keep what start-up made (nixl and the torch it imports, gRPC, prometheus:
    ~180k objects) out of every later collection. A full collection walks every tracked object with
    the event loop stopped: 205 ms here, about every 40 s at 1,800 rendezvous/s (docs/results/
    gc-freeze-ab.txt), while what start-up made lives as long as the daemon anyway. vLLM's workers
    freeze their start-up heap the same way after warm-up (``freeze_gc_heap``)."""
    gc.collect()
    gc.freeze()


def observe(node: Node) -> None:
    """The sinks of the node's observation stream, in the order each record reaches them: the
    tally (the status counters, the metrics' series, and through it each peer's transfers), the
    event hub (Watch; a transfer's start goes to it from the node), the peer book (peers heard
    from, failed, lost), tracing (only when on: spans made from the ledger when a transfer ends)."""
    obs, t = node.obs, node.tracing
    node.tally.observe(obs)
    obs.on(Ended, node.events.ended)
    node.peerbook.observe(obs)
    if t.enabled:
        obs.on(Ended, lambda r: t.ended(r.completion, r.ledger))


def peer_server_options(p: PeerApiConfig) -> list[tuple[str, int]]:
    """gRPC options of the peer server, its bounds on what callers can make it hold.

    A message over ``max_message_bytes`` is refused; streams per connection and metadata are capped; BDP probing is
    off, so a sender cannot grow the flow-control window and push tens of MiB per stream before an oversized message
    is refused (measured: +341 MiB RSS with it on under 8 parallel 60-128 MiB calls, +2 MiB off; docs/results.md).
    Calls the event loop has not taken up yet queue in gRPC per method up to ``max_pending_calls`` (gRPC's own
    default drops them CANCELLED from 1,000 on, at random, and from 3,000 on always: a fleet of a few thousand
    decode daemons handshaking at once lost half its handshakes that way; docs/results.md), for at most
    ``max_pending_s``: a queue longer than the callers wait would have the loop answer only calls their callers gave
    up on (10,000 decode daemons retrying 5 s Handshakes: 413k attempts, 4,667 served)."""
    return [("grpc.max_receive_message_length", p.max_message_bytes),
            ("grpc.max_send_message_length", p.max_message_bytes),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.min_ping_interval_without_data_ms", 5000),
            ("grpc.max_concurrent_streams", p.max_streams_per_connection),
            ("grpc.max_metadata_size", 16 << 10), ("grpc.http2.bdp_probe", 0),
            ("grpc.server.max_pending_requests", p.max_pending_calls),
            ("grpc.server.max_pending_requests_hard_limit", p.max_pending_calls),
            ("grpc.server_max_unrequested_time_in_server", p.max_pending_s)]


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.tracing = make_tracing(cfg.tracing, cfg.node_id)  # a no-op (and no import) unless configured
        self.node = Node(cfg, self.tracing)
        self.metrics = Metrics(self.node.view)
        observe(self.node)
        self.notifier = SdNotifier.from_env()
        self.local_server: grpc.aio.Server | None = None
        self.peer_server: grpc.aio.Server | None = None
        # grpc.health.v1 on both servers: NOT_SERVING until ready and again once draining.
        self.local_health = health.aio.HealthServicer()
        self.peer_health = health.aio.HealthServicer()
        self._health_names: list[tuple[health.aio.HealthServicer, list[str]]] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._stopped = False

    async def start(self) -> None:
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self.node.start(loop)
        local_opts = [("grpc.max_receive_message_length", cfg.worker_api.max_message_bytes),
                      ("grpc.max_send_message_length", cfg.worker_api.max_message_bytes)]
        sock = Path(cfg.socket_path)
        sock.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        if sock.exists() or sock.is_symlink():
            if not stat.S_ISSOCK(sock.lstat().st_mode):
                raise FailedPrecondition(f"{sock} exists and is not a socket")
            sock.unlink()  # a stale socket from a previous run
        self.local_server = grpc.aio.server(options=[*local_opts, ("grpc.max_metadata_size", 16 << 10),
                                                           ("grpc.http2.bdp_probe", 0)])
        local_services = [add_service(self.local_server, worker_pb2, "WorkerService", WorkerServicer(self.node)),
                          add_service(self.local_server, status_pb2, "StatusService", StatusServicer(self.node.view))]
        await self._add_health(self.local_health, local_services, self.local_server)
        reflection.enable_server_reflection([*local_services, health.SERVICE_NAME, reflection.SERVICE_NAME],
                                            self.local_server)
        old = os.umask(0o177)  # the socket is born private, then opened up to the group below
        try:
            self.local_server.add_insecure_port(f"unix:{sock}")
        finally:
            os.umask(old)
        # memory bounds (messages, streams, calls queued): peer_server_options
        interceptors = peer_interceptors(cfg.peer_api)  # protected mode: loopback only unless TLS/allow/insecure
        self.peer_server = grpc.aio.server(options=peer_server_options(cfg.peer_api), interceptors=interceptors)
        peer_service = add_service(self.peer_server, peer_pb2, "PeerService", PeerServicer(self.node))
        await self._add_health(self.peer_health, [peer_service], self.peer_server)
        host, port = cfg.listen_host_port
        listen = f"{host or '0.0.0.0'}:{port}"
        if tls_enabled(cfg.peer_api):
            bound = self.peer_server.add_secure_port(listen, server_credentials(cfg.peer_api))
        else:
            bound = self.peer_server.add_insecure_port(listen)
        if bound == 0:
            raise FailedPrecondition(f"cannot listen on {cfg.peer_api.listen}")
        if port == 0:  # an ephemeral port (tests): advertise the one we got
            self.node.ident.peer_address = f"{cfg.advertise_host}:{bound}"
        # the fd socket (sealed memfds of host KV), before any worker can attach
        self.node.workers.fds.start(loop)
        await self.local_server.start()
        await self.peer_server.start()
        self.node.outbound.preconnect(cfg.peer_api.preconnect)  # peer_api.preconnect: handshakes start now
        os.chmod(sock, cfg.worker_api.socket_mode)
        self.metrics.serve(cfg.metrics)
        self.node.ident.metrics_address = self.metrics.address
        self._tasks.append(loop.create_task(self.notifier.run_watchdog()))
        freeze_startup_objects()
        log.info("kvpushd ready", node_id=self.node.ident.node_id, socket=str(sock),
                 peer_address=self.node.ident.peer_address,
                 backends=list(cfg.transfer.backends), pid=os.getpid(), peer_tls=tls_enabled(cfg.peer_api),
                 peer_allow=list(cfg.peer_api.allow), peer_allow_names=list(cfg.peer_api.allow_names))
        for h, names in self._health_names:
            for name in names:
                await h.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.notifier.ready(f"serving on {sock} and {self.node.ident.peer_address}")

    async def run(self) -> None:
        """Start, serve until a signal, then drain and stop."""
        loop = asyncio.get_running_loop()
        signals = 0

        def on_signal(signum: int) -> None:
            nonlocal signals
            signals += 1
            if signals == 1:
                log.info("signal received: draining", signal=signal.Signals(signum).name)
                self._stop.set()
            else:
                log.warning("second signal: exiting now")
                os._exit(1)

        for s in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(s, on_signal, s)
        try:
            await self.start()
            await self._stop.wait()
        finally:
            await self.shutdown()

    async def _add_health(self, servicer: health.aio.HealthServicer, services: list[str],
                          server: grpc.aio.Server) -> None:
        """grpc.health.v1 on ``server``: overall ("") and per service, NOT_SERVING until ready."""
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        names = [health.OVERALL_HEALTH, *services]
        for name in names:
            await servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        self._health_names.append((servicer, names))

    async def shutdown(self) -> None:
        """Stop accepting, drain, deregister, close. Safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        self.notifier.stopping()
        await self.local_health.enter_graceful_shutdown()
        await self.peer_health.enter_graceful_shutdown()
        self.node.events.emit(EventKind.DRAINING, detail="shutting down")
        # Peers first: no new registrations; the local socket stays up so workers see completions.
        self.node.draining = True
        if self.peer_server is not None:
            await self.peer_server.stop(grace=1.0)
        await self.node.drain(self.cfg.transfer.drain_timeout_s)
        for t in self._tasks:
            t.cancel()
        self.node.events.close()  # ends Watch streams, so the local server stops without waiting
        await asyncio.get_running_loop().run_in_executor(None, self.metrics.stop)
        if self.local_server is not None:
            await self.local_server.stop(grace=1.0)
        # the exporter's last batch (bounded by its own export timeout)
        await asyncio.get_running_loop().run_in_executor(None, self.tracing.shutdown)
        with contextlib.suppress(FileNotFoundError):
            Path(self.cfg.socket_path).unlink()
        self.node.workers.fds.close()
        self.notifier.close()
        log.info("kvpushd stopped")
