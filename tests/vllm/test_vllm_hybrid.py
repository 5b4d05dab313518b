"""KVPushdConnector and vLLM 0.33.0's connector contract: failures by request id (failed_recving),
hybrid models with the hybrid KV cache manager on (SupportsHMA: a full-attention and a sliding-window
group), the layout the regions state (tokens first on both sides, different TP sizes), the router's
kv_transfer_params. vLLM's own Scheduler and KVOutputAggregator, real daemons, real NIXL.

    heavy .venv-vllm/bin/python -m pytest -q -p no:cacheprovider tests/vllm/test_vllm_hybrid.py
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytest.importorskip("vllm.distributed", reason="needs vLLM 0.33.0: run with the venv scripts/vllm_venv.sh builds")

import torch
import vllm_support as vs
from engine_support import POISON, Engine, step_until_moved
from kvpushd_client.vllm.groups import GroupPlan, plan_groups
from kvpushd_client.vllm.metadata import PREFILL_PARAMS
from vllm.v1.request import RequestStatus

P_ENGINE = "prefill-hybrid"
D_ENGINE = "decode-hybrid"
DAEMON_CONFIG = "[transfer]\npublish_timeout_s = 3.0\nexpect_timeout_s = 5.0\ndrain_timeout_s = 3.0\n"
WINDOW = 48   # tokens of the sliding-window layers (engine tests: 32-token blocks)
BS = 16       # scheduler-only tests


x_request_id, engine_request_id = vs.x_request_id, vs.engine_request_id


workdir, model_dir, daemons = vs.pd_fixtures("kvpushd-hybrid-", DAEMON_CONFIG, layers=4, kv_heads=4)


# ------------------------------------------------------------------------------------------------
# Scheduler side


def test_connector_keeps_the_hybrid_kv_cache_manager_on() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA, supports_hma
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, MambaSpec

    cfg = vs.make_vllm_config(_tiny(), "kv_both", "e", "/x.sock")
    assert KVConnectorFactory.supports_hma_config(cfg.kv_transfer_config)
    from kvpushd_client.vllm.connector import KVPushdConnector

    assert issubclass(KVPushdConnector, SupportsHMA) and supports_hma(KVPushdConnector)
    # Mamba state: refused at start, naming the groups.
    full = vs.hybrid_kv_cache_config(10, BS, WINDOW).kv_cache_groups[0]
    mamba = KVCacheGroupSpec(["model.layers.1.mixer"], MambaSpec(block_size=BS, shapes=((4, 4),),
                                                                   dtypes=(torch.float32,)))
    kcc = KVCacheConfig(num_blocks=10, kv_cache_tensors=[], kv_cache_groups=[full, mamba])
    with pytest.raises(NotImplementedError, match=r"group\(s\) 1 .*group 0: FullAttentionSpec.*group 1: MambaSpec"):
        plan_groups(kcc)
    assert plan_groups(vs.hybrid_kv_cache_config(10, BS, WINDOW)) == (GroupPlan(BS), GroupPlan(BS, WINDOW))


_tiny_dir: Path | None = None


def _tiny() -> Path:
    global _tiny_dir
    if _tiny_dir is None:
        _tiny_dir = vs.write_tiny_llama(Path(tempfile.mkdtemp(prefix="kvpushd-tiny-")))
    return _tiny_dir


def test_window_positions() -> None:
    g = GroupPlan(16, 32)
    assert g.positions(100) == range(4, 7)   # vLLM skips max(0, 100 - 32 + 1) = 69 tokens: 4 blocks
    assert g.positions(20) == range(0, 2)    # shorter than the window: every block
    assert GroupPlan(16).positions(100) == range(0, 7)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_receive_on_a_two_group_model(policy: str) -> None:
    """A failed receive reported through failed_recving: vLLM's policy applies and the scheduler goes
    on. The older per-block report (invalid_block_ids) raises in vLLM 0.33's scheduler here."""
    cfg = vs.make_vllm_config(_tiny(), "kv_consumer", D_ENGINE, "/nonexistent/kvpushd.sock", policy=policy)
    s = vs.create_scheduler(cfg, vs.hybrid_kv_cache_config(100, BS, 32))
    start_free = vs.num_free_blocks(s)
    x = x_request_id()
    req = vs.create_request(engine_request_id(x), 100, 2, vs.decode_params(P_ENGINE, "10.0.0.1:7700", x), BS)
    rid = req.request_id
    s.add_request(req)
    so = s.schedule()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (e,) = so.kv_connector_metadata.expects
    full, swa = s.kv_cache_manager.get_block_ids(rid)
    assert swa[:4] == [0, 0, 0, 0]  # vLLM's null placeholders before the window
    assert e.block_ids == tuple(full) + tuple(swa[4:7]) and not e.failed  # every group, window only
    s.update_from_output(so, vs.model_output([]))

    so = s.schedule()
    with pytest.raises(RuntimeError, match="failed_recving instead"):
        s.update_from_output(so, vs.model_output([], vs.kv_output(invalid_block_ids=set(e.block_ids))))

    s = vs.create_scheduler(cfg, vs.hybrid_kv_cache_config(100, BS, 32))
    req = vs.create_request(engine_request_id(x), 100, 2, vs.decode_params(P_ENGINE, "10.0.0.1:7700", x), BS)
    rid = req.request_id
    s.add_request(req)
    so = s.schedule()
    s.update_from_output(so, vs.model_output([]))
    so = s.schedule()
    outs = s.update_from_output(so, vs.model_output([], vs.kv_output(finished_recving={rid},
                                                                     failed_recving={rid})))
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR and outs[0].outputs[0].finish_reason is not None
    else:
        so = s.schedule()  # recomputed here from the first token
        assert req.status == RequestStatus.RUNNING and so.num_scheduled_tokens[rid] == 100
        assert not so.kv_connector_metadata.expects
        s.update_from_output(so, vs.model_output([req]))
        so = s.schedule()
        s.update_from_output(so, vs.model_output([req], eos=True))
        assert req.is_finished()
    so = s.schedule()
    s.update_from_output(so, vs.model_output([]))
    vs.assert_scheduler_empty(s)
    assert vs.num_free_blocks(s) == start_free


@pytest.mark.parametrize("progressive", [True, False])
def test_prefill_publishes_every_group_and_answers_like_upstream(progressive: bool) -> None:
    """Declared in the step that computes the prompt (progressive push), or published in the next one:
    the same blocks of both groups either way."""
    cfg = vs.make_vllm_config(_tiny(), "kv_producer", P_ENGINE, "/nonexistent/kvpushd.sock",
                              extra={"kvpushd_peer_address": "10.0.0.2:7700", "kvpushd_progressive": progressive})
    s = vs.create_scheduler(cfg, vs.hybrid_kv_cache_config(100, BS, 32))
    x = x_request_id()
    req = vs.create_request(engine_request_id(x), 100, 1, vs.prefill_params(), BS)
    s.add_request(req)
    so = s.schedule()
    declared = so.kv_connector_metadata.publishes
    full, swa = (list(b) for b in s.kv_cache_manager.get_block_ids(req.request_id))
    outs = s.update_from_output(so, vs.model_output([req]))
    params = outs[0].outputs[0].kv_transfer_params
    so = s.schedule()
    (pub,) = declared if progressive else so.kv_connector_metadata.publishes
    assert not (so.kv_connector_metadata.publishes if progressive else declared)  # once
    assert pub.declared is progressive and pub.ready_blocks == 0
    assert pub.block_ids == tuple(full[:7]) + tuple(swa[4:7])
    # The keys upstream's NixlPushConnector answers (transfer_mode included), block ids per group.
    upstream = {"do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id", "remote_request_id",
                "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size", "remote_num_tokens", "transfer_mode"}
    assert upstream <= set(PREFILL_PARAMS) <= set(params)
    assert params["transfer_mode"] == "push" and params["remote_num_tokens"] == 100
    assert params["remote_block_ids"] == [full, [0] * 4 + swa[4:]]  # vLLM freed the blocks before the window
    assert (params["remote_host"], params["remote_port"]) == ("10.0.0.2", 7700)
    s.update_from_output(so, vs.model_output([], vs.kv_output(finished_sending={req.request_id})))
    s.update_from_output(s.schedule(), vs.model_output([]))
    vs.assert_scheduler_empty(s)


def test_local_prefix_hit_on_a_two_group_model_prefills_here() -> None:
    cfg = vs.make_vllm_config(_tiny(), "kv_consumer", D_ENGINE, "/nonexistent/kvpushd.sock")
    s = vs.create_scheduler(cfg, vs.hybrid_kv_cache_config(100, BS, 32))
    assert s.connector._sched.groups and len(s.connector._sched.groups) == 2
    req = vs.create_request("r-1", 100, 1, vs.decode_params(P_ENGINE, "10.0.0.1:7700", "r"), BS)
    assert s.connector.get_num_new_matched_tokens(req, 32) == (0, False)
    assert req.kv_transfer_params["do_remote_prefill"] is False


# ------------------------------------------------------------------------------------------------
# Worker side against live daemons


def _groups_of(e: Engine) -> tuple[GroupPlan, ...]:
    return plan_groups(e.kv_cache_config)


def run_hybrid_request(pe: Engine, de: Engine, p_daemon: vs.Daemon, n: int) -> None:
    """One request of n prompt tokens through both engines; every group's blocks arrive (a
    sliding-window group only its window) and no other decode block changes."""
    g = torch.Generator().manual_seed(n)
    prompt = [int(t) + 3 for t in torch.randint(0, 120, (n,), generator=g)]
    x = x_request_id()
    d_req = vs.create_request(engine_request_id(x), n, 2, vs.decode_params(P_ENGINE, p_daemon.peer_address, x,
                                                                          tp_size=len(pe.ranks)), 32, prompt)
    p_req = vs.create_request(engine_request_id(x), n, 1, vs.prefill_params(), 32, prompt)
    d_start, p_start = vs.num_free_blocks(de.sched), vs.num_free_blocks(pe.sched)
    de.sched.add_request(d_req)
    pe.sched.add_request(p_req)
    de.step()
    d_tables = [list(b) for b in de.sched.kv_cache_manager.get_block_ids(d_req.request_id)]
    assert d_req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    pe.step([p_req])
    assert p_req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    p_tables = [list(b) for b in pe.sched.kv_cache_manager.get_block_ids(p_req.request_id)]  # held to push
    step_until_moved(pe, de, p_req.request_id, d_req.request_id)
    moved = 0
    for gi, (plan, group) in enumerate(zip(_groups_of(pe), pe.kv_cache_config.kv_cache_groups, strict=True)):
        pos = list(plan.positions(n))
        assert pos[0] == (max(0, n - WINDOW + 1) // 32 if gi == 1 else 0)
        src = [p_tables[gi][i] for i in pos]
        dst = [d_tables[gi][i] for i in pos]
        for (_, pkv), (_, dkv) in zip(pe.ranks, de.ranks, strict=True):
            for name in group.layer_names:  # this group's layers hold these blocks
                assert torch.equal(dkv[name][dst], pkv[name][src])
                dkv[name][dst] = POISON
        moved += len(pos)
    if n > WINDOW:  # the sliding group's blocks before its window stayed behind
        assert moved < len(p_tables) * -(-n // 32)
    for _, dkv in de.ranks:  # nothing else arrived: not the null block, not the blocks before the window
        assert all(bool((t == POISON).all()) for t in dkv.values())
    de.step([d_req])
    assert d_req.status == RequestStatus.RUNNING
    de.step([d_req], eos=True)
    de.step()
    vs.assert_scheduler_empty(de.sched)
    assert vs.num_free_blocks(de.sched) == d_start and vs.num_free_blocks(pe.sched) == p_start


def test_hybrid_request_end_to_end(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    p, d = daemons
    pe = Engine(model_dir, "kv_producer", P_ENGINE, p.sock, num_blocks=80, fill="random", window=WINDOW)
    de = Engine(model_dir, "kv_consumer", D_ENGINE, d.sock, num_blocks=96, fill="poison", window=WINDOW)
    try:
        assert len(pe.kv_cache_config.kv_cache_groups) == 2
        assert pe.cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
        run_hybrid_request(pe, de, p, 150)   # 5 blocks; the window keeps the last 2
        run_hybrid_request(pe, de, p, 40)    # shorter than the window: every block of both groups
    finally:
        pe.close()
        de.close()


def test_failed_receive_through_the_worker(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """No prefill ever publishes: the decode daemon's expect times out. Through get_transfer_results
    the request comes back in failed_recving (no blocks in invalid_block_ids), and a two-group engine
    recomputes it and goes on."""
    _, d = daemons
    de = Engine(model_dir, "kv_consumer", "decode-fail", d.sock, num_blocks=96, fill="poison",
                window=WINDOW, policy="recompute")
    try:
        x = x_request_id()
        req = vs.create_request(engine_request_id(x), 100, 2, vs.decode_params("nobody", "127.0.0.1:9", x), 32)
        start = vs.num_free_blocks(de.sched)
        de.sched.add_request(req)
        de.step()
        (_expect,) = de.expects()  # one, and nobody publishes it
        seen: dict[str, Any] = {}

        def failed() -> bool:
            de.step()
            kv = de.last_kv
            if kv.finished_recving:
                seen.update(recv=set(kv.finished_recving), failed=set(kv.failed_recving),
                            invalid=set(kv.invalid_block_ids))
            return bool(seen)

        assert vs.wait_for(failed, 60, 0.05)
        assert seen["recv"] == {req.request_id}
        assert seen["failed"] == {req.request_id} and not seen["invalid"]
        outs = de.step([req])  # recomputed here, whole prompt
        assert req.status == RequestStatus.RUNNING and outs is not None
        de.step([req], eos=True)
        de.step()
        vs.assert_scheduler_empty(de.sched)
        assert vs.num_free_blocks(de.sched) == start
    finally:
        de.close()


def test_tokens_first_layout_across_tp_sizes(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """KV laid out tokens before heads (vLLM's LBNHC) on both sides, prefill TP 2, decode TP 1: the
    regions say NHD and their head counts, and the decode blocks get each rank's heads exactly."""
    p, d = daemons
    pe = Engine(model_dir, "kv_producer", "prefill-nhd", p.sock, num_blocks=40, fill="random", tp=2,
                layout="LBNHC", split_heads=True)
    de = Engine(model_dir, "kv_consumer", "decode-nhd", d.sock, num_blocks=48, fill="poison", layout="LBNHC")
    try:
        from kvpushd_client.types import KVLayout
        from kvpushd_client.vllm.layout import describe_kv_caches, layer_specs

        _, regions, _ = describe_kv_caches(pe.ranks[0][1], 40, specs=layer_specs(pe.kv_cache_config))
        assert {(r.layout, r.num_heads, r.block_size_tokens) for r in regions} == {(KVLayout.NHD, 2, 32)}
        n = 100
        x = x_request_id()
        d_req = vs.create_request(engine_request_id(x), n, 2, vs.decode_params("prefill-nhd", p.peer_address, x,
                                                                              tp_size=2), 32)
        p_req = vs.create_request(engine_request_id(x), n, 1, vs.prefill_params(), 32)
        de.sched.add_request(d_req)
        pe.sched.add_request(p_req)
        de.step()
        pe.step([p_req])
        got = {"recv": False, "sent": False}

        def progress() -> bool:
            if not got["sent"]:
                pe.step()
                got["sent"] = p_req.request_id in (pe.last_kv.finished_sending or ())
            if not got["recv"]:
                de.step()
                got["recv"] = d_req.request_id in (de.last_kv.finished_recving or ())
                assert not de.last_kv.failed_recving, "load failed"
            return got["sent"] and got["recv"]

        assert vs.wait_for(progress, 60, 0.01), str(got)
        (e,) = [e for e in de.expects() if e.req_id == d_req.request_id]
        (pub,) = [q for q in pe.publishes() if q.req_id == p_req.request_id]
        dkv = de.kv
        for name in dkv:  # logical [B, H, N, C]: decode heads 0-1 from rank 0, 2-3 from rank 1
            want = torch.cat([pkv[name][list(pub.block_ids)] for _, pkv in pe.ranks], dim=1)
            assert torch.equal(dkv[name][list(e.block_ids)], want)
    finally:
        pe.close()
        de.close()


# ------------------------------------------------------------------------------------------------
# Regions: the layout read from the tensors and the spec


class _Spec:
    def __init__(self, block_size: int, num_kv_heads: int) -> None:
        self.block_size, self.num_kv_heads = block_size, num_kv_heads


@pytest.mark.parametrize(("kind", "want_layout", "n_regions"), [
    ("LBHNC", "HND", 1), ("LBNHC", "NHD", 1), ("split", "NHD", 2), ("joined", "NHD", 2)])
def test_regions_say_their_layout(kind: str, want_layout: str, n_regions: int) -> None:
    from kvpushd_client.types import KVLayout
    from kvpushd_client.vllm.layout import describe_kv_caches

    nb, n, h, d = 10, 16, 4, 8
    if kind == "LBHNC":
        t = torch.zeros(nb, h, n, 2 * d)
    elif kind == "LBNHC":  # tokens before heads in memory, vLLM's logical [B, H, N, C] view
        t = torch.zeros(nb, n, h, 2 * d).permute(0, 2, 1, 3)
    elif kind == "split":
        t = torch.zeros(2, nb, n, h, d)
    else:
        t = torch.zeros(nb, 2, n, h, d)
    t.share_memory_()
    _, regions, _ = describe_kv_caches({"l.0": t}, nb, specs={"l.0": _Spec(n, h)})
    assert len(regions) == n_regions
    assert {(r.layout, r.num_heads, r.block_size_tokens) for r in regions} == {(KVLayout[want_layout], h, n)}
    _, unsaid, _ = describe_kv_caches({"l.0": t}, nb)  # no spec: nothing said (the daemon's old rule)
    assert {(r.num_heads, r.block_size_tokens) for r in unsaid} == {(0, 0)}
    _, wrong, _ = describe_kv_caches({"l.0": t}, nb, specs={"l.0": _Spec(n * 2, h)})  # spec does not fit: unsaid
    assert {(r.num_heads, r.block_size_tokens) for r in wrong} == {(0, 0)}


def test_one_allocation_viewed_two_ways_is_refused() -> None:
    from kvpushd_client.vllm.layout import describe_kv_caches

    base = torch.zeros(10, 4, 16, 16).share_memory_()
    other = base.view(10, 16, 4, 16).permute(0, 2, 1, 3)  # same bytes, read tokens first
    memory, regions, _ = describe_kv_caches({"a": base, "b": base}, 10, specs={"a": _Spec(16, 4), "b": _Spec(16, 4)})
    assert len(memory) == 1 and len(regions) == 1  # one allocation, one hand-over, one region
    with pytest.raises(NotImplementedError, match="different block layouts"):
        describe_kv_caches({"a": base, "b": other}, 10, specs={"a": _Spec(16, 4), "b": _Spec(16, 4)})
