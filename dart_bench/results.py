"""Writing results: every JSON, table and chart of the benchmarks is replaced atomically (a run cut short never
leaves half a file), with a description of the machine and checkout it came from."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Optional

import torch

from dart_core.io import atomic_write


def write_results(path: str | Path, results: dict, indent: int = 2) -> None:
    """Write `results` as indented JSON to `path` (folders created, file replaced atomically)."""
    path = str(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with atomic_write(path, "w") as fh:
        json.dump(results, fh, indent=indent)
        fh.write("\n")


def write_text(path: str | Path, text: str) -> None:
    """Write `text` to `path`, replaced atomically."""
    with atomic_write(str(path), "w") as fh:
        fh.write(text)


def save_png(fig, path: Path) -> Path:
    """Save a matplotlib figure atomically (a partial PNG never replaces a good one)."""
    with atomic_write(str(path), "wb") as fh:
        fig.savefig(fh, format="png", dpi=110)
    return path


def machine_info(**versions: str) -> dict:
    """CPU count, platform, `versions` (e.g. numpy=np.__version__), torch and Python versions."""
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), **versions, "torch": torch.__version__,
            "python": sys.version.split()[0]}


def git_commit(checkout: Path) -> Optional[str]:
    """$DART_SPEC_COMMIT when set (a copied tree's .git can be stale), else HEAD of the checkout (with "+dirty"
    when tracked files differ), else None."""
    if os.environ.get("DART_SPEC_COMMIT"):
        return os.environ["DART_SPEC_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=checkout,
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return None


def environment(device: torch.device, checkout: Path) -> dict:
    """Device (name, CUDA version and capability on CUDA), library versions, platform, torch threads and the commit
    of `checkout` (`git_commit`)."""
    import transformers

    env = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
           "python": platform.python_version(), "platform": platform.platform(), "commit": git_commit(checkout),
           "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        env.update(device_name=torch.cuda.get_device_name(device), cuda=torch.version.cuda,
                   device_capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    else:
        env["device_name"] = platform.processor() or platform.machine() or device.type
        env["cpu"] = cpu_description()
    return env


# the CPU flags that decide which kernels win on the CPU (x86: vector width, bfloat16 and matrix units)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_tile", "neon", "sve")


def cpu_description() -> dict:
    """`lscpu`'s model name, family, model and cores, and which of `CPU_FLAGS` the CPU has (empty where `lscpu` is
    missing): the name every CPU figure is given with."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("Flags", "").split())
    return {"model_name": fields.get("Model name", ""), "family": fields.get("CPU family", ""),
            "model": fields.get("Model", ""), "cpus": fields.get("CPU(s)", ""),
            "flags": [f for f in CPU_FLAGS if f in flags]}
