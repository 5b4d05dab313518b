"""deploy/kubernetes: every manifest validates offline against Kubernetes' schemas, and the facts that
tie the manifests to the daemon hold (config, socket, probes, ports, grace period, connector config).

Schemas are the ones bundled with the ``kubernetes-validate`` package (no network). ``kubectl
kustomize`` renders the kustomizations too where kubectl is installed; the checks do not need it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate  # the dev extra: a missing package fails here rather than skipping the check
import pytest
import yaml
from kvpushd_client.types import Expect, Publish

from kvpushd import config
from kvpushd.peer_security import access_mode

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
# the oldest Kubernetes these manifests are written for, and the newest schema set the package has
VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]


def helpers() -> Any:
    """The test helpers' package (tests/support), else the older tests/conftest.py."""
    try:
        import support

        support.start_daemon  # noqa: B018 - loaded on first use there
        return support
    except (ImportError, AttributeError):
        import conftest

        return conftest


def manifests() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def docs(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def objects() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> object, over every manifest."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for p in manifests():
        for d in docs(p):
            key = (d["kind"], d["metadata"]["name"])
            assert key not in out, f"{key} defined twice"
            out[key] = d
    return out


@pytest.mark.parametrize("path", manifests(), ids=lambda p: str(p.relative_to(K8S)))
@pytest.mark.parametrize("version", VERSIONS)
def test_manifest_validates(path: Path, version: str) -> None:
    for d in docs(path):
        try:
            kubernetes_validate.validate(d, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{path.name}: {d['kind']}/{d['metadata']['name']} against Kubernetes {version}: "
                        f"{'.'.join(map(str, e.path))}: {e.message}")


def test_kustomizations_list_every_manifest() -> None:
    listed: set[Path] = set()
    for k in K8S.rglob("kustomization.yaml"):
        kust = yaml.safe_load(k.read_text())
        assert kust["kind"] == "Kustomization"
        for r in kust["resources"]:
            assert (k.parent / r).is_file(), f"{k}: {r} does not exist"
            listed.add((k.parent / r).resolve())
        for p in kust["resources"]:
            for d in docs(k.parent / p):
                ns = d["metadata"]["name"] if d["kind"] == "Namespace" else d["metadata"].get("namespace")
                assert ns == kust["namespace"], (p, d["kind"], ns)
    assert listed == {p.resolve() for p in manifests()}, "a manifest no kustomization applies"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with its kustomize) is not installed")
@pytest.mark.parametrize("where", ["", "examples"])
def test_kustomize_renders_valid_objects(where: str) -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S / where)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert rendered
    for d in rendered:
        kubernetes_validate.validate(d, VERSIONS[-1], strict=True)


# ------------------------------------------------------------------ the facts

def daemonset() -> dict[str, Any]:
    return objects()[("DaemonSet", "kvpushd")]


def pod(ds: dict[str, Any]) -> dict[str, Any]:
    return dict(ds["spec"]["template"]["spec"])


def container(spec: dict[str, Any]) -> dict[str, Any]:
    (c,) = spec["containers"]
    return dict(c)


def arg(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def config_text() -> str:
    return str(objects()[("ConfigMap", "kvpushd-config")]["data"]["kvpushd.toml"])


def loaded_config(tmp_path: Path) -> config.Config:
    """The ConfigMap's TOML through kvpushd's own loader and validation, TLS paths pointed at stand-ins."""
    data = tomllib.loads(config_text())
    pem = tmp_path / "stand-in.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    for key in ("tls_cert", "tls_key", "tls_ca"):
        data["peer_api"][key] = str(pem)
    return config.from_dict(data)


def mount_of(c: dict[str, Any], spec: dict[str, Any], name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    (m,) = [m for m in c["volumeMounts"] if m["name"] == name]
    (v,) = [v for v in spec["volumes"] if v["name"] == name]
    return m, v


def test_config_map_is_a_valid_closed_config(tmp_path: Path) -> None:
    cfg = loaded_config(tmp_path)
    raw = tomllib.loads(config_text())
    assert not cfg.peer_api.insecure and "insecure = true" not in raw.get("peer_api", {})
    assert access_mode(cfg.peer_api) == "tls+allow_names"
    assert cfg.peer_api.allow_names and cfg.peer_api.tls_server_name in cfg.peer_api.allow_names
    # the TLS files are the Secret's keys, where the DaemonSet mounts it
    ds = daemonset()
    spec, c = pod(ds), container(pod(ds))
    m, v = mount_of(c, spec, "peer-tls")
    secret_keys = {"tls.crt", "tls.key", "ca.crt"}  # kubernetes.io/tls (+ ca.crt, as cert-manager writes it)
    for key in ("tls_cert", "tls_key", "tls_ca"):
        path = Path(raw["peer_api"][key])
        assert str(path.parent) == m["mountPath"] and path.name in secret_keys, (key, path)
    assert v["secret"]["secretName"] == "kvpushd-peer-tls"
    # the config file is where --config says
    m, v = mount_of(c, spec, "config")
    conf = Path(arg(c["command"], "--config"))
    assert str(conf.parent) == m["mountPath"] and v["configMap"]["name"] == "kvpushd-config"
    assert conf.name in objects()[("ConfigMap", "kvpushd-config")]["data"]


def test_daemonset_host_access_and_socket(tmp_path: Path) -> None:
    cfg = loaded_config(tmp_path)
    spec = pod(daemonset())
    c = container(spec)
    assert spec["hostNetwork"] is True and spec["hostIPC"] is True
    assert spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert c["command"][:2] == ["kvpushd", "serve"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["HOST_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert arg(c["command"], "--node-id") == "$(NODE_NAME)"
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
    # the worker socket lives in the hostPath directory the engine pods mount
    m, v = mount_of(c, spec, "socket-dir")
    sock = Path(cfg.socket_path)
    assert str(sock.parent) == m["mountPath"] == v["hostPath"]["path"], (sock, m, v)
    # the peer port: the address --listen gives, the config's port, and the declared containerPort agree
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    listen = arg(c["command"], "--listen")
    assert listen == f"$(HOST_IP):{ports['peer']}" and cfg.listen_host_port[1] == ports["peer"]


def test_probes_ask_the_health_service_on_the_configured_socket(tmp_path: Path) -> None:
    cfg = loaded_config(tmp_path)
    c = container(pod(daemonset()))
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = c[probe]["exec"]["command"]
        assert cmd[:3] == ["kvpushctl", "--socket", cfg.socket_path] and cmd[3] == "health", (probe, cmd)
        assert ("--live" in cmd) is (probe == "livenessProbe"), (probe, cmd)
    # the startup probe allows for NIXL's start (failureThreshold x periodSeconds)
    s = c["startupProbe"]
    assert s["failureThreshold"] * s["periodSeconds"] >= 60


def test_grace_period_outlasts_the_drain(tmp_path: Path) -> None:
    cfg = loaded_config(tmp_path)
    spec = pod(daemonset())
    c = container(spec)
    pre_stop = 0.0
    hook = c.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        pre_stop = float(hook["sleep"]["seconds"])
    # drain_timeout_s, then about a second each to stop the two gRPC servers, then exit
    assert spec["terminationGracePeriodSeconds"] >= pre_stop + cfg.transfer.drain_timeout_s + 10


def test_metrics_are_where_the_scraper_looks(tmp_path: Path) -> None:
    cfg = loaded_config(tmp_path)
    ds = daemonset()
    ann = ds["spec"]["template"]["metadata"]["annotations"]
    host, port = config.split_host_port(cfg.metrics.listen)
    assert cfg.metrics.enabled and host == "0.0.0.0", "the metrics must listen on the node's addresses"
    assert ann["prometheus.io/scrape"] == "true" and ann["prometheus.io/port"] == str(port)
    assert ann["prometheus.io/path"] == "/metrics"
    assert {p["name"]: p["containerPort"] for p in container(pod(ds))["ports"]}["metrics"] == port


def connector_keys() -> set[str]:
    """``kv_connector_extra_config`` keys the connector reads (string literals in the client package)."""
    keys: set[str] = set()
    for p in (ROOT / "client" / "kvpushd_client").rglob("*.py"):
        if "proto" not in p.parts:
            keys |= set(re.findall(r"""["'](kvpushd_[a-z_]+)["']""", p.read_text()))
    return keys


@pytest.mark.parametrize("role, kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_vllm_examples_mount_the_socket_and_name_the_connector(tmp_path: Path, role: str, kv_role: str) -> None:
    cfg = loaded_config(tmp_path)
    dep = objects()[("Deployment", f"vllm-{role}")]
    spec = pod(dep)
    c = container(spec)
    assert spec["hostIPC"] is True, "CUDA IPC and /dev/shm are shared with the daemon through the host IPC namespace"
    assert not any(m["mountPath"] == "/dev/shm" for m in c.get("volumeMounts", [])), "would hide the host /dev/shm"
    kvt = json.loads(arg(c["command"], "--kv-transfer-config"))
    assert kvt["kv_connector"] == "KVPushdConnector"
    assert kvt["kv_connector_module_path"] == "kvpushd_client.vllm_connector"
    assert kvt["kv_role"] == kv_role
    extra = kvt["kv_connector_extra_config"]
    assert set(extra) <= connector_keys(), set(extra) - connector_keys()
    sock = Path(extra["kvpushd_socket"])
    assert sock == Path(cfg.socket_path)
    m, v = mount_of(c, spec, "kvpushd-socket")
    assert m["mountPath"] == str(sock.parent) and v["hostPath"]["path"] == pod(daemonset())["volumes"][
        [x["name"] for x in pod(daemonset())["volumes"]].index("socket-dir")]["hostPath"]["path"]
    # the example runs where the DaemonSet runs
    assert spec["nodeSelector"].items() <= pod(daemonset())["nodeSelector"].items()


def test_the_probe_command_against_a_real_daemon(workdir: Path) -> None:
    """``kvpushctl health`` (the probes' command): SERVING and exit 0 when ready, 1 when nothing answers."""
    d = helpers().start_daemon(workdir, "k8s")
    env = dict(os.environ)
    # what the kvpushctl console script runs
    ctl = [sys.executable, "-c", "import sys; from kvpushd.ctl import main; sys.exit(main())", "--socket", d.sock,
           "health"]
    try:
        for extra in ([], ["--live"], ["--service", "kvpushd.v1.WorkerService"]):
            r = subprocess.run([*ctl, *extra], capture_output=True, text=True, timeout=60, env=env)
            assert r.returncode == 0 and r.stdout.strip() == "SERVING", (extra, r.stdout, r.stderr)
    finally:
        d.client.close()
        assert d.stop() == 0
    r = subprocess.run(ctl, capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 1 and "no health answer" in r.stderr, (r.stdout, r.stderr)


def _pki(d: Path, cn: str) -> dict[str, str]:
    """A CA and one certificate named ``cn`` signed by it, as the Secret holds them (tls.crt, tls.key, ca.crt)."""
    import datetime

    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    def name(n: str) -> Any:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, n)])

    now = datetime.datetime.now(datetime.UTC)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("kvpushd-ca")).issuer_name(name("kvpushd-ca"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))
    cert = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName(cn)]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    files = {"ca.crt": ca.public_bytes(pem), "tls.crt": cert.public_bytes(pem),
             "tls.key": key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())}
    for f, data in files.items():
        (d / f).write_bytes(data)
    return {f: str(d / f) for f in files}


def test_config_map_peer_settings_carry_a_transfer(workdir: Path, kv_pair) -> None:  # type: ignore[no-untyped-def]
    """Two daemons with the ConfigMap's [peer_api] (TLS files from a stand-in Secret, loopback ports):
    a transfer goes through, and a caller without the certificate is refused."""
    import numpy as np
    from kvpushd_client import CompletionKind, Role

    attach_pair, start_daemon = helpers().attach_pair, helpers().start_daemon

    raw = tomllib.loads(config_text())["peer_api"]
    secret = workdir / "secret"
    secret.mkdir()
    files = _pki(secret, raw["tls_server_name"])
    lines = []
    for k, v in raw.items():
        if k == "listen":
            continue  # start_daemon listens on loopback, ephemeral port
        if k in ("tls_cert", "tls_key", "tls_ca"):
            v = files[Path(v).name]
        lines.append(f"{k} = {json.dumps(v)}")
    peer = "\n".join(lines) + "\n" + "connect_timeout_s = 3.0\nrpc_timeout_s = 5.0\n"
    timeouts = "[transfer]\npublish_timeout_s = 30.0\nexpect_timeout_s = 30.0\n"
    src, dst = kv_pair
    p = start_daemon(workdir, "pnode", peer + timeouts)
    daemons = [p]
    try:
        d = start_daemon(workdir, "dnode", peer + timeouts)
        daemons.append(d)
        plain = start_daemon(workdir, "plain", timeouts)
        daemons.append(plain)
        pw, dw = attach_pair(p, d, src, dst)
        dw.send(Expect("k8s-1", (1, 2), p.peer_address, "prefill", 1))
        pw.send(Publish("k8s-1", (9, 10)))
        c_d, c_p = dw.next_completion(30), pw.next_completion(30)
        assert c_d is not None and c_d.kind is CompletionKind.FINISHED_RECEIVING, c_d
        assert c_p is not None and c_p.kind is CompletionKind.FINISHED_SENDING, c_p
        assert np.array_equal(dst.arr[:, [1, 2], :], src.arr[:, [9, 10], :])
        rw = plain.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        rw.send(Expect("k8s-2", (3,), p.peer_address, "prefill", 1))
        c = rw.next_completion(30)
        assert c is not None and c.kind is CompletionKind.FAILED and c.code == "PEER_UNREACHABLE", c
    finally:
        for x in daemons:
            x.client.close()
            x.stop()
