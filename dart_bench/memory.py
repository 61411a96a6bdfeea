"""Peak memory: this process's peak resident set, and fresh child processes that measure one thing each and report
it as their last line of JSON."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys


def peak_rss_mib() -> dict:
    """This process's peak resident memory, MiB: `ru_maxrss_mib` (`resource.getrusage`; Linux reports KiB),
    `vmhwm_mib` (VmHWM of /proc/self/status: the current address space; None where unavailable) and `peak_mib`
    (VmHWM when available, else ru_maxrss).

    ru_maxrss of a child started by subprocess can include the parent's peak (the child is vfork-ed from the
    parent and Linux folds the pre-exec address space into it); VmHWM does not.
    """
    out = {"ru_maxrss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "vmhwm_mib": None}
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    out["vmhwm_mib"] = int(line.split()[1]) / 1024
    except OSError:
        pass
    out["peak_mib"] = out["vmhwm_mib"] if out["vmhwm_mib"] is not None else out["ru_maxrss_mib"]
    return out


def run_child(script: str, *args: str) -> dict:
    """Run `script` (a benchmark's own file, with its hidden child flags) in a fresh Python process; its last line
    of output, parsed as JSON. A failing child raises CalledProcessError."""
    out = subprocess.run([sys.executable, os.path.abspath(script), *args], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
