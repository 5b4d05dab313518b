"""Multi-host: one daemon per network namespace, real NIXL (UCX over TCP) WRITEs across veths and a bridge.

Every daemon runs inside its own namespace (``ip netns exec``) on a private subnet that exists only in
the namespaces these tests create; its peer API listens on the namespace's address and UCX is limited
to TCP on the namespace's veth, so gRPC and KV bytes both cross the (virtual) network. The workers are
this test process, in the root namespace: they reach each daemon through its unix socket in a temporary
directory and hand it shared-memory KV. Skipped, saying why, where namespaces cannot be created.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from kvpushd_client import Completion, CompletionKind, Expect, KVPushError, Publish, Role, StreamWorker
from kvpushd_lab import launch
from kvpushd_lab.netns import VETH, NetnsLab, available, sweep_stale
from support import KV, POISON, DaemonProc, make_kv, wait_for

pytestmark = pytest.mark.timeout(120)

PORT = 7700
Settings = dict[str, dict[str, float]]
SLOW: Settings = {"transfer": {"publish_timeout_s": 30.0, "expect_timeout_s": 30.0}}
# The kill test: a registration whose prefill daemon died ends after expect_timeout_s at the latest.
FAST: Settings = {"transfer": {"publish_timeout_s": 3.0, "expect_timeout_s": 3.0},
                  "peer_api": {"connect_timeout_s": 2.0, "rpc_timeout_s": 3.0}}


@pytest.fixture(scope="module", autouse=True)
def _namespaces_available() -> None:
    ok, why = available()
    if not ok:
        pytest.skip(f"multi-host tests need network namespaces: {why}")
    sweep_stale()


NsDaemon = DaemonProc  # the one launcher's daemon (kvpushd_lab.launch), here inside a namespace


def start_daemons(lab: NetnsLab, workdir: Path, nodes: Sequence[tuple[str, int]],
                  settings: Settings = SLOW) -> list[NsDaemon]:
    """``kvpushd serve`` inside namespace i for each (name, i), all started at once, then waited for.

    Peer API on the namespace's address; UCX limited to TCP on its veth, so the WRITEs cross the bridge.
    """
    env = dict(os.environ, UCX_TLS="tcp", UCX_NET_DEVICES=VETH)
    try:
        return launch.start_all(workdir, [name for name, _ in nodes], env=env,
                                die_with_parent=True, timeout_s=90,
                                settings=settings,  # the launcher allows the lab's /24 (protected mode)
                                per_daemon={name: {"netns": (lab, i), "listen": f"{lab.addrs[i]}:{PORT}"}
                                            for name, i in nodes})
    except launch.DaemonStartError as e:
        raise RuntimeError(str(e)) from None


def stop_all(daemons: Sequence[NsDaemon], expect_clean: bool = True) -> None:
    """SIGTERM all at once (they drain in parallel); each one still running must exit 0."""
    alive = {d.name: d.proc.poll() is None for d in daemons}
    for d in daemons:
        d.client.close()
        if alive[d.name]:
            d.proc.send_signal(signal.SIGTERM)
    errors = []
    for d in daemons:
        try:
            rc = d.proc.wait(30)
        except subprocess.TimeoutExpired:
            d.proc.kill()
            rc = d.proc.wait(10)
            errors.append(f"daemon {d.name} did not stop within 30 s of SIGTERM")
        if alive[d.name] and expect_clean and rc != 0:
            errors.append(f"daemon {d.name} exited {rc}:\n{d.logs()[-3000:]}")
    assert not errors, "\n".join(errors)


class Cluster:
    """Five hosts on one bridge: 0 prefill A, 1 prefill B, 2 decode D (started for every test, normal
    timeouts); 3 prefill A2 and 4 decode D2 (short timeouts) are started by the kill test only."""

    HOSTS = {"a": ("pnode-a", 0), "b": ("pnode-b", 1), "d": ("dnode", 2), "a2": ("kpnode-a", 3), "d2": ("kdnode", 4)}

    def __init__(self, lab: NetnsLab, workdir: Path) -> None:
        self.lab = lab
        self.workdir = workdir
        self.d: dict[str, NsDaemon] = {}

    def start(self, keys: Sequence[str], settings: Settings = SLOW) -> list[NsDaemon]:
        started = start_daemons(self.lab, self.workdir, [self.HOSTS[k] for k in keys], settings)
        self.d.update(zip(keys, started, strict=True))
        return started


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with tempfile.TemporaryDirectory(prefix="kvpushd-netns-") as tmp, NetnsLab(5) as lab:
        c = Cluster(lab, Path(tmp))
        try:
            c.start(["a", "b", "d"])
            yield c
        finally:
            stop_all(list(c.d.values()))  # a daemon killed by a test is not checked


# -- checks ---------------------------------------------------------------------------------------------


def check_blocks(src: KV, dst: KV, src_blocks: Sequence[int], dst_blocks: Sequence[int]) -> None:
    assert np.array_equal(dst.arr[:, list(dst_blocks), :], src.arr[:, list(src_blocks), :])


def check_poison_elsewhere(dst: KV, written: set[int]) -> None:
    others = [b for b in range(dst.num_blocks) if b not in written]
    assert np.all(dst.arr[:, others, :] == POISON), "bytes outside the destination blocks changed"


def collect(worker: StreamWorker, ids: set[str], timeout: float = 30.0) -> dict[str, Completion]:
    """One completion per id, within ``timeout`` overall; any other or duplicate id fails the test."""
    got: dict[str, Completion] = {}
    deadline = time.monotonic() + timeout
    while len(got) < len(ids):
        left = deadline - time.monotonic()
        c = worker.next_completion(left) if left > 0 else None
        assert c is not None, f"no completion for {sorted(ids - set(got))} within {timeout} s"
        assert c.transfer_id in ids and c.transfer_id not in got, c
        got[c.transfer_id] = c
    return got


@dataclass
class Req:
    tid: str
    prefill: str          # "a" or "b"
    src: list[int]
    dst: list[int]
    expect_first: bool


def run_concurrently(reqs: Sequence[Req], dw: StreamWorker, pws: dict[str, StreamWorker], addrs: dict[str, str],
                     engines: dict[str, str]) -> None:
    """Each request's Expect and Publish from its own thread, in the request's arrival order."""
    def go(r: Req) -> None:
        pw = pws[r.prefill]
        if r.expect_first:
            dw.send(Expect(r.tid, tuple(r.dst), addrs[r.prefill], engines[r.prefill], 1))
            pw.send(Publish(r.tid, tuple(r.src)))
        else:
            pw.send(Publish(r.tid, tuple(r.src)))
            dw.send(Expect(r.tid, tuple(r.dst), addrs[r.prefill], engines[r.prefill], 1))

    threads = [threading.Thread(target=go, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)


def make_reqs(rng: random.Random, prefills: Sequence[str], n: int, per: int, src_blocks: int,
              dst_pool: list[int], tag: str) -> list[Req]:
    reqs = []
    for i in range(n):
        reqs.append(Req(f"{tag}-{i}", prefills[i % len(prefills)], rng.sample(range(src_blocks), per),
                        [dst_pool.pop() for _ in range(per)], rng.random() < 0.5))
    reqs[0].expect_first, reqs[1].expect_first = True, False  # both orders, whatever the seed
    return reqs


# -- tests ----------------------------------------------------------------------------------------------


def test_1p1d_across_namespaces_both_orders(cluster: Cluster) -> None:
    lab, ds = cluster.lab, cluster.d
    p, d = ds["a"], ds["d"]
    assert p.client.status().peer_address == f"{lab.addrs[0]}:{PORT}"
    src = make_kv("kvpushd-netns-src", regions=4, num_blocks=256, block_len=4096, seed=1)
    dst = make_kv("kvpushd-netns-dst", regions=4, num_blocks=256, block_len=4096, fill="poison")
    pw = dw = None
    try:
        pw = p.client.attach("prefill-a", Role.PRODUCER, 0, 1, [src.buf.memory], src.region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        assert pw.peer_address == p.peer_address  # the namespace's address, not loopback
        p0, d0 = p.client.status().counters, d.client.status().counters
        link0 = lab.link_stats(2)

        # Decode registers first: the prefill daemon WRITEs when Publish arrives.
        dw.send(Expect("reg-first", (10, 11, 12, 200), p.peer_address, "prefill-a", 1))
        assert wait_for(lambda: any(t.transfer_id == "reg-first" for t in p.client.status().transfers))
        pw.send(Publish("reg-first", (1, 2, 3, 40)))
        assert collect(dw, {"reg-first"})["reg-first"].kind is CompletionKind.FINISHED_RECEIVING
        assert collect(pw, {"reg-first"})["reg-first"].kind is CompletionKind.FINISHED_SENDING
        # Prefill publishes first: the WRITE fires when the registration crosses the network.
        pw.send(Publish("pub-first", (7, 8)))
        assert wait_for(lambda: any(t.transfer_id == "pub-first" for t in p.client.status().transfers))
        dw.send(Expect("pub-first", (30, 5), p.peer_address, "prefill-a", 1))
        assert collect(dw, {"pub-first"})["pub-first"].kind is CompletionKind.FINISHED_RECEIVING
        assert collect(pw, {"pub-first"})["pub-first"].kind is CompletionKind.FINISHED_SENDING
        check_blocks(src, dst, [1, 2, 3, 40], [10, 11, 12, 200])
        check_blocks(src, dst, [7, 8], [30, 5])

        # Many at once, in both orders, to fragmented destination blocks.
        rng = random.Random(11)
        pool = rng.sample(range(dst.num_blocks), dst.num_blocks)
        pool = [b for b in pool if b not in (10, 11, 12, 200, 30, 5)]
        reqs = make_reqs(rng, ["a"], 24, 8, src.num_blocks, pool, "many")
        run_concurrently(reqs, dw, {"a": pw}, {"a": p.peer_address}, {"a": "prefill-a"})
        ids = {r.tid for r in reqs}
        recv, sent = collect(dw, ids), collect(pw, ids)
        assert {c.kind for c in recv.values()} == {CompletionKind.FINISHED_RECEIVING}
        assert {c.kind for c in sent.values()} == {CompletionKind.FINISHED_SENDING}
        for r in reqs:
            check_blocks(src, dst, r.src, r.dst)
        check_poison_elsewhere(dst, {10, 11, 12, 200, 30, 5} | {b for r in reqs for b in r.dst})

        for x in (p, d):
            assert wait_for(lambda x=x: list(x.client.status().transfers) == [])
        p1, d1 = p.client.status().counters, d.client.status().counters
        n = len(reqs) + 2
        assert p1.writes_posted - p0.writes_posted == n
        assert d1.notifications_received - d0.notifications_received == n
        moved = p1.bytes_written - p0.bytes_written
        assert moved == sum(len(r.src) for r in reqs) * 4 * 4096 + 6 * 4 * 4096
        # The KV bytes crossed the decode namespace's veth (UCX over TCP between namespaces).
        assert lab.link_stats(2)["rx_bytes"] - link0["rx_bytes"] >= moved
    finally:
        for w in (pw, dw):
            if w is not None:
                w.detach()
        src.close()
        dst.close()


def test_2p1d_two_prefill_namespaces_alternating(cluster: Cluster) -> None:
    lab, ds = cluster.lab, cluster.d
    pa, pb, d = ds["a"], ds["b"], ds["d"]
    srcs = {"a": make_kv("kvpushd-netns-srca", regions=4, num_blocks=128, block_len=4096, seed=2),
            "b": make_kv("kvpushd-netns-srcb", regions=4, num_blocks=128, block_len=4096, seed=3)}
    dst = make_kv("kvpushd-netns-dst", regions=4, num_blocks=256, block_len=4096, fill="poison")
    pws: dict[str, StreamWorker] = {}
    dw = None
    try:
        pws["a"] = pa.client.attach("prefill-a", Role.PRODUCER, 0, 1, [srcs["a"].buf.memory], srcs["a"].region_list)
        pws["b"] = pb.client.attach("prefill-b", Role.PRODUCER, 0, 1, [srcs["b"].buf.memory], srcs["b"].region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        c0 = {k: ds[k].client.status().counters for k in ("a", "b", "d")}
        tx0 = {k: lab.link_stats(i)["tx_bytes"] for k, i in (("a", 0), ("b", 1))}

        rng = random.Random(5)
        pool = rng.sample(range(dst.num_blocks), dst.num_blocks)
        reqs = make_reqs(rng, ["a", "b"], 32, 6, 128, pool, "alt")  # even: node A, odd: node B
        assert {r.prefill for r in reqs[0::2]} == {"a"} and {r.prefill for r in reqs[1::2]} == {"b"}
        run_concurrently(reqs, dw, pws, {"a": pa.peer_address, "b": pb.peer_address},
                         {"a": "prefill-a", "b": "prefill-b"})
        recv = collect(dw, {r.tid for r in reqs})
        assert {c.kind for c in recv.values()} == {CompletionKind.FINISHED_RECEIVING}
        for k in ("a", "b"):
            sent = collect(pws[k], {r.tid for r in reqs if r.prefill == k})
            assert {c.kind for c in sent.values()} == {CompletionKind.FINISHED_SENDING}
        for r in reqs:
            check_blocks(srcs[r.prefill], dst, r.src, r.dst)
        check_poison_elsewhere(dst, {b for r in reqs for b in r.dst})
        for k in ("a", "b", "d"):
            assert wait_for(lambda k=k: list(ds[k].client.status().transfers) == [])
        c1 = {k: ds[k].client.status().counters for k in ("a", "b", "d")}
        assert c1["a"].writes_posted - c0["a"].writes_posted == 16
        assert c1["b"].writes_posted - c0["b"].writes_posted == 16
        assert c1["d"].notifications_received - c0["d"].notifications_received == 32
        for k, i in (("a", 0), ("b", 1)):  # each prefill namespace sent its share over its own veth
            assert lab.link_stats(i)["tx_bytes"] - tx0[k] >= c1[k].bytes_written - c0[k].bytes_written > 0
    finally:
        for w in [*pws.values(), dw]:
            if w is not None:
                w.detach()
        for kv in (*srcs.values(), dst):
            kv.close()


def test_kill9_one_prefill_daemon_mid_run(cluster: Cluster) -> None:
    """Node A's daemon is SIGKILLed with registrations pending on it: those and later requests to A end
    FAILED (TIMEOUT / PEER_UNREACHABLE) within the short timeouts; node B's requests, before, during and
    after, all succeed; the decode daemon is left with nothing pending."""
    # Fresh daemons with short timeouts for the prefill node that dies and for the decode node; node B
    # is the shared one (normal timeouts), which now serves a second decode node.
    pa, d = daemons = cluster.start(["a2", "d2"], FAST)
    pb = cluster.d["b"]
    srcs = {"a": make_kv("kvpushd-netns-srca", regions=2, num_blocks=128, block_len=4096, seed=4),
            "b": make_kv("kvpushd-netns-srcb", regions=2, num_blocks=128, block_len=4096, seed=5)}
    dst = make_kv("kvpushd-netns-dst", regions=2, num_blocks=256, block_len=4096, fill="poison")
    pws: dict[str, StreamWorker] = {}
    addrs = {"a": pa.peer_address, "b": pb.peer_address}
    engines = {"a": "prefill-a", "b": "prefill-b"}
    try:
        for k, x in (("a", pa), ("b", pb)):
            pws[k] = x.client.attach(engines[k], Role.PRODUCER, 0, 1, [srcs[k].buf.memory], srcs[k].region_list)
        dw = d.client.attach("decode", Role.CONSUMER, 0, 1, [dst.buf.memory], dst.region_list)
        rng = random.Random(9)
        pool = rng.sample(range(dst.num_blocks), dst.num_blocks)

        # Before: both prefill nodes serve.
        before = make_reqs(rng, ["a", "b"], 8, 4, 128, pool, "before")
        run_concurrently(before, dw, pws, addrs, engines)
        recv = collect(dw, {r.tid for r in before})
        assert {c.kind for c in recv.values()} == {CompletionKind.FINISHED_RECEIVING}
        for k in ("a", "b"):
            sent = collect(pws[k], {r.tid for r in before if r.prefill == k})
            assert {c.kind for c in sent.values()} == {CompletionKind.FINISHED_SENDING}
        ok = list(before)

        # Node B keeps serving from a thread while node A dies under it.
        during = make_reqs(rng, ["b"], 12, 4, 128, pool, "during-b")
        b_errors: list[BaseException] = []

        def b_load() -> None:
            try:
                for r in during:
                    run_concurrently([r], dw, pws, addrs, engines)
                    time.sleep(0.1)
            except BaseException as e:
                b_errors.append(e)

        # Registered on A, never published: A dies holding them.
        stranded = [Req(f"stranded-{i}", "a", [], [pool.pop() for _ in range(4)], True) for i in range(3)]
        for r in stranded:
            dw.send(Expect(r.tid, tuple(r.dst), addrs["a"], engines["a"], 1))
        assert wait_for(lambda: {t.transfer_id for t in pa.client.status().transfers}
                        >= {r.tid for r in stranded}), pa.client.status().transfers
        loader = threading.Thread(target=b_load)
        loader.start()
        time.sleep(0.3)
        t_kill = time.monotonic()
        pa.proc.send_signal(signal.SIGKILL)
        assert pa.proc.wait(10) == -signal.SIGKILL

        # After: requests alternate between A (dead) and B.
        after = make_reqs(rng, ["a", "b"], 8, 4, 128, pool, "after")
        for r in after:
            if r.prefill == "b":
                run_concurrently([r], dw, pws, addrs, engines)
            else:  # A's worker cannot publish any more; decode still expects from A
                dw.send(Expect(r.tid, tuple(r.dst), addrs["a"], engines["a"], 1))
                with pytest.raises(KVPushError):
                    pws["a"].send(Publish(r.tid, tuple(r.src)))
        loader.join(60)
        assert not loader.is_alive() and not b_errors, b_errors
        ok += during + [r for r in after if r.prefill == "b"]
        failed = stranded + [r for r in after if r.prefill == "a"]

        got = collect(dw, {r.tid for r in ok + failed if not r.tid.startswith("before")}, timeout=30)
        elapsed = time.monotonic() - t_kill
        for r in ok:
            if r.tid in got:
                assert got[r.tid].kind is CompletionKind.FINISHED_RECEIVING, got[r.tid]
            check_blocks(srcs[r.prefill], dst, r.src, r.dst)
        codes = {}
        for r in failed:
            c = got[r.tid]
            assert c.kind is CompletionKind.FAILED, c
            assert c.code in ("PEER_UNREACHABLE", "TIMEOUT"), c
            assert sorted(c.block_ids) == sorted(r.dst), c
            codes[r.tid] = c.code
        assert elapsed < 20, f"failures took {elapsed:.1f} s after the kill (expect_timeout_s is 3)"
        check_poison_elsewhere(dst, {b for r in ok for b in r.dst})

        # Node B's side is whole, and nothing is left pending on the decode node.
        sent_b = collect(pws["b"], {r.tid for r in ok if r.prefill == "b" and not r.tid.startswith("before")})
        assert {c.kind for c in sent_b.values()} == {CompletionKind.FINISHED_SENDING}
        assert wait_for(lambda: list(d.client.status().transfers) == [], timeout=10), \
            d.client.status().transfers
        assert wait_for(lambda: list(pb.client.status().transfers) == [], timeout=10)
        st = d.client.status()
        assert st.counters.transfers_failed == len(failed)  # a fresh daemon: exactly A's requests failed
        assert st.counters.transfers_finished == len(ok)
        assert not pws["a"].alive  # A's worker saw its daemon's session end

        # The decode daemon still serves B afterwards.
        last = make_reqs(rng, ["b", "b"], 2, 4, 128, pool, "last")
        run_concurrently(last, dw, pws, addrs, engines)
        assert {c.kind for c in collect(dw, {r.tid for r in last}).values()} == {CompletionKind.FINISHED_RECEIVING}
        for r in last:
            check_blocks(srcs["b"], dst, r.src, r.dst)
        print(f"kill -9 of {pa.name}: codes {codes}, failures done {elapsed:.1f} s after the kill")
        dw.detach()
        stop_all([d])  # the decode daemon drains and exits cleanly
    except BaseException:
        for x in (*daemons, pb):
            print(f"--- {x.name} log tail ---\n{x.logs()[-4000:]}")
        raise
    finally:
        if "b" in pws:
            pws["b"].detach()  # node B is shared with other tests
        for x in daemons:
            if x.proc.poll() is None:
                x.proc.kill()
                x.proc.wait(10)
        for kv in (*srcs.values(), dst):
            kv.close()


def test_pair_of_several_veths_each_carries_its_own_subnet() -> None:
    """``NetnsLab(2, link="pair", veths=3)``: three veth pairs, each its own /24, each shaped; datagrams
    to host 1's address on pair k cross pair k's veth only (the rails bench counts bytes per veth so)."""
    with NetnsLab(2, link="pair", veths=3) as lab:
        lab.shape("100mbit")
        assert lab.veths == [VETH, "kvp1", "kvp2"]
        assert len({a.rsplit(".", 1)[0] for a, _ in lab.link_addrs}) == 3
        for dev in lab.veths:
            qdisc = lab.run(0, ["tc", "qdisc", "show", "dev", dev]).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc, qdisc
        for k, dev in enumerate(lab.veths):
            before = {d: lab.link_stats(0, d)["tx_packets"] for d in lab.veths}
            lab.run(0, [sys.executable, "-c", "import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                        f"for _ in range(5): s.sendto(b'x' * 100, ('{lab.link_addrs[k][1]}', 9))"])
            grew = {d for d in lab.veths if lab.link_stats(0, d)["tx_packets"] - before[d] >= 3}
            assert grew == {dev}, (k, grew)
