"""Float8 training of one linear (torchao's ``Float8Linear``): what it costs against bf16.

``layer_cost`` prices the linears of a layer with ``precision: fp8`` by these terms (the
runtime does not train float8 yet, and the planner does not offer it: only a plan written with
fp8 layers, or a benchmark, is priced so).  The fp8 all-gather and the weight copies are
reported here but not yet in the layer's data-parallel and memory terms.

Mechanism (torchao.float8, README "float8 training"; Micikevicius et al. 2022, "FP8 Formats
for Deep Learning"): each of the linear's three GEMMs -- forward ``y = x W^T``, input
gradient ``dx = dy W``, weight gradient ``dW = dy^T x`` -- runs on fp8 operands (e4m3 for
x and W, e5m2 for dy) scaled into fp8's range by ``amax``:

* **GEMMs** at the device's fp8 rate: the profile's ``peak_flops["fp8"]`` where it has one,
  else twice bf16's (NVIDIA H100 datasheet: 1,979 dense fp8 against 989 dense bf16 TFLOPS on
  SXM5; the same 2x on H200 and L40S), times the profile's linear efficiency.
* **Casts**: every GEMM operand is cast from bf16 (2 bytes) to fp8 (1 byte) in the layout its
  GEMM needs: x and W for the forward, dy and W^T for dx, dy^T and x^T for dW -- six casts.
  Tensorwise scaling first reduces the whole tensor's ``amax`` (a pass reading 2 bytes per
  element) and then casts (reading 2, writing 1): 5 bytes per element; rowwise scaling reduces
  each row's amax in the kernel that casts it: 3 bytes per element.  Each is memory-bound on
  the device, and under compile one kernel per cast (two for tensorwise: the reduction and the
  cast), each paying the launch floor.
* **FSDP2 float8 all-gather** (tensorwise only: torchao ``enable_fsdp_float8_all_gather``): the
  weight is all-gathered as fp8, 1 byte per element instead of bf16's 2; rowwise all-gathers bf16.
* **Memory**: the fp8 copies of W (both layouts) live while the layer runs: 2 bytes per weight
  element of transient memory.
"""
from __future__ import annotations

from dataclasses import dataclass

FP8_BYTES = 1
BF16_BYTES = 2
FP8_OVER_BF16_PEAK = 2.0       # NVIDIA H100 datasheet (SXM5): 1,979 / 989.4 dense TFLOPS
RECIPES = ("tensorwise", "rowwise")
#: bytes per element a cast moves: tensorwise = amax pass (read 2) + cast (read 2, write 1);
#: rowwise = one pass reducing each row's amax and casting it (read 2, write 1)
CAST_BYTES = {"tensorwise": 2 * BF16_BYTES + FP8_BYTES, "rowwise": BF16_BYTES + FP8_BYTES}
CAST_KERNELS = {"tensorwise": 2, "rowwise": 1}


@dataclass(frozen=True)
class Float8LinearCost:
    """One linear of shape [m, k] x [k, n] (m tokens, k in, n out), fwd + bwd, on one device."""
    gemm_s: float                  # the three GEMMs at the fp8 rate
    cast_s: float                  # the six operand casts (amax reductions included)
    fwd_s: float                   # forward: its GEMM and the casts of x and W
    bf16_gemm_s: float             # the same three GEMMs in bf16 (for the summary)
    allgather_bytes_per_weight: int  # FSDP2 all-gather bytes per weight element
    transient_weight_bytes: int    # fp8 copies of the weight while the layer runs

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.cast_s

    @property
    def speedup(self) -> float:
        """bf16 GEMM time over float8's GEMMs and casts."""
        return self.bf16_gemm_s / self.total_s if self.total_s > 0 else 1.0


def fp8_peak(cm) -> float:
    return float(cm.peak_flops.get("fp8") or FP8_OVER_BF16_PEAK * cm.peak("bf16"))


def float8_linear_cost(m: int, k: int, n: int, cm, recipe: str = "tensorwise") -> Float8LinearCost:
    if recipe not in RECIPES:
        raise ValueError(f"float8 recipe {recipe!r}; one of {', '.join(RECIPES)}")
    eff = cm.efficiency.get("linear", cm.efficiency.get("matmul", 1.0))
    flops = 3 * 2.0 * m * n * k                  # forward, input gradient, weight gradient
    gemm_s = flops / (fp8_peak(cm) * eff)
    bf16_gemm_s = flops / (cm.peak("bf16") * eff)
    # the six casts: x, W (forward); dy, W^T (dx); dy^T, x^T (dW)
    elements = [m * k, n * k, m * n, n * k, m * n, m * k]
    floor = cm.overhead("op_launch_s")
    per_cast = [max(e * CAST_BYTES[recipe] / cm.achievable_memory_Bps, CAST_KERNELS[recipe] * floor)
                for e in elements]
    return Float8LinearCost(gemm_s=gemm_s, cast_s=sum(per_cast), fwd_s=gemm_s / 3 + per_cast[0] + per_cast[1],
                            bf16_gemm_s=bf16_gemm_s,
                            allgather_bytes_per_weight=FP8_BYTES if recipe == "tensorwise" else BF16_BYTES,
                            transient_weight_bytes=2 * FP8_BYTES * n * k)
