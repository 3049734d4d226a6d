"""How fast this CPU runs now, against the op rows of a profile made on it.

A shared machine's speed drifts: the host's other tenants slowed every plan of the accuracy
benchmark by 10-30% for minutes at a time (docs/profiling.md), and a one-process run does not
show it when the other tenant holds one of the two cores.  ``speed_ratio`` times a few of the
profile's own op cases -- the mid-sized linear, element-wise and copy rows -- the way the profile
timed them (``ops.measure_ops``: operands out of L2, median of samples) in ``processes``
single-threaded processes at once (the profile's op rows were timed with as many processes busy
as a 2-rank run keeps, one per core), and returns the median over processes and cases of
now / profile, now timed by the host clock.  1.0: as fast as when profiled (for rows timed by
the thread's CPU time, profiling/timing.py, as fast as an idle machine); 1.3: every op 30%
slower, and so will be a run started now.  CPU only: a GPU's kernels do not share their device with other tenants here.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: the kinds timed: a matmul-bound, an element-wise and a memory-copy row
KINDS = ("linear", "elementwise", "copy")


def _case_key(kind: str, variant: str | None, dtype: str, shape) -> tuple:
    """What names one op case, in the sweep (``OpCase``) and in a profile's op rows."""
    return kind, variant, dtype, tuple(shape)


def _sweep_cases() -> dict[tuple, object]:
    from autopar.profiling.op_sweeps import op_cases

    return {_case_key(c.kind, c.variant, c.dtype, c.shape): c for c in op_cases("cpu", ["fp32"], quick=False)}


def reference_rows(profile: dict) -> list[dict]:
    """Per kind in ``KINDS``, the fp32 row of the profile's op table with the median work among
    those the CPU sweep still makes (so the case can be rebuilt); empty if none match."""
    cases = _sweep_cases()
    out = []
    for kind in KINDS:
        rows = [r for r in profile.get("op_table", []) if r.get("kind") == kind and r.get("dtype") == "fp32"
                and _case_key(r["kind"], r.get("variant"), r["dtype"], r["shape"]) in cases
                and r.get("measured_seconds")]
        if rows:
            rows.sort(key=lambda r: r["flops"] if kind == "linear" else r["bytes"])
            out.append(rows[len(rows) // 2])
    return out


def _worker(keys: list[tuple], target_s: float, ready_dir: str, processes: int) -> list[float]:
    """Seconds per call of each case, timed once all ``processes`` workers are ready."""
    import torch

    from autopar.profiling.ops import measure_ops
    from autopar.profiling.timing import RepeatPolicy

    torch.set_num_threads(1)
    by_key = _sweep_cases()
    cases = [by_key[_case_key(*k)] for k in keys]
    # every process busy at once, as when profiled: start when all have imported and built
    ready = Path(ready_dir)
    (ready / f"{os.getpid()}").touch()
    deadline = time.monotonic() + 60
    while len(list(ready.iterdir())) < processes and time.monotonic() < deadline:
        time.sleep(0.001)
    # the host clock: how long an op takes now, waits for a core included (the profile's rows
    # timed by thread time are the idle machine's figure: ratio 1.0 is an idle machine)
    rows = measure_ops(cases, torch.device("cpu"), RepeatPolicy(target_total_s=target_s), clock="wall")
    return [r["measured_seconds"] for r in rows]


def speed_ratio(profile: dict, processes: int = 2, target_s: float = 0.1, timeout_s: float = 120.0) -> dict:
    """``{"ratio", "per_case": {label: ratio}, "processes"}``: the median of now / profile over
    the cases of ``reference_rows`` and the processes; ``ratio`` is None when the profile has
    none of those rows."""
    ref = reference_rows(profile)
    if not ref:
        return {"ratio": None, "per_case": {}, "processes": processes}
    keys = [[r["kind"], r.get("variant"), r["dtype"], list(r["shape"])] for r in ref]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory(prefix="autopar-speed-") as ready:
        arg = json.dumps({"keys": keys, "target_s": target_s, "ready_dir": ready, "processes": processes})
        procs = [subprocess.Popen([sys.executable, "-m", "autopar.profiling.cpu_speed_check", arg], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for _ in range(processes)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=timeout_s)
            if p.returncode != 0:
                raise RuntimeError(f"speed check worker failed: {err.strip()[-500:]}")
            results.append(json.loads(out))
    per_case = {}
    ratios = []
    for i, r in enumerate(ref):
        label = f"{r['kind']} {'x'.join(map(str, r['shape']))}"
        rs = [res[i] / r["measured_seconds"] for res in results]
        per_case[label] = statistics.median(rs)
        ratios += rs
    return {"ratio": statistics.median(ratios), "per_case": per_case, "processes": processes}


if __name__ == "__main__":                 # one worker of speed_ratio
    _a = json.loads(sys.argv[1])
    print(json.dumps(_worker(_a["keys"], _a["target_s"], _a["ready_dir"], _a["processes"])))
