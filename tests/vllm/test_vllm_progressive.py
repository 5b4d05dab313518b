"""Progressive push in KVPushdConnector on vLLM 0.33.0's Scheduler: a prefill leg's publish is declared
in the metadata of the step that computes its prompt's last tokens, the worker hands it to the daemon
before that step's forward and rings the doorbell from ``save_kv_layer``; real daemons and NIXL.

    KVPUSHD_PYTHON=.venv/bin/python .venv-vllm/bin/python -m pytest -q -p no:cacheprovider \
        tests/vllm/test_vllm_progressive.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytest.importorskip("vllm.distributed", reason="needs vLLM 0.33.0: run with the venv scripts/vllm_venv.sh builds")

import torch
import vllm_support as vs
from engine_support import POISON, Engine, step_until_moved
from kvpushd_client.vllm.connector import KVPushdConnector
from kvpushd_client.vllm.metadata import AbortReq, PublishReq
from kvpushd_client.vllm.progress import LayerProgress
from vllm.v1.request import RequestStatus

P_ENGINE = "prefill-prog"
D_ENGINE = "decode-prog"
DAEMON_CONFIG = "[transfer]\npublish_timeout_s = 60.0\nexpect_timeout_s = 60.0\ndrain_timeout_s = 3.0\n"


workdir, model_dir, daemons = vs.pd_fixtures("kvpushd-vllm-prog-", DAEMON_CONFIG)


def scheduler(model_dir: Path, sock: str, **extra: object):  # type: ignore[no-untyped-def]
    cfg = vs.make_vllm_config(model_dir, "kv_producer", P_ENGINE, sock, extra=dict(extra))
    return vs.create_scheduler(cfg, vs.simple_kv_cache_config(100, 16))


def prefill(n: int, max_tokens: int = 1, prompt: list[int] | None = None):  # type: ignore[no-untyped-def]
    x = vs.x_request_id()
    return vs.create_request(vs.engine_request_id(x), n, max_tokens, vs.prefill_params(), 16, prompt), f"cmpl-{x}-0"


def finish_sent(s, req) -> None:  # type: ignore[no-untyped-def]
    """The workers report the push done: vLLM frees the blocks."""
    so = s.schedule()
    s.update_from_output(so, vs.model_output([], vs.kv_output(finished_sending={req.request_id})))
    assert req.request_id not in s.requests


# ------------------------------------------------------------------------------------------------
# Scheduler side


def test_chunked_prefill_declares_in_its_last_chunk(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """600 tokens at 256 per step: chunks of 256, 256, 88; only the last declares, with the 32 blocks
    the first two computed as ready; the kv_transfer_params are today's and nothing is published again."""
    s = scheduler(model_dir, daemons[0].sock)
    start_free = vs.num_free_blocks(s)
    req, tid = prefill(600)
    rid = req.request_id
    s.add_request(req)
    for chunk in (256, 256):
        so = s.schedule()
        assert so.num_scheduled_tokens[rid] == chunk
        assert not so.kv_connector_metadata.publishes  # an earlier chunk declares nothing
        s.update_from_output(so, vs.model_output([req]))
        assert not req.is_finished()
    so = s.schedule()
    assert so.num_scheduled_tokens[rid] == 88
    (table,) = s.kv_cache_manager.get_block_ids(rid)
    (pub,) = so.kv_connector_metadata.publishes  # the step that computes the prompt's last tokens
    assert pub == PublishReq(rid, tid, tuple(table[:38]), declared=True, ready_blocks=32)
    outs = s.update_from_output(so, vs.model_output([req]))
    params = outs[0].outputs[0].kv_transfer_params
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED and params["remote_num_tokens"] == 600
    assert params["remote_block_ids"] == list(pub.block_ids) and params["transfer_id"] == tid
    assert rid in s.requests and s.connector.has_pending_push_work()  # held for the push
    so = s.schedule()
    assert not so.kv_connector_metadata.publishes
    s.update_from_output(so, vs.model_output([]))
    finish_sent(s, req)
    vs.assert_scheduler_empty(s)
    assert vs.num_free_blocks(s) == start_free


def test_prefix_cache_hit_counts_as_ready(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    s = scheduler(model_dir, daemons[0].sock)
    first = [(i * 7) % 100 + 3 for i in range(48)]
    a, _ = prefill(48, prompt=first)
    s.add_request(a)
    so = s.schedule()
    assert so.kv_connector_metadata.publishes[0].ready_blocks == 0
    s.update_from_output(so, vs.model_output([a]))
    finish_sent(s, a)
    b, tid = prefill(40, prompt=first[:32] + [99] * 8)  # the first two blocks are cached
    s.add_request(b)
    so = s.schedule()
    assert so.num_scheduled_tokens[b.request_id] == 8
    (pub,) = so.kv_connector_metadata.publishes
    assert pub.transfer_id == tid and len(pub.block_ids) == 3 and pub.ready_blocks == 2
    s.update_from_output(so, vs.model_output([b]))
    finish_sent(s, b)
    vs.assert_scheduler_empty(s)


def test_request_that_decodes_on_is_published_once_finished(model_dir: Path,
                                                            daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """max_tokens > 1: the request stays running (preemptible) after its prompt: no declare; published
    whole in the step after it finished, as without progressive push."""
    s = scheduler(model_dir, daemons[0].sock)
    req, tid = prefill(40, max_tokens=2)
    s.add_request(req)
    so = s.schedule()
    assert not so.kv_connector_metadata.publishes and not s.connector.has_pending_block_frees()
    s.update_from_output(so, vs.model_output([req]))
    so = s.schedule()
    assert not so.kv_connector_metadata.publishes
    s.update_from_output(so, vs.model_output([req]))
    assert req.is_finished()
    so = s.schedule()
    (pub,) = so.kv_connector_metadata.publishes
    assert pub.transfer_id == tid and not pub.declared
    s.update_from_output(so, vs.model_output([]))
    finish_sent(s, req)


def test_abort_after_declare_keeps_blocks_until_sent(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    s = scheduler(model_dir, daemons[0].sock)
    start_free = vs.num_free_blocks(s)
    req, tid = prefill(40)
    rid = req.request_id
    s.add_request(req)
    so = s.schedule()
    assert so.kv_connector_metadata.publishes[0].declared
    s.finish_requests(rid, RequestStatus.FINISHED_ABORTED)  # the client went away during the step
    assert rid in s.requests and vs.num_free_blocks(s) < start_free  # its layers may be on the wire
    s.update_from_output(so, vs.model_output([]))
    so = s.schedule()
    assert so.kv_connector_metadata.aborts == [AbortReq(rid, tid, send=True)]
    s.update_from_output(so, vs.model_output([]))
    assert rid in s.requests
    finish_sent(s, req)
    vs.assert_scheduler_empty(s)
    assert vs.num_free_blocks(s) == start_free


def test_preempted_after_declare_is_published_once_finished(model_dir: Path,
                                                            daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """reset_prefix_cache(reset_running_requests=True) preempts even a declared request: its push is
    aborted without a report (vLLM freed the blocks), and the recomputed request is published whole."""
    s = scheduler(model_dir, daemons[0].sock)
    req, tid = prefill(40)
    rid = req.request_id
    s.add_request(req)
    so1 = s.schedule()
    assert so1.kv_connector_metadata.publishes[0].declared
    assert s.reset_prefix_cache(reset_running_requests=True)
    so = s.schedule()
    assert AbortReq(rid, tid, send=True, report=False) in so.kv_connector_metadata.aborts
    assert not so.kv_connector_metadata.publishes  # recomputed, not declared again
    assert not s.connector.has_pending_block_frees()
    s.update_from_output(so1, vs.model_output([req]))  # the preempted step's output: dropped
    s.update_from_output(so, vs.model_output([req]))
    publishes = []
    for _ in range(4):
        if req.is_finished():
            break
        so = s.schedule()
        publishes += so.kv_connector_metadata.publishes
        s.update_from_output(so, vs.model_output([req]))
    assert req.is_finished()
    so = s.schedule()
    publishes += so.kv_connector_metadata.publishes
    assert [(p.transfer_id, p.declared) for p in publishes] == [(tid, False)]
    s.update_from_output(so, vs.model_output([]))
    finish_sent(s, req)


def test_layer_groups_follow_the_regions() -> None:
    """One group per layer for one region per layer, and for K and V apart; one per region where a
    region is shared by layers of two KV cache groups (complete once both ran)."""
    packed = LayerProgress([["l.0"], ["l.1"], ["l.2"]])
    assert (packed.layers, packed.per_group) == (3, 1)
    assert [packed.layer_done(n) for n in ("l.0", "l.1", "l.1", "l.2")] == [1, 2, 0, 3]
    split = LayerProgress([["l.0"], ["l.0"], ["l.1"], ["l.1"]])
    assert (split.layers, split.per_group) == (2, 2)
    assert [split.layer_done("l.0"), split.layer_done("l.1")] == [1, 2]
    hybrid = LayerProgress([["l.0", "l.1"], ["l.2", "l.3"]])
    assert hybrid.layers == 2
    assert [hybrid.layer_done(n) for n in ("l.0", "l.1", "l.2", "l.3")] == [0, 1, 0, 2]
    hybrid.reset()
    assert [hybrid.layer_done(n) for n in ("l.2", "l.3", "l.1", "l.0")] == [0, 0, 0, 2]  # leading groups only


# ------------------------------------------------------------------------------------------------
# Worker side against live daemons, real NIXL bytes


@pytest.fixture(scope="module")
def engines(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> Iterator[tuple[Engine, Engine]]:
    p, d = daemons
    pe = Engine(model_dir, "kv_producer", P_ENGINE, p.sock, num_blocks=48, fill="poison", compute=True)
    de = Engine(model_dir, "kv_consumer", D_ENGINE, d.sock, num_blocks=64, fill="poison")
    yield pe, de
    pe.close()
    de.close()


def random_prompt(n: int) -> list[int]:
    return [int(t) + 3 for t in torch.randint(0, 120, (n,))]


@pytest.mark.parametrize("n", [100, 600])  # one step; three chunks (the first two ready at declare time)
def test_layers_pushed_as_the_forward_computes_them(engines: tuple[Engine, Engine],
                                                    daemons: tuple[vs.Daemon, vs.Daemon], n: int) -> None:
    """The prefill forward poisons the blocks it computes and writes each layer just before its
    save_kv_layer: decode gets exactly prefill's final KV, from a publish declared before the forward."""
    pe, de = engines
    p_daemon = daemons[0]
    w = pe.conn.worker_side
    assert w._bell is not None and w._progress is not None and w._progress.layers == len(pe.layer_names)
    declared0, rings0 = w.declared, w.rings
    x, prompt = vs.x_request_id(), random_prompt(n)
    d_req = vs.create_request(vs.engine_request_id(x), n, 2, vs.decode_params(P_ENGINE, p_daemon.peer_address, x),
                              32, prompt)
    p_req = vs.create_request(vs.engine_request_id(x), n, 1, vs.prefill_params(), 32, prompt)
    de.sched.add_request(d_req)
    pe.sched.add_request(p_req)
    de.step()
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    while not p_req.is_finished():
        pe.step([p_req])
    (pub,) = [m.publishes[0] for m in pe.metas if m.publishes and m.publishes[0].req_id == p_req.request_id]
    assert pub.declared and pub.ready_blocks == (16 if n == 600 else 0)
    assert pe.metas[-1].publishes == [pub]  # declared in the step that finished it, not one later
    assert w.declared == declared0 + 1 and w.rings >= rings0 + len(pe.layer_names)  # a ring per layer

    step_until_moved(pe, de, p_req.request_id, d_req.request_id, lambda: p_daemon.logs()[-3000:])
    (e,) = [e for e in de.expects() if e.req_id == d_req.request_id]
    for name in pe.kv:
        assert not bool((pe.kv[name][list(pub.block_ids)] == POISON).any())
        assert torch.equal(de.kv[name][list(e.block_ids)], pe.kv[name][list(pub.block_ids)])
    for name in de.kv:
        de.kv[name][list(e.block_ids)] = POISON
    de.step([d_req])  # decode runs on
    de.step([d_req], eos=True)
    de.step()
    vs.assert_scheduler_empty(de.sched)
    vs.assert_scheduler_empty(pe.sched)


def test_abort_mid_push_frees_once_the_daemon_let_go(engines: tuple[Engine, Engine],
                                                     daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """Declared, and the client aborts during that very step (decode never registers): vLLM keeps the
    blocks while the daemon holds the publish, and frees them once the worker reports the abort done."""
    pe, _ = engines
    p_daemon = daemons[0]
    start = vs.num_free_blocks(pe.sched)
    x = vs.x_request_id()
    req = vs.create_request(vs.engine_request_id(x), 64, 1, vs.prefill_params(), 32, random_prompt(64))
    rid, tid = req.request_id, f"cmpl-{x}-0"
    pe.sched.add_request(req)
    pe.step([], during=lambda: pe.sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED))
    assert pe.metas[-1].publishes[0].declared and req.status == RequestStatus.FINISHED_ABORTED
    assert vs.wait_for(lambda: tid in p_daemon.transfer_ids())  # the worker declared it before the forward
    assert rid in pe.sched.requests and vs.num_free_blocks(pe.sched) < start
    pe.step()
    assert pe.metas[-1].aborts == [AbortReq(rid, tid, send=True)]
    assert vs.wait_for(lambda: pe.step() is not None and rid not in pe.sched.requests, 30)
    assert vs.num_free_blocks(pe.sched) == start
    assert vs.wait_for(lambda: tid not in p_daemon.transfer_ids())
    vs.assert_scheduler_empty(pe.sched)


def test_progressive_off_attaches_without_a_doorbell(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    p, _ = daemons
    pe = Engine(model_dir, "kv_producer", "prefill-whole", p.sock, num_blocks=40, fill="random",
                extra={"kvpushd_progressive": False})
    try:
        assert pe.conn.worker_side._bell is None
        req = vs.create_request(vs.engine_request_id(vs.x_request_id()), 40, 1, vs.prefill_params(), 32)
        pe.sched.add_request(req)
        pe.step([req])
        assert not pe.metas[-1].publishes  # published in the step after it finished
        pe.step()
        assert pe.metas[-1].publishes and not pe.metas[-1].publishes[0].declared
    finally:
        pe.close()


def test_piecewise_cuda_graphs_while_progressive() -> None:
    """Full CUDA graphs would skip save_kv_layer, the doorbell's ring: vLLM must run piecewise ones."""
    assert KVPushdConnector.requires_piecewise_for_cudagraph({})
    assert not KVPushdConnector.requires_piecewise_for_cudagraph({"kvpushd_progressive": False})
