"""Where a disaggregated request's time went: reads the per-process event files that
``sitetimeline/sitecustomize.py`` writes (``kvpushd bench vllm --timeline DIR``) and prints, for the hops
of a push request from the engines' arrival to decode's first token, the p50, mean and max over the
requests, and how often and how long the daemons could not run.

``python -m kvpushd_lab.realvllm.timeline_report DIR [--json] [--slow MS]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

SITE_DIR = Path(__file__).resolve().parent / "sitetimeline"
WARMUP = 2  # the bench's two warm-up requests come first: left out

# (label, from, to): points are "<leg>:<event>" (P prefill engine, D decode engine), "pd:"/"dd:" the
# prefill / decode daemon, "client_*/<op>" the client library; "*" the request's first event.
SEGMENTS = [
    ("P arrival -> P engine core", "P:arrival", "P:add"),
    ("P engine core -> P step begin (publish declared)", "P:add", "P:step_begin"),
    ("P step begin -> P forward end", "P:step_begin", "P:fwd_end"),
    ("P publish: engine thread -> stream sender thread", "client_step/publish", "client_sender/publish"),
    ("P publish: stream sender -> prefill daemon", "client_sender/publish", "pd:batch/publish"),
    ("D arrival -> D engine core", "D:arrival", "D:add"),
    ("D engine core -> D step begin (Expect sent)", "D:add", "D:step_begin"),
    ("D expect: engine thread -> stream sender thread", "client_step/expect", "client_sender/expect"),
    ("D expect: stream sender -> decode daemon", "client_sender/expect", "dd:batch/expect"),
    ("decode daemon Expect -> prefill daemon met", "dd:started", "pd:met"),
    ("prefill daemon met -> WRITE done", "pd:met", "pd:writedone"),
    ("P forward end -> WRITE done", "P:fwd_end", "pd:writedone"),
    ("WRITE done -> decode daemon delivered", "pd:writedone", "dd:delivered"),
    ("decode daemon delivered -> D worker reports it", "dd:delivered", "D:done/recv"),
    ("D worker reports it -> D first token", "D:done/recv", "D:first_tok"),
    ("first event -> D first token (engine-side TTFT)", "*", "D:first_tok"),
]


def _site_on_path(on: bool) -> None:
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(SITE_DIR)]
    parts = [str(SITE_DIR), *parts] if on else parts
    if parts:
        os.environ["PYTHONPATH"] = os.pathsep.join(parts)
    else:
        os.environ.pop("PYTHONPATH", None)


def enable(d: Path) -> None:
    """Make the processes this process starts from now on write their events into ``d``."""
    d.mkdir(parents=True, exist_ok=True)
    os.environ["KVPUSHD_LAB_TIMELINE"] = str(d)
    _site_on_path(True)


def disable() -> None:
    os.environ.pop("KVPUSHD_LAB_TIMELINE", None)
    _site_on_path("KVPUSHD_LAB_VLLM_SPIN_S" in os.environ)


def set_vllm_spin(seconds: float | None) -> None:
    """vLLM's shared-memory readers in the processes started from now on busy-wait ``seconds`` after each
    read (vLLM's own 1 s when None); see the sitecustomize."""
    if seconds is None:
        os.environ.pop("KVPUSHD_LAB_VLLM_SPIN_S", None)
        os.environ.pop("VLLM_SHM_BROADCAST_BUSY_LOOP_S", None)
    else:
        os.environ["KVPUSHD_LAB_VLLM_SPIN_S"] = os.environ["VLLM_SHM_BROADCAST_BUSY_LOOP_S"] = repr(seconds)
    _site_on_path(seconds is not None or "KVPUSHD_LAB_TIMELINE" in os.environ)


def _events(d: Path) -> list[dict[str, Any]]:
    out = []
    for f in sorted(d.glob("*.jsonl")):
        for ln in f.read_text().splitlines():
            if ln:
                e = json.loads(ln)
                e["pid"] = f.stem
                out.append(e)
    return out


def requests(events: list[dict[str, Any]]) -> list[dict[str, float]]:
    """One {point: wall time} per transfer (the first time each point happened), in arrival order."""
    tid_of = {e["rid"]: e["tid"] for e in events if e["ev"] == "add" and e["tid"] != e["rid"]}
    leg = {e["rid"]: "P" if e.get("kind") == "publish" else "D" for e in events if e["ev"] == "meta"}
    prefill_daemons = {e["pid"] for e in events if e["ev"] == "daemon_started" and e.get("side") == "send"}
    by: dict[str, dict[str, float]] = {}
    for e in sorted(events, key=lambda e: e["t"]):
        ev = e["ev"]
        if ev.startswith("daemon_"):
            tid = e["tid"]
            point = ("pd:" if e["pid"] in prefill_daemons else "dd:") + ev[7:] + (f"/{e['op']}" if e.get("op") else "")
        elif ev.startswith("client_"):
            tid, point = e["tid"], f"{ev}/{e.get('op', '')}"
        else:
            tid = tid_of.get(e["rid"], "")
            point = f"{leg.get(e['rid'], '?')}:{ev}" + (f"/{e['kind']}" if e.get("kind") else "")
        if not tid:
            continue
        pts = by.setdefault(tid, {})
        pts.setdefault(point, e["t"])
        if ev == "add" and e.get("arrival"):
            pts.setdefault(point.replace(":add", ":arrival"), e["arrival"])
    return sorted(by.values(), key=lambda p: min(p.values()))


def summary(d: Path) -> dict[str, Any]:
    events = _events(d)
    reqs = [p for p in requests(events) if "D:first_tok" in p][WARMUP:]
    t_cell = min((min(p.values()) for p in reqs), default=0.0)
    rows = []
    for label, a, b in SEGMENTS:
        xs = [1e3 * (p[b] - (min(p.values()) if a == "*" else p[a])) for p in reqs if b in p and (a == "*" or a in p)]
        if xs:
            rows.append({"segment": label, "n": len(xs), "p50_ms": round(statistics.median(xs), 2),
                         "mean_ms": round(statistics.fmean(xs), 2), "max_ms": round(max(xs), 2)})
    late = [e for e in events if e["ev"] == "daemon_thread_late" and e["t"] >= t_cell]
    stalls = {"count": len(late), "sum_ms": round(sum(e["ms"] for e in late), 1),
              "max_ms": round(max((e["ms"] for e in late), default=0.0), 1),
              "cpu_ms_during": round(sum(e.get("cpu_ms", 0.0) for e in late), 1)}
    return {"requests": len(reqs), "segments": rows, "daemon_stalls_over_5ms": stalls}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--slow", type=float, default=0.0, metavar="MS",
                    help="also print every point of each request slower than MS to its first token")
    a = ap.parse_args(argv)
    s = summary(a.dir)
    if a.json:
        print(json.dumps(s))
        return 0
    print(f"{s['requests']} requests (warm-up left out); ms: p50, mean, max")
    for r in s["segments"]:
        print(f"{r['p50_ms']:9.2f} {r['mean_ms']:9.2f} {r['max_ms']:9.2f}  {r['segment']}")
    st = s["daemon_stalls_over_5ms"]
    print(f"daemon threads woken over 5 ms late: {st['count']} times, {st['sum_ms']} ms in all (max "
          f"{st['max_ms']}), the daemon process using {st['cpu_ms_during']} ms of CPU meanwhile")
    if a.slow:
        for p in requests(_events(a.dir))[WARMUP:]:
            t0 = min(p.values())
            if 1e3 * (p.get("D:first_tok", t0) - t0) > a.slow:
                print(" ".join(f"{k}={1e3 * (v - t0):.1f}" for k, v in sorted(p.items(), key=lambda kv: kv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
