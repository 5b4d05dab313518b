"""The reference engine: a tiny deterministic transformer whose real KV cache kvpushd moves.

(a) the model alone: deterministic, paged decode == unpaged full recomputation, layout and TP slices;
(b) prefill engine -> decode engine with the in-process fake connector, TP sizes equal and not;
(c) the same with two real daemons and the kvpushd-backed hooks: tokens equal the monolithic run.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
from kvpushd_client import Role
from kvpushd_lab.refengine import (
    Engine,
    KVPushdHooks,
    LocalKVNetwork,
    PagedKV,
    RequestOutput,
    TinyConfig,
    TinyModel,
    copy_blocks,
    kv_slice,
    random_prompt,
)

CFG = TinyConfig()
NEW = 12
PROMPT_LENS = [5, 16, 23, 40, 33, 1]


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    # Tiny ops: thread hand-offs cost more than they save (and cost a lot on a loaded machine).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model() -> TinyModel:
    return TinyModel(CFG, seed=0)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return [random_prompt(100 + i, n) for i, n in enumerate(PROMPT_LENS)]


@pytest.fixture(scope="module")
def expected(model: TinyModel, prompts: list[list[int]]) -> list[list[int]]:
    return [model.generate_monolithic(p, NEW) for p in prompts]


# ------------------------------------------------------------------------------------------------
# (a) the model


def test_monolithic_is_deterministic(model: TinyModel, prompts: list[list[int]], expected: list[list[int]]) -> None:
    again = TinyModel(CFG, seed=0)  # a fresh model from the same seed: same weights, same tokens
    for p, e in zip(prompts[:3], expected[:3], strict=True):
        assert model.generate_monolithic(p, NEW) == e
        assert again.generate_monolithic(p, NEW) == e
        assert len(e) == NEW and all(0 <= t < CFG.vocab_size for t in e)
    assert len({t for e in expected for t in e}) > NEW  # not a degenerate model repeating one token
    assert TinyModel(CFG, seed=1).generate_monolithic(prompts[0], NEW) != expected[0]


def test_paged_decode_equals_unpaged_reference(model: TinyModel, prompts: list[list[int]],
                                               expected: list[list[int]]) -> None:
    for p, e in list(zip(prompts, expected, strict=True))[:4]:
        ref_tokens, ref_logits = model.generate_unpaged(p, NEW)
        assert ref_tokens == e
        # the paged path's logits, step by step, over scattered blocks of a NaN-poisoned cache
        kv = PagedKV(CFG, 16)
        kv.fill_(float("nan"))
        blocks = [13, 2, 7, 0, 9, 4, 11, 5]
        seq = list(p)
        first = model.prefill(seq, blocks, kv)
        assert first == e[0]
        for i in range(1, NEW):
            logits = model.decode_logits(e[i - 1], len(p) + i - 1, blocks, kv)
            assert float((logits - ref_logits[i]).abs().max()) < 1e-4  # same math, other summation order
            assert int(logits.argmax()) == e[i]


def test_layout_regions_and_tp_slices(model: TinyModel, prompts: list[list[int]]) -> None:
    assert kv_slice(CFG, 0, 1) == slice(0, 4)
    assert [CFG.kv_slice(r, 2) for r in range(2)] == [slice(0, 2), slice(2, 4)]
    assert [CFG.q_slice(r, 2) for r in range(2)] == [slice(0, 4), slice(4, 8)]
    with pytest.raises(ValueError):
        CFG.kv_slice(0, 3)
    full = PagedKV.shared(CFG, 8, "kvpushd-test-ref-full")
    ranks = [PagedKV.shared(CFG, 8, f"kvpushd-test-ref-r{r}", r, 2) for r in range(2)]
    try:
        blocks = [6, 1, 3]
        model.prefill(prompts[3], blocks, full)        # 40 tokens: 3 blocks
        model.prefill(prompts[3], blocks, ranks)
        for layer in range(CFG.num_layers):
            for r, kv in enumerate(ranks):
                assert torch.equal(kv.k[layer], full.k[layer][:, CFG.kv_slice(r, 2)])
                assert torch.equal(kv.v[layer], full.v[layer][:, CFG.kv_slice(r, 2)])
        # the regions describe exactly the tensors' bytes: layer 0 K, layer 0 V, layer 1 K, ...
        assert full.block_len == 4 * 16 * 16 * 4 and ranks[0].block_len == full.block_len // 2
        regions = full.regions()
        assert len(regions) == 2 * CFG.num_layers
        assert full.shm is not None
        raw = np.frombuffer(full.shm.mmap, dtype=np.uint8)
        for i, reg in enumerate(regions):
            assert (reg.memory_index, reg.num_blocks, reg.block_stride) == (0, 8, reg.block_len)
            t = (full.k if i % 2 == 0 else full.v)[i // 2]
            for b in blocks:
                at = reg.offset + b * reg.block_stride
                assert raw[at:at + reg.block_len].tobytes() == t[b].numpy().tobytes()
        assert regions[-1].offset + 8 * regions[-1].block_len == full.nbytes == full.shm.size
        # an in-process transfer between TP sizes is a per-head regather
        back = PagedKV(CFG, 8)
        copy_blocks(ranks, blocks, back, [0, 4, 2])
        for layer in range(CFG.num_layers):
            assert torch.equal(back.k[layer][[0, 4, 2]], full.k[layer][blocks])
    finally:
        for kv in [full, *ranks]:
            kv.close()


def test_monolithic_engine_batches_like_vllm(model: TinyModel, prompts: list[list[int]],
                                             expected: list[list[int]]) -> None:
    kv = PagedKV(CFG, 40)
    # a small batch and a shuffled free queue: requests wait, run together, finish apart
    eng = Engine(model, kv, "both", max_num_seqs=3, max_prefills_per_step=2,
                 block_order=random.Random(1).sample(range(40), 40))
    lens = {}
    for i, p in enumerate(prompts):
        lens[f"r{i}"] = NEW - (i % 3)
        eng.add_request(f"r{i}", p, lens[f"r{i}"])
    outs = {o.req_id: o for o in eng.run(timeout_s=60)}
    assert all(o.ok for o in outs.values())
    for i in range(len(prompts)):
        assert outs[f"r{i}"].tokens == expected[i][:lens[f"r{i}"]]
    assert eng.num_free_blocks == 40 and not eng.running


# ------------------------------------------------------------------------------------------------
# Disaggregated runs


def run_disaggregated(prefill: Engine, decode: Engine, prompts: Sequence[list[int]], new_tokens: int,
                      decode_first: Sequence[bool], timeout_s: float = 60.0) -> dict[str, RequestOutput]:
    """Drive both engines (as a proxy would). decode_first[i]: request i reaches decode before prefill
    has run, so decode registers its blocks first and gets the first token later; otherwise decode
    gets the prefill's kv_params (first token included) after prefill finished."""
    import time

    done: dict[str, RequestOutput] = {}
    for i, p in enumerate(prompts):
        rid = f"req-{i}"
        if decode_first[i]:
            decode.add_request(rid, p, new_tokens, {"transfer_id": rid, **prefill_params(prefill)})
            decode.step()  # blocks allocated and registered before prefill sees the request
        prefill.add_request(rid, p)
    deadline = time.monotonic() + timeout_s
    while len(done) < len(prompts) or prefill.has_unfinished():
        assert time.monotonic() < deadline, f"stuck: {len(done)} of {len(prompts)} done"
        for o in prefill.step():
            assert o.ok, o.error
            i = int(o.req_id.split("-")[1])
            if decode_first[i]:
                decode.set_first_token(o.req_id, o.tokens[0])
            else:
                decode.add_request(o.req_id, prompts[i], new_tokens, o.kv_params)
        for o in decode.step():
            done[o.req_id] = o
        if not decode.running:
            time.sleep(0.001)
    return done


def prefill_params(prefill: Engine) -> dict[str, object]:
    """The static part of a prefill engine's kv_params (push mode: decode needs no more to register)."""
    h = prefill.hooks
    if isinstance(h, KVPushdHooks):
        host, _, port = h.peer_address.rpartition(":")
        return {"remote_engine_id": h.engine_id, "remote_host": host, "remote_port": int(port),
                "tp_size": h.tp_size}
    return {"remote_engine_id": "prefill", "remote_host": "local", "remote_port": 0, "tp_size": len(prefill.caches)}


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 1), (2, 1), (1, 2)])
def test_disaggregated_in_process_equals_monolithic(model: TinyModel, prompts: list[list[int]],
                                                    expected: list[list[int]], p_tp: int, d_tp: int) -> None:
    pkv = [PagedKV(CFG, 24, tp_rank=r, tp_size=p_tp) for r in range(p_tp)]
    dkv = [PagedKV(CFG, 48, tp_rank=r, tp_size=d_tp) for r in range(d_tp)]
    for kv in dkv:
        kv.fill_(float("nan"))  # anything decode reads that was not transferred or computed shows up
    net = LocalKVNetwork()
    prefill = Engine(model, pkv, "prefill", net.producer("prefill", pkv), max_prefills_per_step=2)
    decode = Engine(model, dkv, "decode", net.consumer(dkv), max_num_seqs=4,
                    block_order=list(range(47, -1, -1)))  # different block ids on each side
    outs = run_disaggregated(prefill, decode, prompts, NEW, [i % 2 == 0 for i in range(len(prompts))])
    assert {o.req_id: o.tokens for o in outs.values()} == {f"req-{i}": e for i, e in enumerate(expected)}
    assert all(o.ok for o in outs.values()) and net.copies == len(prompts)
    assert prefill.num_free_blocks == 24 and decode.num_free_blocks == 48  # everything freed
    assert not prefill.held and not prefill.send_failures and prefill.unknown_events == decode.unknown_events == 0


def test_failed_transfer_fails_the_request_and_frees_blocks(model: TinyModel, prompts: list[list[int]],
                                                            expected: list[list[int]]) -> None:
    pkv, dkv = PagedKV(CFG, 24), PagedKV(CFG, 48)
    net = LocalKVNetwork(fail=["req-1"])
    prefill = Engine(model, pkv, "prefill", net.producer("prefill", pkv))
    decode = Engine(model, dkv, "decode", net.consumer(dkv))
    outs = run_disaggregated(prefill, decode, prompts[:3], NEW, [True, False, True])
    assert not outs["req-1"].ok and "injected failure" in outs["req-1"].error
    assert outs["req-0"].tokens == expected[0] and outs["req-2"].tokens == expected[2]
    assert "req-1" in prefill.send_failures
    assert prefill.num_free_blocks == 24 and decode.num_free_blocks == 48


def test_disaggregated_through_kvpushd_equals_monolithic(daemon_pair, model: TinyModel,  # type: ignore[no-untyped-def]
                                                         prompts: list[list[int]], expected: list[list[int]]) -> None:
    p, d = daemon_pair
    caches: list[PagedKV] = []
    hooks: list[KVPushdHooks] = []
    try:
        # TP1 -> TP1, then prefill TP2 -> decode TP1 on the same daemons (HND: heads gathered per block)
        for name, p_tp, idx in (("tp11", 1, [0, 1, 2, 3]), ("tp21", 2, [4, 3])):
            pkv = [PagedKV.shared(CFG, 24, f"kvpushd-test-ref-p{r}", r, p_tp) for r in range(p_tp)]
            dkv = PagedKV.shared(CFG, 48, "kvpushd-test-ref-d")
            dkv.fill_(float("nan"))
            caches += [*pkv, dkv]
            ph = KVPushdHooks.attach(p.client, f"prefill-{name}", Role.PRODUCER, pkv)
            dh = KVPushdHooks.attach(d.client, f"decode-{name}", Role.CONSUMER, dkv)
            hooks += [ph, dh]
            prefill = Engine(model, pkv, "prefill", ph, max_prefills_per_step=2)
            decode = Engine(model, dkv, "decode", dh, max_num_seqs=4, block_order=list(range(47, -1, -1)))
            sel = [prompts[i] for i in idx]
            outs = run_disaggregated(prefill, decode, sel, NEW, [k % 2 == 0 for k in range(len(sel))])
            bad = {k: o.error for k, o in outs.items() if not o.ok}
            assert not bad, f"{name}: {bad}\n{p.logs()[-2000:]}\n{d.logs()[-2000:]}"
            assert [outs[f"req-{k}"].tokens for k in range(len(sel))] == [expected[i] for i in idx], name
            assert prefill.num_free_blocks == 24 and decode.num_free_blocks == 48
            assert prefill.unknown_events == decode.unknown_events == 0
            assert ph.unknown_completions == dh.unknown_completions == 0
        counters = d.client.status().counters
        assert counters.notifications_received == 4 + 2 * 2  # one per producer rank per request
        assert not p.client.status().transfers and not d.client.status().transfers
    finally:
        for h in hooks:
            h.close()
        for kv in caches:
            kv.close()


def test_prefill_writes_each_layer_before_signalling_it() -> None:
    """Progressive push relies on it: when ``on_layer(n)`` runs, layers 0..n-1 hold their final K and V."""
    cfg = TinyConfig(num_layers=3, attn_window=8)
    m = TinyModel(cfg, seed=1)
    prompt = random_prompt(7, 40)
    want = PagedKV(cfg, 3)
    m.prefill(prompt, [0, 1, 2], want)
    kv = PagedKV(cfg, 3)
    seen: list[int] = []

    def on_layer(n: int) -> None:
        seen.append(n)
        for layer in range(n):
            assert torch.equal(kv.k[layer], want.k[layer]) and torch.equal(kv.v[layer], want.v[layer])
        for layer in range(n, cfg.num_layers):
            assert not kv.k[layer].any()

    m.prefill(prompt, [0, 1, 2], kv, on_layer)
    assert seen == [1, 2, 3]


def test_sliding_window_paged_decode_matches_full_recomputation() -> None:
    cfg = TinyConfig(attn_window=16)
    m = TinyModel(cfg, seed=2)
    prompt = random_prompt(8, 37)
    assert m.generate_monolithic(prompt, 6) == m.generate_unpaged(prompt, 6)[0]
    assert m.generate_unpaged(prompt, 6)[0] != TinyModel(TinyConfig(), seed=2).generate_unpaged(prompt, 6)[0]
