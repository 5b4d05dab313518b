#!/usr/bin/env python3
"""What the GPU check runs on, as one JSON object: GPUs (by torch), versions, whether nixl and kvpushd import.

Part of scripts/gpu_check.sh run; never fails (a missing piece is reported, not raised)."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import sys


def version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return ""


def main() -> int:
    out: dict[str, object] = {"python": platform.python_version(), "machine": platform.machine(),
                              "versions": {n: version(n) for n in ("torch", "nixl", "nixl-cu13", "grpcio",
                                                                   "protobuf", "structlog", "msgspec", "numpy")}}
    try:
        import torch

        out["torch_cuda"] = torch.version.cuda or ""
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        out["gpus"] = n
        out["gpu"] = [{"name": torch.cuda.get_device_name(i), "uuid": str(torch.cuda.get_device_properties(i).uuid),
                       "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                      for i in range(n)]
    except Exception as e:
        out.update(gpus=0, torch_error=f"{type(e).__name__}: {e}")
    for mod in ("nixl._api", "kvpushd.app", "kvpushd_client.cuda"):
        try:
            m = __import__(mod, fromlist=["_"])
            out[f"import_{mod}"] = getattr(m, "__file__", "") or "ok"
        except Exception as e:
            out[f"import_{mod}"] = f"FAILED {type(e).__name__}: {e}"
    try:
        from kvpushd_client.cuda import driver

        out["libcuda"] = driver() is not None
    except Exception as e:
        out["libcuda"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
