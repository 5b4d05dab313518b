"""Peer API security: mutual TLS with grpcio's own credentials, and an allowlist of callers.

TLS (``[peer_api] tls_cert``, ``tls_key``, ``tls_ca``): the peer server presents ``tls_cert`` and
requires a client certificate signed by ``tls_ca``; the peer client presents the same certificate
and checks the remote daemon's against ``tls_ca`` (under ``tls_server_name`` when set, else the
host of the address it dials). A caller without a certificate, or with one from another CA, fails
the TLS handshake before any RPC runs.

The allowlist (``allow``: CIDRs of caller addresses; ``allow_names``: client certificate CN/SAN
names, TLS only) is a server interceptor: a call from anyone else ends with PERMISSION_DENIED
naming the caller and the rule, and the daemon goes on serving others. The health service stays
open to every caller that gets through TLS, so probes keep working.

Closed by default (protected mode, as Redis has): with neither TLS nor ``allow``, the same
interceptor admits loopback callers only and tells anyone else how to open the peer API. Opening
it to the network without TLS or an allowlist takes ``insecure = true``, logged as a warning.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import structlog

from .config import PeerApiConfig

log = structlog.get_logger(__name__)

HEALTH_PREFIX = "/grpc.health.v1.Health/"
HOW_TO_OPEN = ("to open it, set in [peer_api] tls_cert, tls_key and tls_ca (mutual TLS, with allow_names), "
               "or allow = [\"<CIDR of the peer daemons>\"], or insecure = true (plaintext, open to anyone who "
               "reaches the port)")


def tls_enabled(p: PeerApiConfig) -> bool:
    return bool(p.tls_cert and p.tls_key and p.tls_ca)


def server_credentials(p: PeerApiConfig) -> grpc.ServerCredentials:
    """Our certificate; client certificates signed by the CA are required."""
    return grpc.ssl_server_credentials([(Path(p.tls_key).read_bytes(), Path(p.tls_cert).read_bytes())],
                                       root_certificates=Path(p.tls_ca).read_bytes(), require_client_auth=True)


def channel_credentials(p: PeerApiConfig) -> grpc.ChannelCredentials:
    """The CA to check the remote daemon with, and our certificate to present to it."""
    return grpc.ssl_channel_credentials(root_certificates=Path(p.tls_ca).read_bytes(),
                                        private_key=Path(p.tls_key).read_bytes(),
                                        certificate_chain=Path(p.tls_cert).read_bytes())


def channel_options(p: PeerApiConfig) -> list[tuple[str, Any]]:
    if p.tls_server_name:
        return [("grpc.ssl_target_name_override", p.tls_server_name)]
    return []


def caller_ip(peer: str) -> str:
    """The IP address in a gRPC peer string ("ipv4:10.0.0.1:5000", "ipv6:[::1]:5000"); "" if none."""
    kind, _, rest = urllib.parse.unquote(peer).partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    return ""


def cert_names(auth: dict[str, list[bytes]]) -> list[str]:
    """The client certificate's common name and subject alternative names."""
    out: list[str] = []
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        out += [v.decode(errors="replace") for v in auth.get(key, [])]
    return out


def _address(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The caller's address (IPv4-mapped IPv6 as IPv4), None if it has none."""
    try:
        addr = ipaddress.ip_address(caller_ip(peer))
    except ValueError:
        return None
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def access_mode(p: PeerApiConfig) -> str:
    """Who may call the peer API: "loopback" (protected mode), "insecure", or what opens it."""
    if p.insecure:
        return "insecure"
    if p.protected:
        return "loopback"
    return "+".join(m for m, on in (("tls", tls_enabled(p)), ("allow", bool(p.allow)),
                                    ("allow_names", bool(p.allow_names))) if on)


def peer_interceptors(p: PeerApiConfig) -> list[grpc.aio.ServerInterceptor]:
    """The peer server's interceptors; logs, once at start, who may call it."""
    mode = access_mode(p)
    if mode == "insecure":
        log.warning("peer API open to every caller without TLS or an allowlist (peer_api.insecure = true): "
                    "anyone who reaches it can register for transfers and receive KV; use TLS with allow_names, "
                    "or an allow list, outside a trusted lab", listen=p.listen, peer_access=mode)
        return []
    if mode == "loopback":
        host = p.listen.rpartition(":")[0].strip("[]")
        try:
            reachable = host in ("", "0.0.0.0", "::", "localhost") or ipaddress.ip_address(host).is_loopback
        except ValueError:
            reachable = False
        # listening on one non-loopback address, nothing that may call can reach it: say so loudly
        say = log.info if reachable else log.warning
        say("peer API serves loopback callers only (protected mode: neither TLS nor peer_api.allow is set); "
            + HOW_TO_OPEN, listen=p.listen, peer_access=mode)
    else:
        log.info("peer API access", listen=p.listen, peer_access=mode, peer_allow=list(p.allow),
                 peer_allow_names=list(p.allow_names))
    return [AllowList(p)] if mode == "loopback" or p.allow or p.allow_names else []


class AllowList(grpc.aio.ServerInterceptor):
    """PERMISSION_DENIED for callers outside ``allow`` / ``allow_names``, or, in protected mode, for
    every caller not on loopback (health excepted)."""

    def __init__(self, p: PeerApiConfig) -> None:
        self.networks = [ipaddress.ip_network(a, strict=False) for a in p.allow]
        self.allow = p.allow
        self.names = frozenset(p.allow_names)
        self.loopback_only = p.protected
        self.denied = 0

    def check(self, peer: str, auth: dict[str, list[bytes]]) -> str:
        """"" when the caller may call, else why not."""
        if self.loopback_only:
            addr = _address(peer)
            if addr is None or not addr.is_loopback:
                return (f"caller {caller_ip(peer) or peer} is not on loopback, and this daemon serves loopback "
                        "callers only (protected mode: neither TLS nor peer_api.allow is set); " + HOW_TO_OPEN)
        if self.networks:
            addr = _address(peer)
            if addr is None:
                return f"caller {peer} has no IP address; peer_api.allow = {list(self.allow)}"
            if not any(addr in n for n in self.networks):
                return f"caller {caller_ip(peer)} is not in peer_api.allow = {list(self.allow)}"
        if self.names:
            names = cert_names(auth)
            if not self.names.intersection(names):
                return (f"caller {caller_ip(peer) or peer} presents certificate names {names[:8]}, none in "
                        f"peer_api.allow_names = {sorted(self.names)}")
        return ""

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Any]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = await continuation(handler_call_details)
        method = str(getattr(handler_call_details, "method", ""))
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        if handler.unary_unary is not None:
            inner: Any = handler.unary_unary

            async def guarded(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                await self._gate(method, context)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(guarded, handler.request_deserializer,
                                                       handler.response_serializer)
        if handler.stream_stream is not None:  # Channel: gated when it opens, before any item is read
            inner_b: Any = handler.stream_stream

            async def guarded_b(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                await self._gate(method, context)
                async for item in inner_b(requests, context):
                    yield item

            return grpc.stream_stream_rpc_method_handler(guarded_b, handler.request_deserializer,
                                                         handler.response_serializer)
        # the peer API has no client- or server-streaming methods: refused rather than served unguarded
        raise RuntimeError(f"peer API method {method} of a kind the allowlist does not guard")

    async def _gate(self, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        auth = {k: list(v) for k, v in context.auth_context().items()}
        why = self.check(context.peer(), auth)
        if why:
            self.denied += 1
            log.warning("peer call denied", method=method, reason=why, denied_total=self.denied)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, f"kvpushd peer API: {why}")
