"""A GPU's compute rates at the clock it holds, from its datasheet peaks.

It lives in ``core`` because the simulator (its cost model) and the runtime (the MFU of its log
line, runtime/metrics.py) both read it.

A datasheet's peak FLOP/s is SMs x FLOPs per SM per clock x the clock it is quoted at: for the
H100 SXM5, 989.4 dense bf16 TFLOP/s = 132 SMs x 4096 (2048 FMA per SM per clock, twice the A100's
1024) x 1830 MHz (NVIDIA H100 Tensor Core GPU Architecture whitepaper, Tables 2-3: per-SM
rates and the SM count; the clock follows from them).  The FLOPs per SM per clock are fixed by
the silicon; the clock is not: under a board power limit the GPU lowers its SM clock until its
power fits (NVIDIA, nvidia-smi documentation, "Clocks Throttle Reasons: SW Power Cap").  So a
part sold or run at another power limit, on the same die, keeps the datasheet peaks scaled by
``sustained_clock_MHz / boost_clock_MHz`` -- the profile's optional keys, each with its source
(docs/profiles.md, "GPU variants") -- and so do the published flash-attention rates the profile
carries (``attention_kernels``, measured on the boost part; the cost model's ``clock_ratio``), a
compute-bound kernel's rate being proportional to the clock.  HBM bandwidth is the memory's own clock and is stated as
``memory_bandwidth_Bps`` for the part.

A profile without both keys keeps its peaks: the bundled 700 W profiles take their efficiencies
from measurements made at that limit, whatever clock those runs held.
"""
from __future__ import annotations

from typing import Any, Mapping


def clock_ratio(prof: Mapping[str, Any]) -> float:
    """sustained / boost clock of a profile (1.0 where either is absent)."""
    boost, sustained = prof.get("boost_clock_MHz"), prof.get("sustained_clock_MHz")
    if not boost or not sustained:
        return 1.0
    return float(sustained) / float(boost)


def peak_flops_at_clock(prof: Mapping[str, Any]) -> dict[str, float]:
    """The profile's peak FLOP/s per dtype at the clock it holds (module docstring)."""
    ratio = clock_ratio(prof)
    return {k: float(v) * ratio for k, v in prof["peak_flops"].items()}
