"""Peer API security with real daemons: mutual TLS (grpcio credentials) and the caller allowlist.

Certificates are made here, in the test's temp dir, with the ``cryptography`` package: a CA, a
certificate per daemon (CN = its name, SAN localhost and 127.0.0.1), and a second, unrelated CA.
"""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

import numpy as np
import pytest
from kvpushd_client import CompletionKind, Expect, Publish, Role
from support import attach_pair, start_daemon

from kvpushd.config import PeerApiConfig, from_dict
from kvpushd.core.errors import InvalidArgument
from kvpushd.peer_security import AllowList, caller_ip

x509 = pytest.importorskip("cryptography.x509")
from cryptography.hazmat.primitives import hashes, serialization  # noqa: E402
from cryptography.hazmat.primitives.asymmetric import ec  # noqa: E402
from cryptography.x509.oid import NameOID  # noqa: E402

FAST = "connect_timeout_s = 3.0\nrpc_timeout_s = 5.0\n"
TIMEOUTS = "[transfer]\npublish_timeout_s = 30.0\nexpect_timeout_s = 30.0\n"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def make_ca(d: Path, name: str) -> tuple[object, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(name)).issuer_name(_name(name))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    (d / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def make_cert(d: Path, ca: tuple[object, x509.Certificate], cn: str, prefix: str = "") -> str:
    """Write <prefix><cn>.crt/.key signed by ``ca``; returns the path prefix."""
    ca_key, ca_cert = ca
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn), x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(ca_key, hashes.SHA256()))  # type: ignore[arg-type]
    base = d / f"{prefix}{cn}"
    base.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    base.with_suffix(".key").write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                                           serialization.PrivateFormat.PKCS8,
                                                           serialization.NoEncryption()))
    return str(base)


def tls_conf(base: str, ca_pem: Path, extra: str = "") -> str:
    return (f'[peer_api]\ntls_cert = "{base}.crt"\ntls_key = "{base}.key"\ntls_ca = "{ca_pem}"\n' + FAST + extra
            + TIMEOUTS)


def start(workdir: Path, name: str, conf: str):  # type: ignore[no-untyped-def]
    return start_daemon(workdir, name, _merge(conf))


def _merge(conf: str) -> str:
    """start_daemon opens [peer_api] itself (listen): put our peer_api keys as dotted keys instead."""
    out, section = [], ""
    for line in conf.splitlines():
        if line.startswith("["):
            section = line.strip("[]")
            if section == "peer_api":
                continue
            out.append(line)
        elif section == "peer_api" and line.strip():
            out.insert(0, line)  # before any other table: still inside start_daemon's [peer_api]
        else:
            out.append(line)
    return "\n".join(out) + "\n"


@pytest.fixture
def pki(workdir: Path) -> dict[str, object]:
    d = workdir / "pki"
    d.mkdir()
    ca = make_ca(d, "kvp-ca")
    other = make_ca(d, "other-ca")
    return {
        "dir": d, "ca": d / "kvp-ca.pem", "other_ca": d / "other-ca.pem",
        "pnode": make_cert(d, ca, "pnode"), "dnode": make_cert(d, ca, "dnode"),
        "intruder": make_cert(d, ca, "intruder"), "foreign": make_cert(d, other, "foreign"),
    }


def roundtrip(pw, dw, p, tid: str, dst_blocks: list[int], src_blocks: list[int]):  # type: ignore[no-untyped-def]
    dw.send(Expect(tid, tuple(dst_blocks), p.peer_address, "prefill", 1))
    pw.send(Publish(tid, tuple(src_blocks)))
    return dw.next_completion(30), pw.next_completion(30)


def test_transfer_over_mutual_tls_and_refusals(workdir: Path, pki: dict[str, object], kv_pair) -> None:  # type: ignore[no-untyped-def]
    src, dst = kv_pair
    ca = pki["ca"]
    p = start(workdir, "pnode", tls_conf(str(pki["pnode"]), ca, 'allow_names = ["dnode"]\n'))  # type: ignore[arg-type]
    others = []
    try:
        d = start(workdir, "dnode", tls_conf(str(pki["dnode"]), ca))  # type: ignore[arg-type]
        others.append(d)
        pw, dw = attach_pair(p, d, src, dst)
        c_d, c_p = roundtrip(pw, dw, p, "tls-1", [1, 2, 3], [10, 11, 12])
        assert c_d.kind is CompletionKind.FINISHED_RECEIVING, c_d
        assert c_p.kind is CompletionKind.FINISHED_SENDING, c_p
        assert np.array_equal(dst.arr[:, [1, 2, 3], :], src.arr[:, [10, 11, 12], :])
        assert p.client.status().config["peer_api.tls_ca"] == str(ca)

        # a peer without a client certificate (plaintext), and one whose certificate another CA signed
        plain = start(workdir, "plain", "[peer_api]\n" + FAST + TIMEOUTS)
        others.append(plain)
        foreign = start(workdir, "foreign", tls_conf(str(pki["foreign"]), pki["other_ca"]))  # type: ignore[arg-type]
        others.append(foreign)
        # same CA but a name outside allow_names: TLS passes, the allowlist refuses
        intruder = start(workdir, "intruder", tls_conf(str(pki["intruder"]), ca))  # type: ignore[arg-type]
        others.append(intruder)
        for rogue, codes in ((plain, {"PEER_UNREACHABLE"}), (foreign, {"PEER_UNREACHABLE", "PEER_REJECTED"}),
                             (intruder, {"PEER_REJECTED"})):
            rw = rogue.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
            rw.send(Expect(f"from-{rogue.name}", (20, 21), p.peer_address, "prefill", 1))
            c = rw.next_completion(30)
            assert c is not None and c.kind is CompletionKind.FAILED, (rogue.name, c)
            assert c.code in codes and c.block_ids == (20, 21), (rogue.name, c)
            assert p.peer_address in c.reason, c.reason
            print(rogue.name, "->", c.code, c.reason)
            if rogue is plain:
                assert "tls_cert" in c.reason, c.reason  # the hint: that daemon speaks TLS
            if rogue is foreign:
                assert "handshake failed" in c.reason.lower(), c.reason
            if rogue is intruder:
                assert "PERMISSION_DENIED" in c.reason and "intruder" in c.reason and "allow_names" in c.reason
            rw.detach()
        assert not np.any(dst.arr[:, [20, 21], :] != 0xA5), "a refused peer's blocks were written"

        # the prefill daemon still serves the good peer
        assert p.proc.poll() is None
        c_d, c_p = roundtrip(pw, dw, p, "tls-2", [4, 5], [13, 14])
        assert c_d.kind is CompletionKind.FINISHED_RECEIVING and c_p.kind is CompletionKind.FINISHED_SENDING
        assert np.array_equal(dst.arr[:, [4, 5], :], src.arr[:, [13, 14], :])
        assert "peer call denied" in p.logs()
    finally:
        for x in [p, *others]:
            x.client.close()
            if x.proc.poll() is None:
                x.stop()


def test_allowlist_denies_callers_outside_the_cidrs(workdir: Path, kv_pair) -> None:  # type: ignore[no-untyped-def]
    src, dst = kv_pair
    p = start(workdir, "pnode", '[peer_api]\nallow = ["10.0.0.0/8", "192.168.1.7"]\n' + FAST + TIMEOUTS)
    d = start(workdir, "dnode", "[peer_api]\n" + FAST + TIMEOUTS)
    try:
        _, dw = attach_pair(p, d, src, dst)
        dw.send(Expect("denied", (1, 2), p.peer_address, "prefill", 1))
        c = dw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FAILED and c.code == "PEER_REJECTED", c
        assert "PERMISSION_DENIED" in c.reason and "127.0.0.1" in c.reason and "10.0.0.0/8" in c.reason, c.reason
        assert c.block_ids == (1, 2)
        assert p.proc.poll() is None and not p.client.status().transfers
    finally:
        for x in (p, d):
            x.client.close()
            x.stop()


def test_allowlist_admits_listed_callers(workdir: Path, kv_pair) -> None:  # type: ignore[no-untyped-def]
    src, dst = kv_pair
    p = start(workdir, "pnode", '[peer_api]\nallow = ["10.0.0.0/8", "127.0.0.0/8"]\n' + FAST + TIMEOUTS)
    d = start(workdir, "dnode", "[peer_api]\n" + FAST + TIMEOUTS)
    try:
        pw, dw = attach_pair(p, d, src, dst)
        c_d, c_p = roundtrip(pw, dw, p, "allowed", [7], [8])
        assert c_d.kind is CompletionKind.FINISHED_RECEIVING and c_p.kind is CompletionKind.FINISHED_SENDING
        assert np.array_equal(dst.arr[:, [7], :], src.arr[:, [8], :])
    finally:
        for x in (p, d):
            x.client.close()
            x.stop()


def test_config_is_validated(tmp_path: Path) -> None:
    cert = tmp_path / "c.pem"
    cert.write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    with pytest.raises(InvalidArgument, match="tls_cert, tls_key and tls_ca together"):
        from_dict({"peer_api": {"tls_cert": str(cert)}})
    with pytest.raises(InvalidArgument, match="cannot read"):
        from_dict({"peer_api": {"tls_cert": str(cert), "tls_key": str(tmp_path / "nope"), "tls_ca": str(cert)}})
    (tmp_path / "k.txt").write_text("not pem")
    with pytest.raises(InvalidArgument, match="not a PEM file"):
        from_dict({"peer_api": {"tls_cert": str(cert), "tls_key": str(tmp_path / "k.txt"), "tls_ca": str(cert)}})
    with pytest.raises(InvalidArgument, match="allow_names needs TLS"):
        from_dict({"peer_api": {"allow_names": ["a"]}})
    with pytest.raises(InvalidArgument, match="tls_server_name needs TLS"):
        from_dict({"peer_api": {"tls_server_name": "a"}})
    with pytest.raises(InvalidArgument, match="not an address or CIDR"):
        from_dict({"peer_api": {"allow": ["10.0.0.0/33"]}})
    ok = from_dict({"peer_api": {"tls_cert": str(cert), "tls_key": str(cert), "tls_ca": str(cert),
                                 "allow": ["10.0.0.0/8", "::1"], "allow_names": ["dnode"]}})
    assert ok.peer_api.allow == ("10.0.0.0/8", "::1")


def test_allowlist_rules() -> None:
    a = AllowList(PeerApiConfig(allow=("10.0.0.0/8", "127.0.0.1", "fd00::/8"), allow_names=("dnode",)))
    good = {"x509_common_name": [b"dnode"]}
    assert caller_ip("ipv6:%5B::1%5D:5000") == "::1"
    assert a.check("ipv4:10.1.2.3:5000", good) == ""
    assert a.check("ipv4:127.0.0.1:1", {"x509_subject_alternative_name": [b"localhost", b"dnode"]}) == ""
    assert a.check("ipv6:[fd00::5]:1", good) == ""
    assert a.check("ipv6:[::ffff:10.0.0.1]:1", good) == ""  # v4-mapped
    assert "not in peer_api.allow" in a.check("ipv4:127.0.0.2:1", good)
    assert "allow_names" in a.check("ipv4:10.0.0.1:1", {"x509_common_name": [b"other"]})
    assert "no IP address" in a.check("unix:/tmp/x", good)
