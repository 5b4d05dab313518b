"""``kvpushd bench``: every suite runs at a tiny size and prints sane JSON (no timed asserts)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def bench(*args: str, timeout: float = 240) -> dict[str, Any]:
    r = subprocess.run([sys.executable, "-m", "kvpushd", "bench", *args, "--json"], capture_output=True, text=True,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    out: dict[str, Any] = json.loads(r.stdout)
    assert out["suite"] == args[0]
    assert out["method"]
    assert out["load"]["before"]["cpus"] >= 1
    return out


def positive(d: dict[str, Any], *keys: str) -> None:
    for k in keys:
        assert isinstance(d[k], int | float) and d[k] > 0, (k, d[k])


def test_ceiling() -> None:
    out = bench("ceiling", "--tokens", "1024", "--repeat", "1")
    positive(out, "efficiency", "ceiling_gbps", "daemon_gbps")
    (row,) = out["rows"]
    positive(row, "bytes", "ceiling_gbps", "raw_blocks_gbps", "daemon_gbps", "efficiency", "ceiling_ms", "daemon_ms")
    assert row["tokens"] == out["at_tokens"] == 1024
    assert row["bytes"] == row["bytes_verified"] == 128 * 64 * 4096  # 64 blocks of 4 KiB in each of 128 regions
    assert row["descriptors_requested"] == 128 * 64
    assert row["descriptors_posted"] == 128  # contiguous blocks merge into one descriptor per region
    assert out["efficiency"] == row["efficiency"] and out["fragmented"] is False
    # progressive push's path: declared for a doorbell step, timed from the seal, bytes verified too
    positive(row, "declared_ms", "efficiency_declared", "efficiency_declared_paired")


def test_ceiling_fragmented() -> None:
    out = bench("ceiling", "--tokens", "256", "--repeat", "1", "--layers", "4", "--fragmented")
    (row,) = out["rows"]
    assert out["fragmented"] is True
    assert row["descriptors_requested"] == 8 * 16
    assert 8 < row["descriptors_posted"] <= row["descriptors_requested"]  # random order: little to merge


def test_ceiling_on_libfabric() -> None:
    from kvpushd_lab.backend import available

    if why := available("LIBFABRIC"):
        pytest.skip(why)
    out = bench("ceiling", "--tokens", "256", "--repeat", "1", "--layers", "4", "--backend", "LIBFABRIC")
    (row,) = out["rows"]
    assert out["backend"] == "LIBFABRIC"
    assert row["bytes"] == row["bytes_verified"] == 8 * 16 * 4096
    positive(row, "ceiling_gbps", "raw_blocks_gbps", "daemon_gbps", "declared_ms")


def test_rails_on_libfabric() -> None:
    """Two veth pairs between two namespaces, one LIBFABRIC WRITE: the bytes land exact, NIXL says how many
    rails it made, and the veths' counters say which links carried the bytes (docs/efa.md, Rails)."""
    from kvpushd_lab.backend import available
    from kvpushd_lab.netns import available as netns_available

    if why := available("LIBFABRIC"):
        pytest.skip(why)
    ok, why = netns_available()
    if not ok:
        pytest.skip(why)
    out = bench("rails", "--rails", "2", "--mib", "4", "--rate", "10gbit")
    (row,) = out["rows"]
    assert row["state"] == "DONE" and row["notified"] is True and row["mismatched_bytes"] == 0
    assert {"kvp0", "kvp1"} <= set(row["libfabric_tcp_domains"])  # libfabric sees both links
    assert row["nixl_rails_created"] and row["nixl_discovered"]
    assert sum(row["tx_bytes_per_veth"].values()) >= row["bytes"] == 4 << 20
    assert 1 <= row["veths_carrying"] <= 2


def test_critical_path() -> None:
    out = bench("critical-path", "--samples", "20")
    assert out["samples"] == 20
    for k in ("prefill_done_to_posted_us", "landed_to_told_us", "publish_rpc_us", "daemon_post_us",
              "daemon_queue_us"):
        positive(out[k], "p50", "p99", "n")
        assert out[k]["p99"] >= out[k]["p50"]
    assert out["target_p99_us"] == 1000
    assert set(out["per_request_sched_us"]) == {"prefill daemon", "decode daemon"}
    positive(out["per_request_sched_us"]["prefill daemon"], "cpu_us")


def test_engine_cost() -> None:
    out = bench("engine-cost", "--batch", "2", "--steps", "20", "--rounds", "1", "--step-ms", "20")
    for k in ("prefill_step_us", "decode_step_us", "publish_call_us", "expect_call_us"):
        positive(out["kvpushd"][k], "p50", "p99", "n")
    for k in ("step_us", "prep_us", "transfer_us", "poll_us"):
        positive(out["in_engine"][k], "p50", "n")
    positive(out, "engine_step_us_p99", "kvpushd_requests", "inengine_requests")
    assert out["target_p99_us"] == 50


def test_rate_and_plot(tmp_path: Path) -> None:
    args = ["rate", "--seconds", "1", "--warmup", "0.5", "--concurrency", "8"]
    have_mpl = True
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        have_mpl = False
    if have_mpl:
        args += ["--plot", str(tmp_path)]
    out = bench(*args)
    positive(out, "rate_per_s", "completed")
    positive(out["latency_ms"], "p50", "p99")
    assert out["failed"] == 0 and out["concurrency"] == 8
    assert set(out["cpu_cores"]) == {"prefill daemon", "decode daemon", "bench client"}
    if have_mpl:
        assert (tmp_path / "rate.png").stat().st_size > 1000


def test_plot_without_matplotlib(tmp_path: Path) -> None:
    """--plot fails at once, with a clear message, when matplotlib is missing."""
    code = ("import sys; sys.modules['matplotlib'] = None; "  # makes `import matplotlib` fail
            "from kvpushd.cli import main; raise SystemExit(main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", code, "bench", "rate", "--plot", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "matplotlib" in r.stderr and "pip install" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv", [["bench", "--help"], ["bench", "ceiling", "--help"]])
def test_help(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "kvpushd", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "usage: kvpushd bench" in r.stdout


def test_sweep_smoke() -> None:
    """One tiny cell per mode: every available mode completes and matches the monolithic tokens."""
    out = bench("sweep", "--prompt-lens", "48", "--qps", "4", "--requests", "2", "--warmup", "1",
                "--max-new-tokens", "4", timeout=900)
    modes = out["modes"]
    assert set(modes) == {"kvpushd-push", "kvpushd-pull", "inengine-push", "inengine-pull"}
    ran = {m for m, s in modes.items() if s["status"] == "ok"}
    assert {"kvpushd-push", "inengine-push", "inengine-pull"} <= ran
    for m, s in modes.items():
        assert m in ran or s["status"].startswith("unavailable"), (m, s)
    assert {c["mode"] for c in out["cells"]} == ran
    for c in out["cells"]:
        assert c["tokens_match"] is True and c["failed"] == 0 and c["completed"] == 2, c
        positive(c["ttft_ms"], "p50", "p99", "n")
        positive(c["tpot_ms"], "p50", "n")
        assert c["prompt_len"] == 48 and c["qps"] == 4
    assert out["tokens_match"] is True
    assert out["ratio_at_top_qps"]["48"]["ratio"] > 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_sweep_inengine_hooks(mode: str) -> None:
    """In-engine NIXL hooks (agents owned by the engines, real UCX transfers): tokens equal the monolithic run."""
    import time

    from kvpushd_lab.refengine import Engine, PagedKV, TinyConfig, TinyModel, random_prompt
    from kvpushd_lab.refengine.inengine import InEnginePullHooks, InEnginePushHooks

    cls = InEnginePullHooks if mode == "pull" else InEnginePushHooks
    cfg = TinyConfig(num_layers=2)
    model = TinyModel(cfg, 0)
    pkv, dkv = PagedKV(cfg, 48), PagedKV(cfg, 48)
    ph, dh = cls(pkv, "p"), cls(dkv, "d")
    try:
        pe = Engine(model, pkv, "prefill", ph, max_prefills_per_step=1)
        de = Engine(model, dkv, "decode", dh)
        prompts = {f"r{i}": random_prompt(100 + i, 20 + 13 * i, cfg.vocab_size) for i in range(4)}
        if mode == "push":  # decode registers its blocks before prefill has run
            for rid, p in prompts.items():
                de.add_request(rid, p, 5, {"transfer_id": rid, **ph.kv_params})
        for rid, p in prompts.items():
            pe.add_request(rid, p, 1)
        got: dict[str, list[int]] = {}
        deadline = time.monotonic() + 120
        while (pe.has_unfinished() or de.has_unfinished()) and time.monotonic() < deadline:
            for o in pe.step():
                assert o.ok, o
                if mode == "push":
                    de.set_first_token(o.req_id, o.tokens[0])
                else:  # pull: decode gets the request with prefill's kv_params (block ids, side channel)
                    assert o.kv_params["remote_block_ids"]
                    de.add_request(o.req_id, prompts[o.req_id], 5, o.kv_params)
            for o in de.step():
                assert o.ok, o
                got[o.req_id] = o.tokens
            time.sleep(0.001)
        assert not pe.has_unfinished() and not de.has_unfinished()  # prefill blocks freed after the transfer
        assert got == {rid: model.generate_monolithic(p, 5) for rid, p in prompts.items()}
        assert pe.num_free_blocks == 48 and de.num_free_blocks == 48
        assert pe.unknown_events == de.unknown_events == 0
        assert dh.handshakes == 1 and ph.unknown_notifs == dh.unknown_notifs == 0
    finally:
        ph.close()
        dh.close()
        pkv.close()
        dkv.close()


def test_soak_smoke() -> None:
    """200 requests with faults at a high rate: every request ends, nothing held (the invariants the
    full-size run reports; counts, not times)."""
    out = bench("soak", "--requests", "200", "--concurrency", "8", "--fault-rate", "0.2", "--write-fault-rate",
                "0.05", "--timeout-s", "2", "--churn-every-s", "0.3", "--attack-every-s", "0.1", timeout=600)
    assert out["never_ended"] == 0, out["never_ended_examples"]
    assert out["takeovers_accepted"] == 0, out["attacks"]  # the rogue peer never replaced a registration
    assert out["blocks_held_at_end"] == {"prefill": 0, "decode": 0}, out["held_at_end"]
    assert out["duplicate_completions"] == 0 and out["unexpected_completions"] == 0
    assert out["finished"] + out["failed"] == 200
    assert out["finished"] > 0 and sum(out["scenarios"].values()) == 200
    assert set(out["rss_kib_end"]) == {"prefill", "decode"}
