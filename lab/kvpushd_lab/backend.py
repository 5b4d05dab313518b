"""Which NIXL backend the lab's daemons run (``transfer.backends``) and the environment it needs.

UCX needs nothing. LIBFABRIC needs a libfabric with NIXL 1.5.1's symbols, libcudart.so.13 and, on a
host without a GPU driver, a libcuda.so.1 that says "no device": ``scripts/libfabric.sh`` builds them
and prints the ``LD_LIBRARY_PATH`` that makes the plugin load. The lab takes it from
``KVPUSHD_LIBFABRIC_LD_PATH`` or, unset, from what the script last wrote (``build/libfabric/ld_library_path``).
Only the processes that run NIXL get it (the daemons, and the benchmarks' raw NIXL agents, which load
the libraries by path: ``preload``); the systemd unit and deploy/ never do (docs/efa.md).

    env = backend_env("LIBFABRIC", os.environ)     # raises BackendUnavailable, naming what is missing
    launch.spawn(workdir, name, backend="LIBFABRIC", ...)
    agent = nixl_agent("bench-target", "LIBFABRIC")  # a raw agent in this process (benchmarks, in-engine)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

BACKENDS = ("UCX", "LIBFABRIC")
LD_ENV = "KVPUSHD_LIBFABRIC_LD_PATH"
# The repository's build folder, where scripts/libfabric.sh writes the path it printed last.
LD_FILE = Path(__file__).resolve().parents[2] / "build" / "libfabric" / "ld_library_path"
# What NIXL's LIBFABRIC plugin links besides the system's libhwloc.so.15.
PLUGIN_LIBS = ("libfabric.so.1", "libcudart.so.13", "libcuda.so.1")
# tcp: the provider a host without EFA or CXI runs the plugin with (it refuses shm; sockets works too).
DEFAULT_PROVIDER = "tcp"


class BackendUnavailable(RuntimeError):
    """The backend's libraries are not at hand; the message names what is missing and how to get it."""


def libfabric_ld_path() -> str:
    """The ``LD_LIBRARY_PATH`` for the LIBFABRIC plugin; raises BackendUnavailable naming what is missing."""
    how = f"run scripts/libfabric.sh (or set {LD_ENV} to the path it prints)"
    path = os.environ.get(LD_ENV, "").strip()
    if not path:
        try:
            path = LD_FILE.read_text().strip()
        except OSError:
            raise BackendUnavailable(f"LIBFABRIC: no libfabric build ({LD_ENV} unset, no {LD_FILE}); {how}") from None
    dirs = [d for d in path.split(":") if d]
    found = {lib for lib in PLUGIN_LIBS for d in dirs if (Path(d) / lib).exists()}
    if ctypes.util.find_library("cuda"):  # a GPU driver: its libcuda.so.1 serves (the script adds no stub)
        found.add("libcuda.so.1")
    missing = [lib for lib in PLUGIN_LIBS if lib not in found]
    if missing:
        raise BackendUnavailable(f"LIBFABRIC: {', '.join(missing)} not in {path!r}; {how}")
    return path


def available(backend: str) -> str:
    """"" when ``backend`` can run here, else why not."""
    if backend != "LIBFABRIC":
        return ""
    try:
        libfabric_ld_path()
    except BackendUnavailable as e:
        return str(e)
    return ""


def backend_env(backend: str, env: Mapping[str, str], iface: str = "") -> dict[str, str]:
    """``env`` plus what a process running NIXL with ``backend`` needs. LIBFABRIC: the libraries'
    ``LD_LIBRARY_PATH`` (before what ``env`` has), ``FI_PROVIDER=tcp`` unless ``env`` names one, and
    with ``iface`` (a namespace's veth) ``FI_TCP_IFACE``, so the bytes cross that link."""
    out = dict(env)
    if backend != "LIBFABRIC":
        return out
    path = libfabric_ld_path()
    out["LD_LIBRARY_PATH"] = ":".join(filter(None, (path, out.get("LD_LIBRARY_PATH", ""))))
    out.setdefault("FI_PROVIDER", DEFAULT_PROVIDER)
    if iface:
        out.setdefault("FI_TCP_IFACE", iface)
    return out


def preload(backend: str) -> None:
    """Load the LIBFABRIC plugin's libraries into this process by path, so that NIXL's plugin finds
    them by soname although ``LD_LIBRARY_PATH`` (read once, at process start) lacks them."""
    if backend != "LIBFABRIC":
        return
    dirs = libfabric_ld_path().split(":")
    for lib in PLUGIN_LIBS:
        for d in dirs:
            if (Path(d) / lib).exists():
                ctypes.CDLL(str(Path(d) / lib), mode=ctypes.RTLD_GLOBAL)
                break


def nixl_agent(name: str, backend: str = "UCX") -> Any:
    """A NIXL agent on ``backend`` without NIXL's progress thread (it spins a core; the owner polls, as
    the daemon does). LIBFABRIC: its libraries loaded by path first (``preload``) and the tcp provider
    unless ``FI_PROVIDER`` names one; in a namespace the caller sets ``FI_TCP_IFACE``."""
    preload(backend)
    if backend == "LIBFABRIC":
        os.environ.setdefault("FI_PROVIDER", DEFAULT_PROVIDER)
    import nixl._api as nx

    if backend == "UCX":
        return nx.nixl_agent(name, nx.nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    agent = nx.nixl_agent(name, nx.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend(backend, {})
    return agent


def with_backend(settings: Mapping[str, Mapping[str, Any]] | None, extra: str,
                 backend: str) -> tuple[dict[str, dict[str, Any]], str]:
    """``transfer.backends = [backend]`` where the config will have it: in the raw TOML's [transfer]
    table when ``extra`` has one (TOML allows a table once), else in ``settings``, or, with no
    ``settings`` (None), in a [transfer] table added to ``extra``."""
    line = f"backends = {json.dumps([backend])}\n"
    lines = extra.splitlines(keepends=True)
    out = {k: dict(v) for k, v in (settings or {}).items()}
    for i, text in enumerate(lines):
        if text.strip() == "[transfer]":
            return out, "".join([*lines[:i + 1], line, *lines[i + 1:]])
    if settings is None:
        sep = "" if not extra or extra.endswith("\n") else "\n"
        return out, f"{extra}{sep}[transfer]\n{line}"
    out.setdefault("transfer", {})["backends"] = [backend]
    return out, extra
