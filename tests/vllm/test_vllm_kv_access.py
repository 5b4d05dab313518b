"""vLLM 0.34's KV cache access and the hooks around releasing the KV, on both supported vLLM versions.

* ``kv_cache_access`` (vLLM 0.34): the flags per platform and setting (``access.py``), and vLLM 0.34.0's
  own ``VllmConfig`` with the connector: it starts on CPU (no ValueError), and where vLLM is made to
  believe it runs on CUDA, the extensible KV cache is on with EXPORTS_FD and off wherever it cannot be
  on (``kv_cache_memory_bytes``) or the operator keeps CUDA IPC (``kvpushd_kv_cache_access``).
* ``unregister_kv_caches`` / ``restore_kv_caches`` (vLLM 0.33 and 0.34): through vLLM's Scheduler and
  two live daemons, the worker detaches once its transfers settled and attaches again; a request goes
  through end to end before and after.

    KVPUSHD_PYTHON=.venv/bin/python .venv-vllm034/bin/python -m pytest -q -p no:cacheprovider \\
        tests/vllm/test_vllm_kv_access.py
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

pytest.importorskip("vllm.distributed", reason="needs vLLM: run with the venvs scripts/vllm_venv.sh builds")

import vllm_support as vs
from engine_support import Engine
from kvpushd_client import KVPushClient
from kvpushd_client.vllm import compat
from kvpushd_client.vllm.access import AccessFacts, Choice, decide_access
from test_vllm_connector import random_prompt, run_pd_request

P_ENGINE = "prefill-access-001"
D_ENGINE = "decode-access-001"
DAEMON_CONFIG = "[transfer]\npublish_timeout_s = 3.0\nexpect_timeout_s = 60.0\ndrain_timeout_s = 3.0\n"

workdir, model_dir, daemons = vs.pd_fixtures("kvpushd-access-", DAEMON_CONFIG)

needs_034 = pytest.mark.skipif(not compat.HAS_KV_CACHE_ACCESS, reason="kv_cache_access is a vLLM 0.34 hook")


@pytest.mark.parametrize(("facts", "want"), [
    (AccessFacts(platform_is_cuda=False, kv_buffer_device="cpu"), Choice.IN_PROCESS),
    (AccessFacts(platform_is_cuda=False, kv_buffer_device="cpu", setting="legacy_ipc"), Choice.IN_PROCESS),
    (AccessFacts(platform_is_cuda=True), Choice.EXPORTS_FD),
    (AccessFacts(platform_is_cuda=True, setting="auto"), Choice.EXPORTS_FD),
    (AccessFacts(platform_is_cuda=True, setting="legacy_ipc"), Choice.LEGACY_IPC),
    (AccessFacts(platform_is_cuda=True, setting=" LEGACY_IPC "), Choice.LEGACY_IPC),
    (AccessFacts(platform_is_cuda=True, kv_buffer_device="cpu"), Choice.IN_PROCESS),
    (AccessFacts(platform_is_cuda=True, extensible_blockers=("kv_cache_memory_bytes",)), Choice.LEGACY_IPC),
    (AccessFacts(platform_is_cuda=True, extensible_blockers=("custom_mem_pool",)), Choice.LEGACY_IPC),
    (AccessFacts(platform_is_rocm=True), Choice.LEGACY_IPC),
])
def test_access_per_platform_and_setting(facts: AccessFacts, want: Choice) -> None:
    assert decide_access(facts) is want


def test_unknown_access_setting_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="kvpushd_kv_cache_access must be one of auto, legacy_ipc"):
        decide_access(AccessFacts(platform_is_cuda=True, setting="exports_fabric"))


def _config(model_dir: Path, extra: dict[str, Any] | None = None) -> Any:
    return vs.make_vllm_config(model_dir, "kv_producer", P_ENGINE, "/nonexistent.sock", extra=extra)


@needs_034
def test_vllm_config_with_the_connector_starts_on_cpu(model_dir: Path) -> None:
    from vllm.config.kv_transfer import KVCacheAccess

    for extra in (None, {"kvpushd_kv_cache_access": "legacy_ipc"}):
        cfg = _config(model_dir, extra)  # VllmConfig.__post_init__ resolved the extensible KV cache: no ValueError
        assert cfg.cache_config.enable_extensible_kv_cache is False  # not CUDA
        assert cfg.kv_transfer_config.kv_cache_access() == KVCacheAccess.IN_PROCESS


def _as_if_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's platform claims CUDA: the config resolution takes the CUDA branch (nothing else runs)."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "is_cuda", lambda self: True)
    monkeypatch.setattr(type(current_platform), "is_cuda_alike", lambda self: True)
    monkeypatch.setattr(type(current_platform), "is_rocm", lambda self: False)


def _resolve(cfg: Any, **cache: Any) -> None:
    """Run vLLM 0.34's own resolution again on this config, with these cache settings."""
    for k, v in cache.items():
        setattr(cfg.cache_config, k, v)
    cfg.cache_config.enable_extensible_kv_cache = None
    cfg.cache_config._extensible_kv_cache_resolved = False
    cfg._resolve_extensible_kv_cache()


@needs_034
def test_on_cuda_the_extensible_cache_is_exported_by_fd_or_off(model_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config.kv_transfer import KVCacheAccess

    cfg = _config(model_dir)
    cfg.kv_transfer_config.kv_buffer_device = "cuda"
    _as_if_cuda(monkeypatch)
    _resolve(cfg)  # vLLM asks the connector while it resolves: EXPORTS_FD, the cache on
    assert cfg.cache_config.enable_extensible_kv_cache is True
    assert cfg.kv_transfer_config.kv_cache_access() == KVCacheAccess.EXPORTS_FD
    # Settings under which vLLM cannot have the cache: never EXPORTS_FD (vLLM would raise), CUDA IPC instead
    _resolve(cfg, kv_cache_memory_bytes=64 << 20)
    assert cfg.cache_config.enable_extensible_kv_cache is False
    _resolve(cfg, kv_cache_memory_bytes=None, num_gpu_blocks_override=100)
    assert cfg.cache_config.enable_extensible_kv_cache is False
    # The operator keeps CUDA IPC: LEGACY_IPC turns the cache off
    cfg.cache_config.num_gpu_blocks_override = None
    cfg.kv_transfer_config.kv_connector_extra_config["kvpushd_kv_cache_access"] = "legacy_ipc"
    _resolve(cfg)
    assert cfg.cache_config.enable_extensible_kv_cache is False
    assert cfg.kv_transfer_config.kv_cache_access() == KVCacheAccess.LEGACY_IPC
    # ... unless asked for explicitly: then vLLM's own error names the conflict
    cfg.cache_config.enable_extensible_kv_cache = True
    cfg.cache_config._extensible_kv_cache_resolved = False
    with pytest.raises(ValueError, match="legacy CUDA IPC"):
        cfg._resolve_extensible_kv_cache()


@pytest.fixture(scope="module")
def engines(model_dir: Path, daemons: tuple[vs.Daemon, vs.Daemon]) -> Iterator[tuple[Engine, Engine]]:
    p, d = daemons
    pe = Engine(model_dir, "kv_producer", P_ENGINE, p.sock, num_blocks=48, fill="random")
    de = Engine(model_dir, "kv_consumer", D_ENGINE, d.sock, num_blocks=64, fill="poison")
    yield pe, de
    pe.close()
    de.close()


def _attached(d: vs.Daemon, engine_id: str) -> int:
    with KVPushClient(d.sock, timeout_s=5.0) as c:
        return sum(1 for w in c.status().workers if w.engine_id == engine_id)


def test_unregister_detaches_and_restore_attaches_again(engines: tuple[Engine, Engine],
                                                        daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    pe, de = engines
    p, d = daemons
    run_pd_request(pe, de, p, random_prompt(100), P_ENGINE)
    for e, daemon, eid in ((pe, p, P_ENGINE), (de, d, D_ENGINE)):
        assert _attached(daemon, eid) == 1
        e.conn.unregister_kv_caches()  # sleep / weight update: nothing pending, so it detaches at once
        e.conn.unregister_kv_caches()  # idempotent
        assert vs.wait_for(lambda daemon=daemon, eid=eid: _attached(daemon, eid) == 0, 10)
        assert e.conn.worker_side.detaches == 1
        e.conn.restore_kv_caches()
        e.conn.restore_kv_caches()  # idempotent
        assert _attached(daemon, eid) == 1
    run_pd_request(pe, de, p, random_prompt(70), P_ENGINE)  # byte for byte again through the new attachments


def test_unregister_settles_a_pending_receive_first(engines: tuple[Engine, Engine],
                                                    daemons: tuple[vs.Daemon, vs.Daemon]) -> None:
    """A decode request registered, its KV not pushed: unregister aborts it and detaches only once the
    daemon confirmed; the request's receive is reported failed (vLLM's failure policy applies)."""
    from vllm.v1.request import RequestStatus

    pe, de = engines
    p, d = daemons
    x = vs.x_request_id()
    req = vs.create_request(vs.engine_request_id(x), 64, 2, vs.decode_params(P_ENGINE, p.peer_address, x), 32)
    de.sched.add_request(req)
    de.step()
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    w = de.conn.worker_side
    assert any(q.recv and not q.done for q in w._pending.values())
    de.conn.unregister_kv_caches()
    assert not any(q.recv for q in w._pending.values()) and _attached(d, D_ENGINE) == 0
    de.conn.restore_kv_caches()
    assert _attached(d, D_ENGINE) == 1
    de.step()  # vLLM takes the failed receive: kv_load_failure_policy "fail" ends the request
    assert req.request_id in (de.last_kv.failed_recving or ())
    assert req.is_finished()
    de.step()
    vs.assert_scheduler_empty(de.sched)
    run_pd_request(pe, de, p, random_prompt(50), P_ENGINE)
