"""The real-vLLM timeline (realvllm/sitetimeline, realvllm/timeline_report): the report's arithmetic on
event files written the way the patched processes write them, the bench's switch, and the patcher
doing nothing without its variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from kvpushd_lab.bench import parser
from kvpushd_lab.realvllm import timeline_report as tr


def _write(d: Path, pid: int, events: list[dict]) -> None:
    with (d / f"{pid}.jsonl").open("a") as f:
        for e in events:
            f.write(json.dumps(e) + "\n")


def _request(d: Path, n: int, t0: float, stall_ms: float = 0.0) -> None:
    """One push request: prefill core (pid 10), prefill worker (11), decode core (20), decode worker (21),
    prefill daemon (30), decode daemon (40). Times in ms after t0; ``stall_ms`` delays the Publish's
    arrival at the prefill daemon (and everything after it)."""
    tid, prid, drid = f"xfer-{n}", f"p{n}", f"d{n}"

    def ev(ms: float, name: str, rid: str, **kw: object) -> dict:
        return {"t": t0 + ms / 1e3, "ev": name, "tid": kw.pop("tid", rid), "rid": rid, **kw}

    s = stall_ms
    _write(d, 10, [ev(1, "add", prid, tid=tid, arrival=t0), ev(1.5, "meta", prid, tid=tid, kind="publish")])
    _write(d, 11, [ev(3, "step_begin", prid), ev(3.1, "client_step", tid, tid=tid, op="publish"),
                   ev(3.5, "client_sender", tid, tid=tid, op="publish"), ev(11, "fwd_end", prid)])
    _write(d, 20, [ev(2, "add", drid, tid=tid, arrival=t0 + 0.0005), ev(2.2, "meta", drid, tid=tid, kind="expect"),
                   ev(16 + s, "first_tok", drid)])
    _write(d, 21, [ev(2.5, "step_begin", drid), ev(2.6, "client_step", tid, tid=tid, op="expect"),
                   ev(2.7, "client_sender", tid, tid=tid, op="expect"), ev(12 + s, "done", drid, kind="recv")])
    _write(d, 30, [ev(4 + s, "daemon_batch", tid, op="publish"), ev(4.1 + s, "daemon_started", tid, side="send"),
                   ev(4.2 + s, "daemon_met", tid), ev(11.2 + s, "daemon_writedone", tid)])
    _write(d, 40, [ev(3, "daemon_batch", tid, op="expect"), ev(3.1, "daemon_started", tid, side="recv"),
                   ev(11.5 + s, "daemon_delivered", tid)])


def test_segments_from_event_files(tmp_path: Path) -> None:
    for n in range(tr.WARMUP):  # warm-up requests: left out however slow
        _request(tmp_path, n, 1000.0 + n, stall_ms=500)
    for n in range(tr.WARMUP, tr.WARMUP + 5):
        _request(tmp_path, n, 1000.0 + n, stall_ms=100.0 if n == tr.WARMUP + 4 else 0.0)
    _write(tmp_path, 30, [{"t": 1000.0 + tr.WARMUP + 4.005, "ev": "daemon_thread_late", "tid": "", "rid": "",
                           "ms": 99.0, "cpu_ms": 0.2}])
    s = tr.summary(tmp_path)
    assert s["requests"] == 5
    seg = {r["segment"]: r for r in s["segments"]}
    sender = seg["P publish: stream sender -> prefill daemon"]
    assert sender["n"] == 5 and sender["p50_ms"] == 0.5 and sender["max_ms"] == 100.5
    assert seg["P forward end -> WRITE done"]["p50_ms"] == 0.2
    assert seg["D worker reports it -> D first token"]["p50_ms"] == 4.0
    assert seg["P arrival -> P engine core"]["p50_ms"] == 1.0
    assert seg["first event -> D first token (engine-side TTFT)"]["p50_ms"] == 16.0
    assert s["daemon_stalls_over_5ms"] == {"count": 1, "sum_ms": 99.0, "max_ms": 99.0, "cpu_ms_during": 0.2}


def test_report_cli(tmp_path: Path, capsys: object) -> None:
    for n in range(tr.WARMUP + 2):
        _request(tmp_path, n, 2000.0 + n)
    assert tr.main([str(tmp_path), "--slow", "1"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "2 requests" in out and "engine-side TTFT" in out and "D:first_tok=16.0" in out


def test_bench_switch_sets_and_clears_the_environment(tmp_path: Path, monkeypatch: object) -> None:
    a = parser().parse_args(["vllm", "--timeline", str(tmp_path)])
    assert a.timeline == str(tmp_path) and a.layers == 16
    monkeypatch.setenv("PYTHONPATH", "/x")  # type: ignore[attr-defined]
    tr.enable(tmp_path / "kvpushd-push")
    assert os.environ["KVPUSHD_LAB_TIMELINE"] == str(tmp_path / "kvpushd-push")
    assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tr.SITE_DIR), "/x"]
    tr.disable()
    assert "KVPUSHD_LAB_TIMELINE" not in os.environ and os.environ["PYTHONPATH"] == "/x"


def test_patcher_writes_events_only_when_asked(tmp_path: Path) -> None:
    code = ("import sys, kvpushd.rpc.pump as p; "
            "print(any(type(f).__name__ == '_Finder' for f in sys.meta_path), p.Pump.batch.__name__)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tr.SITE_DIR), os.environ.get("PYTHONPATH", "")]))
    env.pop("KVPUSHD_LAB_TIMELINE", None)
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert off.returncode == 0, off.stderr
    assert off.stdout.split() == ["False", "batch"]
    env["KVPUSHD_LAB_TIMELINE"] = str(tmp_path / "tl")
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert on.returncode == 0, on.stderr
    assert on.stdout.split()[0] == "True"


def test_vllm_spin_grace_patch(tmp_path: Path, monkeypatch: object) -> None:
    """``bench vllm --vllm-spin-s``: vLLM's SpinCondition readers get the grace asked for, in every process
    started meanwhile, independent of the timeline; nothing changes without it."""
    mod = tmp_path / "vllm" / "distributed" / "device_communicators"
    mod.mkdir(parents=True)
    for d in (tmp_path / "vllm", tmp_path / "vllm" / "distributed", mod):
        (d / "__init__.py").write_text("")
    (mod / "shm_broadcast.py").write_text(  # SpinCondition's signature in vLLM 0.32 / 0.33
        "class SpinCondition:\n"
        "    def __init__(self, is_reader, context, notify_address, busy_loop_s=1):\n"
        "        self.busy_loop_s = busy_loop_s\n")
    code = ("from vllm.distributed.device_communicators.shm_broadcast import SpinCondition as S; "
            "print(S(True, None, 'ipc://x').busy_loop_s, S(False, None, 'ipc://x', busy_loop_s=3).busy_loop_s)")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # type: ignore[attr-defined]
    monkeypatch.delenv("KVPUSHD_LAB_TIMELINE", raising=False)  # type: ignore[attr-defined]

    def run() -> list[str]:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.split()

    assert run() == ["1", "3"]
    tr.set_vllm_spin(0.002)
    try:
        assert os.environ["VLLM_SHM_BROADCAST_BUSY_LOOP_S"] == "0.002"
        assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(tr.SITE_DIR), str(tmp_path)]
        assert run() == ["0.002", "3"]
        tr.enable(tmp_path / "tl")
        tr.disable()  # the timeline off, the grace stays
        assert run() == ["0.002", "3"]
    finally:
        tr.set_vllm_spin(None)
    assert os.environ["PYTHONPATH"] == str(tmp_path) and "KVPUSHD_LAB_VLLM_SPIN_S" not in os.environ
    assert run() == ["1", "3"]
