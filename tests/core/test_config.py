"""Config: every key has a default, typos and bad values fail loudly at load."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvpushd import config
from kvpushd.core.errors import InvalidArgument

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_are_usable() -> None:
    cfg = config.load(None)
    assert cfg.transfer.backends == ("UCX",)
    assert cfg.listen_host_port == ("0.0.0.0", 7700)
    assert cfg.socket_path.endswith("worker.sock")
    assert cfg.node_id


def test_shipped_config_file_loads() -> None:
    data = tomllib.loads((ROOT / "systemd" / "kvpushd.toml").read_text())
    cfg = config.from_dict(data)
    assert cfg.worker_api.socket == "/run/kvpushd/worker.sock"
    assert cfg.worker_api.socket_mode == 0o660


@pytest.mark.parametrize("data, words", [
    ({"nope": {}}, r"unknown section \[nope\]"),
    ({"peer_api": {"alow": ["10.0.0.0/8"]}}, r"unknown key peer_api\.alow; known: \[.*'allow'"),
    ({"peer_api": "open"}, "peer_api must be a table"),
    ({"transfer": {"backend": ["UCX"]}}, "transfer.backend must be a str"),
    ({"transfer": {"backend": "UCX", "backends": ["LIBFABRIC"]}}, "disagree"),
    ({"transfer": {"backend": "LIB FABRIC"}}, "must be a NIXL backend name"),
    ({"transfer": {"backends": ["UCX", "LIB FABRIC"]}}, r"transfer\.backends\[1\] must be a NIXL backend name"),
    ({"transfer": {"backend_params": "device_list=mlx5_0"}}, "backend_params must be a table"),
    ({"transfer": {"backend_params": {"device_list": ["mlx5_0"]}}}, r"backend_params\.device_list must be a string"),
    ({"transfer": {"backend_params": {"LIBFABRIC": {"num_threads": "4"}}}}, "names no configured backend"),
    ({"transfer": {"device_params": {"cuda0": {"device_list": "mlx5_0"}}}}, "\"host\" or \"gpu<N>\""),
    ({"transfer": {"device_params": {"gpu0": "mlx5_0"}}}, "must be a table of backend parameters"),
    ({"transfer": {"device_params": {"gpu0": {"x": {"y": "z"}}}}}, r"device_params\.gpu0\.x must be a string"),
    ({"transfer": {"backends": "UCX"}}, "list of strings"),
    ({"transfer": {"backends": []}}, "at least one"),
    ({"transfer": {"publish_timeout_s": -1}}, "publish_timeout_s must be positive, got -1"),
    ({"transfer": {"poll_hot_s": 3601}}, r"poll_hot_s must be 0\.\.3600"),
    ({"transfer": {"max_pending": 1.5}}, "max_pending must be an integer"),
    ({"peer_api": {"max_stream_items": 0}}, "max_stream_items must be positive"),
    ({"metrics": {"listen": "host"}}, "metrics.listen must be host:port, got 'host'"),
    ({"metrics": {"listen": "127.0.0.1:70000"}}, "metrics.listen: address '127.0.0.1:70000' is not host:port"),
    ({"tracing": {"otlp_endpoint": "127.0.0.1:4317"}}, "must be http://host:port or https://host:port"),
    ({"tracing": {"sample_ratio": 1.5}}, r"sample_ratio must be 0\.\.1"),
    ({"transfer": {"expect_timeout_s": "10"}}, "expect_timeout_s must be a number, got '10'"),
    ({"transfer": {"expect_timeout_s": True}}, "expect_timeout_s must be a number"),
    ({"peer_api": {"listen": "7700"}}, "host:port"),
    ({"worker_api": {"socket_mode": 0o1777}}, r"socket_mode must be 0\.\.511, got 1023 \(Permission bits"),
    ({"log": {"level": "loud"}}, "log.level must be debug, info, warning or error, got 'loud'"),
    ({"log": {"format": "xml"}}, "log.format must be one of"),
])
def test_bad_config(data: dict, words: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(InvalidArgument, match=words):
        config.from_dict(data)


def test_log_level_is_case_insensitive() -> None:
    assert config.from_dict({"log": {"level": "WARNING"}}).log.level == "WARNING"


def test_overrides_are_decoded_and_validated_with_the_file(tmp_path: Path) -> None:
    """kvpushd serve --socket/--listen/--node-id: set over the file's keys, checked like them."""
    f = tmp_path / "c.toml"
    f.write_text('[peer_api]\nlisten = "127.0.0.1:7000"\n[node]\nnode_id = "a"\n')
    cfg = config.load(str(f), {"peer_api.listen": "127.0.0.1:7001", "node.node_id": None, "worker_api.socket": "/s"})
    assert (cfg.peer_api.listen, cfg.node_id, cfg.socket_path) == ("127.0.0.1:7001", "a", "/s")
    with pytest.raises(InvalidArgument, match=r"peer_api\.listen must be host:port, got '7001'"):
        config.load(None, {"peer_api.listen": "7001"})


def test_serve_rejects_bad_config_file(tmp_path: Path) -> None:
    f = tmp_path / "bad.toml"
    f.write_text("[transfer]\npublish_timeout_s = 0\n")
    r = subprocess.run([sys.executable, "-m", "kvpushd", "serve", "--config", str(f)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "publish_timeout_s must be positive" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvpushd", "serve", "--config", str(tmp_path / "missing.toml")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_backend_settings() -> None:
    """[transfer] backend, backend_params (plain keys and per-backend tables) and device_params hints."""
    data = tomllib.loads("""
[transfer]
backend = "LIBFABRIC"
[transfer.backend_params]
num_threads = 4
split_batch_size = "1024"
[transfer.backend_params.LIBFABRIC]
split_batch_size = "2048"
[transfer.device_params.gpu1]
max_bw_per_dram_seg = "200"
[transfer.device_params.host]
flag = true
""")
    t = config.from_dict(data).transfer
    assert t.backends == ("LIBFABRIC",) and t.backend == "LIBFABRIC"
    assert config.backend_init_params(t, "LIBFABRIC") == {"num_threads": "4", "split_batch_size": "2048"}
    assert config.backend_init_params(t, "LIBFABRIC", "gpu1") == {
        "num_threads": "4", "split_batch_size": "2048", "max_bw_per_dram_seg": "200"}
    assert config.backend_init_params(t, "LIBFABRIC", "host")["flag"] == "true"
    assert config.backend_init_params(t, "LIBFABRIC", "gpu7") == config.backend_init_params(t, "LIBFABRIC")
    # backends alone still works, and the same list given both ways is no conflict
    assert config.from_dict({"transfer": {"backends": ["UCX", "POSIX"]}}).transfer.backends == ("UCX", "POSIX")
    assert config.from_dict({"transfer": {"backend": "UCX", "backends": ["UCX"]}}).transfer.backends == ("UCX",)
    assert config.load(None).transfer.backend_params == {}


def test_status_config_summary_is_made_once_per_config() -> None:
    """GetStatus describes the settings; walking the structs costs ~1 ms of the loop, so it is made once."""
    from kvpushd.rpc.status import config_summary

    a = config.from_dict({"transfer": {"poll_interval_s": 0.0005}})
    b = config.from_dict({"transfer": {"poll_interval_s": 0.002}})
    sa = config_summary(a)
    assert config_summary(a) is sa
    assert sa["transfer.poll_interval_s"] == "0.0005"
    sb = config_summary(b)
    assert sb["transfer.poll_interval_s"] == "0.002" and sb is not sa
