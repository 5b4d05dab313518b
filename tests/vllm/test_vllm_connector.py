"""KVPushdConnector inside vLLM 0.33.0: its own Scheduler, real worker-side calls, real daemons.

Runs with the vLLM venv (``bash scripts/vllm_venv.sh``; ``make test`` does both)::

    KVPUSHD_PYTHON=.venv/bin/python .venv-vllm/bin/python -m pytest -q -p no:cacheprovider \
        tests/vllm/test_vllm_connector.py

Daemons run under ``KVPUSHD_PYTHON`` (the vLLM venv has no nixl). Under an interpreter without vLLM
the module is skipped; the clean-venv install check runs in the vLLM run only, so once per make test.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

# vllm.distributed, not vllm: in a venv without vLLM, this directory (tests/vllm) would pass for a
# namespace package named vllm.
pytest.importorskip("vllm.distributed", reason="needs vLLM 0.33.0: run with the venv scripts/vllm_venv.sh builds")

import torch
import vllm_support as vs
from engine_support import POISON, Engine, step_until_moved
from kvpushd_client import MemfdMemory
from kvpushd_client.vllm.layout import describe_kv_caches, owned_memfd_names
from kvpushd_client.vllm.metadata import (
    COMPAT_HASH,
    COMPAT_HASH_KEY,
    ExpectReq,
    KVPushdConnectorMetadata,
    PublishReq,
)
from vllm.v1.request import RequestStatus

P_ENGINE = "prefill-engine-001"
D_ENGINE = "decode-engine-001"
DAEMON_CONFIG = "[transfer]\npublish_timeout_s = 3.0\nexpect_timeout_s = 60.0\ndrain_timeout_s = 3.0\n"


x_request_id, engine_request_id = vs.x_request_id, vs.engine_request_id


# ------------------------------------------------------------------------------------------------
# Fixtures


workdir, model_dir, daemons = vs.pd_fixtures("kvpushd-vllm-", DAEMON_CONFIG)


# ------------------------------------------------------------------------------------------------
# Scheduler side: vLLM's own Scheduler with the connector loaded by module path


def test_decode_request_waits_for_remote_kv(model_dir: Path) -> None:
    cfg = vs.make_vllm_config(model_dir, "kv_consumer", D_ENGINE, "/nonexistent/kvpushd.sock")
    s = vs.create_scheduler(cfg, vs.simple_kv_cache_config(100, 16))
    assert type(s.connector).__name__ == "KVPushdConnector"
    start_free = vs.num_free_blocks(s)
    x = x_request_id()
    req = vs.create_request(engine_request_id(x), 40, 3, vs.decode_params(P_ENGINE, "10.0.0.1:7700", x, 2), 16)
    rid = req.request_id
    s.add_request(req)

    so = s.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert so.total_num_scheduled_tokens == 0 and req.num_computed_tokens == 40
    meta = so.kv_connector_metadata
    assert isinstance(meta, KVPushdConnectorMetadata) and not meta.publishes and not meta.aborts
    (e,) = meta.expects
    (allocated,) = s.kv_cache_manager.get_block_ids(rid)
    assert e == ExpectReq(rid, f"cmpl-{x}-0", tuple(allocated), "10.0.0.1:7700", P_ENGINE, 2)
    assert len(allocated) == 3 and vs.num_free_blocks(s) == start_free - 3
    assert req.kv_transfer_params["do_remote_prefill"] is False  # marks the registration as shipped
    s.update_from_output(so, vs.model_output([]))

    so = s.schedule()  # still waiting: nothing shipped twice
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not so.kv_connector_metadata.expects
    s.update_from_output(so, vs.model_output([], vs.kv_output(finished_recving={rid})))

    so = s.schedule()  # the KV is there: update_state_after_alloc runs again, registers nothing
    assert req.status == RequestStatus.RUNNING and so.num_scheduled_tokens[rid] == 1
    assert not so.kv_connector_metadata.expects
    s.update_from_output(so, vs.model_output([req]))
    so = s.schedule()
    outs = s.update_from_output(so, vs.model_output([req], eos=True))
    assert outs[0].outputs[0].finish_reason is not None and req.is_finished()
    so = s.schedule()
    s.update_from_output(so, vs.model_output([]))
    vs.assert_scheduler_empty(s)
    assert vs.num_free_blocks(s) == start_free
    assert not s.connector.has_pending_push_work()


@pytest.mark.parametrize("progressive", [False, True])
def test_prefill_request_holds_blocks_until_sent(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon],
                                                 progressive: bool) -> None:
    """Without progressive push the publish goes in the step after the request finished; with it (the
    default) it is declared in the step that computes the prompt, and never published again."""
    p, _ = daemons
    cfg = vs.make_vllm_config(model_dir, "kv_producer", P_ENGINE, p.sock, extra={"kvpushd_progressive": progressive})
    s = vs.create_scheduler(cfg, vs.simple_kv_cache_config(100, 16))
    start_free = vs.num_free_blocks(s)
    x = x_request_id()
    req = vs.create_request(engine_request_id(x), 40, 1, vs.prefill_params(), 16)
    rid = req.request_id
    s.add_request(req)

    so = s.schedule()
    (blocks,) = s.kv_cache_manager.get_block_ids(rid)
    declared = [PublishReq(rid, f"cmpl-{x}-0", tuple(blocks), declared=True)] if progressive else []
    assert so.kv_connector_metadata.publishes == declared
    assert s.connector.has_pending_block_frees() is progressive  # no preemption until it finished
    outs = s.update_from_output(so, vs.model_output([req]))
    assert not s.connector.has_pending_block_frees()
    params = outs[0].outputs[0].kv_transfer_params
    host, port = p.peer_address.rsplit(":", 1)
    assert params["remote_host"] == host and params["remote_port"] == int(port)  # the daemon, not NIXL
    assert params["remote_engine_id"] == P_ENGINE and params["tp_size"] == 1 and params["pp_size"] == 1
    assert params["do_remote_prefill"] is True and params["transfer_mode"] == "push"
    assert params["transfer_id"] == f"cmpl-{x}-0"
    assert params[COMPAT_HASH_KEY] == COMPAT_HASH
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert rid in s.requests and vs.num_free_blocks(s) == start_free - len(blocks)  # held
    assert s.has_requests() and s.connector.has_pending_push_work()

    so = s.schedule()
    meta = so.kv_connector_metadata
    published = [] if progressive else [PublishReq(rid, f"cmpl-{x}-0", tuple(blocks))]
    assert meta.publishes == published and rid in so.finished_req_ids
    s.update_from_output(so, vs.model_output([]))
    assert rid in s.requests and s.connector.has_pending_push_work()  # still held: nothing sent yet

    so = s.schedule()
    s.update_from_output(so, vs.model_output([], vs.kv_output(finished_sending={rid})))
    assert not s.connector.has_pending_push_work() and not s.has_requests()
    vs.assert_scheduler_empty(s)
    assert vs.num_free_blocks(s) == start_free


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_takes_the_failure_policy(model_dir: Path, policy: str) -> None:
    cfg = vs.make_vllm_config(model_dir, "kv_consumer", D_ENGINE, "/nonexistent/kvpushd.sock", policy=policy)
    s = vs.create_scheduler(cfg, vs.simple_kv_cache_config(100, 16))
    start_free = vs.num_free_blocks(s)
    x = x_request_id()
    req = vs.create_request(engine_request_id(x), 40, 2, vs.decode_params(P_ENGINE, "10.0.0.1:7700", x), 16)
    rid = req.request_id
    s.add_request(req)
    so = s.schedule()
    (e,) = so.kv_connector_metadata.expects
    s.update_from_output(so, vs.model_output([]))

    # What the worker connector reports for a failed receive: finished, and every block in error.
    so = s.schedule()
    outs = s.update_from_output(so, vs.model_output(
        [], vs.kv_output(finished_recving={rid}, invalid_block_ids=set(e.block_ids))))
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
        assert outs[0].outputs[0].finish_reason is not None
        so = s.schedule()
        s.update_from_output(so, vs.model_output([]))
    else:
        so = s.schedule()  # recomputed locally from the first token
        assert req.status == RequestStatus.RUNNING and so.num_scheduled_tokens[rid] == 40
        assert not so.kv_connector_metadata.expects  # no second registration
        s.update_from_output(so, vs.model_output([req]))
        so = s.schedule()
        s.update_from_output(so, vs.model_output([req], eos=True))
        assert req.is_finished()
        so = s.schedule()
        s.update_from_output(so, vs.model_output([]))
    vs.assert_scheduler_empty(s)
    assert vs.num_free_blocks(s) == start_free


def test_bad_remote_params_fall_back_to_local_prefill(model_dir: Path) -> None:
    cfg = vs.make_vllm_config(model_dir, "kv_consumer", D_ENGINE, "/nonexistent/kvpushd.sock")
    s = vs.create_scheduler(cfg, vs.simple_kv_cache_config(100, 16))
    x = x_request_id()
    params = vs.decode_params(P_ENGINE, "10.0.0.1:7700", x)
    params["remote_host"] = None
    req = vs.create_request(engine_request_id(x), 40, 1, params, 16)
    s.add_request(req)
    so = s.schedule()
    assert req.status == RequestStatus.RUNNING and so.num_scheduled_tokens[req.request_id] == 40
    assert not so.kv_connector_metadata.expects


def test_other_wire_format_falls_back_to_local_prefill(model_dir: Path) -> None:
    """A prefill connector with another compatibility hash: prefilled here; none at all: as before."""
    cfg = vs.make_vllm_config(model_dir, "kv_consumer", D_ENGINE, "/nonexistent/kvpushd.sock")
    s = vs.create_scheduler(cfg, vs.simple_kv_cache_config(100, 16))
    x, y = x_request_id(), x_request_id()
    other = vs.decode_params(P_ENGINE, "10.0.0.1:7700", x)
    other[COMPAT_HASH_KEY] = "0" * 16
    older = vs.decode_params(P_ENGINE, "10.0.0.1:7700", y)
    older.pop(COMPAT_HASH_KEY, None)
    r1 = vs.create_request(engine_request_id(x), 40, 1, other, 16)
    r2 = vs.create_request(engine_request_id(y), 40, 1, older, 16)
    s.add_request(r1)
    s.add_request(r2)
    so = s.schedule()
    assert r1.status == RequestStatus.RUNNING and so.num_scheduled_tokens[r1.request_id] == 40
    assert r2.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [e.req_id for e in so.kv_connector_metadata.expects] == [r2.request_id]


# ------------------------------------------------------------------------------------------------
# Worker side against live daemons


@pytest.fixture(scope="module")
def engines(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> Iterator[tuple[Engine, Engine]]:
    p, d = daemons
    pe = Engine(model_dir, "kv_producer", P_ENGINE, p.sock, num_blocks=48, fill="random")
    de = Engine(model_dir, "kv_consumer", D_ENGINE, d.sock, num_blocks=64, fill="poison")
    yield pe, de
    pe.close()
    de.close()


def test_kv_layout_is_vllms_cpu_layout(engines: tuple[Engine, Engine]) -> None:
    pe, _ = engines
    names = list(pe.kv)
    t0 = pe.kv[names[0]]
    assert t0.shape == (48, 2, 32, 128)  # [blocks, kv heads, block size, K|V of head size 64]
    memory, regions, _ = describe_kv_caches(pe.kv, 48)
    page = 2 * 32 * 128 * 4
    assert len(memory) == 1 and owned_memfd_names(memory)[0].startswith("kvpushd-kv-")  # moved to a memfd
    assert [(r.num_blocks, r.block_len, r.block_stride) for r in regions] == [(48, page, page)] * len(names)
    assert regions[1].offset - regions[0].offset == 48 * page  # layer-compact: layer 1 after layer 0


def random_prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(int(uuid.uuid4().int & 0xFFFFFFFF))
    return [int(t) + 3 for t in torch.randint(0, 120, (n,), generator=g)]


@pytest.mark.parametrize("layout", ["split", "joined", "head_outer"])
def test_other_kv_layouts(layout: str) -> None:
    nb, n, h, d = 10, 16, 2, 8  # blocks, block size, kv heads, head size (float32)
    page = n * h * d * 4
    if layout == "split":  # [2, B, N, H, D]: K of every block, then V of every block
        kv = {f"l.{i}": torch.zeros(2, nb, n, h, d).share_memory_() for i in range(2)}
        want = [(0, page, page), (nb * page, page, page)]
    elif layout == "joined":  # [B, 2, N, H, D]: a block holds its K and V
        kv = {f"l.{i}": torch.zeros(nb, 2, n, h, d).share_memory_() for i in range(2)}
        want = [(0, 2 * page, 2 * page)]
    else:  # [B, H, N, 2D] stored head-major over blocks: one region per head
        kv = {f"l.{i}": torch.zeros(h, nb, n, 2 * d).permute(1, 0, 2, 3).share_memory_() for i in range(2)}
        want = [(0, 2 * page // h, 2 * page // h), (nb * 2 * page // h, 2 * page // h, 2 * page // h)]
    memory, regions, _ = describe_kv_caches(kv, nb)
    assert len(memory) == 2  # one shared-memory object per storage
    for mi in range(2):
        mine = [r for r in regions if r.memory_index == mi]
        base = mine[0].offset
        assert [(r.offset - base, r.block_len, r.block_stride) for r in mine] == want
        assert all(r.num_blocks == nb for r in mine)


def test_private_host_kv_is_refused_unless_moved() -> None:
    kv = {"l.0": torch.ones(4, 2, 16, 8)}
    with pytest.raises(RuntimeError, match="kvpushd_host_kv_to_shm"):
        describe_kv_caches(kv, 4)
    view = kv["l.0"][1:3]
    memory, regions, _ = describe_kv_caches(kv, 4, host_kv_to_shm=True)
    assert isinstance(memory[0], MemfdMemory) and fcntl.fcntl(memory[0].fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
    assert owned_memfd_names(memory)[0].startswith("kvpushd-kv-")
    assert bool((view == 1).all()) and kv["l.0"].is_shared()  # moved in place: views still see the data
    assert regions[0].block_len == 2 * 16 * 8 * 4


def run_pd_request(pe: Engine, de: Engine, p_daemon: vs.Daemon, prompt: list[int], p_engine: str = P_ENGINE,
                   ) -> None:
    """One request through both engines, as the demo proxy sends it: both at once, same X-Request-Id."""
    x = x_request_id()
    d_req = vs.create_request(engine_request_id(x), len(prompt), 2,
                              vs.decode_params(p_engine, p_daemon.peer_address,
                                               x, tp_size=len(pe.ranks)), 32, prompt)
    p_req = vs.create_request(engine_request_id(x), len(prompt), 1, vs.prefill_params(), 32, prompt)
    d_start, p_start = vs.num_free_blocks(de.sched), vs.num_free_blocks(pe.sched)
    de.sched.add_request(d_req)
    pe.sched.add_request(p_req)

    de.step()  # decode: allocate, register (Expect) through the worker
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    outs = pe.step([p_req])  # prefill: the forward "computes" the KV, the request finishes
    assert p_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    params = outs[0].outputs[0].kv_transfer_params
    assert f"{params['remote_host']}:{params['remote_port']}" == p_daemon.peer_address

    step_until_moved(pe, de, p_req.request_id, d_req.request_id)  # (decode would run its request next)
    (e,) = [e for e in de.expects() if e.req_id == d_req.request_id]
    (pub,) = [p for p in pe.publishes() if p.req_id == p_req.request_id]
    assert e.transfer_id == pub.transfer_id == f"cmpl-{x}-0"
    assert len(pub.block_ids) == -(-len(prompt) // 32)
    # Decode registers only blocks its own prefix cache did not have: they get prefill's tail.
    src = list(pub.block_ids[len(pub.block_ids) - len(e.block_ids):])
    for (_, pkv), (_, dkv) in zip(pe.ranks, de.ranks, strict=True):  # decode rank r <- prefill rank r
        for name in pkv:  # every byte of every layer's blocks arrived
            assert torch.equal(dkv[name][list(e.block_ids)], pkv[name][src])
    assert p_req.request_id not in pe.sched.requests and vs.num_free_blocks(pe.sched) == p_start

    outs = de.step([d_req])  # decode runs: only the last prompt token is recomputed
    assert d_req.status == RequestStatus.RUNNING
    de.step([d_req], eos=True)
    assert d_req.is_finished()
    de.step()
    vs.assert_scheduler_empty(de.sched)
    assert vs.num_free_blocks(de.sched) == d_start
    for _, dkv in de.ranks:  # clean the decode blocks for the next "nothing else changed" check
        for name in dkv:
            dkv[name][list(e.block_ids)] = POISON


def all_poison(de: Engine) -> bool:
    return all(bool((t == POISON).all()) for _, kv in de.ranks for t in kv.values())


def test_request_end_to_end_through_the_worker_hooks(engines: tuple[Engine, Engine],
                                                     daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    pe, de = engines
    first = random_prompt(112)  # 3.5 blocks
    run_pd_request(pe, de, daemons[0], first)
    assert all_poison(de)  # nothing outside the registered blocks changed
    run_pd_request(pe, de, daemons[0], random_prompt(40))
    assert all_poison(de)
    # Both prefix caches hold the first two blocks: decode registers two blocks, prefill publishes
    # four, the daemon writes the last two.
    run_pd_request(pe, de, daemons[0], first[:64] + random_prompt(36))
    (e,) = de.expects()[-1:]
    assert len(e.block_ids) == 2
    assert all_poison(de)


def test_tensor_parallel_ranks(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """TP=2 on both sides: every rank attaches with its rank, decode expects producer TP 2, and
    vLLM's aggregator sees the request finished only when both ranks reported it."""
    p, d = daemons
    pe = Engine(model_dir, "kv_producer", "prefill-tp2", p.sock, num_blocks=40, fill="random", tp=2)
    de = Engine(model_dir, "kv_consumer", "decode-tp2", d.sock, num_blocks=48, fill="poison", tp=2)
    try:
        run_pd_request(pe, de, p, random_prompt(70), p_engine="prefill-tp2")
        assert de.expects()[-1].producer_tp_size == 2
        assert all_poison(de)
    finally:
        pe.close()
        de.close()


def test_decode_abort_releases_both_nodes(engines: tuple[Engine, Engine],
                                          daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    pe, de = engines
    p_daemon = daemons[0]
    x = x_request_id()
    prompt = random_prompt(64)
    d_req = vs.create_request(engine_request_id(x), 64, 2, vs.decode_params(P_ENGINE, p_daemon.peer_address, x), 32,
                              prompt)
    d_start, p_start = vs.num_free_blocks(de.sched), vs.num_free_blocks(pe.sched)
    de.sched.add_request(d_req)
    de.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    tid = f"cmpl-{x}-0"
    assert vs.wait_for(lambda: tid in p_daemon.transfer_ids())

    de.sched.finish_requests(d_req.request_id, RequestStatus.FINISHED_ABORTED)
    assert d_req.request_id in de.sched.requests  # vLLM holds the blocks until the worker lets go
    de.step()
    assert any(a.transfer_id == tid for a in de.metas[-1].aborts)
    assert vs.wait_for(lambda: de.step() is not None and d_req.request_id not in de.sched.requests, 30)
    vs.assert_scheduler_empty(de.sched)
    assert vs.num_free_blocks(de.sched) == d_start
    assert vs.wait_for(lambda: tid not in p_daemon.transfer_ids())  # withdrawn on the prefill node too

    # Prefill finishes later and publishes: its daemon no longer holds decode's registration, so
    # nothing is written into decode's (freed) blocks; the publish times out and prefill frees.
    p_req = vs.create_request(engine_request_id(x), 64, 1, vs.prefill_params(), 32, prompt)
    pe.sched.add_request(p_req)
    pe.step([p_req])
    assert p_req.status == RequestStatus.FINISHED_LENGTH_CAPPED and p_req.request_id in pe.sched.requests
    assert vs.wait_for(lambda: pe.step() is not None and p_req.request_id not in pe.sched.requests, 60)
    vs.assert_scheduler_empty(pe.sched)
    assert vs.num_free_blocks(pe.sched) == p_start
    assert all_poison(de)


def test_decode_daemon_restart(engines: tuple[Engine, Engine], daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    pe, de = engines
    p_daemon, d_daemon = daemons
    x = x_request_id()
    prompt = random_prompt(64)
    d_req = vs.create_request(engine_request_id(x), 64, 2, vs.decode_params(P_ENGINE, p_daemon.peer_address, x), 32,
                              prompt)
    d_start = vs.num_free_blocks(de.sched)
    de.sched.add_request(d_req)
    de.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert [e.req_id for e in de.expects()][-1:] == [d_req.request_id]
    link = de.conn.worker_side.link
    epoch = link.epoch
    tid = f"cmpl-{x}-0"  # registered with the prefill daemon: the Expect ran on this attachment
    assert vs.wait_for(lambda: tid in p_daemon.transfer_ids())

    d_daemon.kill()
    assert vs.wait_for(lambda: not link.connected, 30)  # the session stream broke
    d_daemon.start()
    d_daemon.wait_ready()

    # The next step reports the receive that cannot complete any more: finished, and failed by
    # request id (failed_recving), so vLLM's kv_load_failure_policy ("fail" here) applies and the
    # blocks are freed.
    de.step()
    assert de.last_kv.finished_recving == {d_req.request_id}
    assert de.last_kv.failed_recving == {d_req.request_id} and not de.last_kv.invalid_block_ids
    assert d_req.status == RequestStatus.FINISHED_ERROR
    de.step()
    assert not de.last_kv.finished_recving and not de.last_kv.failed_recving  # failed once
    vs.assert_scheduler_empty(de.sched)
    assert vs.num_free_blocks(de.sched) == d_start

    assert vs.wait_for(lambda: link.connected, 30)  # re-attached with the same memory
    assert link.epoch == epoch + 1
    # Declined once re-attached (the prefill daemon may wait for a registration that will never come).
    assert vs.wait_for(lambda: "transfer declined" in d_daemon.logs() and link.declines_pending == 0, 30)
    run_pd_request(pe, de, p_daemon, random_prompt(80))
    assert all_poison(de)


def test_decode_daemon_down_when_the_request_came(model_dir: Path, workdir: Path) -> None:
    """The decode daemon is down when the decode request arrives: its Expect cannot be made, so the
    connector declines the transfer once re-attached, and the prefill daemon frees the request's
    blocks then, not at publish_timeout_s (120 s here)."""
    cfg = "[transfer]\npublish_timeout_s = 120.0\nexpect_timeout_s = 60.0\ndrain_timeout_s = 3.0\n"
    p, d = vs.spawn_daemon(workdir, "pnode-dl", cfg), vs.spawn_daemon(workdir, "dnode-dl", cfg)
    p.wait_ready()
    d.wait_ready()
    pe = Engine(model_dir, "kv_producer", "prefill-dl", p.sock, num_blocks=40, fill="random")
    de = Engine(model_dir, "kv_consumer", "decode-dl", d.sock, num_blocks=40, fill="poison")
    try:
        x, prompt = x_request_id(), random_prompt(64)
        p_req = vs.create_request(engine_request_id(x), 64, 1, vs.prefill_params(), 32, prompt)
        p_start, d_start = vs.num_free_blocks(pe.sched), vs.num_free_blocks(de.sched)
        pe.sched.add_request(p_req)
        pe.step([p_req])  # prefill done first: published (next step), its blocks held for the decode side
        tid = f"cmpl-{x}-0"
        assert vs.wait_for(lambda: pe.step() is not None and tid in p.transfer_ids())

        link = de.conn.worker_side.link
        d.kill()
        assert vs.wait_for(lambda: not link.connected, 30)
        d_req = vs.create_request(engine_request_id(x), 64, 2,
                                  vs.decode_params("prefill-dl", p.peer_address, x), 32, prompt)
        de.sched.add_request(d_req)
        # The Expect is refused (no daemon): the load fails and vLLM's policy ("fail") ends the request.
        assert vs.wait_for(lambda: de.step() is not None and d_req.is_finished(), 30)
        de.step()
        vs.assert_scheduler_empty(de.sched)
        assert vs.num_free_blocks(de.sched) == d_start
        time.sleep(1.0)
        assert tid in p.transfer_ids() and p_req.request_id in pe.sched.requests  # nobody could tell prefill

        d.start()
        d.wait_ready()
        back = time.monotonic()
        assert vs.wait_for(lambda: pe.step() is not None and p_req.request_id not in pe.sched.requests, 20)
        print(f"prefill blocks freed {time.monotonic() - back:.2f}s after the decode daemon answered")
        vs.assert_scheduler_empty(pe.sched)
        assert vs.num_free_blocks(pe.sched) == p_start
        assert tid not in p.transfer_ids()
        assert vs.wait_for(lambda: link.connected, 30)
        run_pd_request(pe, de, p, random_prompt(80), p_engine="prefill-dl")  # and it serves again
    finally:
        pe.close()
        de.close()
        for x_ in (p, d):
            x_.stop()


def worker_calls(d: vs.Daemon, engine_id: str) -> tuple[int, int]:
    """(command batches, stream commands) of the engine's worker(s) on daemon ``d``."""
    from kvpushd_client import KVPushClient

    with KVPushClient(d.sock, timeout_s=5.0) as c:
        ws = [w for w in c.status().workers if w.engine_id == engine_id]
    assert ws, f"no worker of {engine_id} on {d.name}"
    return sum(w.command_batches for w in ws), sum(w.stream_commands for w in ws)


def commands_in(metas: list[KVPushdConnectorMetadata]) -> list[int]:
    return [len(m.expects) + len(m.publishes) + len(m.aborts) for m in metas]


def test_connector_sends_one_command_batch_per_step(engines: tuple[Engine, Engine],
                                                    daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """A step's Expects, Publishes and Aborts reach the daemon as ONE CommandBatch on the worker stream,
    sent once per step whichever hooks ran."""
    pe, de = engines
    p_daemon, d_daemon = daemons
    assert type(de.conn.worker_side.link).__name__ == "ReconnectingStreamWorker"
    d0, p0 = worker_calls(d_daemon, D_ENGINE), worker_calls(p_daemon, P_ENGINE)
    n_de, n_pe = len(de.metas), len(pe.metas)
    run_pd_request(pe, de, p_daemon, random_prompt(48))

    # Three decode requests scheduled in one step: one batch of three Expects, then one of three Aborts.
    reqs = []
    for _ in range(3):
        x = x_request_id()
        r = vs.create_request(engine_request_id(x), 40, 2, vs.decode_params(P_ENGINE, p_daemon.peer_address, x),
                              32, random_prompt(40))
        de.sched.add_request(r)
        reqs.append(r)
    before = worker_calls(d_daemon, D_ENGINE)
    de.step()
    assert len(de.metas[-1].expects) == 3
    assert vs.wait_for(lambda: worker_calls(d_daemon, D_ENGINE) == (before[0] + 1, before[1] + 3))
    tids = {e.transfer_id for e in de.metas[-1].expects}
    assert vs.wait_for(lambda: tids <= p_daemon.transfer_ids())
    de.sched.finish_requests([r.request_id for r in reqs], RequestStatus.FINISHED_ABORTED)
    de.step()
    assert len(de.metas[-1].aborts) == 3
    assert vs.wait_for(lambda: de.step() is not None and not any(r.request_id in de.sched.requests for r in reqs), 30)
    vs.assert_scheduler_empty(de.sched)
    assert vs.wait_for(lambda: not tids & p_daemon.transfer_ids())

    want_de = sum(1 for n in commands_in(de.metas[n_de:]) if n)
    want_pe = sum(1 for n in commands_in(pe.metas[n_pe:]) if n)
    assert want_de >= 3 and want_pe >= 1
    d1, p1 = worker_calls(d_daemon, D_ENGINE), worker_calls(p_daemon, P_ENGINE)
    assert (d1[0] - d0[0], d1[1] - d0[1]) == (want_de, sum(commands_in(de.metas[n_de:])))
    assert (p1[0] - p0[0], p1[1] - p0[1]) == (want_pe, sum(commands_in(pe.metas[n_pe:])))


# ------------------------------------------------------------------------------------------------
# Packaging


def test_client_installs_into_a_clean_venv(tmp_path: Path) -> None:
    """The client distribution needs only its declared dependencies (no nixl, no torch)."""
    src = tmp_path / "client"
    shutil.copytree(vs.REPO / "client", src, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
    venv = tmp_path / "venv"
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(src)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    r = subprocess.run([str(venv / "bin" / "python"), "-c",
                        "import kvpushd_client; from kvpushd_client import KVPushClient; print('ok')"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
    listed = subprocess.run([str(venv / "bin" / "pip"), "list", "--format=freeze"], capture_output=True,
                            text=True, check=True).stdout.lower()
    names = {line.split("==")[0] for line in listed.split()}
    assert "kvpushd-client" in names
    assert not {n for n in names if n.startswith(("nixl", "torch", "vllm"))}, names


def test_prefill_leg_names_its_decode_node(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """A router that binds the transfer puts the decode daemon's node id in the prefill leg's
    kv_transfer_params["kvpushd_consumer_node"] (and/or "kvpushd_consumer_tls_name"); the publish
    carries them (vLLM's proxy sets neither: "")."""
    p, _ = daemons
    cfg = vs.make_vllm_config(model_dir, "kv_producer", P_ENGINE, p.sock)
    s = vs.create_scheduler(cfg, vs.simple_kv_cache_config(100, 16))
    req = vs.create_request(engine_request_id(x_request_id()), 40, 1,
                            {**vs.prefill_params(), "kvpushd_consumer_node": "decode-7",
                             "kvpushd_consumer_tls_name": "decode-7.example"}, 16)
    s.add_request(req)
    so = s.schedule()
    (pub,) = so.kv_connector_metadata.publishes  # declared with the step that computes the prompt
    s.update_from_output(so, vs.model_output([req]))
    so = s.schedule()
    assert not so.kv_connector_metadata.publishes
    assert pub.consumer_node_id == "decode-7" and pub.consumer_tls_name == "decode-7.example"
    s.update_from_output(so, vs.model_output([]))
    so = s.schedule()
    s.update_from_output(so, vs.model_output([], vs.kv_output(finished_sending={req.request_id})))
    assert not s.connector.has_pending_push_work() and not s.has_requests()
