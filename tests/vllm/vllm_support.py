"""Helpers for tests/vllm/test_vllm_connector.py: daemons started with the daemon venv's interpreter and
vLLM 0.33.0 objects (config, scheduler, requests, model-runner outputs) built without weights.

The vLLM venv has no nixl/uvloop/structlog, so daemons run under ``KVPUSHD_PYTHON`` (default: this
interpreter) with the repository root as working directory. Modelled on vLLM's
tests/v1/kv_connector/unit/utils.py and /tmp/vllmwork/sched_smoke.py.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpushd_client import KVPushClient

REPO = Path(__file__).resolve().parents[2]
KVPUSHD_PYTHON = os.environ.get("KVPUSHD_PYTHON") or sys.executable
EOS_TOKEN_ID = 2
CONNECTOR_MODULE = "kvpushd_client.vllm_connector"


# ------------------------------------------------------------------------------------------------
# Daemons


@dataclass
class Daemon:
    name: str
    sock: str
    cfg: Path
    log: Path
    proc: subprocess.Popen[bytes]
    peer_address: str = ""

    def start(self) -> None:
        self.proc = _spawn(self.cfg, self.log)

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        with KVPushClient(self.sock, timeout_s=5.0) as c:
            try:
                c.wait_ready(timeout_s)
            except Exception:
                self.proc.kill()
                raise RuntimeError(f"daemon {self.name} did not start:\n{self.logs()[-4000:]}") from None
            self.peer_address = c.status().peer_address

    def transfer_ids(self) -> set[str]:
        """Transfers the daemon holds now (status API)."""
        with KVPushClient(self.sock, timeout_s=5.0) as c:
            return {t.transfer_id for t in c.status().transfers}

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye to anyone."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait(30)
        return int(self.proc.returncode)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def _spawn(cfg: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen([KVPUSHD_PYTHON, "-m", "kvpushd", "serve", "--config", str(cfg)],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO)


def spawn_daemon(workdir: Path, name: str, extra_config: str = "") -> Daemon:
    """Start a daemon (returns at once; call wait_ready())."""
    sock = str(workdir / f"{name}.sock")
    cfg = workdir / f"{name}.toml"
    cfg.write_text(
        f'[node]\nnode_id = "{name}"\nadvertise_host = "127.0.0.1"\n'
        f'[worker_api]\nsocket = "{sock}"\n'
        f'[peer_api]\nlisten = "127.0.0.1:0"\n' + extra_config)
    log = workdir / f"{name}.log"
    return Daemon(name, sock, cfg, log, _spawn(cfg, log))


@contextlib.contextmanager
def daemon_pair(workdir: Path, extra_config: str = "") -> Iterator[tuple[Daemon, Daemon]]:
    """A prefill-node daemon and a decode-node daemon, started together; both must exit 0 at the end."""
    p = spawn_daemon(workdir, "pnode", extra_config)
    d = spawn_daemon(workdir, "dnode", extra_config)
    try:
        p.wait_ready()
        d.wait_ready()
    except BaseException:
        p.stop()
        d.stop()
        raise
    yield p, d
    rcs = [(x, x.stop()) for x in (p, d)]
    for x, rc in rcs:
        assert rc == 0, f"daemon {x.name} exited {rc}:\n{x.logs()[-3000:]}"


def pd_fixtures(prefix: str, daemon_config: str, **llama: int) -> tuple[Any, Any, Any]:
    """A test module's ``workdir``, ``model_dir`` (a tiny Llama, ``write_tiny_llama(**llama)``) and
    ``daemons`` (``daemon_pair``) fixtures, module-scoped; assign them to those three names."""
    import tempfile

    import pytest

    @pytest.fixture(scope="module", name="workdir")
    def workdir() -> Iterator[Path]:
        with tempfile.TemporaryDirectory(prefix=prefix) as d:
            yield Path(d)

    @pytest.fixture(scope="module", name="model_dir")
    def model_dir(workdir: Path) -> Path:
        d = workdir / "tiny-llama"
        d.mkdir()
        return write_tiny_llama(d, **llama)

    @pytest.fixture(scope="module", name="daemons")
    def daemons(workdir: Path) -> Iterator[tuple[Daemon, Daemon]]:
        """A prefill-node daemon and a decode-node daemon, started together."""
        with daemon_pair(workdir, daemon_config) as pair:
            yield pair

    return workdir, model_dir, daemons


def wait_for(pred: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval_s)
    return bool(pred())


# ------------------------------------------------------------------------------------------------
# vLLM objects


def write_tiny_llama(d: Path, layers: int = 2, kv_heads: int = 2, head_size: int = 64) -> Path:
    """config.json of a tiny Llama: enough for ModelConfig, no weights, no tokenizer."""
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": head_size * 4, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": kv_heads, "num_hidden_layers": layers, "vocab_size": 128,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": 1,
        "eos_token_id": EOS_TOKEN_ID, "torch_dtype": "float32",
    }
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def make_vllm_config(model_dir: Path, kv_role: str, engine_id: str, socket: str, block_size: int = 16,
                     policy: str = "fail", extra: dict[str, Any] | None = None) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )

    model_config = ModelConfig(model=str(model_dir), tokenizer=str(model_dir), skip_tokenizer_init=True,
                               dtype="float32", seed=42, max_model_len=1024)
    return VllmConfig(
        model_config=model_config,
        scheduler_config=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024,
                                         enable_chunked_prefill=True,
                                         is_encoder_decoder=model_config.is_encoder_decoder),
        cache_config=CacheConfig(block_size=block_size, gpu_memory_utilization=0.9, cache_dtype="auto",
                                 enable_prefix_caching=True),
        # Exactly what an operator passes with --kv-transfer-config.
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPushdConnector", kv_connector_module_path=CONNECTOR_MODULE, kv_role=kv_role,
            engine_id=engine_id, kv_load_failure_policy=policy,
            kv_connector_extra_config={"kvpushd_socket": socket, **(extra or {})}),
        device_config=DeviceConfig("cpu"),
    )


def simple_kv_cache_config(num_blocks: int, block_size: int) -> Any:
    """The scheduler-only KV cache config of vLLM's connector unit tests (one group, no tensors)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(
        ["layer"], FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32))])


def real_kv_cache_config(vllm_config: Any, num_blocks: int, window: int = 0, tp: int = 1) -> Any:
    """What vLLM's engine core plans for the CPU attention backend (layout LBHNC), for num_blocks.
    ``window``: odd layers are sliding-window layers of that many tokens, with vLLM's hybrid KV cache
    manager on (two KV cache groups, one block pool, each allocation shared by a layer of each).
    ``tp``: each rank holds 1/tp of the KV heads (as vLLM's specs say per rank)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    mc = vllm_config.model_config
    cc = vllm_config.cache_config
    if cc.kv_cache_layout is None:  # resolved once by the engine core from the backend's support list
        cc.kv_cache_layout = CPUAttentionBackend.supported_kv_cache_layouts()[0].name
    kw = dict(block_size=cc.block_size, num_kv_heads=mc.get_total_num_kv_heads() // tp, head_size=mc.get_head_size(),
              dtype=mc.dtype)
    spec = FullAttentionSpec(**kw)
    n_layers = mc.get_num_layers(vllm_config.parallel_config)
    specs = {f"model.layers.{i}.self_attn.attn": SlidingWindowSpec(sliding_window=window, **kw) if window and i % 2
             else spec for i in range(n_layers)}
    if window:  # this venv's platform says nothing of the hybrid manager; a CPU or GPU engine has it on
        vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = False
    groups = get_global_kv_cache_groups(vllm_config, [specs])
    per_block = spec.page_size_bytes * (len(specs) // 2 if window else len(specs))  # hybrid: groups share pages
    return get_kv_cache_configs(vllm_config, [specs], [per_block * num_blocks], groups)[0]


def allocate_cpu_kv_caches(vllm_config: Any, kv_cache_config: Any) -> dict[str, Any]:
    """The KV tensors vLLM's CPU model runner allocates (vllm.v1.worker.utils.allocate_kv_cache)."""
    import torch
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    block_size = vllm_config.cache_config.block_size
    return allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout,
                             [block_size] * len(kv_cache_config.kv_cache_groups))


def create_scheduler(vllm_config: Any, kv_cache_config: Any) -> Any:
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    return Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vllm_config),
                     block_size=vllm_config.cache_config.block_size)


_none_hash_ready = False


def create_request(req_id: str, num_tokens: int, max_tokens: int, kv_transfer_params: dict[str, Any] | None,
                   block_size: int, prompt: list[int] | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    global _none_hash_ready
    if not _none_hash_ready:
        init_none_hash(sha256)
        _none_hash_ready = True
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, EOS_TOKEN_ID)
    if prompt is None:
        prompt = [(i % 100) + 3 for i in range(num_tokens)]
    req = Request(request_id=req_id, prompt_token_ids=list(prompt),
                  sampling_params=sp, pooling_params=None,
                  block_hasher=get_request_block_hasher(block_size, sha256))
    req.kv_transfer_params = kv_transfer_params  # the engine takes it from sampling_params.extra_args
    return req


@functools.cache
def _has_req_id_to_index() -> bool:
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    return any(f.name == "req_id_to_index" for f in dataclasses.fields(ModelRunnerOutput))


def model_output(reqs: list[Any], kv: Any = None, eos: bool = False) -> Any:
    """A ModelRunnerOutput sampling one token for each request (none for a request still in its
    prompt: a partial prefill chunk, whose sample the model runner discards)."""
    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

    if not reqs:
        out = copy.deepcopy(EMPTY_MODEL_RUNNER_OUTPUT)
        out.kv_connector_output = kv
        return out
    ids = [r.request_id for r in reqs]
    # vLLM 0.34 dropped req_id_to_index (the order of req_ids says it)
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if _has_req_id_to_index() else {}
    return ModelRunnerOutput(req_ids=ids, **index,
                             sampled_token_ids=[[] if r.num_computed_tokens < r.num_tokens
                                                else [EOS_TOKEN_ID if eos else 7] for r in reqs], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kv)


def kv_output(finished_sending: set[str] | None = None, finished_recving: set[str] | None = None,
              invalid_block_ids: set[int] | None = None, failed_recving: set[str] | None = None) -> Any:
    from vllm.v1.outputs import KVConnectorOutput

    return KVConnectorOutput(finished_sending=finished_sending, finished_recving=finished_recving,
                             invalid_block_ids=invalid_block_ids or set(), failed_recving=failed_recving or set())


def hybrid_kv_cache_config(num_blocks: int, block_size: int, window: int) -> Any:
    """Scheduler-only KV cache config of a hybrid model: a full-attention and a sliding-window group."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

    kw = dict(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["full"], FullAttentionSpec(**kw)),
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(sliding_window=window, **kw))])


def num_free_blocks(s: Any) -> int:
    return int(s.kv_cache_manager.block_pool.free_block_queue.num_free_blocks)


def assert_scheduler_empty(s: Any) -> None:
    assert not s.requests and not s.waiting and not s.kv_holding_waiting and not s.running
    assert not s.finished_recving_kv_req_ids
    assert num_free_blocks(s) == s.kv_cache_manager.block_pool.num_gpu_blocks - 1  # all but the null block
    assert all(b.ref_cnt == 0 for b in s.kv_cache_manager.block_pool.blocks)


def decode_params(prefill_engine_id: str, prefill_peer_address: str, request_id: str, tp_size: int = 1,
                  ) -> dict[str, Any]:
    """What disagg_proxy_pushconnector_demo.py sends to decode (its CLI args name P's daemon)."""
    host, _, port = prefill_peer_address.rpartition(":")
    return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": prefill_engine_id,
            "remote_host": host, "remote_port": int(port), "tp_size": tp_size, "pp_size": 1,
            "remote_request_id": request_id}


def prefill_params() -> dict[str, Any]:
    """What disagg_proxy_pushconnector_demo.py sends to prefill."""
    return {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}


def x_request_id() -> str:
    """A router's X-Request-Id: the transfer id vLLM's push proxy hands both legs."""
    return str(uuid.uuid4())


def engine_request_id(x: str) -> str:
    """vLLM's internal id for a completion: cmpl-<X-Request-Id>-<i>-<8 random hex>."""
    return f"cmpl-{x}-0-{uuid.uuid4().hex[:8]}"
