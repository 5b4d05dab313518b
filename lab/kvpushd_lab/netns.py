"""Network namespaces as "hosts": N of them on a private subnet that exists only inside them.

Used by the multi-host tests (tests/lab/test_netns.py) and by ``kvpushd demo --hosts netns``. Needs root
(CAP_NET_ADMIN and CAP_SYS_ADMIN) and iproute2; ``available()`` says why not where it cannot work.

    ok, why = available()            # (False, reason) where namespaces cannot be made: tests skip
    with NetnsLab(3) as lab:         # kvp-<pid>-<k>-0..2 plus kvp-<pid>-<k>-br
        lab.addrs[0]                 # "10.199.<x>.1"
        lab.run(0, ["ip", "addr"])   # `ip netns exec kvp-<pid>-<k>-0 ip addr`
        proc = lab.popen(0, [sys.executable, "-m", "kvpushd", "serve", ...])  # dies with this process
        lab.link_stats(1)            # rx/tx bytes of host 1's veth: what crossed the "network"

Layout (nothing is created or configured in the root namespace, and the host's routes are never touched):

    kvp-P-K-br:  br0 (bridge, no address)  +  p0 .. p<N-1>  (veth ends, enslaved to br0)
    kvp-P-K-i:   lo (up)  +  kvp0 (the other end of p<i>), address 10.199.<x>.<i+1>/24

``NetnsLab(2, link="pair")`` joins two hosts by one veth pair instead (``kvp0`` in each, no bridge
namespace): the shortest "network" there is; ``NetnsLab(2, link="pair", veths=N)`` by N of them
(``kvp0`` .. ``kvp<N-1>``, pair k on 10.<199-k>.<x>.0/24: N rails). ``lab.shape("10gbit")`` puts a
``tc tbf`` on every veth end inside the hosts (each end shapes what it sends).

Each veth pair is created inside the bridge namespace with its peer born in the host namespace
(``ip -n BR link add p<i> type veth peer name kvp0 netns HOST``), so no link ever appears in the root
namespace. Teardown kills whatever still runs in the namespaces (only processes started in them,
which are ours), then deletes the namespaces, which removes every link with them. It is idempotent,
runs from ``atexit`` too, and ``sweep_stale()`` removes what a killed earlier run (dead pid) left.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from typing import Any

PREFIX = "kvp"
VETH = "kvp0"  # the interface name inside every host namespace
_STALE = re.compile(rf"^{PREFIX}-(\d+)-\d+-(?:\d+|br)$")
_counter = itertools.count()
_available: tuple[bool, str] | None = None


def _ip(*args: str, check: bool = True, timeout: float = 10.0) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {p.returncode}: {p.stderr.strip()}")
    return p


def wait_running(ns: str, dev: str, timeout_s: float = 10.0) -> None:
    """Wait until ``dev`` in ``ns`` is RUNNING (operstate UP: the peer is up and the kernel's link watch
    has said so), which can come a while after ``ip link set up`` returns. Until then getifaddrs() leaves
    IFF_RUNNING out, and libfabric's tcp provider, told ``FI_TCP_IFACE=dev``, finds no address to listen
    on (its endpoint fails to enable with EBADF)."""
    deadline = time.monotonic() + timeout_s
    while True:
        link = json.loads(_ip("-n", ns, "-j", "link", "show", "dev", dev).stdout)[0]
        if link.get("operstate") == "UP" and "LOWER_UP" in link.get("flags", ()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{ns}: {dev} not running {timeout_s:.0f} s after it was set up: "
                               f"operstate {link.get('operstate')}, flags {link.get('flags')}")
        time.sleep(0.02)


def _netns_names() -> set[str]:
    p = _ip("netns", "list", check=False)
    return {line.split()[0] for line in p.stdout.splitlines() if line.strip()}


def available() -> tuple[bool, str]:
    """Whether this process can create namespaces, a bridge and veths, and exec in them (cached)."""
    global _available
    if _available is not None:
        return _available
    if shutil.which("ip") is None:
        _available = (False, "iproute2 `ip` not found on PATH")
    else:
        lab = NetnsLab(1)
        try:
            lab.setup()
            p = lab.run(0, ["true"], check=False)
            if p.returncode != 0:
                raise RuntimeError(f"`ip netns exec` failed: {p.stderr.strip()}")
            _available = (True, "")
        except Exception as e:  # any failure means: skip, saying why
            who = "" if os.geteuid() == 0 else f"not root (euid {os.geteuid()}), "
            _available = (False, f"{who}cannot create network namespaces here: {e}")
        finally:
            try:
                lab.teardown()
            except RuntimeError as e:
                _available = (False, f"cannot delete a probe namespace: {e}")
    return _available


def enter(name: str) -> None:
    """Move the calling thread (call it first thing, in a fresh process) into network namespace ``name``."""
    import ctypes

    clone_newnet = 0x40000000
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into network namespace {name}: {os.strerror(err)}")
    finally:
        os.close(fd)


def enter_host(name: str) -> None:
    """``enter(name)``, then a private mount namespace with this network namespace's /sys, as ``ip netns
    exec`` makes: libraries that list network devices under /sys/class/net (UCX) see the namespace's.
    Call it first thing in a fresh process, while it has one thread."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    enter(name)
    clone_newns, ms_rec, ms_slave, mnt_detach = 0x00020000, 0x4000, 0x80000, 2

    def check(what: str, rc: int) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} for network namespace {name}: {os.strerror(err)}")

    check("unshare(CLONE_NEWNS)", libc.unshare(clone_newns))
    check("mount / rslave", libc.mount(b"none", b"/", None, ms_rec | ms_slave, None))
    check("umount /sys", libc.umount2(b"/sys", mnt_detach))
    check("mount sysfs", libc.mount(name.encode(), b"/sys", b"sysfs", 0, None))


def same_netns(pid: int, name: str) -> bool:
    """Whether process ``pid`` lives in network namespace ``name``."""
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return False


def sweep_stale() -> list[str]:
    """Delete namespaces that a dead earlier run of these tests left behind (its pid is gone)."""
    removed = []
    for name in sorted(_netns_names()):
        m = _STALE.match(name)
        if m is None or int(m.group(1)) == os.getpid() or os.path.exists(f"/proc/{m.group(1)}"):
            continue
        _kill_pids(name)
        if _ip("netns", "del", name, check=False).returncode == 0:
            removed.append(name)
    return removed


def _kill_pids(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns`` (each one was started there by a test)."""
    p = _ip("netns", "pids", ns, check=False)
    pids = [int(x) for x in p.stdout.split() if x.isdigit()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)]
        time.sleep(0.02)


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


class NetnsLab:
    """``n`` host namespaces joined by a bridge in its own namespace (or, ``link="pair"``, two joined
    by ``veths`` veth pairs), on 10.199.<x>.0/24 (pair k of several on 10.<199-k>.<x>.0/24)."""

    MAX_HOSTS = 16
    MAX_VETHS = 8

    def __init__(self, n: int, subnet_octet: int | None = None, link: str = "bridge", veths: int = 1) -> None:
        if not 1 <= n <= self.MAX_HOSTS:
            raise ValueError(f"1..{self.MAX_HOSTS} namespaces, not {n}")
        if link not in ("bridge", "pair") or (link == "pair" and n != 2):
            raise ValueError(f"link is \"bridge\" (any n) or \"pair\" (n = 2), not {link!r} with n = {n}")
        if not 1 <= veths <= (self.MAX_VETHS if link == "pair" else 1):
            raise ValueError(f"veths: 1 with a bridge, 1..{self.MAX_VETHS} with a pair, not {veths}")
        self.link = link
        k = next(_counter)
        base = f"{PREFIX}-{os.getpid()}-{k}"
        self.n = n
        self.names = [f"{base}-{i}" for i in range(n)]
        self.bridge_ns = f"{base}-br"
        # The subnet lives only inside these namespaces; the third octet just tells labs apart in logs.
        x = subnet_octet if subnet_octet is not None else 1 + (os.getpid() + k) % 250
        self.subnet = f"10.199.{x}.0/24"
        self.addrs = [f"10.199.{x}.{i + 1}" for i in range(n)]
        self.veth = VETH
        self.veths = [VETH] + [f"{PREFIX}{k}" for k in range(1, veths)]
        self.link_addrs = [[f"10.{199 - k}.{x}.{i + 1}" for i in range(n)] for k in range(veths)]  # per veth
        self._created: list[str] = []
        self._torn_down = False
        atexit.register(self.teardown)

    # -- lifecycle ---------------------------------------------------------------------------------

    def setup(self) -> NetnsLab:
        if self.link == "pair":
            return self._setup_pair()
        try:
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "lo", "up")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, ns in enumerate(self.names):
                self._add_ns(ns)
                port = f"p{i}"
                _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", VETH, "netns", ns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", port, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "addr", "add", f"{self.addrs[i]}/24", "dev", VETH)
                _ip("-n", ns, "link", "set", VETH, "up")
            for ns in self.names:
                wait_running(ns, VETH)
        except BaseException:
            self.teardown()
            raise
        return self

    def _setup_pair(self) -> NetnsLab:
        """Two host namespaces, veth pairs between them (each born in host 0, its peer moved to host 1)."""
        try:
            for ns in self.names:
                self._add_ns(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            for dev, addrs in zip(self.veths, self.link_addrs, strict=True):
                _ip("-n", self.names[0], "link", "add", dev, "type", "veth", "peer", "name", dev, "netns",
                    self.names[1])
                for ns, addr in zip(self.names, addrs, strict=True):
                    _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                    _ip("-n", ns, "link", "set", dev, "up")
            for ns in self.names:
                for dev in self.veths:
                    wait_running(ns, dev)
        except BaseException:
            self.teardown()
            raise
        return self

    def shape(self, rate: str, burst: str = "4mb", latency: str = "100ms") -> NetnsLab:
        """``tc tbf`` at ``rate`` on every veth end inside the hosts: each end shapes what it sends."""
        for i in range(self.n):
            for dev in self.veths:
                self.run(i, ["tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", burst,
                             "latency", latency], timeout=10.0)
        return self

    def _add_ns(self, ns: str) -> None:
        self._created.append(ns)  # before: a half-made namespace is deleted too
        _ip("netns", "add", ns)

    def teardown(self) -> None:
        """Kill what runs inside, delete every namespace (and so every link). Idempotent."""
        if self._torn_down:
            return
        self._torn_down = True
        errors = []
        for ns in reversed(self._created):
            _kill_pids(ns)
            p = _ip("netns", "del", ns, check=False)
            if p.returncode != 0 and ns in _netns_names():
                errors.append(f"{ns}: {p.stderr.strip()}")
        self._created.clear()
        atexit.unregister(self.teardown)
        if errors:
            raise RuntimeError("netns teardown failed: " + "; ".join(errors))

    def __enter__(self) -> NetnsLab:
        return self.setup()

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    # -- running things inside -----------------------------------------------------------------------

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]

    def run(self, i: int, argv: Sequence[str], check: bool = True, timeout: float = 30.0,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(i, argv), capture_output=True, text=True, check=check, timeout=timeout,
                              **kw)

    def popen(self, i: int, argv: Sequence[str], die_with_parent: bool = True, **kw: Any) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside namespace ``i``; ``ip netns exec`` execs it, so the pid is the program's.

        ``die_with_parent``: SIGKILL it when the thread that started it exits (``setpriv --pdeathsig``,
        where util-linux has it), so a killed test run leaves no daemon behind. Call from a thread that
        outlives the process, e.g. the main thread.
        """
        if die_with_parent and shutil.which("setpriv"):
            argv = ["setpriv", "--pdeathsig", "KILL", "--", *argv]
        return subprocess.Popen(self.argv(i, argv), **kw)

    def link_stats(self, i: int, dev: str = VETH) -> dict[str, int]:
        """rx/tx byte and packet counters of namespace ``i``'s veth ``dev`` (the first: ``kvp0``)."""
        p = _ip("-n", self.names[i], "-s", "-j", "link", "show", "dev", dev)
        s = json.loads(p.stdout)[0]["stats64"]
        return {"rx_bytes": s["rx"]["bytes"], "tx_bytes": s["tx"]["bytes"],
                "rx_packets": s["rx"]["packets"], "tx_packets": s["tx"]["packets"]}
