"""Was a CPU profile measured on this kind of machine?

A CPU profile's op rows are the speed of the processor that timed them, and the machine a
"local" cluster names can change under it: this project's shared host has been an AMD EPYC
(AVX2) when ``profiles/local-cpu.json`` was measured and an Intel Xeon with AVX-512 on another
day, whose linears ran 1.5-2x faster by the same sweep (docs/profiling.md, "A quick profile").
``mismatch`` compares the profile's recorded ``machine`` (profiling/machine.py writes it) with
this host -- the processor model, the core count and the vector instructions torch dispatches
to -- and says what differs, so ``autopar plan`` can say that the prices describe another
machine and how to re-time them in minutes.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

#: the command that re-times a copy's op table on this machine, with as many processes busy as
#: timed the profile's rows (``ranks``; profiles/local-cpu.json: 2, one per core of the 2-core
#: host); the thread clock of profiling/timing.py keeps other work out of the rows
QUICK_PROFILE = ("OMP_NUM_THREADS=1 torchrun --nproc-per-node {processes} -m autopar.cli profile -o {out} "
                 "--skip-collectives --skip-overheads --skip-sync-wait")


def op_processes(profile: Mapping) -> int:
    """How many processes were busy when the profile's op rows were timed (their ``ranks``; 1 when
    the rows do not say)."""
    ranks = [r.get("ranks") for r in profile.get("op_table") or [] if isinstance(r.get("ranks"), int)]
    return max(ranks) if ranks else 1


def this_host() -> dict:
    """This machine as a profile's ``machine`` names it: cpu_model, num_cpu_cores, cpu_capability."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:                        # no torch, or an old one: compare what is known
        capability = None
    return {"cpu_model": model, "num_cpu_cores": os.cpu_count(), "cpu_capability": capability}


def mismatch(profile: Mapping, host: Mapping | None = None) -> list[str]:
    """What differs between the CPU profile's recorded machine and ``host`` (default: this one),
    as "key: profile's -> this host's"; empty for a GPU profile, a profile that records no
    machine, or the same machine."""
    machine = profile.get("machine")
    if profile.get("device") != "cpu" or not isinstance(machine, Mapping):
        return []
    host = this_host() if host is None else host
    out = []
    for key in ("cpu_model", "num_cpu_cores", "cpu_capability"):
        a, b = machine.get(key), host.get(key)
        if a is not None and b is not None and a != b:
            out.append(f"{key}: {a} -> {b}")
    return out


def advice(profile_name: str, differences: list[str], processes: int = 2) -> str:
    """One paragraph for a user planning with a CPU profile of another machine."""
    command = QUICK_PROFILE.format(out="mine.json", processes=processes)
    return (f"note: profile {profile_name} was measured on another machine ({'; '.join(differences)}), so its op "
            f"times may be off by up to 2x here. Re-time its op table on this machine in a few minutes: copy the "
            f"profile to mine.json, run `{command}`, and plan with --profile mine.json.")
