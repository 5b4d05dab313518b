"""Registration binding: a prefill-side publish that names its decode node (the router's
``kvpushd_consumer_node``) accepts that daemon's registration only. Real daemons, real NIXL WRITE;
a second admitted caller (loopback) speaks the peer API with a NIXL agent of its own."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from kvpushd_client import Abort, CompletionKind, Expect, Publish
from support import attach_pair, wait_for
from support.peer import PeerSession
from test_closed import _register, _rogue_agent
from test_peer_trust import session
from test_tls import pki, start, tls_conf  # noqa: F401 (pki: the certificates fixture)

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif
from kvpushd.runtime.identity import agent_prefix


def _agent(node: str, instance: str) -> tuple[str, bytes]:
    """A NIXL agent named as node ``node``'s (what a caller claiming that node id would use)."""
    nixl_api = pytest.importorskip("nixl._api")
    name = agent_prefix(node, instance) + "thief"
    a = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    return name, bytes(a.get_agent_metadata())


def test_bound_a_second_caller_registering_after_the_publish_is_refused(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    pw.send(Publish("bound-after", (10, 11, 12), consumer_node_id="dnode"))
    rogue = session(p.peer_address, "rogue")
    e = _register(rogue, "bound-after", _rogue_agent(rogue.instance_id), [4, 5, 6])
    assert e.code == "PERMISSION_DENIED" and "bound to decode node 'dnode'" in e.message, e
    assert "'rogue'" in e.message, e
    dw.send(Expect("bound-after", (1, 2, 3), p.peer_address, "prefill", 1))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    assert (dst.arr[:, [1, 2, 3]] == src.arr[:, [10, 11, 12]]).all()
    assert "registration refused" in p.logs()


def test_bound_a_second_caller_registering_before_the_publish_is_failed_back(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """Push mode's usual order (the decode side registers while prefill computes): the other
    caller's registration is held until the publish names the binding, then dropped; the named
    decode daemon, registering later, gets the exact bytes."""
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    rogue = session(p.peer_address, "rogue")
    e = _register(rogue, "bound-before", _rogue_agent(rogue.instance_id), [4, 5, 6])
    assert e.code == "OK", e  # nothing names the decode node yet: held
    assert wait_for(lambda: any(t.transfer_id == "bound-before" for t in p.client.status().transfers))
    pw.send(Publish("bound-before", (20, 21, 22), consumer_node_id="dnode"))
    dw.send(Expect("bound-before", (7, 8, 9), p.peer_address, "prefill", 1))
    assert dw.next_completion(20).kind is CompletionKind.FINISHED_RECEIVING
    assert pw.next_completion(20).kind is CompletionKind.FINISHED_SENDING
    assert (dst.arr[:, [7, 8, 9]] == src.arr[:, [20, 21, 22]]).all()
    assert wait_for(lambda: not any(t.transfer_id == "bound-before" for t in p.client.status().transfers))


def test_unbound_the_first_registration_still_wins(daemon_pair, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """Without a name (vLLM's unchanged proxy) behaviour is as before: the caller that registered
    first holds the consumer rank, and the decode daemon's registration is refused."""
    p, d = daemon_pair
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    rogue = session(p.peer_address, "rogue")
    e = _register(rogue, "unbound", _rogue_agent(rogue.instance_id), [4, 5, 6])
    assert e.code == "OK", e
    dw.send(Expect("unbound", (1, 2, 3), p.peer_address, "prefill", 1))
    c = dw.next_completion(20)
    assert c is not None and c.kind is CompletionKind.FAILED and "another decode daemon" in c.reason, c
    assert pw.send(Abort("unbound")) is False  # nothing published on this worker


def test_bound_by_tls_name_a_caller_claiming_the_node_id_is_refused(workdir, pki, kv_pair) -> None:  # type: ignore[no-untyped-def]  # noqa: F811
    """Under mutual TLS a router can bind by the decode daemon's certificate name: a caller with
    another certificate of the same CA that claims the decode daemon's node id is refused."""
    src, dst = kv_pair
    ca = pki["ca"]
    p = start(workdir, "pnode", tls_conf(str(pki["pnode"]), ca))
    d = start(workdir, "dnode", tls_conf(str(pki["dnode"]), ca))
    try:
        pw, dw = attach_pair(p, d, src, dst)
        base = str(pki["intruder"])
        creds = grpc.ssl_channel_credentials(root_certificates=Path(ca).read_bytes(),
                                             private_key=Path(base + ".key").read_bytes(),
                                             certificate_chain=Path(base + ".crt").read_bytes())
        rogue = PeerSession(p.peer_address, PROTOCOL_VERSION, notif.compat_hash(), "dnode", credentials=creds)
        pw.send(Publish("bound-tls", (30, 31, 32), consumer_tls_name="dnode"))
        e = _register(rogue, "bound-tls", _agent("dnode", rogue.instance_id), [4, 5, 6])
        assert e.code == "PERMISSION_DENIED" and "TLS name 'dnode'" in e.message and "'intruder'" in e.message, e
        dw.send(Expect("bound-tls", (11, 12, 13), p.peer_address, "prefill", 1))
        assert dw.next_completion(30).kind is CompletionKind.FINISHED_RECEIVING
        assert pw.next_completion(30).kind is CompletionKind.FINISHED_SENDING
        assert (dst.arr[:, [11, 12, 13]] == src.arr[:, [30, 31, 32]]).all()
    finally:
        for x in (p, d):
            x.client.close()
            assert x.stop() == 0
