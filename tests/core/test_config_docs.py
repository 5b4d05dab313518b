"""docs/configuration.md and systemd/kvpushd.toml are generated from the schema: stale files fail here,
and what is generated says every key and decodes."""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest

from kvpushd import config

ROOT = Path(__file__).resolve().parents[2]


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_config_docs", ROOT / "scripts" / "gen_config_docs.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rel", ["docs/configuration.md", "systemd/kvpushd.toml"])
def test_generated_file_is_current(rel: str) -> None:
    gen = generator()
    want = dict(gen.outputs())[Path(rel)]
    got = (ROOT / rel).read_text()
    assert got == want, f"{rel} is stale: regenerate it with `{gen.COMMAND}` (and commit the result)"


def test_every_key_is_documented_and_shown() -> None:
    gen = generator()
    md, example = gen.markdown(), gen.example_toml()
    for name, doc, keys in gen.sections(config.Config):
        assert doc and f"## [{name}]" in md
        for k in keys:
            assert k.doc, f"{k.dotted} has no doc"
            assert f"| `{k.name}` |" in md
            assert f"{k.name} = " in example or f"[{k.dotted}" in example, k.dotted


def test_example_with_every_commented_key_set_decodes(tmp_path: Path) -> None:
    """Uncomment every key of the shipped example (examples included): a valid config, once the TLS
    paths point at a PEM file and the keys that exclude each other (insecure, backend) are left out."""
    lines = []
    for line in generator().example_toml().splitlines():
        body = line.removeprefix("# ")
        if body.startswith("[") or (" = " in body and body.split(" = ")[0].isidentifier()):
            lines.append(body)
    data = tomllib.loads("\n".join(lines))
    pem = tmp_path / "stand-in.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nx\n-----END CERTIFICATE-----\n")
    for key in ("tls_cert", "tls_key", "tls_ca"):
        data["peer_api"][key] = str(pem)
    assert data["peer_api"].pop("insecure") is False and data["transfer"].pop("backend") == "LIBFABRIC"
    cfg = config.from_dict(data)
    assert cfg.peer_api.allow_names == ("decode-node-1", "decode-node-2")
    assert cfg.transfer.device_params["gpu1"] == {"device_list": "mlx5_1"}
    assert cfg.tracing.otlp_endpoint == "http://127.0.0.1:4317"
