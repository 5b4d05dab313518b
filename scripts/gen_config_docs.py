"""Generate the configuration reference (docs/configuration.md) and the shipped example configuration
(systemd/kvpushd.toml) from the schema in kvpushd/config.py.

    python scripts/gen_config_docs.py          # rewrite both files
    python scripts/gen_config_docs.py --check  # exit 1 naming the files that are stale

tests/core/test_config_docs.py fails when either file differs from what this writes.
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from msgspec import inspect as mi

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvpushd.config import Config  # noqa: E402
from kvpushd.config_rules import bounds, type_name  # noqa: E402

COMMAND = "python scripts/gen_config_docs.py"
MARKDOWN = Path("docs/configuration.md")
EXAMPLE = Path("systemd/kvpushd.toml")

# The keys systemd/kvpushd.toml sets for the unit (the others are comments): value None is the default.
EXAMPLE_SETS: dict[str, Any] = {
    "node.node_id": None, "node.advertise_host": None,
    "worker_api.socket": "/run/kvpushd/worker.sock",  # the unit's RuntimeDirectory
    "worker_api.socket_mode": None, "peer_api.listen": None,
    "transfer.backends": None, "transfer.publish_timeout_s": None, "transfer.expect_timeout_s": None,
    "log.level": None, "log.format": None, "metrics.enabled": None, "metrics.listen": None,
}


@dataclass(frozen=True)
class Key:
    section: str
    name: str
    type: mi.Type
    default: Any
    doc: str
    examples: tuple[Any, ...]

    @property
    def dotted(self) -> str:
        return f"{self.section}.{self.name}"


def sections(root: type[msgspec.Struct]) -> Iterator[tuple[str, str, list[Key]]]:
    """(name, doc, keys) of every table of ``root``, in the schema's order."""
    for sec in mi.type_info(root).fields:
        info = sec.type
        keys = []
        for f in info.fields:
            meta = (f.type.extra_json_schema or {}) if isinstance(f.type, mi.Metadata) else {}
            default = f.default_factory() if f.default is msgspec.NODEFAULT else f.default
            keys.append(Key(sec.name, f.name, f.type, default, meta.get("description", ""),
                            tuple(meta.get("examples", ()))))
        yield sec.name, inspect.cleandoc(info.cls.__doc__ or ""), keys


def toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    return "{" + ", ".join(f"{k} = {toml_value(x)}" for k, x in v.items()) + "}"


def toml_tables(prefix: str, table: dict[str, Any]) -> list[str]:
    """A table value as TOML table sections: [prefix] with its plain keys, then its sub-tables."""
    plain = [f"{k} = {toml_value(v)}" for k, v in table.items() if not isinstance(v, dict)]
    out = [f"[{prefix}]", *plain] if plain else []
    for k, v in table.items():
        if isinstance(v, dict):
            out += toml_tables(f"{prefix}.{k}", v)
    return out


def kind(k: Key) -> str:
    return ", ".join(p for p in (type_name(k.type), bounds(k.type)) if p)


def comment(text: str, width: int = 100) -> list[str]:
    return [f"# {line}".rstrip() for para in text.split("\n\n")
            for line in (textwrap.wrap(" ".join(para.split()), width - 2) or [""])]


def example_toml() -> str:
    out = [
        "# kvpushd configuration, installed as /etc/kvpushd/kvpushd.toml and read by",
        "#   kvpushd serve --config /etc/kvpushd/kvpushd.toml",
        "# (systemd/kvpushd.service). The keys set below are the unit's; every other key is shown as a",
        "# comment with its default or an example. Reference: docs/configuration.md.",
        f"# Generated from kvpushd/config.py by `{COMMAND}`: edit the schema, not this file.",
    ]
    for name, doc, keys in sections(Config):
        sets = [k for k in keys if k.dotted in EXAMPLE_SETS]
        out += ["", f"[{name}]" if sets else f"# [{name}]", *comment(doc)]
        for k in sorted(keys, key=lambda k: isinstance(k.default, dict)):  # tables last: they end the section
            out += ["", *comment(f"{k.doc} ({kind(k)}; default {toml_value(k.default)})")]
            if k.dotted in EXAMPLE_SETS:
                value = EXAMPLE_SETS[k.dotted]
                out.append(f"{k.name} = {toml_value(k.default if value is None else value)}")
            elif isinstance(k.default, dict):
                out += [f"# {line}" for line in toml_tables(k.dotted, k.examples[0] if k.examples else {})]
            else:
                out.append(f"# {k.name} = {toml_value(k.examples[0] if k.examples else k.default)}")
    return "\n".join(out) + "\n"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown() -> str:
    out = [
        "# Configuration reference",
        "",
        f"<!-- Generated from kvpushd/config.py by `{COMMAND}`: edit the schema, not this file. -->",
        "",
        "kvpushd reads one TOML file: `kvpushd serve --config FILE`. Every key has a default, so a daemon",
        "started without a file is usable on one host (its peer API answers loopback callers only).",
        "Unknown sections and keys, values of the wrong type and values out of bounds stop the daemon at",
        "start with an error that names the key (`config: unknown key peer_api.alow`). The command line",
        "options `--socket`, `--listen` and `--node-id` set `worker_api.socket`, `peer_api.listen` and",
        "`node.node_id` over the file, checked like the file's own keys. `kvpushctl status` shows every",
        "effective setting. [systemd/kvpushd.toml](../systemd/kvpushd.toml) is the example the unit ships,",
        "generated from the same schema.",
    ]
    for name, doc, keys in sections(Config):
        out += ["", f"## [{name}]", "", " ".join(doc.split()), "",
                "| Key | Type | Default | Allowed | Description |", "|---|---|---|---|---|"]
        out += [f"| `{k.name}` | {type_name(k.type)} | `{cell(toml_value(k.default))}` | {cell(bounds(k.type))} | "
                f"{cell(k.doc)} |" for k in keys]
        examples = [k for k in keys if k.examples and isinstance(k.default, dict)]
        for k in examples:
            out += ["", f"`{k.name}`, for example:", "", "```toml", *toml_tables(k.dotted, k.examples[0]), "```"]
    return "\n".join(out) + "\n"


def outputs() -> Iterable[tuple[Path, str]]:
    yield MARKDOWN, markdown()
    yield EXAMPLE, example_toml()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is stale")
    args = ap.parse_args()
    stale = []
    for rel, text in outputs():
        path = ROOT / rel
        if path.exists() and path.read_text() == text:
            continue
        stale.append(str(rel))
        if not args.check:
            path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(stale)}; regenerate with `{COMMAND}`", file=sys.stderr)
        return 1
    print(f"{'stale' if args.check else 'wrote'}: {', '.join(stale) or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
