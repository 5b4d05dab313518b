"""Configuration: one typed schema (msgspec Structs) that decodes the TOML file and validates it.

Every key has a default, a type, its bounds and a one-line doc, here and nowhere else:
docs/configuration.md and systemd/kvpushd.toml are generated from this module
(``python scripts/gen_config_docs.py``). ``kvpushd serve`` with no file starts a usable daemon.
Unknown sections and keys are errors naming the key (``peer_api.alow``); rules that relate keys
to each other or to files (TLS, allowlists, host:port) are checked by ``validate``.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, field

from .config_rules import config_error
from .core.errors import InvalidArgument

Positive = Meta(gt=0)
BackendName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_]+$", title="a NIXL backend name (UCX, LIBFABRIC, ...)")]
Param = Annotated[str | int | float | bool, Meta(
    title="a string (NIXL backend parameters are strings; numbers and booleans are written as such)")]
ParamTable = Annotated[dict[str, Param], Meta(title="a table of backend parameters")]
HostPort = Annotated[str, Meta(pattern=r"^.*:[0-9]+$", title="host:port")]
Device = Annotated[str, Meta(pattern=r"^(host|gpu[0-9]+)$", title='"host" or "gpu<N>" (the CUDA device index of '
                             "the worker's KV)")]


def default_socket_path() -> str:
    """/run/kvpushd when we may write there (root or systemd's RuntimeDirectory), else per user."""
    run = Path("/run/kvpushd")
    if (run.is_dir() and os.access(run, os.W_OK)) or os.geteuid() == 0:
        return str(run / "worker.sock")
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvpushd-{os.getuid()}"
    return str(Path(base) / "kvpushd" / "worker.sock")


def default_advertise_host() -> str:
    """The first non-loopback IPv4 address of this host, else 127.0.0.1."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        infos = []
    for info in infos:
        addr = str(info[4][0])
        if not addr.startswith("127."):
            return addr
    return "127.0.0.1"


# The largest legal message on either port carries one Register, Offer, Publish or Expect of
# max_blocks_per_request block ids: a packed uint32 varint is at most 5 bytes, plus headroom for the
# agent's NIXL metadata and regions and the batch's other (small) items. Anything bigger is junk; gRPC
# buffers a whole message before it is parsed, so this bound is also what one call can make the daemon
# hold (the default is 8 MiB: room for several of the largest requests in one batch).
# Block ids in one request: 256 Ki is 4 M tokens at vLLM's GPU block size of 16. Each id becomes a Python
# int in the daemon's books: a request of 256 Ki ids costs ~25 ms of the event loop, one of 1 Mi ~100 ms.
DEFAULT_MAX_BLOCKS_PER_REQUEST = 1 << 18


DEFAULT_MAX_MESSAGE_BYTES = 8 << 20  # at least 5 B x DEFAULT_MAX_BLOCKS_PER_REQUEST + 3 MiB = 4.25 MiB


class Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A table of the file: unknown keys are errors."""


class NodeConfig(Section, frozen=True):
    """This daemon among its peers."""

    node_id: Annotated[str, Meta(description="Unique name of this daemon among its peers; empty: the hostname")] = ""
    advertise_host: Annotated[str, Meta(description=(
        "Host other daemons are told to dial; empty: the listen host, or with a wildcard listen 127.0.0.1 in "
        "protected mode and else the first non-loopback address (set it on hosts with several networks)"))] = ""


class WorkerApiConfig(Section, frozen=True):
    """The Unix socket of the engine workers on this host (prefill and decode); it also serves the status.
    Under systemd /run/kvpushd is the unit's RuntimeDirectory."""

    socket: Annotated[str, Meta(description=(
        "Path of the worker socket; empty: /run/kvpushd/worker.sock where writable, else "
        "$XDG_RUNTIME_DIR/kvpushd/worker.sock"))] = ""
    socket_mode: Annotated[int, Meta(ge=0, le=0o777, description=(
        "Permission bits of the socket file, in decimal: 432 = 0o660, the daemon's user and group (engine "
        "workers join the group)"))] = 0o660
    max_workers: Annotated[int, Positive, Meta(description="Workers attached at once")] = 256
    max_blocks_per_request: Annotated[int, Positive, Meta(description=(
        "Block ids in one Publish or Expect (and in a decode daemon's Register): 262,144 is 4 M tokens at a "
        "block size of 16; each costs the event loop ~0.1 us and ~45 bytes while pending"))] = (
        DEFAULT_MAX_BLOCKS_PER_REQUEST)
    max_attach_descriptors: Annotated[int, Positive, Meta(description=(
        "Regions x blocks of one worker (the NIXL descriptors it needs)"))] = 1 << 23
    session_grace_s: Annotated[float, Positive, Meta(description=(
        "Seconds an attached worker may take to open its session before it is reaped"))] = 30.0
    max_message_bytes: Annotated[int, Positive, Meta(description=(
        "Largest message on the worker socket; at least 5 bytes per block id of max_blocks_per_request "
        "plus 3 MiB, or the largest Expect is refused"))] = DEFAULT_MAX_MESSAGE_BYTES
    populate_host_kv: Annotated[bool, Meta(description=(
        "Map the pages of a worker's host KV (shm) that the worker has touched into the daemon's page tables "
        "after it attaches, in the background, so a first WRITE from or into a block takes no page faults "
        "in the daemon (about 4 GB/s of one core, once)"))] = True


class PeerApiConfig(Section, frozen=True):
    """The TCP API other daemons call. Protected mode (the default): with neither TLS nor `allow`, only
    callers on this host's loopback are served; any other gets PERMISSION_DENIED saying how to open it.
    Open it to the other nodes with mutual TLS (all three tls_* paths, checked at start, optionally
    allow_names) or an `allow` list of their addresses; the health service stays open."""

    listen: Annotated[HostPort, Meta(description="Address this daemon accepts other daemons on")] = "0.0.0.0:7700"
    connect_timeout_s: Annotated[float, Positive, Meta(description="Seconds to connect to another daemon")] = 5.0
    rpc_timeout_s: Annotated[float, Positive, Meta(description="Seconds one call to another daemon may take")] = 10.0
    max_message_bytes: Annotated[int, Positive, Meta(description=(
        "Largest message between daemons; at least 5 bytes per block id of worker_api.max_blocks_per_request "
        "plus 3 MiB, or the largest registration is refused. A larger one is refused RESOURCE_EXHAUSTED "
        "unparsed"))] = DEFAULT_MAX_MESSAGE_BYTES
    max_streams_per_connection: Annotated[int, Positive, Meta(description=(
        "Calls open at once on one connection from another daemon (it needs one Channel, a Handshake and a "
        "health check); with max_message_bytes it bounds what one connection can make this daemon buffer"))] = 16
    max_pending_calls: Annotated[int, Meta(ge=1, le=1 << 20, description=(
        "Calls from other daemons (Handshakes, Channel opens) held per method, unanswered, while this daemon "
        "admits earlier ones: a fleet connecting at once waits here instead of being refused. One more is "
        "refused CANCELLED at once and its daemon retries after its back-off (handshake_retry_s). A call "
        "waits at most max_pending_s. A queued call holds about 16 KiB (10,000 Handshakes: +157 MiB) "
        "until it is answered"))] = 16384
    max_pending_s: Annotated[int, Meta(ge=1, le=30, description=(
        "Seconds a call from another daemon may wait in that queue: an older one is dropped (CANCELLED) without "
        "work when the event loop takes up the next, since its caller gave up on it (a decode daemon's "
        "Handshake waits connect_timeout_s); the daemon's time goes to calls still awaited"))] = 4
    max_registers_per_s: Annotated[float, Positive, Meta(description=(
        "Registrations one decode daemon may make per second (a token bucket with one second's burst)"))] = 20000.0
    max_registrations_per_peer: Annotated[int, Positive, Meta(description=(
        "Registrations one peer identity (its TLS certificate, else the host it connects from) may have "
        "pending here, over all its sessions"))] = 65536
    max_blocks_per_peer: Annotated[int, Positive, Meta(description=(
        "Destination blocks the pending registrations of one peer identity may cover, over all its sessions "
        "(about 45 bytes of daemon memory each)"))] = 1 << 21
    max_sessions_per_peer: Annotated[int, Positive, Meta(description=(
        "Peer sessions one identity may have open here at once (a restarted daemon's new session replaces "
        "its old one)"))] = 16
    max_stream_items: Annotated[int, Positive, Meta(description=(
        "Items queued to or unanswered by one peer's Channel stream; beyond it new ones fail PEER_UNREACHABLE"))] = 8192
    max_concurrent_handshakes: Annotated[int, Positive, Meta(description=(
        "Handshakes this daemon makes to other daemons at once; more wait their turn (a fleet restarting "
        "together does not storm one daemon)"))] = 32
    handshake_retry_s: Annotated[float, Positive, Meta(description=(
        "After a daemon did not answer a handshake, calls to it fail at once for this long, doubled per "
        "failure in a row up to handshake_retry_max_s, each delay drawn at 50-100%"))] = 1.0
    handshake_retry_max_s: Annotated[float, Positive, Meta(description=(
        "The longest handshake back-off"))] = 5.0
    preconnect: Annotated[tuple[HostPort, ...], Meta(description=(
        "Peer addresses (host:port) to handshake with and open a stream to at start, retried with the "
        "back-off until they answer, and kept open (never closed as idle)"),
        examples=[["prefill-1:7700", "prefill-2:7700"]])] = ()
    idle_close_s: Annotated[float, Positive, Meta(description=(
        "A peer nothing is pending with, unheard for this long, is closed (outbound: its channel and "
        "stream) or forgotten (inbound: its session and agents); a peer with transfers in flight never is"))] = 300.0
    tls_cert: Annotated[str, Meta(description=(
        "PEM certificate chain this daemon presents, as server and as client (mutual TLS: set all three tls_* "
        "paths or none)"), examples=["/etc/kvpushd/tls/node.crt"])] = ""
    tls_key: Annotated[str, Meta(description="PEM private key of tls_cert",
                                 examples=["/etc/kvpushd/tls/node.key"])] = ""
    tls_ca: Annotated[str, Meta(description=(
        "PEM CA bundle that must have signed the peers' certificates, both directions"),
        examples=["/etc/kvpushd/tls/ca.pem"])] = ""
    tls_server_name: Annotated[str, Meta(description=(
        "Name checked in the remote daemons' certificates instead of the host dialled"),
        examples=["kvpushd.cluster.local"])] = ""
    allow: Annotated[tuple[str, ...], Meta(description=(
        "Caller addresses allowed (CIDRs or addresses); empty: loopback only without TLS, anyone the CA "
        "signed with TLS"), examples=[["10.0.0.0/8", "127.0.0.1"]])] = ()
    allow_names: Annotated[tuple[str, ...], Meta(description=(
        "With TLS: client certificate names (CN or a SAN) allowed; empty: any"),
        examples=[["decode-node-1", "decode-node-2"]])] = ()
    insecure: Annotated[bool, Meta(description=(
        "Plaintext and open to every caller that reaches the port, no TLS, no allowlist (logged as a "
        "warning; not with TLS or allow)"))] = False

    @property
    def protected(self) -> bool:
        """Loopback callers only: nothing (TLS, an allowlist, or insecure) opens the peer API."""
        return not (self.insecure or self.allow or (self.tls_cert and self.tls_key and self.tls_ca))


class TransferConfig(Section, frozen=True):
    """NIXL and the transfers. backend_params and device_params are passed to NIXL's create_backend as
    strings; names NIXL does not know and values a backend refuses stop the daemon at start. UCX (NIXL
    1.5.1): num_workers, ucx_error_handling_mode, device_list (RDMA HCA names "mlx5_0,mlx5_1"; for TCP
    interfaces set UCX_NET_DEVICES in the unit's environment instead). LIBFABRIC (AWS EFA, docs/efa.md):
    num_threads, split_batch_size, max_bw_per_dram_seg (Gbps)."""

    backends: Annotated[tuple[BackendName, ...], Meta(min_length=1, description=(
        "NIXL backends to create, in order of preference; the daemon refuses to start when NIXL has no plugin "
        "by that name"))] = ("UCX",)
    backend: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_]*$", title="a NIXL backend name (UCX, LIBFABRIC, ...) or empty",
                                 description="One backend: shorthand for backends = [backend]",
                                 examples=["LIBFABRIC"])] = ""
    backend_params: Annotated[dict[str, Param | ParamTable], Meta(description=(
        "NIXL init parameters of every backend; a sub-table named after a backend "
        "([transfer.backend_params.UCX]) applies to that one only, over the plain keys"),
        examples=[{"num_workers": "2"}])] = field(default_factory=dict)
    device_params: Annotated[dict[Device, ParamTable], Meta(description=(
        "Per device hints merged over backend_params for the agent of a worker whose KV is there: "
        '"gpu<N>" (CUDA device N) or "host" (shared memory)'),
        examples=[{"gpu0": {"device_list": "mlx5_0"}, "gpu1": {"device_list": "mlx5_1"}}])] = field(
        default_factory=dict)
    publish_timeout_s: Annotated[float, Positive, Meta(description=(
        "Seconds a prefill worker's published blocks wait for the matching decode registration"))] = 120.0
    expect_timeout_s: Annotated[float, Positive, Meta(description=(
        "Seconds a decode registration waits for its blocks to arrive"))] = 120.0
    poll_interval_s: Annotated[float, Positive, Meta(description=(
        "NIXL progress interval while transfers are active"))] = 0.0001
    poll_max_interval_s: Annotated[float, Positive, Meta(description=(
        "The interval polling backs off to while nothing happens (idle: no polling)"))] = 0.001
    poll_hot_s: Annotated[float, Meta(ge=0, le=3600, description=(
        "Seconds a new receive keeps the short interval (decode registers while prefill computes)"))] = 2.0
    progressive_min_write_bytes: Annotated[int, Meta(ge=0, le=1 << 30, description=(
        "Progressive push: layer groups ready together or one after another gather into WRITEs of at least "
        "this many bytes (the last one of a request excepted); 0: each group goes alone as soon as it is ready"))] = (
        1 << 20)
    nixl_threads: Annotated[int, Meta(ge=0, description="NIXL agent threads (0: NIXL's default)")] = 0
    max_pending: Annotated[int, Positive, Meta(description="Transfers pending at once")] = 100_000
    drain_timeout_s: Annotated[float, Positive, Meta(description=(
        "Seconds a stopping daemon waits for its transfers to finish"))] = 30.0
    write_timeout_s: Annotated[float, Positive, Meta(description=(
        "Seconds a WRITE or READ may be in flight before it is cancelled (both sides fail)"))] = 60.0
    heartbeat_interval_s: Annotated[float, Positive, Meta(description=(
        "Seconds between heartbeats to prefill daemons while transfers are pending"))] = 1.0
    peer_timeout_s: Annotated[float, Positive, Meta(description=(
        "Seconds a peer may be silent before everything pending with it fails"))] = 10.0

    def __post_init__(self) -> None:
        if self.backend:
            msgspec.structs.force_setattr(self, "backends", (self.backend,))
        msgspec.structs.force_setattr(self, "backend_params", _strings(self.backend_params))
        msgspec.structs.force_setattr(self, "device_params", _strings(self.device_params))


def _strings(table: Mapping[str, Any]) -> dict[str, Any]:
    """NIXL parameters are strings: numbers as written, booleans as true/false."""
    return {k: _strings(v) if isinstance(v, Mapping) else str(v).lower() if isinstance(v, bool) else str(v)
            for k, v in table.items()}


class LogConfig(Section, frozen=True):
    """The daemon's log (stderr)."""

    level: Annotated[str, Meta(pattern=r"(?i)^(debug|info|warning|error)$", title="debug, info, warning or error",
                               description="Lowest level logged")] = "info"
    format: Annotated[Literal["auto", "json", "console"], Meta(description=(
        "auto: console on a terminal, json otherwise (e.g. under systemd, where stderr goes to the journal)"))] = "auto"


class MetricsConfig(Section, frozen=True):
    """Prometheus metrics over HTTP at http://<listen>/metrics. A port that cannot be bound is logged and
    skipped; the daemon keeps running without metrics."""

    enabled: Annotated[bool, Meta(description="Serve /metrics")] = True
    listen: Annotated[HostPort, Meta(description="Address of /metrics; port 0 picks a free one (kvpushctl status "
                                               "shows it)")] = "127.0.0.1:9400"


class TracingConfig(Section, frozen=True):
    """OpenTelemetry spans per transfer (rendezvous wait, WRITE or READ, notifications) over OTLP/gRPC,
    joined to the engine request's trace. Off by default, and then opentelemetry is not even imported;
    needs `pip install kvpushd[tracing]`."""

    otlp_endpoint: Annotated[str, Meta(pattern=r"^(https?://.+)?$", title="http://host:port or https://host:port",
                                       description="OTLP/gRPC collector (http: plaintext, https: TLS); empty: off",
                                       examples=["http://127.0.0.1:4317"])] = ""
    service_name: Annotated[str, Meta(description="service.name of the spans")] = "kvpushd"
    sample_ratio: Annotated[float, Meta(ge=0, le=1, description=(
        "Ratio of transfers traced that come without a trace context; a traceparent's sampled flag is "
        "followed either way"))] = 1.0


class Config(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    node: NodeConfig = field(default_factory=NodeConfig)
    worker_api: WorkerApiConfig = field(default_factory=WorkerApiConfig)
    peer_api: PeerApiConfig = field(default_factory=PeerApiConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    log: LogConfig = field(default_factory=LogConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)

    @property
    def node_id(self) -> str:
        return self.node.node_id or socket.gethostname()

    @property
    def socket_path(self) -> str:
        return self.worker_api.socket or default_socket_path()

    @property
    def listen_host_port(self) -> tuple[str, int]:
        return split_host_port(self.peer_api.listen)

    @property
    def advertise_host(self) -> str:
        """The host peers are told to dial. In protected mode only this host's loopback callers are
        served, so a wildcard listen advertises 127.0.0.1 (another daemon here dials it from loopback)."""
        if self.node.advertise_host:
            return self.node.advertise_host
        host = self.listen_host_port[0]
        if host not in ("", "0.0.0.0", "::", "[::]"):
            return host
        return "127.0.0.1" if self.peer_api.protected else default_advertise_host()


def split_host_port(addr: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"address {addr!r} is not host:port")
    return host.strip("[]"), int(port)


def from_dict(data: dict[str, Any]) -> Config:
    """Decode and validate a Config from the TOML file's tables."""
    t = data.get("transfer")
    if isinstance(t, dict) and t.get("backend") and "backends" in t and t["backends"] != [t["backend"]]:
        raise InvalidArgument(f"config: transfer.backend = {t['backend']!r} and transfer.backends = "
                              f"{t['backends']} disagree; set one of them")
    try:
        cfg = msgspec.convert(data, Config)
    except msgspec.ValidationError as e:
        raise config_error(e, data, Config) from None
    validate(cfg)
    return cfg


def backend_init_params(t: TransferConfig, backend: str, device: str = "") -> dict[str, str]:
    """NIXL init parameters for ``backend`` on an agent whose memory is on ``device`` ("gpu0", "host")."""
    out = {k: str(v) for k, v in t.backend_params.items() if not isinstance(v, dict)}
    sub = t.backend_params.get(backend)
    for table in (sub if isinstance(sub, dict) else {}, t.device_params.get(device, {})):
        out.update((k, str(v)) for k, v in table.items())
    return out


def validate(cfg: Config) -> None:
    """The rules the schema's types and bounds cannot say: addresses, and keys that relate to each other."""
    p = cfg.peer_api
    for where, addr in (("peer_api.listen", p.listen), ("metrics.listen", cfg.metrics.listen),
                        *(("peer_api.preconnect", a) for a in p.preconnect)):
        try:
            split_host_port(addr)
        except InvalidArgument as e:
            raise InvalidArgument(f"config: {where}: {e}") from None
    t = cfg.transfer
    for k, v in t.backend_params.items():
        if isinstance(v, dict) and k not in t.backends:
            raise InvalidArgument(f"config: [transfer.backend_params.{k}] names no configured backend "
                                  f"(transfer.backends: {list(t.backends)})")
    validate_peer_security(p)
    if p.handshake_retry_max_s < p.handshake_retry_s:
        raise InvalidArgument(f"config: peer_api.handshake_retry_max_s ({p.handshake_retry_max_s:g}) is below "
                              f"peer_api.handshake_retry_s ({p.handshake_retry_s:g})")


def validate_peer_security(p: PeerApiConfig) -> None:
    """TLS paths: all three or none, each a readable PEM file; allow entries parse as networks."""
    paths = {"tls_cert": p.tls_cert, "tls_key": p.tls_key, "tls_ca": p.tls_ca}
    given = [k for k, v in paths.items() if v]
    if given and len(given) != 3:
        missing = sorted(set(paths) - set(given))
        raise InvalidArgument(f"config: peer_api.{', peer_api.'.join(given)} set but peer_api."
                              f"{', peer_api.'.join(missing)} not: TLS needs tls_cert, tls_key and tls_ca together")
    for key in given:
        try:
            head = Path(paths[key]).read_bytes()[:65536]
        except OSError as e:
            raise InvalidArgument(f"config: peer_api.{key} = {paths[key]!r}: cannot read it ({e.strerror})") from None
        if b"-----BEGIN " not in head:
            raise InvalidArgument(f"config: peer_api.{key} = {paths[key]!r} is not a PEM file")
    if p.tls_server_name and not given:
        raise InvalidArgument("config: peer_api.tls_server_name needs TLS (tls_cert, tls_key, tls_ca)")
    if p.allow_names and not given:
        raise InvalidArgument("config: peer_api.allow_names needs TLS (tls_cert, tls_key, tls_ca): "
                              "names come from client certificates")
    for entry in p.allow:
        try:
            ipaddress.ip_network(entry, strict=False)
        except ValueError:
            raise InvalidArgument(f"config: peer_api.allow entry {entry!r} is not an address or CIDR "
                                  "(e.g. \"10.0.0.0/8\", \"127.0.0.1\")") from None
    if p.insecure and (given or p.allow):
        opened = "TLS" if given else "peer_api.allow"
        raise InvalidArgument(f"config: peer_api.insecure = true opens the peer API to every caller in plaintext, "
                              f"but {opened} is set and already decides who may call: remove insecure")


def load(path: str | None, overrides: Mapping[str, object] | None = None) -> Config:
    """The file's configuration (defaults without one), with ``overrides`` ("section.key" -> value,
    None: not given, e.g. command line options) set over it, decoded and validated as one."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise InvalidArgument(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise InvalidArgument(f"config file {path}: {e}") from None
    for key, value in (overrides or {}).items():
        if value is not None:
            section, _, name = key.partition(".")
            table = data.setdefault(section, {})
            if isinstance(table, dict):
                table[name] = value
    return from_dict(data)
