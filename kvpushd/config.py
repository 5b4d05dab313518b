"""Configuration: a TOML file whose every key has a default, validated once at load.

``kvpushd serve`` with no file starts a usable daemon; systemd/kvpushd.toml documents every key.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .core.errors import InvalidArgument


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


@dataclass(frozen=True)
class NodeConfig:
    node_id: str = ""
    advertise_host: str = ""


@dataclass(frozen=True)
class WorkerApiConfig:
    socket: str = ""
    socket_mode: int = 0o660
    max_workers: int = 256
    max_blocks_per_request: int = 1 << 20
    max_attach_descriptors: int = 1 << 23  # regions x blocks of one worker (NIXL descriptors it needs)
    session_grace_s: float = 30.0  # an attached worker that never opens its session is reaped
    # the local socket's own message limit: an Expect of max_blocks_per_request ids is ~3 MiB
    max_message_bytes: int = 8 << 20


@dataclass(frozen=True)
class PeerApiConfig:
    listen: str = "0.0.0.0:7700"
    connect_timeout_s: float = 5.0
    rpc_timeout_s: float = 10.0
    max_message_bytes: int = 64 << 20
    # what one decode daemon may hold here: Registers per second (a token bucket, burst of one
    # second's worth), registrations pending, destination blocks those cover
    max_registers_per_s: float = 20000.0
    max_registrations_per_peer: int = 65536
    max_blocks_per_peer: int = 1 << 24
    # items queued to one peer's Channel stream or unanswered by it: a peer that stops reading fills
    # it, then new items fail at once with PEER_UNREACHABLE (memory stays bounded)
    max_stream_items: int = 8192
    # mutual TLS (grpcio's own credentials): all three paths or none
    tls_cert: str = ""  # PEM certificate chain this daemon presents, as server and as client
    tls_key: str = ""  # PEM private key of tls_cert
    tls_ca: str = ""  # PEM CA bundle: peers' certificates (both directions) must be signed by it
    tls_server_name: str = ""  # name checked in the remote daemon's certificate instead of its host
    allow: tuple[str, ...] = ()  # caller addresses allowed (CIDRs or addresses); empty: see protected mode
    allow_names: tuple[str, ...] = ()  # with TLS: client certificate CN/SAN names allowed; empty: any
    # Protected mode: with neither TLS nor ``allow`` the peer API serves loopback callers only.
    # ``insecure = true`` opens it to every caller in plaintext (a warning is logged at start).
    insecure: bool = False

    @property
    def protected(self) -> bool:
        """Loopback callers only: nothing (TLS, an allowlist, or insecure) opens the peer API."""
        return not (self.insecure or self.allow or (self.tls_cert and self.tls_key and self.tls_ca))


@dataclass(frozen=True)
class TransferConfig:
    backends: tuple[str, ...] = ("UCX",)
    backend: str = ""  # one NIXL backend ("UCX", "LIBFABRIC"): shorthand for backends = [backend]
    # NIXL backend init parameters (create_backend), string -> string; a sub-table named after a
    # backend ([transfer.backend_params.UCX]) applies to that backend only, over the plain keys
    backend_params: dict[str, Any] = field(default_factory=dict)
    # per device hints, merged over backend_params for the agent of a worker whose KV lives there:
    # [transfer.device_params.gpu0] device_list = "mlx5_0"  ("gpu<N>": CUDA device N, "host": shm)
    device_params: dict[str, dict[str, str]] = field(default_factory=dict)
    publish_timeout_s: float = 120.0
    expect_timeout_s: float = 120.0
    poll_interval_s: float = 0.0002  # NIXL progress while transfers are active ...
    poll_max_interval_s: float = 0.001  # ... backing off to this while nothing happens (idle: no polling)
    # a new receive (Expect, or a pull-mode offer) keeps the short interval this long: in push mode
    # decode registers while prefill computes, so a prefill shorter than this lands on a hot poll
    poll_hot_s: float = 2.0
    nixl_threads: int = 0
    max_pending: int = 100_000
    drain_timeout_s: float = 30.0
    write_timeout_s: float = 60.0  # a WRITE or READ in flight longer than this is cancelled (both sides fail)
    heartbeat_interval_s: float = 1.0  # decode -> prefill daemons, while transfers are pending
    peer_timeout_s: float = 10.0  # a peer silent this long has everything pending with it failed


@dataclass(frozen=True)
class LogConfig:
    level: str = "info"
    format: str = "auto"


@dataclass(frozen=True)
class MetricsConfig:
    enabled: bool = True
    listen: str = "127.0.0.1:9400"  # Prometheus /metrics over HTTP (port 0: ephemeral)


@dataclass(frozen=True)
class TracingConfig:
    # OTLP/gRPC collector, e.g. "http://127.0.0.1:4317" (http: plaintext, https: TLS); "" = tracing off
    otlp_endpoint: str = ""
    service_name: str = "kvpushd"
    # transfers without a sampled parent context traced at this ratio; a traceparent's own sampled
    # flag is followed (parent-based), so a traced vLLM request is traced through the daemons
    sample_ratio: float = 1.0


@dataclass(frozen=True)
class Config:
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


_SECTIONS: dict[str, type[Any]] = {
    "node": NodeConfig, "worker_api": WorkerApiConfig, "peer_api": PeerApiConfig,
    "transfer": TransferConfig, "log": LogConfig, "metrics": MetricsConfig,
    "tracing": TracingConfig,
}


def from_dict(data: dict[str, Any]) -> Config:
    """Build and validate a Config; unknown sections and keys are errors (typos fail loudly)."""
    sections: dict[str, Any] = {}
    for name, value in data.items():
        cls = _SECTIONS.get(name)
        if cls is None:
            raise InvalidArgument(f"config: unknown section [{name}]; known: {sorted(_SECTIONS)}")
        if not isinstance(value, dict):
            raise InvalidArgument(f"config: [{name}] must be a table")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, v in value.items():
            f = fields.get(key)
            if f is None:
                raise InvalidArgument(f"config: unknown key {name}.{key}; known: {sorted(fields)}")
            if f.default_factory is dict:
                kwargs[key] = _coerce_table(f"{name}.{key}", v, depth=2 if key == "device_params" else 1)
            else:
                kwargs[key] = _coerce(f"{name}.{key}", f.default, v)
        if name == "transfer" and kwargs.get("backend"):
            one = (kwargs["backend"],)
            if "backends" in kwargs and kwargs["backends"] != one:
                raise InvalidArgument(f"config: transfer.backend = {kwargs['backend']!r} and transfer.backends = "
                                      f"{list(kwargs['backends'])} disagree; set one of them")
            kwargs["backends"] = one
        sections[name] = cls(**kwargs)
    cfg = Config(**sections)
    validate(cfg)
    return cfg


def _coerce(where: str, default: Any, v: Any) -> Any:
    if isinstance(default, tuple):
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise InvalidArgument(f"config: {where} must be a list of strings")
        return tuple(v)
    if isinstance(default, (bool, str)):
        if not isinstance(v, type(default)):
            raise InvalidArgument(f"config: {where} must be a {type(default).__name__}")
        return v
    if isinstance(default, float):
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise InvalidArgument(f"config: {where} must be a number")
        return float(v)
    if isinstance(default, int):
        if isinstance(v, bool) or not isinstance(v, int):
            raise InvalidArgument(f"config: {where} must be an integer")
        return v
    return v


def _coerce_table(where: str, v: Any, depth: int) -> dict[str, Any]:
    """A TOML table of string values (numbers and booleans are written as NIXL expects them).

    ``depth`` 2: a table of such tables (device_params). backend_params takes both: plain keys,
    and sub-tables named after a backend.
    """
    if not isinstance(v, dict):
        raise InvalidArgument(f"config: {where} must be a table")
    out: dict[str, Any] = {}
    for k, x in v.items():
        if isinstance(x, dict) and (depth == 2 or where.endswith("backend_params")):
            out[k] = _coerce_table(f"{where}.{k}", x, 1)
        elif depth == 2:
            raise InvalidArgument(f"config: {where}.{k} must be a table of backend parameters")
        elif isinstance(x, bool):
            out[k] = "true" if x else "false"
        elif isinstance(x, str | int | float):
            out[k] = str(x)
        else:
            raise InvalidArgument(f"config: {where}.{k} must be a string (NIXL backend parameters are strings)")
    return out


def backend_init_params(t: TransferConfig, backend: str, device: str = "") -> dict[str, str]:
    """NIXL init parameters for ``backend`` on an agent whose memory is on ``device`` ("gpu0", "host")."""
    out = {k: v for k, v in t.backend_params.items() if isinstance(v, str)}
    sub = t.backend_params.get(backend)
    if isinstance(sub, dict):
        out.update(sub)
    out.update(t.device_params.get(device, {}))
    return out


def validate(cfg: Config) -> None:
    split_host_port(cfg.peer_api.listen)
    split_host_port(cfg.metrics.listen)
    ep = cfg.tracing.otlp_endpoint
    if ep and not (ep.startswith(("http://", "https://")) and len(ep.split("://", 1)[1]) > 0):
        raise InvalidArgument(f"config: tracing.otlp_endpoint {ep!r} must be http://host:port or https://host:port")
    if not 0.0 <= cfg.tracing.sample_ratio <= 1.0:
        raise InvalidArgument(f"config: tracing.sample_ratio {cfg.tracing.sample_ratio} must be within 0..1")
    t = cfg.transfer
    if not t.backends:
        raise InvalidArgument("config: transfer.backends must name at least one NIXL backend")
    for b in t.backends:
        if not b or not b.replace("_", "").isalnum():
            raise InvalidArgument(f"config: transfer backend {b!r} is not a NIXL backend name (e.g. UCX, LIBFABRIC)")
    for k, v in t.backend_params.items():
        if isinstance(v, dict) and k not in t.backends:
            raise InvalidArgument(f"config: [transfer.backend_params.{k}] names no configured backend "
                                  f"(transfer.backends: {list(t.backends)})")
    for dev in t.device_params:
        if dev != "host" and not (dev.startswith("gpu") and dev[3:].isdigit()):
            raise InvalidArgument(f"config: [transfer.device_params.{dev}]: devices are \"host\" or \"gpu<N>\" "
                                  "(the CUDA device index of the worker's KV)")
    for name in ("publish_timeout_s", "expect_timeout_s", "poll_interval_s", "drain_timeout_s",
                 "heartbeat_interval_s", "peer_timeout_s", "write_timeout_s", "poll_max_interval_s"):
        if getattr(t, name) <= 0:
            raise InvalidArgument(f"config: transfer.{name} must be positive")
    if not 0 <= t.poll_hot_s <= 3600:
        raise InvalidArgument("config: transfer.poll_hot_s must be between 0 and 3600 seconds")
    for where, v in (("peer_api.max_registers_per_s", cfg.peer_api.max_registers_per_s),
                     ("peer_api.max_registrations_per_peer", cfg.peer_api.max_registrations_per_peer),
                     ("peer_api.max_blocks_per_peer", cfg.peer_api.max_blocks_per_peer),
                     ("peer_api.max_stream_items", cfg.peer_api.max_stream_items),
                     ("peer_api.max_message_bytes", cfg.peer_api.max_message_bytes),
                     ("worker_api.max_message_bytes", cfg.worker_api.max_message_bytes)):
        if v <= 0:
            raise InvalidArgument(f"config: {where} must be positive")
    validate_peer_security(cfg.peer_api)
    if not 0 <= cfg.worker_api.socket_mode <= 0o777:
        raise InvalidArgument("config: worker_api.socket_mode must be permission bits (0..511)")
    if cfg.log.level.lower() not in ("debug", "info", "warning", "error"):
        raise InvalidArgument("config: log.level must be debug, info, warning or error")
    if cfg.log.format not in ("auto", "json", "console"):
        raise InvalidArgument("config: log.format must be auto, json or console")


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


def load(path: str | None) -> Config:
    if path is None:
        return Config()
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        raise InvalidArgument(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as e:
        raise InvalidArgument(f"config file {path}: {e}") from None
    return from_dict(data)
