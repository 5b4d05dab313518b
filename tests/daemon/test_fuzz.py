"""Fuzzing a live daemon pair while correct prefill -> decode transfers run alongside.

Malformed and random requests go to both daemons on the worker API (unix socket: WorkerService,
StatusService) and the peer API (TCP: PeerService), as raw bytes and as Hypothesis-generated protobuf
messages built from the .proto descriptors (so new fields, RPCs and stream items are fuzzed too):
random and 1 MiB strings, uint32/uint64 edge values, empty and huge block lists (up to 1 Mi ids),
unknown worker and caller ids, wrong protocol versions and compatibility hashes, absurd region tables, agent metadata
garbage, attaches with up to 4096 regions. Meanwhile a background thread keeps running correct transfers
between the real prefill and decode workers (expect first and publish first) and checks each one
finishes with the exact bytes.

Targets, in this order: peer_raw, worker_raw (bytes on the wire), peer_msg, worker_msg, attach (random
messages), cross_peer (one peer registers another daemon's consumer agent with a forged region table:
refused with PERMISSION_DENIED, and that daemon's own transfer must still land on exactly its blocks),
agent (registrations of a real NIXL agent of the fuzzer's own, named as the calling origin's agents must
be, with its metadata sometimes mutated and absurd region tables around the buffer it registered,
matched by a publish, sometimes with the consumer's daemon "restarting" while the WRITE is in flight:
NIXL must refuse every descriptor outside that buffer, nothing around it may change, a WRITE inside the
real table must land the exact bytes, and the daemon must survive it; and replays of the real decode
daemon's captured agent by a fake origin, which must be refused with PERMISSION_DENIED).

The streams are the only transfer APIs (protocol 5): the peer API's Channel gets raw bytes on a
stream with a live session (peer_raw), and PeerBatches of items of every kind (peer_msg), with the
stream's instance in metadata known or not, duplicate seqs and batches over the item limit: a stream
without a session must be refused, and every item of one with a session answered once by seq, none
INTERNAL. The fuzz workers attach with plain Attach calls and the fuzzer drives their Streams itself
(``RawWorker``): drawn commands in batches (worker_msg), each answered once by seq, none INTERNAL;
raw bytes and drawn first batches go on Streams of their own (worker_raw, worker_msg).

Every fuzzed call (and stream item) must come back within 10 s with a status that is not INTERNAL or
UNKNOWN. A request
that grpc itself cannot parse comes back UNKNOWN ("Unexpected <class ...DecodeError>", logged by grpc
as "Unexpected [DecodeError] raised by servicer method") before any daemon code runs: that one is
accepted. At the end the correct traffic must all have succeeded, every Publish and Expect the fuzzer
got accepted must have ended with a completion (and no refused one with any), nothing may be pending in
either daemon, no worker or Watch subscription may be left over, both daemons must still be alive and
stop on SIGTERM within 15 s with exit 0, and their logs may hold no sign of an unhandled error.

Helpers of the fuzzer, outside the daemons:
- a fake peer daemon (a gRPC server in this process) that the fuzzer names as the peer address of its
  handshakes and as a producer address: failure notices, withdrawals and registrations then go
  somewhere that answers at once, and its Channel captures a real consumer agent's NIXL metadata
  (the decode daemon's: what cross_peer and the agent target's replays forge);
- a few real NIXL agents in this process (UCX, no progress thread: the agent target drives them), each
  with a registered host buffer between guard bytes, used in turn by the agent target's origins (their
  instance ids share the 8 characters the daemon names a peer's agents by), so that registrations with
  absurd region tables get past the daemon's checks of the agent's name and metadata and reach NIXL;
- a memory guard (RLIMIT_AS = current size + 1.5 GiB on each daemon): a request that makes a daemon
  allocate without bound fails with MemoryError (INTERNAL, reported) instead of driving the machine
  out of memory;
- a time budget per target, so the file stays around a minute and a half even when a bug makes each
  example slow (per-target counts, call time, refusal reasons and completions are printed with
  `pytest -s`, and on failure; the daemon logs of a failed run are kept and their path is printed).

Examples are derandomized (the same every run); KVPUSHD_FUZZ_RANDOM=1 draws new ones,
KVPUSHD_FUZZ_EXAMPLES / KVPUSHD_FUZZ_BUDGET_S change how many and for how long, and
KVPUSHD_FUZZ_TARGETS=peer_msg,agent (comma-separated) runs only some targets.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import random
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from google.protobuf import descriptor as pb_descriptor
from google.protobuf import message_factory, text_format
from google.protobuf.message import Message
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from kvpushd_client import Attach, Completion, CompletionKind, Expect, Publish, Role, _convert
from kvpushd_client.handover import hand_over
from kvpushd_client.proto.v1 import common_pb2, peer_pb2, status_pb2, worker_pb2, worker_pb2_grpc
from support import KV, POISON, DaemonProc, attach_pair, make_kv, wait_for

from kvpushd import PROTOCOL_VERSION
from kvpushd.core import notif
from kvpushd.runtime.identity import agent_prefix, metadata_agent_name

CALL_TIMEOUT = 10.0  # a fuzzed call not answered within this is a hang
MAX_MSG = 64 << 20  # the daemons' default peer_api.max_message_bytes
OPTS = [("grpc.max_send_message_length", MAX_MSG), ("grpc.max_receive_message_length", MAX_MSG)]
EXAMPLES = int(os.environ.get("KVPUSHD_FUZZ_EXAMPLES", "150"))
BUDGET_S = float(os.environ.get("KVPUSHD_FUZZ_BUDGET_S", "6"))  # per target
GUARD_BYTES = 1536 << 20
SLOW_S = 3.0
ORIGIN_NODE = "fuzz-origin"  # the node id of the fuzzer's fake origins (their agents: agent_prefix())

FD = pb_descriptor.FieldDescriptor
PEER_SVC = peer_pb2.DESCRIPTOR.services_by_name["PeerService"]
WORKER_SVC = worker_pb2.DESCRIPTOR.services_by_name["WorkerService"]
STATUS_SVC = status_pb2.DESCRIPTOR.services_by_name["StatusService"]
HASH = notif.compat_hash()

# fuzz workers' memory: separate from the real pair's, so fuzzed WRITEs can never touch it
F_REGIONS, F_BLOCKS, F_BLOCK_LEN = 2, 32, 1024

FUZZ_SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
    derandomize=os.environ.get("KVPUSHD_FUZZ_RANDOM") != "1", print_blob=False,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.filter_too_much, HealthCheck.large_base_example])


# ------------------------------------------------------------------------------------------------
# Strategies

U32_EDGES = [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 64, 255, 256, 4095, 4096, 65535, 65536, 1 << 24,
             2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1]
U64_EDGES = [*U32_EDGES, 2**32, 2**40, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 4096, 2**64 - 2, 2**64 - 1]
I32_EDGES = [0, 1, -1, 2, 99, -99, 2**31 - 1, -(2**31)]
U32 = st.one_of(st.sampled_from(U32_EDGES), st.integers(0, 2**32 - 1))
U64 = st.one_of(st.sampled_from(U64_EDGES), st.integers(0, 2**64 - 1))
I32 = st.one_of(st.sampled_from(I32_EDGES), st.integers(-(2**31), 2**31 - 1))
I64 = st.one_of(st.sampled_from([0, -1, 2**63 - 1, -(2**63)]), st.integers(-(2**63), 2**63 - 1))
SPECIAL_STRINGS = ["", " ", ".", "..", "/", "a.b", "../etc/passwd", "\x00", "a\x00b", "\t", "%s%n", "${HOME}",
                   "é", "\u202e", "\U0001f600", "kvp1:1:0", "127.0.0.1:1", "unix:/tmp/x", "dns:///", "[::1]:0",
                   "x" * 129, "t" * 257, "y" * 5000]
TEXT = st.one_of(st.text(max_size=40), st.sampled_from(SPECIAL_STRINGS))
BIG_TEXT = st.one_of(TEXT, st.just("z" * (1 << 20)))  # 1 MiB: what a peer may make a daemon keep
TP = st.one_of(st.just(1), st.just(1), st.integers(0, 4), st.sampled_from([65536, 1 << 24, 2**31, 2**32 - 1]), U32)
BIG_STRING = 64 << 10
TIDS = st.one_of(st.sampled_from([f"t{i}" for i in range(6)]), TEXT)  # a small pool, so calls collide


def mostly(value: Any, other: st.SearchStrategy[Any], one_in: int = 4) -> st.SearchStrategy[Any]:
    """``value``, except one time in ``one_in`` one of ``other``."""
    return st.integers(1, one_in).flatmap(lambda i: other if i == 1 else st.just(value))


def pool(items: list[Any]) -> st.SearchStrategy[Any]:
    """One of a list that may still grow (read when drawn)."""
    return st.integers(0, 2**16).map(lambda i: items[i % len(items)])


def is_repeated(f: pb_descriptor.FieldDescriptor) -> bool:
    rep = getattr(f, "is_repeated", None)
    return bool(rep) if rep is not None else f.label == FD.LABEL_REPEATED


def scalar(f: pb_descriptor.FieldDescriptor) -> st.SearchStrategy[Any]:
    t = f.type
    if t in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return U32
    if t in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return U64
    if t in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return I32
    if t in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return I64
    if t == FD.TYPE_ENUM:
        return st.one_of(st.sampled_from([v.number for v in f.enum_type.values]), I32)
    if t == FD.TYPE_BOOL:
        return st.booleans()
    if t == FD.TYPE_DOUBLE:
        return st.floats()
    if t == FD.TYPE_FLOAT:
        return st.floats(width=32)
    if t == FD.TYPE_STRING:
        return TEXT
    if t == FD.TYPE_BYTES:
        return st.binary(max_size=64)
    raise AssertionError(f"field type {t}")


@st.composite
def messages(draw: st.DrawFn, desc: pb_descriptor.Descriptor,
             overrides: dict[str, st.SearchStrategy[Any]] | None = None, depth: int = 0) -> Message:
    """Any message of this type: every field set or not, with edge values. Fields named in ``overrides``
    are drawn from there, and set more often (a request must get past the first check to reach deeper)."""
    msg = message_factory.GetMessageClass(desc)()
    overrides = overrides or {}
    for f in desc.fields:
        if not draw(st.integers(0, 7) if f.name in overrides else st.integers(0, 1)):
            continue
        if f.name in overrides:
            value = draw(overrides[f.name])
            target = getattr(msg, f.name)
            if f.type == FD.TYPE_MESSAGE and not is_repeated(f):
                target.CopyFrom(value)
            elif is_repeated(f):
                target.extend(value)
            else:
                setattr(msg, f.name, value)
        elif f.type == FD.TYPE_MESSAGE:
            if depth >= 3 or f.message_type.GetOptions().map_entry:
                continue
            if is_repeated(f):
                for _ in range(draw(st.integers(0, 3))):
                    getattr(msg, f.name).add().CopyFrom(draw(messages(f.message_type, None, depth + 1)))
            else:
                getattr(msg, f.name).CopyFrom(draw(messages(f.message_type, None, depth + 1)))
        elif is_repeated(f):
            getattr(msg, f.name).extend(draw(st.lists(scalar(f), max_size=6)))
        else:
            setattr(msg, f.name, draw(scalar(f)))
    return msg


@st.composite
def raw_payloads(draw: st.DrawFn, desc: pb_descriptor.Descriptor) -> bytes:
    """Bytes on the wire: random, or a valid message of the right type cut, flipped or padded."""
    kind = draw(st.sampled_from(["random", "random", "flip", "cut", "tail", "empty", "dup", "varint"]))
    if kind == "random":
        return draw(st.binary(max_size=600))
    if kind == "empty":
        return b""
    if kind == "varint":  # a field header followed by an unterminated or over-long varint / length
        tag = draw(st.integers(1, 40)) << 3 | draw(st.sampled_from([0, 1, 2, 5, 3, 4, 6, 7]))
        return bytes([tag & 0x7F]) + b"\xff" * draw(st.integers(1, 12)) + draw(st.binary(max_size=8))
    base = bytearray(draw(messages(desc)).SerializeToString())
    if kind == "dup":
        return bytes(base + base)
    if not base:
        return draw(st.binary(min_size=1, max_size=32))
    if kind == "flip":
        for _ in range(draw(st.integers(1, 4))):
            base[draw(st.integers(0, len(base) - 1))] ^= 1 << draw(st.integers(0, 7))
        return bytes(base)
    if kind == "cut":
        return bytes(base[: draw(st.integers(0, len(base) - 1))])
    return bytes(base + draw(st.binary(min_size=1, max_size=32)))


@st.composite
def block_lists(draw: st.DrawFn, dense_max: int = F_BLOCKS) -> list[int]:
    kind = draw(st.sampled_from(["ok"] * 12 + ["empty", "dups", "edges", "big", "huge", "over"]))
    if kind == "ok":
        return draw(st.lists(st.integers(0, dense_max - 1), min_size=1, max_size=8, unique=True))
    if kind == "empty":
        return []
    if kind == "dups":
        return [draw(st.integers(0, 3))] * 2
    if kind == "edges":
        return draw(st.lists(st.sampled_from(U32_EDGES), min_size=1, max_size=4))
    if kind == "big":
        return list(range(draw(st.sampled_from([1000, 50_000]))))
    if kind == "huge":  # within max_blocks_per_request (256 Ki) and gRPC's message limit
        n = 1 << 18
        return list(range(n)) if draw(st.booleans()) else [0] * n
    return [0] * ((1 << 18) + 1)  # one over max_blocks_per_request


@st.composite
def region_tables(draw: st.DrawFn) -> list[peer_pb2.RemoteRegion]:
    kind = draw(st.sampled_from(["none", "random", "layout", "layout", "many"]))
    if kind == "none":
        return []
    if kind == "random":
        return draw(st.lists(messages(peer_pb2.RemoteRegion.DESCRIPTOR), max_size=5))
    if kind == "layout":  # the fuzz producer's region count and block_len: gets past check_regions
        r = peer_pb2.RemoteRegion(base_addr=draw(U64), num_blocks=draw(st.one_of(st.just(F_BLOCKS), U32)),
                                  block_len=F_BLOCK_LEN, block_stride=draw(st.one_of(st.just(F_BLOCK_LEN), U64)),
                                  device_id=draw(st.one_of(st.just(0), U32)))
        return [r] * F_REGIONS
    r = peer_pb2.RemoteRegion(base_addr=4096, num_blocks=draw(U32), block_len=draw(U64), block_stride=draw(U64))
    return [r] * draw(st.sampled_from([1000, 100_000]))


# ------------------------------------------------------------------------------------------------
# The fake peer daemon


class FakePeer(grpc.GenericRpcHandler):
    """Answers a Handshake and every Channel item at once; keeps the first consumer agent registered with it."""

    def __init__(self) -> None:
        self.instance = f"fake-{uuid.uuid4().hex}"
        self.captured: peer_pb2.AgentInfo | None = None
        self.calls: collections.Counter[str] = collections.Counter()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        name = details.method.rsplit("/", 1)[-1]
        if name == "Channel":  # every item answered OK at once
            return grpc.stream_stream_rpc_method_handler(self.channel)
        if name == "Handshake":
            return grpc.unary_unary_rpc_method_handler(lambda req, ctx: self.hello())
        return None

    def channel(self, requests: Any, ctx: Any) -> Any:
        self.calls["Channel"] += 1
        for raw in requests:
            out = peer_pb2.PeerBatch()
            for it in peer_pb2.PeerBatch.FromString(raw).items:
                kind = it.WhichOneof("item")
                self.calls[f"Channel.{kind}"] += 1
                if kind == "register" and it.register.consumer_agent.agent_metadata and self.captured is None:
                    self.captured = it.register.consumer_agent
                r = out.items.add(seq=it.seq).result
                r.code = "OK"
                if kind == "heartbeat":
                    r.heartbeat.instance_id = self.instance
                    r.heartbeat.knows_caller = True
            yield out.SerializeToString()

    def hello(self) -> bytes:
        self.calls["Handshake"] += 1
        return peer_pb2.HandshakeResponse(protocol_version=PROTOCOL_VERSION, compat_hash=HASH, node_id="fuzz-peer",
                                          instance_id=self.instance).SerializeToString()


class RawWorker:
    """A fuzz worker: attached with a plain Attach, its Stream driven here. The fuzzer's commands go out in
    batches of its choosing (seqs numbered here, so every answer is matched), the answers by seq, the
    completions as they come."""

    def __init__(self, chan: grpc.Channel, req: worker_pb2.AttachRequest) -> None:
        self.stub = stub = worker_pb2_grpc.WorkerServiceStub(chan)
        resp = stub.Attach(req, timeout=30)
        self.worker_id, self.token = resp.worker_id, resp.worker_token
        self._out: queue.SimpleQueue[worker_pb2.CommandBatch | None] = queue.SimpleQueue()
        self._out.put(worker_pb2.CommandBatch(worker_id=self.worker_id, worker_token=self.token))
        self._seq = itertools.count(1)
        self._cond = threading.Condition()
        self._results: dict[int, worker_pb2.CommandResult] = {}
        self._done: list[Completion] = []
        self.error: grpc.RpcError | None = None
        self._call = stub.Stream(iter(self._out.get, None))
        self._reader = threading.Thread(target=self._read, name=f"fuzz-{self.worker_id}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for ev in self._call:
                with self._cond:
                    self._results.update((r.seq, r) for r in ev.results)
                    self._done.extend(_convert.completion(c) for c in ev.completions)
                    self._cond.notify_all()
        except grpc.RpcError as e:
            self.error = e
        with self._cond:
            self._cond.notify_all()

    def batch(self, cmds: list[worker_pb2.Command],
              timeout: float = CALL_TIMEOUT) -> list[worker_pb2.CommandResult | None]:
        """One CommandBatch; each command's answer (None: none within ``timeout``)."""
        seqs = []
        for c in cmds:
            c.seq = next(self._seq)
            seqs.append(c.seq)
        self._out.put(worker_pb2.CommandBatch(commands=cmds))
        with self._cond:
            self._cond.wait_for(lambda: all(s in self._results for s in seqs) or self.error is not None, timeout)
            return [self._results.pop(s, None) for s in seqs]

    def command(self, **op: Message) -> worker_pb2.CommandResult | None:
        return self.batch([worker_pb2.Command(**op)])[0]  # type: ignore[arg-type]

    def completions(self) -> list[Completion]:
        with self._cond:
            out, self._done = self._done, []
        return out

    def detach(self) -> None:
        """A Detach (done when it returns), then the stream's end."""
        self.stub.Detach(worker_pb2.DetachRequest(worker_id=self.worker_id, worker_token=self.token), timeout=30)
        self._out.put(None)
        self._call.cancel()
        self._reader.join(10)


# ------------------------------------------------------------------------------------------------
# Real NIXL agents of this process (the agent target's consumers)

AGENT_POOL = 4  # the agent target's NIXL agents, used in turn (each by a new origin instance)
AGENT_GUARD = 16 << 10  # bytes on each side of a fuzz agent's registered buffer that must never change


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass(eq=False)
class FuzzAgent:
    """A NIXL agent (UCX, no progress thread) that registered a host buffer of the fuzz consumer's
    size, with guard bytes on both sides; its metadata is what a fake origin sends."""

    name: str
    agent: Any
    buf: np.ndarray  # guard + registered + guard, POISON at first
    reg: Any
    lo: int  # the registered buffer's address range
    hi: int
    metadata: bytes
    notifs: int = 0

    @classmethod
    def create(cls, name: str) -> FuzzAgent:
        import nixl._api as nixl_api

        logging.getLogger("nixl").setLevel(logging.WARNING)  # not a line per agent
        size = F_REGIONS * F_BLOCKS * F_BLOCK_LEN
        agent = nixl_api.nixl_agent(name, nixl_api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        buf = np.full(size + 2 * AGENT_GUARD, POISON, dtype=np.uint8)
        lo = buf.ctypes.data + AGENT_GUARD
        reg = agent.register_memory([(lo, size, 0, "")], "DRAM")
        return cls(name, agent, buf, reg, lo, lo + size, bytes(agent.get_agent_metadata()))

    @property
    def kv(self) -> np.ndarray:
        return self.buf[AGENT_GUARD:-AGENT_GUARD].reshape(F_REGIONS, F_BLOCKS, F_BLOCK_LEN)

    def guards_intact(self) -> bool:
        return bool((self.buf[:AGENT_GUARD] == POISON).all() and (self.buf[-AGENT_GUARD:] == POISON).all())

    def drain(self) -> None:
        """Progress (UCX) and the notifications received."""
        if self.agent is not None:
            self.notifs += sum(len(v) for v in self.agent.get_new_notifs().values())

    def close(self) -> None:
        """Deregister and release the agent (the buffer stays with the caller)."""
        if self.agent is not None:
            self.drain()
            self.agent.deregister_memory(self.reg)
            self.agent = self.reg = None


# ------------------------------------------------------------------------------------------------
# Correct traffic alongside


class Traffic(threading.Thread):
    """Correct transfers between the real workers, one after another, both arrival orders."""

    def __init__(self, p: DaemonProc, pw: Any, dw: Any, src: KV, dst: KV) -> None:
        super().__init__(name="fuzz-traffic", daemon=True)
        self.p, self.pw, self.dw, self.src, self.dst = p, pw, dw, src, dst
        self.stop_event = threading.Event()
        self.ok = 0
        self.errors: list[str] = []
        self.slowest = 0.0

    def run(self) -> None:
        rng = random.Random(7)
        i = 0
        while not self.stop_event.is_set() and len(self.errors) < 5:
            n = rng.randint(1, 8)
            sb = rng.sample(range(self.src.num_blocks), n)
            db = rng.sample(range(self.dst.num_blocks), n)
            tid = f"real-{i}-{uuid.uuid4().hex[:8]}"
            t0 = time.monotonic()
            try:
                if i % 2:
                    self.dw.send(Expect(tid, tuple(db), self.p.peer_address, "prefill", 1))
                    self.pw.send(Publish(tid, tuple(sb)))
                else:
                    self.pw.send(Publish(tid, tuple(sb)))
                    self.dw.send(Expect(tid, tuple(db), self.p.peer_address, "prefill", 1))
                cd, cp = self.dw.next_completion(60), self.pw.next_completion(60)
                self.slowest = max(self.slowest, time.monotonic() - t0)
                if cd is None or cp is None or (cd.kind, cd.transfer_id) != (CompletionKind.FINISHED_RECEIVING, tid) \
                        or (cp.kind, cp.transfer_id) != (CompletionKind.FINISHED_SENDING, tid):
                    self.errors.append(f"transfer {tid} ({'expect' if i % 2 else 'publish'} first, src {sb}, dst {db}) "
                                       f"ended with decode {cd}, prefill {cp}")
                elif not np.array_equal(self.dst.arr[:, db], self.src.arr[:, sb]):
                    bad = int(np.count_nonzero(self.dst.arr[:, db] != self.src.arr[:, sb]))
                    self.errors.append(f"transfer {tid}: {bad} destination bytes differ from the source")
                else:
                    self.ok += 1
            except Exception as e:
                self.errors.append(f"transfer {tid}: {type(e).__name__}: {e}")
            self.dst.arr[:, db] = POISON
            i += 1


# ------------------------------------------------------------------------------------------------
# The fuzzer


@dataclass
class Anomaly:
    target: str
    method: str
    problem: str
    status: str
    details: str
    request: str
    seconds: float
    count: int = 1


@dataclass
class Registration:
    daemon: str
    origin: str
    transfer_id: str
    registration_id: int


@dataclass
class Fuzz:
    p: DaemonProc
    d: DaemonProc
    fake: FakePeer
    fake_addr: str  # the agent target's fake origins
    fake_addr2: str  # the generic targets' fake origins (another address for the same server)
    fuzzp: RawWorker  # fuzz producer worker on p
    fuzzd: RawWorker  # fuzz consumer worker on d (worker API fuzzing)
    fuzzc: RawWorker  # fuzz consumer worker on d whose agent only the fake origins register with p
    fsrc: KV
    fcap: KV  # fuzzc's memory
    attach_kv: KV
    anomalies: dict[tuple[str, ...], Anomaly] = field(default_factory=dict)
    stats: dict[str, collections.Counter[str]] = field(default_factory=lambda: collections.defaultdict(
        collections.Counter))
    reasons: dict[str, collections.Counter[str]] = field(default_factory=lambda: collections.defaultdict(
        collections.Counter))
    slow: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    call_s: collections.Counter[str] = field(default_factory=collections.Counter)
    origins: dict[str, list[str]] = field(default_factory=lambda: {"p": [], "d": []})
    registrations: list[Registration] = field(default_factory=list)
    accepted: collections.Counter[tuple[str, str]] = field(default_factory=collections.Counter)
    got: dict[tuple[str, str], list[Completion]] = field(default_factory=lambda: collections.defaultdict(list))
    deadline: float = 0.0
    skipped: collections.Counter[str] = field(default_factory=collections.Counter)
    info: list[str] = field(default_factory=list)
    kept_buffers: list[np.ndarray] = field(default_factory=list)  # released fuzz agents' memory, kept to the end

    def __post_init__(self) -> None:
        self.chans = {
            ("p", "peer"): grpc.insecure_channel(self.p.peer_address, options=OPTS),
            ("d", "peer"): grpc.insecure_channel(self.d.peer_address, options=OPTS),
            ("p", "local"): grpc.insecure_channel(f"unix:{self.p.sock}", options=OPTS),
            ("d", "local"): grpc.insecure_channel(f"unix:{self.d.sock}", options=OPTS),
        }
        self.fuzz_ids = {self.fuzzp.worker_id: "p", self.fuzzd.worker_id: "d", self.fuzzc.worker_id: "d"}
        self.workers = {w.worker_id: w for w in (self.fuzzp, self.fuzzd, self.fuzzc)}
        self.known_origins = {"p": set(), "d": set()}  # handshakes the daemon accepted from us
        self.tokens: dict[tuple[str, str], str] = {}  # (daemon, instance) -> session token from its handshake

    def close(self) -> None:
        for c in self.chans.values():
            c.close()

    # -- one call ------------------------------------------------------------------------------

    def call(self, target: str, daemon: str, api: str, service: Any, method: str, req: Message | bytes, *,
             want: tuple[str, Callable[[grpc.StatusCode], bool]] | None = None, timeout: float = CALL_TIMEOUT,
             allow_deadline: bool = False, instance: str | None = None) -> tuple[grpc.StatusCode, str, bytes | None]:
        """One fuzzed call; anything but a clean, prompt status is recorded as an anomaly."""
        raw = isinstance(req, bytes)
        payload = req if isinstance(req, bytes) else req.SerializeToString()
        path = f"/{service.full_name}/{method}"
        streaming = service.methods_by_name[method].server_streaming
        chan = self.chans[(daemon, api)]
        data: bytes | None = None
        # a Channel names its instance in metadata, with the session token of that instance if we have one
        md: Any = None
        if instance is not None:
            tok = self.tokens.get((daemon, instance))
            md = ((("kvpushd-session", tok),) if tok else ()) + (("kvpushd-instance", instance),)
        t0 = time.monotonic()
        try:
            if service.methods_by_name[method].client_streaming:  # one batch, then half-close: all answers
                data = b"".join(chan.stream_stream(path)(iter([payload]), timeout=timeout, metadata=md))
            elif streaming:
                it = chan.unary_stream(path)(payload, timeout=timeout, metadata=md)
                try:
                    data = next(it, b"")
                finally:
                    it.cancel()
            else:
                data = chan.unary_unary(path)(payload, timeout=timeout, metadata=md)
            code, details = grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            code, details = e.code(), e.details() or ""  # type: ignore[attr-defined]
        dt = time.monotonic() - t0
        self.call_s[target] += dt
        self.stats[target][f"{method}:{code.name}"] += 1
        if code is not grpc.StatusCode.OK:
            self.reasons[target][f"{method}: {code.name}: {re.sub(r'[0-9]+', '#', details)[:70]}"] += 1
        problem = ""
        if code is grpc.StatusCode.DEADLINE_EXCEEDED and not allow_deadline:
            problem = f"no answer within {timeout:g}s (a hang)"
        elif code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) and not (raw and grpc_decode_error(details)):
            problem = f"{code.name} status"
        elif want is not None and not want[1](code):
            problem = f"status {code.name}, wanted {want[0]}"
        if code not in (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                        grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS) and not problem \
                and not (raw and grpc_decode_error(details)) and not allow_deadline and len(self.notes) < 12:
            self.notes.append(f"{target} {daemon}.{method} -> {code.name}: {details[:160]} "
                              f"request {describe(req)[:300]}")
        if dt > SLOW_S:
            self.slow.append(f"{target} {daemon}.{method} took {dt:.1f}s -> {code.name}: {details[:120]} "
                             f"request {describe(req)}")
        if problem:
            key = (target, method, problem, code.name, re.sub(r"[0-9a-f]{6,}|\d+", "#", details)[:160])
            if key in self.anomalies:
                self.anomalies[key].count += 1
            else:
                self.anomalies[key] = Anomaly(target, f"{daemon}:{path}", problem, code.name, details[:600],
                                              describe(req), dt)
        return code, details, data

    def judge_item(self, target: str, where: str, code: str, message: str, req: Message,
                   want: tuple[str, Callable[[grpc.StatusCode], bool]] | None = None) -> None:
        """One stream item's answer (``code`` "" or None-like: no answer): a clean status, and the wanted one."""
        self.stats[target][f"{where}:{code or 'NO ANSWER'}"] += 1
        if code != "OK":
            self.reasons[target][f"{where}: {code}: {re.sub(r'[0-9]+', '#', message)[:70]}"] += 1
        status = getattr(grpc.StatusCode, code, None) if code else None
        problem = ""
        if status is None:
            problem = f"item answered {code!r}" if code else "item not answered within the call timeout"
        elif status in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            problem = f"item {code}"
        elif want is not None and not want[1](status):
            problem = f"item {code}, wanted {want[0]}"
        if problem:
            key = (target, where, problem, re.sub(r"[0-9a-f]{6,}|\d+", "#", message)[:160])
            if key in self.anomalies:
                self.anomalies[key].count += 1
            else:
                self.anomalies[key] = Anomaly(target, where, problem, code, message[:600], describe(req), 0.0)

    def peer_item(self, target: str, daemon: str, origin: str, kind: str, msg: Message,
                  want: tuple[str, Callable[[grpc.StatusCode], bool]] | None = None) -> peer_pb2.PeerResult:
        """One item on a Channel stream of ``origin``'s session; its result (code "" when none came)."""
        batch = peer_pb2.PeerBatch()
        getattr(batch.items.add(seq=1), kind).CopyFrom(msg)
        code, _, data = self.call(target, daemon, "peer", PEER_SVC, "Channel", batch, instance=origin,
                                  want=("OK", lambda c: c is grpc.StatusCode.OK))
        out = peer_pb2.PeerBatch.FromString(data or b"") if code is grpc.StatusCode.OK else peer_pb2.PeerBatch()
        res = out.items[0].result if out.items else peer_pb2.PeerResult()
        if code is grpc.StatusCode.OK:
            self.judge_item(target, f"{daemon}:Channel.{kind}", res.code, res.message, msg, want)
        return res

    def command(self, target: str, w: RawWorker, kind: str, msg: Message,
                want: tuple[str, Callable[[grpc.StatusCode], bool]] | None = None) -> str:
        """One command on a fuzz worker's stream; its answer's code (accepted Expects and Publishes counted)."""
        t0 = time.monotonic()
        r = w.command(**{kind: msg})
        self.call_s[target] += time.monotonic() - t0
        code = r.code if r is not None else ""
        self.judge_item(target, f"{self.fuzz_ids[w.worker_id]}:Stream.{kind}", code, r.message if r else "", msg,
                        want)
        if code == "OK" and kind in ("expect", "publish"):
            self.accepted[(w.worker_id, msg.transfer_id)] += 1  # type: ignore[attr-defined]
        return code

    def out_of_time(self, target: str) -> bool:
        if time.monotonic() > self.deadline:
            self.skipped[target] += 1
            return True
        return False

    def collect(self) -> None:
        """Completions of the fuzz workers, by (worker, transfer)."""
        for wid, w in self.workers.items():
            for c in w.completions():
                self.got[(wid, c.transfer_id)].append(c)

    def handshake(self, daemon: str, address: str, inst: str = "") -> str:
        """A fake origin: a handshake from an instance that lives at ``address`` (the fake peer)."""
        inst = inst or f"fz-{uuid.uuid4().hex}"
        req = peer_pb2.HandshakeRequest(protocol_version=PROTOCOL_VERSION, compat_hash=HASH, node_id=ORIGIN_NODE,
                                        peer_address=address, instance_id=inst)
        code, _, data = self.call("setup", daemon, "peer", PEER_SVC, "Handshake", req,
                                  want=("OK", lambda c: c is grpc.StatusCode.OK))
        if code is grpc.StatusCode.OK:
            self.tokens[(daemon, inst)] = peer_pb2.HandshakeResponse.FromString(data or b"").session_token
            self.origins[daemon].append(inst)
            self.known_origins[daemon].add(inst)
        return inst

    # -- targets -------------------------------------------------------------------------------

    def peer_raw(self) -> None:
        methods = [m.name for m in PEER_SVC.methods] + ["Channel"] * 2  # the stream daemons use: weighted up

        @FUZZ_SETTINGS
        @given(daemon=st.sampled_from(["p", "d"]), data=st.data())
        def run(daemon: str, data: st.DataObject) -> None:
            method = data.draw(st.sampled_from(methods))
            payload = data.draw(raw_payloads(PEER_SVC.methods_by_name[method].input_type))
            if self.out_of_time("peer_raw"):
                return
            inst = data.draw(pool(self.origins[daemon])) if method == "Channel" else None
            self.call("peer_raw", daemon, "peer", PEER_SVC, method, payload, instance=inst)

        run()

    def channel_case(self, daemon: str, instance: str, batch: peer_pb2.PeerBatch) -> None:
        """A Channel stream of one PeerBatch: refused unless ``instance`` has a session; else every item
        answered once, by seq, none INTERNAL (a bad item fails alone, in its result)."""
        if not (instance.isascii() and instance.isprintable()):
            instance = "fz-not-printable"  # metadata values are printable ASCII: grpc's client refuses others
        want = None
        if instance not in self.known_origins[daemon]:
            want = ("a refusal of a stream without a session", lambda c: c is not grpc.StatusCode.OK)
        code, details, data = self.call("peer_msg", daemon, "peer", PEER_SVC, "Channel", batch, want=want,
                                        instance=instance)
        if code is not grpc.StatusCode.OK or not batch.items:
            return
        out = peer_pb2.PeerBatch()
        try:  # the answers were joined: parse them back as one batch (repeated fields concatenate)
            out.ParseFromString(data or b"")
        except Exception as e:
            out.items.add().result.code = f"unparsable answer: {e}"
        want_seqs = collections.Counter(it.seq for it in batch.items)
        got_seqs = collections.Counter(it.seq for it in out.items)
        problem = ""
        if got_seqs != want_seqs:
            problem = f"answered seqs {sorted(got_seqs.elements())[:8]} for {sorted(want_seqs.elements())[:8]}"
        bad = [it.result for it in out.items if it.result.code in ("INTERNAL", "UNKNOWN", "")]
        if bad:
            problem = problem or f"item result {bad[0].code or 'without code'}: {bad[0].message[:200]}"
        for it in out.items:
            why = re.sub(r"[0-9]+", "#", it.result.message)[:60]
            self.reasons["peer_msg"][f"Channel item: {it.result.code}: {why}"] += 1
        for it in batch.items:
            if it.WhichOneof("item") == "register" and instance in self.known_origins[daemon]:
                self.registrations.append(Registration(daemon, instance, it.register.transfer_id,
                                                       it.register.registration_id))
        if problem:
            key = ("peer_msg", "Channel", problem[:80])
            if key in self.anomalies:
                self.anomalies[key].count += 1
            else:
                self.anomalies[key] = Anomaly("peer_msg", f"{daemon}:Channel", problem, code.name, details[:600],
                                              describe(batch), 0.0)

    def peer_case(self, daemon: str, method: str, req: Message) -> None:
        want = None
        if method == "Handshake" and (req.protocol_version != PROTOCOL_VERSION or req.compat_hash != HASH):
            want = ("a refusal of a wrong protocol version or hash", lambda c: c is not grpc.StatusCode.OK)
        code, _, _ = self.call("peer_msg", daemon, "peer", PEER_SVC, method, req, want=want)
        if method == "Handshake" and code is grpc.StatusCode.OK:
            self.origins[daemon].append(req.instance_id)
            self.known_origins[daemon].add(req.instance_id)
            big = {k: n for k in ("node_id", "peer_address") if (n := len(getattr(req, k))) > BIG_STRING}
            if big:
                self.anomalies[("peer_msg", "big-handshake", daemon)] = Anomaly(
                    "peer_msg", f"{daemon}:Handshake", f"accepted a peer's {big} characters long string(s): kept "
                    "for as long as the peer is known, shown in every GetStatus and written to the log",
                    "OK", "", describe(req), 0.0)

    def peer_seeds(self) -> None:
        """Inputs the random search may or may not reach within its budget: they run first."""
        self.peer_case("p", "Handshake", peer_pb2.HandshakeRequest(
            protocol_version=PROTOCOL_VERSION, compat_hash=HASH, node_id="z" * (1 << 20),
            peer_address=self.fake_addr2, instance_id=f"fz-{uuid.uuid4().hex}"))
        table = [peer_pb2.RemoteRegion(base_addr=4096, num_blocks=F_BLOCKS, block_len=F_BLOCK_LEN,
                                       block_stride=F_BLOCK_LEN)] * F_REGIONS
        origin = self.origins["p"][-1]
        self.peer_item("peer_msg", "p", origin, "register", peer_pb2.RegisterRequest(
            transfer_id="seed-tp", registration_id=77,
            producer_engine_id="fuzzp", producer_tp_size=2**32 - 1, consumer_engine_id="x", consumer_tp_size=1,
            consumer_agent=peer_pb2.AgentInfo(agent_name="fz-agent-seed", agent_metadata=b"garbage",
                                              memory_kind="DRAM", regions=table), block_ids=[1]))
        self.registrations.append(Registration("p", origin, "seed-tp", 77))

    def peer_msg(self) -> None:
        self.peer_seeds()
        methods = [m.name for m in PEER_SVC.methods] + ["Channel"] * 2  # the stream daemons use: weighted up
        agents = messages(peer_pb2.AgentInfo.DESCRIPTOR, {
            "agent_name": mostly("fz-agent", st.one_of(st.sampled_from(["fz-agent-2", "fz-agent-3", ""]), TEXT), 6),
            "agent_metadata": st.one_of(st.just(b""), st.binary(min_size=1, max_size=300)),
            "memory_kind": st.one_of(st.sampled_from(["DRAM", "DRAM", "VRAM", "", "dram", "FILE"]), TEXT),
            "regions": region_tables(),
        })

        kinds = [f for f in peer_pb2.PeerItem.DESCRIPTOR.oneofs_by_name["item"].fields]

        @FUZZ_SETTINGS
        @given(daemon=st.sampled_from(["p", "p", "d"]), data=st.data())
        def run(daemon: str, data: st.DataObject) -> None:
            method = data.draw(st.sampled_from(methods))
            if method == "Channel":  # a batch of items of every kind
                instance = data.draw(st.one_of(pool(self.origins[daemon]), pool(self.origins[daemon]), TEXT))
                batch = peer_pb2.PeerBatch()
                for _ in range(data.draw(st.sampled_from([0, 1, 1, 2, 3, 6]))):
                    it = batch.items.add(seq=data.draw(st.one_of(st.integers(1, 8), U64)))
                    f = data.draw(st.one_of(st.sampled_from(kinds), st.none()))
                    if f is not None:
                        getattr(it, f.name).CopyFrom(data.draw(messages(f.message_type, fields())))
                if data.draw(st.integers(0, 9)) == 0:  # over the limit of items in one batch
                    batch.items.extend([peer_pb2.PeerItem(seq=1)] * 4097)
                if self.out_of_time("peer_msg"):
                    return
                self.channel_case(daemon, instance, batch)
                return
            desc = PEER_SVC.methods_by_name[method].input_type
            req = data.draw(messages(desc, fields()))
            if self.out_of_time("peer_msg"):
                return
            self.peer_case(daemon, method, req)

        def fields() -> dict[str, st.SearchStrategy[Any]]:
            return {
                "instance_id": st.one_of(st.builds(lambda: f"fz-{uuid.uuid4().hex}"), TEXT),
                "protocol_version": mostly(PROTOCOL_VERSION, U32),
                "compat_hash": mostly(HASH, TEXT),
                "peer_address": mostly(self.fake_addr2, BIG_TEXT),
                "node_id": BIG_TEXT,
                "transfer_id": TIDS,
                "producer_engine_id": st.one_of(st.sampled_from(["fuzzp", "fuzzp", "prefill", "nobody"]), TEXT),
                "producer_tp_size": TP,
                "consumer_tp_size": TP,
                "consumer_tp_rank": st.one_of(st.integers(0, 3), st.just(0), U32),
                "consumer_agent": agents,
                "block_ids": block_lists(),
                "reason": st.one_of(TEXT, st.just("r" * 100_000)),
            }

        run()

    def agent(self) -> None:
        """Registrations whose consumer agent is a real NIXL agent of this process (UCX, a host buffer of
        the fuzz consumer's size), named as the calling fake origin's agents must be, with its metadata
        sometimes mutated and absurd region tables around that buffer, matched by a publish of the fuzz
        producer: the WRITE reaches NIXL, which must refuse every descriptor outside the registered buffer
        (a WRITE that reports FINISHED_SENDING must have stayed inside it, and the guard bytes around it
        must not change; one inside the real table must land the exact bytes). Each case is a new origin
        instance at the same address (the daemon forgets the previous one and its agents), so a new agent;
        the last few are kept and older ones released. A few cases replay the captured agent of the real
        decode daemon (another daemon's agent): those must be refused with PERMISSION_DENIED."""
        cap = self.fake.captured
        assert cap is not None
        serial = iter(range(10**9))
        cases = iter(range(10**9))
        span = F_BLOCKS * F_BLOCK_LEN
        # the buffer's real table, relative to its first byte (the cases add the buffer's address)
        legit = [peer_pb2.RemoteRegion(base_addr=i * span, num_blocks=F_BLOCKS, block_len=F_BLOCK_LEN,
                                       block_stride=F_BLOCK_LEN, device_id=0) for i in range(F_REGIONS)]
        # A bounded pool of agents, used in turn: the origin instance ids of slot k all start with the same
        # 8 characters (fz-agNNN), which is all of an instance id that agent_prefix() keeps, so the agent of
        # slot k is named as each of those origins' agents must be.
        slots: list[FuzzAgent | None] = [None] * AGENT_POOL
        pool: list[FuzzAgent] = []  # the agents of the cases so far, last one last (at most AGENT_POOL)
        rss0 = rss_bytes()
        t_agents = 0.0

        @st.composite
        def tables(draw: st.DrawFn) -> list[peer_pb2.RemoteRegion]:
            regs = [peer_pb2.RemoteRegion() for _ in legit]
            for r, c in zip(regs, legit, strict=True):
                r.CopyFrom(c)
            kind = draw(st.sampled_from(["same", "shift", "num_blocks", "stride", "block_len", "device", "count"]))
            i = draw(st.integers(0, len(regs) - 1))
            if kind == "shift":
                delta = draw(st.one_of(st.sampled_from([-(2**40), -8192, -1024, -1, 1, 1024, 4096, 32 * 1024,
                                                         64 * 1024, 2**32, 2**63]), st.integers(-(2**64), 2**64)))
                regs[i].base_addr = (regs[i].base_addr + delta) % 2**64
            elif kind == "num_blocks":
                regs[i].num_blocks = draw(st.one_of(st.sampled_from([33, 64, 1 << 16, 1 << 20, 1 << 26, 2**32 - 1]),
                                                    U32))
            elif kind == "stride":
                regs[i].block_stride = draw(st.one_of(st.sampled_from([0, 1, 1023, 2048, 1 << 20, 2**63]), U64))
            elif kind == "block_len":
                regs[i].block_len = draw(st.one_of(st.sampled_from([0, 1, 512, 1025, 2048, 2**63]), U64))
            elif kind == "device":
                regs[i].device_id = draw(U32)
            elif kind == "count":
                regs = regs[: draw(st.integers(0, len(regs) - 1))] + regs * draw(st.integers(0, 2))
            return regs

        # how a case's metadata is made from its agent's own: (kind, argument)
        md_kinds = st.one_of(
            st.just(("same", None)), st.just(("same", None)), st.just(("same", None)), st.just(("same", None)),
            st.tuples(st.just("cut"), st.integers(0, 2**16)),
            st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 2**16), st.integers(0, 7)), min_size=1,
                                                max_size=3)),
            st.tuples(st.just("random"), st.binary(min_size=1, max_size=400)),
            st.sampled_from([("empty", None), ("captured", None), ("previous", None)]))
        # the agent name a case registers: its own, or one the origin does not own
        name_kinds = st.one_of(*[st.just(("own", ""))] * 6, st.sampled_from([
            ("captured", ""), ("previous", ""), ("prefix", ""), ("own+", "")]), st.tuples(st.just("text"), TEXT))

        def make_md(kind: tuple[str, Any], fa: FuzzAgent, previous: FuzzAgent | None) -> bytes:
            what, arg = kind
            md = bytearray(fa.metadata)
            if what == "cut":
                return bytes(md[: arg % len(md)])
            if what == "flip":
                for pos, bit in arg:
                    md[pos % len(md)] ^= 1 << bit
            elif what == "random":
                return bytes(arg)
            elif what == "empty":
                return b""
            elif what == "captured":
                return bytes(cap.agent_metadata)
            elif what == "previous":  # the previous case's agent's (another origin's)
                return previous.metadata if previous else bytes(cap.agent_metadata)
            return bytes(md)

        def make_name(kind: tuple[str, str], fa: FuzzAgent, prefix: str, previous: FuzzAgent | None) -> str:
            what, text = kind
            return {"own": fa.name, "captured": cap.agent_name, "prefix": prefix, "own+": fa.name + "2",
                    "previous": previous.name if previous else cap.agent_name, "text": text}[what]

        def slot_agent(k: int, origin: str) -> FuzzAgent:
            nonlocal t_agents
            fa = slots[k]
            if fa is None:
                t0 = time.monotonic()
                fa = slots[k] = FuzzAgent.create(f"{agent_prefix(ORIGIN_NODE, origin)}x")
                t_agents += time.monotonic() - t0
                self.deadline += time.monotonic() - t0  # (the first one loads NIXL: seconds) not the search's time
                self.stats["agent"]["nixl-agents-created"] += 1
            assert fa.name.startswith(agent_prefix(ORIGIN_NODE, origin))
            fa.drain()  # what a previous case left
            fa.kv[:] = POISON
            fa.notifs = 0
            if fa in pool:
                pool.remove(fa)
            pool.append(fa)
            return fa

        def case(rel: list[peer_pb2.RemoteRegion], md_kind: tuple[str, Any], name_kind: tuple[str, str],
                 mem_kind: str, dst: list[int], src: list[int], rid: int, restart: bool,
                 must_finish: bool = False) -> None:
            tid = f"ag-{next(serial)}"
            k = next(cases) % AGENT_POOL
            # a new instance at the same address: the daemon forgets the previous one and its agents
            origin = self.handshake("p", self.fake_addr, f"fz-ag{k:03d}-{uuid.uuid4().hex}")
            prefix = agent_prefix(ORIGIN_NODE, origin)
            previous = pool[-1] if pool else None
            fa = slot_agent(k, origin)
            try:
                regions = [peer_pb2.RemoteRegion() for _ in rel]
                for r, x in zip(regions, rel, strict=True):
                    r.CopyFrom(x)
                    r.base_addr = (x.base_addr + fa.lo) % 2**64
                md = make_md(md_kind, fa, previous)
                name = make_name(name_kind, fa, prefix, previous)
                md_name = metadata_agent_name(md)
                want = None
                if not name:
                    want = ("INVALID_ARGUMENT: no agent name", lambda c: c is grpc.StatusCode.INVALID_ARGUMENT)
                elif not name.startswith(prefix):
                    want = ("PERMISSION_DENIED: another daemon's agent name",
                            lambda c: c is grpc.StatusCode.PERMISSION_DENIED)
                elif md and md_name != name:
                    want = ("a refusal: the metadata names another agent", lambda c: c is not grpc.StatusCode.OK)
                elif name == fa.name and md == fa.metadata:
                    want = ("no PERMISSION_DENIED: the origin's own agent",
                            lambda c: c is not grpc.StatusCode.PERMISSION_DENIED)
                req = peer_pb2.RegisterRequest(
                    transfer_id=tid, registration_id=rid, producer_engine_id="fuzzp",
                    producer_tp_size=1, consumer_engine_id="fuzzd", consumer_tp_rank=0, consumer_tp_size=1,
                    consumer_agent=peer_pb2.AgentInfo(agent_name=name, agent_metadata=md, memory_kind=mem_kind,
                                                      regions=regions), block_ids=dst)
                res = self.peer_item("agent", "p", origin, "register", req, want=want)
                self.registrations.append(Registration("p", origin, tid, rid))
                if res.code != "OK" or res.need_metadata:
                    if must_finish:
                        self.anomalies[("agent-seed", tid)] = Anomaly(
                            "agent", "p:Channel.register", "the registration of a fuzz agent with its real table "
                            "was not accepted with its metadata", res.code, res.message, describe(req), 0.0)
                    return
                pub = worker_pb2.PublishRequest(transfer_id=tid, block_ids=src)
                if self.command("agent", self.fuzzp, "publish", pub, want=("OK", lambda c: c is grpc.StatusCode.OK)) \
                        != "OK":
                    return
                self.stats["agent"]["reached-nixl"] += 1
                if restart:
                    self.handshake("p", self.fake_addr)
                key = (self.fuzzp.worker_id, tid)
                end = time.monotonic() + 15
                while not self.got.get(key) and time.monotonic() < end:
                    self.collect()
                    fa.drain()  # this agent has no progress thread: drive it
                    time.sleep(0.002)
                comps = self.got.get(key)
                if not comps:
                    self.anomalies[("agent", tid)] = Anomaly("agent", "p:Publish", "no completion within 15 s", "",
                                                             "", describe(req), 15.0)
                    return
                c = comps[0]
                self.stats["agent"][f"completion:{c.kind.name}:{c.code}"] += 1
                finished = c.kind is CompletionKind.FINISHED_SENDING
                if must_finish and not finished:
                    self.anomalies[("agent-seed", tid)] = Anomaly(
                        "agent", "p:Register+Publish", f"a correct WRITE to a fuzz agent ended {c}", "", "",
                        describe(req), 0.0)
                if finished:
                    wlen = [max(r.block_len, F_BLOCK_LEN) for r in regions]
                    inside = all(fa.lo <= a and a + n <= fa.hi for r, n in zip(regions, wlen, strict=True)
                                 for a in ((r.base_addr + b * r.block_stride) % 2**64 for b in dst))
                    if not inside or len(regions) != F_REGIONS or name != fa.name:
                        self.anomalies[("agent-write", tid)] = Anomaly(
                            "agent", "p:Register+Publish", "a WRITE outside the consumer agent's registered memory "
                            f"[{fa.lo:#x}, {fa.hi:#x}) reported FINISHED_SENDING", "OK", "", describe(req), 0.0)
                    elif list(rel) == legit and len(src) == len(dst):
                        end = time.monotonic() + 3  # the notification follows the data
                        while not fa.notifs and time.monotonic() < end:
                            fa.drain()
                            time.sleep(0.002)
                        self.stats["agent"][f"notified:{bool(fa.notifs)}"] += 1
                        bad = int(np.count_nonzero(fa.kv[:, dst] != self.fsrc.arr[:, src]))
                        if bad:
                            self.anomalies[("agent-bytes", tid)] = Anomaly(
                                "agent", "p:Register+Publish", f"a WRITE inside the real table (src {src} -> dst "
                                f"{dst}) reported FINISHED_SENDING but {bad} destination bytes differ from the "
                                "source", "OK", "", describe(req), 0.0)
            finally:
                fa.drain()
                if not fa.guards_intact():
                    self.anomalies[("agent-guard", tid)] = Anomaly(
                        "agent", "p:Register+Publish", f"bytes around the consumer agent's registered memory "
                        f"[{fa.lo:#x}, {fa.hi:#x}) changed", "", "", describe(req), 0.0)
                    fa.buf[:] = POISON

        def replay(regions: list[peer_pb2.RemoteRegion], md: bytes, own_prefix: bool) -> None:
            """The real decode daemon's captured agent, replayed by a fake origin."""
            tid = f"ag-replay-{next(serial)}"
            origin = self.handshake("p", self.fake_addr)
            name = f"{agent_prefix(ORIGIN_NODE, origin)}x" if own_prefix else cap.agent_name
            req = peer_pb2.RegisterRequest(
                transfer_id=tid, registration_id=3, producer_engine_id="fuzzp",
                producer_tp_size=1, consumer_engine_id="fuzzc", consumer_tp_rank=0, consumer_tp_size=1,
                consumer_agent=peer_pb2.AgentInfo(agent_name=name, agent_metadata=md, memory_kind=cap.memory_kind,
                                                  regions=regions), block_ids=[1])
            self.peer_item("agent", "p", origin, "register", req,
                           want=("PERMISSION_DENIED", lambda c: c is grpc.StatusCode.PERMISSION_DENIED))
            self.registrations.append(Registration("p", origin, tid, 3))

        shifted = [peer_pb2.RemoteRegion() for _ in cap.regions]
        for r, x in zip(shifted, cap.regions, strict=True):
            r.CopyFrom(x)
        shifted[0].base_addr -= 2 * F_BLOCK_LEN
        replay(list(cap.regions), cap.agent_metadata, False)  # as captured
        replay(shifted, cap.agent_metadata, False)  # with a forged table
        replay(list(cap.regions), b"", False)  # without metadata (as if the daemon knew the agent)
        replay(list(cap.regions), cap.agent_metadata, True)  # under the origin's own name
        # a correct registration first: the cases do reach NIXL (and the bytes land)
        case(legit, ("same", None), ("own", ""), "DRAM", [1, 2], [5, 6], 7, False, must_finish=True)

        @FUZZ_SETTINGS
        @given(rel=tables(), md_kind=md_kinds, name_kind=name_kinds, data=st.data())
        def run(rel: list[peer_pb2.RemoteRegion], md_kind: tuple[str, Any], name_kind: tuple[str, str],
                data: st.DataObject) -> None:
            mem_kind = data.draw(st.one_of(st.just("DRAM"), st.just("DRAM"), st.sampled_from(["VRAM", "dram", ""])))
            n = data.draw(st.integers(1, 4))
            nb = min((r.num_blocks for r in rel), default=0)
            dst = data.draw(st.lists(st.one_of(st.integers(0, F_BLOCKS - 1), st.integers(0, max(nb - 1, 0))),
                                     min_size=n, max_size=n, unique=True))
            src = data.draw(st.lists(st.integers(0, F_BLOCKS - 1), min_size=n, max_size=n + 2, unique=True))
            rid = data.draw(U64)
            restart = data.draw(st.booleans())  # the consumer's daemon "restarts" while the WRITE may be in flight
            if self.out_of_time("agent"):
                return
            case(rel, md_kind, name_kind, mem_kind, dst, src, rid, restart)

        try:
            run()
            # then a seed the random search may or may not reach within its budget: the consumer's daemon
            # "restarts" (a handshake from its address with a new instance id) right after the WRITE started
            case(legit, ("same", None), ("own", ""), "DRAM", [1], [5], 8, True)
        finally:
            self.handshake("p", self.fake_addr)  # the daemon forgets the last origin and its agent
            for fa in pool:
                fa.close()
                self.kept_buffers.append(fa.buf)  # a late WRITE would still land in memory we own
            self.info.append(f"agent: {next(cases)} cases on {len(pool)} NIXL agents of this process (created in "
                             f"{t_agents:.1f}s); fuzzer RSS {rss0 / 2**20:.0f} -> {rss_bytes() / 2**20:.0f} MiB")


    def cross_peer(self) -> None:
        """One peer's registration must not change how the daemon writes another peer's transfers: a fake
        origin registers the (captured) agent of the capture consumer with its region 0 shifted by one
        block, still inside that worker's memory; then the real decode daemon registers the same worker
        for a correct transfer, which must land on exactly its blocks."""
        cap = self.fake.captured
        assert cap is not None
        origin = self.handshake("p", self.fake_addr)
        regions = [peer_pb2.RemoteRegion() for _ in cap.regions]
        for r, c in zip(regions, cap.regions, strict=True):
            r.CopyFrom(c)
        regions[0].base_addr += F_BLOCK_LEN
        forged = peer_pb2.RegisterRequest(
            transfer_id="cross-forged", registration_id=1, producer_engine_id="fuzzp",
            producer_tp_size=1, consumer_engine_id="fuzzc", consumer_tp_rank=0, consumer_tp_size=1,
            consumer_agent=peer_pb2.AgentInfo(agent_name=cap.agent_name, agent_metadata=cap.agent_metadata,
                                              memory_kind=cap.memory_kind, regions=regions), block_ids=[0])
        self.peer_item("cross_peer", "p", origin, "register", forged, want=(
            "PERMISSION_DENIED: another daemon's agent", lambda c: c is grpc.StatusCode.PERMISSION_DENIED))
        self.registrations.append(Registration("p", origin, "cross-forged", 1))
        self.fcap.arr[:] = POISON
        tid, sb, db = "cross-real", [7, 8], [1, 2]
        ok = ("OK", lambda c: c is grpc.StatusCode.OK)
        self.command("cross_peer", self.fuzzc, "expect", worker_pb2.ExpectRequest(
            transfer_id=tid, block_ids=db, producer_address=self.p.peer_address, producer_engine_id="fuzzp",
            producer_tp_size=1), want=ok)
        self.command("cross_peer", self.fuzzp, "publish", worker_pb2.PublishRequest(transfer_id=tid, block_ids=sb),
                     want=ok)
        end = time.monotonic() + 20
        while time.monotonic() < end and not (self.got.get((self.fuzzc.worker_id, tid))
                                              and self.got.get((self.fuzzp.worker_id, tid))):
            self.collect()
            time.sleep(0.005)
        comps = (self.got.get((self.fuzzc.worker_id, tid)), self.got.get((self.fuzzp.worker_id, tid)))
        exact = np.array_equal(self.fcap.arr[:, db], self.fsrc.arr[:, sb])
        others = np.delete(self.fcap.arr, db, axis=1)
        if not exact or not (others == POISON).all() or not comps[0] or comps[0][0].kind is not \
                CompletionKind.FINISHED_RECEIVING:
            moved = [b for b in range(F_BLOCKS) if np.array_equal(self.fcap.arr[0, b], self.fsrc.arr[0, sb[0]])]
            self.anomalies[("cross_peer",)] = Anomaly(
                "cross_peer", "p:Register (another peer) then d:Expect + p:Publish",
                "a registration by one peer of another daemon's consumer agent changed how that daemon's "
                f"correct transfer {tid!r} (src {sb} -> dst {db}) was written: completions {comps}, bytes exact "
                f"{exact}, bytes outside dst untouched {bool((others == POISON).all())}, region 0 of src block "
                f"{sb[0]} found in dst block(s) {moved}", "", "", describe(forged), 0.0)
        self.handshake("p", self.fake_addr)  # the forging origin goes away: the daemon forgets its agents

    def worker_raw(self) -> None:
        targets = [(WORKER_SVC, m.name) for m in WORKER_SVC.methods] + [(STATUS_SVC, "GetStatus")]

        @FUZZ_SETTINGS
        @given(daemon=st.sampled_from(["p", "d"]), data=st.data())
        def run(daemon: str, data: st.DataObject) -> None:
            svc, method = data.draw(st.sampled_from(targets))
            payload = data.draw(raw_payloads(svc.methods_by_name[method].input_type))
            if self.out_of_time("worker_raw"):
                return
            self.call("worker_raw", daemon, "local", svc, method, payload)

        run()

    def worker_batch(self, w: RawWorker, cmds: list[worker_pb2.Command]) -> None:
        """Commands in one batch on a fuzz worker's stream: every one answered, none INTERNAL, each alone."""
        t0 = time.monotonic()
        results = w.batch(cmds)
        self.call_s["worker_msg"] += time.monotonic() - t0
        home = self.fuzz_ids[w.worker_id]
        for c, r in zip(cmds, results, strict=True):
            op = c.WhichOneof("op")
            msg = getattr(c, op) if op else c
            want = None
            if len(cmds) > 4096 or op is None:
                want = ("INVALID_ARGUMENT", lambda x: x is grpc.StatusCode.INVALID_ARGUMENT)
            elif (op, home) in (("expect", "d"), ("publish", "p")) and not msg.block_ids and not undefined_enum(msg):
                want = ("INVALID_ARGUMENT for no blocks", lambda x: x is grpc.StatusCode.INVALID_ARGUMENT)
            code = r.code if r is not None else ""
            self.judge_item("worker_msg", f"{home}:Stream.{op}", code, r.message if r else "", msg, want)
            if code == "OK" and op in ("expect", "publish"):
                self.accepted[(w.worker_id, msg.transfer_id)] += 1

    def worker_msg(self) -> None:
        # first a seed the random search may or may not reach within its budget
        self.command("worker_msg", self.fuzzd, "expect", worker_pb2.ExpectRequest(
            transfer_id="seed-tp", block_ids=[1, 2], producer_address=self.p.peer_address,
            producer_engine_id="fuzzp", producer_tp_size=2**32 - 1))
        ops = list(worker_pb2.Command.DESCRIPTOR.oneofs_by_name["op"].fields)
        fuzz_ids = [self.fuzzp.worker_id, self.fuzzd.worker_id]
        calls = ["command"] * 6 + ["batch", "batch", "Stream", "Detach", "GetStatus", "Watch"]
        addresses = st.one_of(st.just(self.p.peer_address), st.just(self.p.peer_address), st.just(self.fake_addr2),
                              st.just("127.0.0.1:1"), TEXT)
        overrides = {
            "transfer_id": TIDS,
            "block_ids": block_lists(),
            "producer_address": addresses,
            "producer_engine_id": mostly("fuzzp", st.one_of(st.sampled_from(["prefill", "nobody"]), TEXT)),
            "producer_tp_size": TP,
        }

        @FUZZ_SETTINGS
        @given(data=st.data())
        def run(data: st.DataObject) -> None:
            what = data.draw(st.sampled_from(calls))
            if what in ("command", "batch"):
                w = data.draw(st.sampled_from([self.fuzzp, self.fuzzd]))
                # (a batch over the 4,096 items one may hold ends the worker's stream unparsed, which
                # would end the fuzz worker's session: tests/daemon/test_batch_cost.py covers it)
                n = 1 if what == "command" else data.draw(st.sampled_from([0, 2, 3, 6]))
                cmds = []
                for _ in range(min(n, 6)):
                    c = worker_pb2.Command()
                    f = data.draw(st.one_of(st.sampled_from(ops), st.sampled_from(ops), st.none()))
                    if f is not None:
                        getattr(c, f.name).CopyFrom(data.draw(messages(f.message_type, overrides)))
                    cmds.append(c)
                cmds += [worker_pb2.Command() for _ in range(n - len(cmds))]  # over the limit of one batch
                if self.out_of_time("worker_msg"):
                    return
                self.worker_batch(w, cmds)
                return
            daemon = data.draw(st.sampled_from(["p", "d"]))
            if what in ("Stream", "Detach"):  # of another worker: the fuzz workers stay (their Detach is no bug)
                desc = worker_pb2.CommandBatch.DESCRIPTOR if what == "Stream" else worker_pb2.DetachRequest.DESCRIPTOR
                req = data.draw(messages(desc, {"worker_id": st.one_of(st.sampled_from(fuzz_ids), TEXT)}))
                if req.worker_id in self.fuzz_ids or req.worker_id == self.fuzzc.worker_id:
                    req.worker_id = "not-" + req.worker_id
                want = ("NOT_FOUND for an unknown worker", lambda c: c is grpc.StatusCode.NOT_FOUND)
                if self.out_of_time("worker_msg"):
                    return
                self.call("worker_msg", daemon, "local", WORKER_SVC, what, req, want=want)
                return
            req = data.draw(messages(STATUS_SVC.methods_by_name[what].input_type))
            if self.out_of_time("worker_msg"):
                return
            self.call("worker_msg", daemon, "local", STATUS_SVC, what, req,
                      timeout=1.5 if what == "Watch" else CALL_TIMEOUT, allow_deadline=what == "Watch")

        run()

    def attach(self) -> None:
        kv = self.attach_kv
        shm_names = mostly(kv.buf.name, st.one_of(st.sampled_from(
            ["/" + kv.buf.name, "kvpushd-no-such", "..", ".", "", "a/b", "x" * 251]), TEXT), 6)
        shm_sizes = mostly(kv.buf.size, st.one_of(st.sampled_from([kv.buf.size - 1, kv.buf.size + 1, 0, 1]), U64), 6)

        @st.composite
        def handles(draw: st.DrawFn) -> common_pb2.MemoryHandle:
            kind = draw(st.sampled_from(["memfd"] * 10 + ["shm", "cuda", "none"]))
            if kind == "memfd":  # FRESH: the attach memory's descriptor, handed over just before the call
                token = draw(mostly(FRESH, st.one_of(st.sampled_from([b"", b"\0" * 16]), st.binary(max_size=40)), 6))
                return common_pb2.MemoryHandle(memfd=common_pb2.MemfdHandle(token=token, size=draw(shm_sizes)))
            if kind == "shm":
                return common_pb2.MemoryHandle(shm=common_pb2.ShmHandle(name=draw(shm_names), size=draw(shm_sizes)))
            if kind == "cuda":  # size 0 or no handle: refused before the daemon imports torch
                c = draw(messages(common_pb2.CudaIpcHandle.DESCRIPTOR))
                if draw(st.booleans()):
                    c.size = 0
                else:
                    c.ipc_handle = b""
                return common_pb2.MemoryHandle(cuda_ipc=c)
            return common_pb2.MemoryHandle()

        @st.composite
        def regions(draw: st.DrawFn) -> list[common_pb2.Region]:
            if draw(st.integers(0, 2)):  # dense: blocks that fit, in many regions (descriptors: regions x blocks)
                n = draw(st.sampled_from([1, 2, 16, 256, 4096]))
                block_len = draw(st.sampled_from([1, 16, 1024]))
                nb = draw(st.sampled_from([1, kv.buf.size // block_len]))
                return [common_pb2.Region(memory_index=0, offset=0, num_blocks=nb, block_len=block_len,
                                          block_stride=block_len)] * n
            return draw(st.lists(messages(common_pb2.Region.DESCRIPTOR, {
                "memory_index": st.one_of(st.integers(0, 2), U32),
                "offset": st.one_of(st.integers(0, kv.buf.size), U64),
                "num_blocks": st.one_of(st.integers(0, 64), U32),
                "block_len": st.one_of(st.sampled_from([1, 64, 1024]), U64),
                "block_stride": st.one_of(st.sampled_from([0, 1024]), U64),
            }), max_size=4))

        @FUZZ_SETTINGS
        @given(daemon=st.sampled_from(["p", "d"]), data=st.data())
        def run(daemon: str, data: st.DataObject) -> None:
            req = worker_pb2.AttachRequest(
                engine_id=data.draw(mostly("fuzzA", st.one_of(st.sampled_from(["fuzzp", "fuzzd"]), TEXT), 8)),
                role=data.draw(mostly(1, st.one_of(st.sampled_from([2, 3]), I32), 3)),
                tp_rank=data.draw(mostly(0, U32, 8)), tp_size=data.draw(mostly(1, U32, 8)),
                pp_rank=data.draw(mostly(0, U32)),
                memory=data.draw(mostly(1, st.integers(0, 3), 8).flatmap(lambda n: st.lists(handles(), min_size=n,
                                                                                       max_size=n))),
                regions=data.draw(regions()),
                description=data.draw(st.one_of(TEXT, st.just("d" * 100_000))))
            if self.out_of_time("attach"):
                return
            fresh = [h.memfd for h in req.memory if h.WhichOneof("kind") == "memfd" and h.memfd.token == FRESH]
            sock = (self.p if daemon == "p" else self.d).sock
            for h, token in zip(fresh, hand_over(sock, [kv.buf.memory] * len(fresh)).values(), strict=True):
                h.token = token
            code, _, resp = self.call("attach", daemon, "local", WORKER_SVC, "Attach", req)
            if code is grpc.StatusCode.OK:
                ans = worker_pb2.AttachResponse.FromString(resp or b"")
                self.call("attach", daemon, "local", WORKER_SVC, "Detach",
                          worker_pb2.DetachRequest(worker_id=ans.worker_id, worker_token=ans.worker_token),
                          want=("OK", lambda c: c is grpc.StatusCode.OK))

        run()


def undefined_enum(msg: Message) -> bool:
    """Whether the message (or one nested in it) sets an enum field to a value its enum does not define."""
    for f, v in msg.ListFields():
        if f.type == FD.TYPE_ENUM:
            if any(x not in f.enum_type.values_by_number for x in (v if is_repeated(f) else [v])):
                return True
        elif f.type == FD.TYPE_MESSAGE and not f.message_type.GetOptions().map_entry \
                and any(undefined_enum(x) for x in (v if is_repeated(f) else [v])):
            return True
    return False


def grpc_decode_error(details: str) -> bool:
    """grpc's own request deserializer failed: no daemon code ran."""
    return "DecodeError" in details or "Exception deserializing request" in details


def describe(req: Message | bytes) -> str:
    """A short reproducer: text format with long strings and lists cut (their length noted)."""
    if isinstance(req, bytes):
        return f"raw {len(req)} bytes: {req[:200].hex()}{'...' if len(req) > 200 else ''}"
    m = type(req)()
    m.CopyFrom(req)
    notes = []

    def shorten(msg: Message, path: str) -> None:
        for f, v in msg.ListFields():
            where = f"{path}{f.name}"
            if f.type == FD.TYPE_MESSAGE:
                if is_repeated(f):
                    if len(v) > 4:
                        notes.append(f"{where}: {len(v)} entries (first 2 shown)")
                        del v[2:]
                    for x in v:
                        shorten(x, where + ".")
                else:
                    shorten(v, where + ".")
            elif is_repeated(f) and len(v) > 16:
                notes.append(f"{where}: {len(v)} values, from {min(v)} to {max(v)} (first 8 shown)")
                del v[8:]
            elif isinstance(v, str | bytes) and len(v) > 120:
                notes.append(f"{where}: {len(v)} long (first 60 shown)")
                setattr(msg, f.name, v[:60])

    shorten(m, "")
    text = text_format.MessageToString(m, as_one_line=True, as_utf8=True)
    return f"{type(req).__name__} {{{text}}}" + (f" [{'; '.join(notes)}]" if notes else "")


def keep_log(src: Path, dst: Path, limit: int = 8 << 20) -> None:
    """A copy of a daemon log; a huge one (a log flood) keeps only its first and last ``limit`` bytes."""
    size = src.stat().st_size
    if size <= 2 * limit:
        shutil.copy(src, dst)
        return
    with open(src, "rb") as f, open(dst, "wb") as out:
        out.write(f.read(limit))
        out.write(b"\n[... %d bytes left out ...]\n" % (size - 2 * limit))
        f.seek(size - limit)
        out.write(f.read())


def guard_memory(pid: int) -> None:
    """Cap the daemon's address space a little above what it uses now (see the module docstring)."""
    with open(f"/proc/{pid}/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.prlimit(pid, resource.RLIMIT_AS, (vm + GUARD_BYTES, vm + GUARD_BYTES))


FRESH = b"fresh"  # a memfd handle whose token the attach fuzz replaces with a real one

BUG_LINES = re.compile(r"unexpected error in RPC|background task failed|tick failed|transfer thread command failed|"
                       r"transfer thread poll failed|Task exception was never retrieved|Exception in callback|"
                       r"Fatal Python error|Segmentation fault|raised by servicer method|raised in core by servicer")


def bug_lines(log: str) -> list[str]:
    """Log lines that show an unhandled error (grpc's own DecodeError of garbage requests excepted)."""
    return [line[:400] for line in log.splitlines() if BUG_LINES.search(line) and "[DecodeError]" not in line]


def test_fuzz_daemon_pair(daemon_factory: Any, kv_pair: tuple[KV, KV]) -> None:
    # the fuzzer's made-up peers all handshake from loopback, one identity: no bound on its sessions
    p, d = daemon_factory.pair(settings={"transfer": {"publish_timeout_s": 20.0, "expect_timeout_s": 20.0},
                                         "peer_api": {"max_sessions_per_peer": 1_000_000}})
    src, dst = kv_pair
    pw, dw = attach_pair(p, d, src, dst)
    fsrc = make_kv("kvpushd-fuzz-src", F_REGIONS, F_BLOCKS, F_BLOCK_LEN, seed=3)
    fdst = make_kv("kvpushd-fuzz-dst", F_REGIONS, F_BLOCKS, F_BLOCK_LEN, fill="poison")
    fcap = make_kv("kvpushd-fuzz-cap", F_REGIONS, F_BLOCKS, F_BLOCK_LEN, fill="poison")
    attach_kv = make_kv("kvpushd-fuzz-att", 1, 64, 1024, fill="poison")
    fake = FakePeer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=[fake], options=OPTS)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        run_fuzz(p, d, pw, dw, src, dst, fsrc, fdst, fcap, attach_kv, fake, port)
    finally:
        server.stop(None)
        for kv in (fsrc, fdst, fcap, attach_kv):
            kv.close()


def run_fuzz(p: DaemonProc, d: DaemonProc, pw: Any, dw: Any, src: KV, dst: KV, fsrc: KV, fdst: KV, fcap: KV,
             attach_kv: KV, fake: FakePeer, port: int) -> None:
    traffic = Traffic(p, pw, dw, src, dst)
    problems: list[str] = []

    def attempt(what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            problems.append(f"{what}: {type(e).__name__}: {e}")
            return None

    try:
        def raw(x: DaemonProc, engine: str, role: Role, kv: KV) -> RawWorker:
            chan = grpc.insecure_channel(f"unix:{x.sock}", options=OPTS)
            mem = [kv.buf.memory]
            attach = Attach(engine, role, 0, 1, mem, kv.region_list, 0, "fuzz worker")
            return RawWorker(chan, _convert.attach_request(attach, hand_over(x.sock, mem)))

        fuzzp, fuzzd, fuzzc = (raw(p, "fuzzp", Role.PRODUCER, fsrc), raw(d, "fuzzd", Role.CONSUMER, fdst),
                               raw(d, "fuzzc", Role.CONSUMER, fcap))
        fz = Fuzz(p, d, fake, f"127.0.0.1:{port}", f"localhost:{port}", fuzzp, fuzzd, fuzzc, fsrc, fcap, attach_kv)
        # the decode daemon registers the capture consumer's agent with the fake peer: keep its metadata
        fz.command("setup", fuzzc, "expect", worker_pb2.ExpectRequest(
            transfer_id="capture", block_ids=[0], producer_address=fz.fake_addr, producer_engine_id="fuzzp",
            producer_tp_size=1), want=("OK", lambda c: c is grpc.StatusCode.OK))
        assert wait_for(lambda: fake.captured is not None, 30), f"no registration reached the fake peer: {fake.calls}"
        fz.command("setup", fuzzc, "abort", worker_pb2.AbortRequest(transfer_id="capture"))
        for daemon in ("p", "d"):
            fz.handshake(daemon, fz.fake_addr2)
        for x in (p, d):
            guard_memory(x.proc.pid)

        traffic.start()
        # agent last: a bug it finds may wedge the prefill daemon's transfer thread for the rest of the run
        chosen = os.environ.get("KVPUSHD_FUZZ_TARGETS",
                                "peer_raw,worker_raw,peer_msg,worker_msg,attach,cross_peer,agent")
        for name in chosen.split(","):
            t0 = time.monotonic()
            fz.deadline = t0 + BUDGET_S * {"worker_msg": 1.5, "attach": 1.5, "agent": 2}.get(name, 1)
            getattr(fz, name)()
            fz.info.append(f"{name}: {time.monotonic() - t0:.1f}s")
    finally:
        traffic.stop_event.set()
        traffic.join(90)

    # a daemon already seen hanging is not waited for at length again
    wedged = any("no completion" in a.problem or "hang" in a.problem for a in fz.anomalies.values())
    grace = 5.0 if wedged else 25.0
    # clean up what the fuzzer left pending: its registrations, its workers' transfers
    by_origin: dict[tuple[str, str], list[Registration]] = collections.defaultdict(list)
    for r in fz.registrations:
        by_origin[(r.daemon, r.origin)].append(r)
    for (daemon, origin), regs in by_origin.items():  # one batch per origin (a forgotten one is refused)
        batch = peer_pb2.PeerBatch()
        for i, r in enumerate(regs[:4096], 1):
            batch.items.add(seq=i, withdraw=peer_pb2.FailNotice(
                transfer_id=r.transfer_id, registration_id=r.registration_id, code=common_pb2.FAILURE_ABORTED,
                reason="fuzz cleanup"))
        fz.call("cleanup", daemon, "peer", PEER_SVC, "Channel", batch, instance=origin)
    for w in fz.workers.values():
        aborts = [worker_pb2.Command(abort=worker_pb2.AbortRequest(transfer_id=tid))
                  for wid, tid in fz.accepted if wid == w.worker_id]
        for i in range(0, len(aborts), 4096):
            for r in w.batch(aborts[i:i + 4096]):
                fz.judge_item("cleanup", "Stream.abort", r.code if r else "", r.message if r else "",
                              worker_pb2.AbortRequest())

    def all_completed() -> bool:
        fz.collect()
        return all(fz.got.get(k) for k in fz.accepted)

    wait_for(all_completed, grace)
    for k, n in fz.accepted.items():
        if not fz.got.get(k) or len(fz.got[k]) > n:
            problems.append(f"{k}: accepted {n} time(s), completions {fz.got.get(k)}")
    for k, comps in fz.got.items():
        if k not in fz.accepted:
            problems.append(f"completion(s) for a transfer the daemon never accepted: {k}: {comps}")

    def idle() -> bool:
        return not p.client.status().transfers and not d.client.status().transfers

    if not attempt("status", lambda: wait_for(idle, grace)):
        for x in (p, d):
            for t in attempt("status", lambda x=x: x.client.status().transfers) or []:
                problems.append(f"{x.name} still has a pending transfer: {t.transfer_id!r} side {t.side} "
                                f"state {t.state} waiting for {t.waiting_for} worker {t.worker_id}")
    attempt("detach of the fuzz producer worker", fz.fuzzp.detach)
    attempt("detach of the fuzz consumer worker", fz.fuzzd.detach)
    attempt("detach of the capture consumer worker", fz.fuzzc.detach)
    for x in (p, d):
        status = attempt(f"{x.name} status", x.client.status)
        if status is None:
            continue
        engines = sorted(w.engine_id for w in status.workers)
        if engines not in (["prefill"], ["decode"]):
            problems.append(f"{x.name}: workers left attached: {engines}")
        if getattr(status, "watchers", 0):
            problems.append(f"{x.name}: {status.watchers} Watch subscription(s) left after their calls ended")

    def final_transfer() -> None:  # the real pair still works, and nothing else wrote into its memory
        dw.send(Expect("final", (1, 2), p.peer_address, "prefill", 1))
        pw.send(Publish("final", (3, 4)))
        cd, cp = dw.next_completion(grace), pw.next_completion(grace)
        if cd is None or cd.kind is not CompletionKind.FINISHED_RECEIVING or cp is None \
                or cp.kind is not CompletionKind.FINISHED_SENDING:
            problems.append(f"a correct transfer after fuzzing failed: decode {cd}, prefill {cp}")
        dst.arr[:, [1, 2]] = POISON
        if not (dst.arr == POISON).all():
            problems.append(f"{int(np.count_nonzero(dst.arr != POISON))} bytes of the real decode memory changed")

    attempt("a correct transfer after fuzzing", final_transfer)
    fz.close()

    alive = {x.name: x.proc.poll() for x in (p, d)}
    stop_s = {}
    for x in (p, d):
        if x.proc.poll() is None:
            x.proc.send_signal(signal.SIGTERM)
    for x in (p, d):
        t0 = time.monotonic()
        try:
            x.proc.wait(10 if wedged else 40)
        except subprocess.TimeoutExpired:
            x.proc.kill()
            x.proc.wait()
        stop_s[x.name] = time.monotonic() - t0
    logs = {x.name: x.logs() for x in (p, d)}

    summary = ["fuzzed calls per target (method:status -> count):"]
    for target, counts in fz.stats.items():
        summary.append(f"  {target}: {sum(counts.values())} calls ({fz.call_s[target]:.1f}s), "
                       f"{dict(sorted(counts.items()))}"
                       + (f", {fz.skipped[target]} examples skipped (time budget)" if fz.skipped[target] else ""))
    summary.append("most frequent refusals per target:")
    for target, counts in fz.reasons.items():
        summary += [f"  {target}: {n} x {k}" for k, n in counts.most_common(6)]
    summary.append(f"correct transfers alongside: {traffic.ok} finished bit-exact, slowest {traffic.slowest:.1f}s")
    summary.append(f"fake peer saw: {dict(fake.calls)}")
    ends = collections.Counter(f"{c.kind.name}:{c.code}:{re.sub(r'[0-9]+', '#', c.reason)[:70]}"
                               for comps in fz.got.values() for c in comps)
    summary.append("completions of the fuzz workers' transfers:\n    " + "\n    ".join(
        f"{n} x {k}" for k, n in ends.most_common(25)))
    summary += [f"info: {s}" for s in fz.info]
    summary.append("stop on SIGTERM: " + ", ".join(f"{k} {v:.1f}s" for k, v in stop_s.items()))
    summary += [f"slow: {s}" for s in fz.slow[:10]]
    summary += [f"note: {s}" for s in fz.notes]
    print("\n".join(summary))

    for a in fz.anomalies.values():
        problems.append(f"[{a.target}] {a.method}: {a.problem} (x{a.count}, {a.seconds:.1f}s): {a.status}: "
                        f"{a.details}\n      request: {a.request}")
    problems += [f"correct traffic: {e}" for e in traffic.errors]
    if traffic.ok < 3:
        problems.append(f"only {traffic.ok} correct transfers finished alongside the fuzzing")
    for name, rc in alive.items():
        if rc is not None:
            problems.append(f"daemon {name} died during the fuzzing (exit {rc})")
    for x in (p, d):
        if x.proc.returncode != 0:
            problems.append(f"daemon {x.name} exited {x.proc.returncode} on SIGTERM (after {stop_s[x.name]:.0f}s)")
        elif stop_s[x.name] > 15:
            problems.append(f"daemon {x.name} took {stop_s[x.name]:.0f}s to stop on SIGTERM")
        lines = bug_lines(logs[x.name])
        if lines:
            unique = list(dict.fromkeys(re.sub(r'"timestamp": "[^"]*"', "", line) for line in lines))
            problems.append(f"daemon {x.name} logged {len(lines)} error line(s), e.g.:\n      "
                            + "\n      ".join(unique[:6]))
    if problems:
        keep = Path(tempfile.mkdtemp(prefix="kvpushd-fuzz-logs-"))
        for x in (p, d):
            keep_log(x.log, keep / x.log.name)
        problems.append(f"daemon logs kept in {keep}")
    assert not problems, "\n".join(summary) + "\n\nPROBLEMS:\n  " + "\n  ".join(problems)
