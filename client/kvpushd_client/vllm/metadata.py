"""The connector's wire format: the ``kv_transfer_params`` prefill and decode exchange through the
proxy, and the metadata the scheduler side ships to the workers each step (no vLLM import needed).

Transfer ids: vLLM 0.33.0 has no ``transfer_id`` parameter. The proxy sends one ``X-Request-Id`` to
both engines and each engine appends ``-<8 hex>`` (``InputProcessor.assign_request_id``), so both sides
use the request id with that suffix stripped -- the same rule ``NixlPushConnector`` matches by
(``get_base_request_id``). A ``transfer_id`` in ``kv_transfer_params`` wins when a router sets one.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .utils import logger

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
else:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata
    except ImportError:  # the wire format stays readable without vLLM (tools, tests)
        class KVConnectorMetadata:
            """Stand-in for vLLM's base class when vLLM is not installed."""

#
# KVPushd connector version
#
# Increment it whenever a change breaks prefill/decode interoperability of two connectors:
#   - the kv_transfer_params keys or their meaning (below, PREFILL_PARAMS)
#   - the rule that derives one transfer id on both nodes
#   - what remote_host/remote_port name (the prefill node's daemon peer API)
# (the KV layout is not part of it: the daemons check each other's regions per request.)
#
# Version history:
#   1: push mode through the node's daemon; remote_host/remote_port name the prefill daemon's peer
#      API; transfer id = request id without vLLM's "-<8 hex>" suffix, or kv_transfer_params
#      ["transfer_id"]
#   2: kv_transfer_params["transfer_mode"] ("push" | "pull") passed through to the daemons
#   3: prefill's kv_transfer_params carry kvpushd_compat_hash; decode prefills locally on a mismatch
#   4: hybrid models (several KV cache groups, vLLM's hybrid manager on): one transfer moves every
#      group's blocks, concatenated in group order, a sliding-window group only the positions of its
#      last window (groups.py); remote_block_ids is then one list per group
#
KVPUSHD_CONNECTOR_VERSION: int = 4

COMPAT_HASH_KEY = "kvpushd_compat_hash"
# What a prefill engine answers in kv_transfer_params (the decode request carries them back).
PREFILL_PARAMS = ("do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                  "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
                  "remote_num_tokens", "transfer_mode", "transfer_id", COMPAT_HASH_KEY)

_RANDOM_SUFFIX_RE = re.compile(r"-[0-9a-f]{8}$", re.IGNORECASE)


# What two connectors must agree on to work as prefill and decode (see the version history).
_COMPAT_FACTORS = {"kvpushd_connector_version": KVPUSHD_CONNECTOR_VERSION, "prefill_params": sorted(PREFILL_PARAMS),
                   "transfer_id_rule": _RANDOM_SUFFIX_RE.pattern, "group_rule": "concat-groups/window-positions"}
COMPAT_HASH = hashlib.sha256(json.dumps(_COMPAT_FACTORS, sort_keys=True).encode()).hexdigest()[:16]


def base_request_id(request_id: str) -> str:
    """The request id without vLLM's per-engine ``-<8 hex>`` suffix (what P and D share)."""
    return _RANDOM_SUFFIX_RE.sub("", request_id)


def transfer_id_for(request_id: str, params: dict[str, Any] | None) -> str:
    """The transfer id both nodes derive for one request (see the module docstring)."""
    explicit = (params or {}).get("transfer_id")
    return str(explicit) if explicit else base_request_id(request_id)


def daemon_engine_id(engine_id: str) -> str:
    """vLLM engine ids as the daemon accepts them (it forbids '.')."""
    return engine_id.replace(".", "_")


def producer_address(params: dict[str, Any]) -> str:
    host, port = str(params["remote_host"]), int(params["remote_port"])
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def remote_params_problem(params: dict[str, Any]) -> str | None:
    """Why a decode request's kv_transfer_params cannot drive a push, or None."""
    missing = [k for k in ("remote_engine_id", "remote_host", "remote_port") if params.get(k) in (None, "")]
    if missing:
        return f"kv_transfer_params lack {', '.join(missing)}"
    try:
        port = int(params["remote_port"])
        tp = int(params.get("tp_size") or 1)
        pp = int(params.get("pp_size") or 1)
    except (TypeError, ValueError):
        return "remote_port, tp_size and pp_size must be integers"
    if not 0 < port < 65536:
        return f"remote_port {port} is not a port"
    if tp < 1:
        return f"tp_size {tp} must be positive"
    if pp != 1:
        return f"the prefill engine runs pp_size={pp}; kvpushd pushes from pp_size=1 engines only"
    theirs = params.get(COMPAT_HASH_KEY)
    if theirs not in (None, "", COMPAT_HASH):  # absent: a prefill connector older than version 3
        return (f"the prefill engine's kvpushd connector speaks another wire format ({COMPAT_HASH_KEY} "
                f"{theirs}, this one {COMPAT_HASH}, version {KVPUSHD_CONNECTOR_VERSION})")
    return None


def transfer_mode_of(params: dict[str, Any]) -> str:
    """kv_transfer_params["transfer_mode"]: "push" (default) or "pull"; anything else is pushed."""
    mode = str(params.get("transfer_mode") or "push").lower()
    if mode not in ("push", "pull"):
        logger.warning("kvpushd: unknown transfer_mode %r; using push", mode)
        return "push"
    return mode


# ------------------------------------------------------------------------------------------------
# Scheduler -> worker metadata (plain data: it is pickled to the workers)


@dataclass(frozen=True)
class ExpectReq:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    producer_address: str
    producer_engine_id: str
    producer_tp_size: int
    transfer_mode: str = "push"
    traceparent: str = ""  # the request's W3C trace context (vLLM's trace_headers), "" without one
    failed: str = ""  # not to be expected at all (why): the worker reports the receive failed at once


@dataclass(frozen=True)
class PublishReq:
    req_id: str
    transfer_id: str
    block_ids: tuple[int, ...]
    traceparent: str = ""
    # kv_transfer_params["kvpushd_consumer_node"] / ["kvpushd_consumer_tls_name"]: the decode daemon's
    # node id / client certificate name, set by a router that binds the transfer to it ("": unbound)
    consumer_node_id: str = ""
    consumer_tls_name: str = ""
    # Progressive push: declared in the step that computes the prompt's last tokens, before its
    # forward (the worker adds the step and its layer groups); else published once the request finished.
    declared: bool = False
    ready_blocks: int = 0  # declared: the leading blocks already complete (a prefix-cache hit, earlier chunks)


@dataclass(frozen=True)
class AbortReq:
    req_id: str
    transfer_id: str
    send: bool = False    # a declared publish (prefill), not an expect
    report: bool = True   # send: report finished_sending once it settled (False: vLLM already freed the blocks)


@dataclass
class KVPushdConnectorMetadata(KVConnectorMetadata):
    """One step's work for every worker: processed in the order expects, publishes, aborts."""

    expects: list[ExpectReq] = field(default_factory=list)
    publishes: list[PublishReq] = field(default_factory=list)
    aborts: list[AbortReq] = field(default_factory=list)
